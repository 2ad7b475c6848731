//! Handing a host's shared-memory segment from the rank that made it to the other ranks of the
//! host: its file descriptor, passed over a Unix socket (`SCM_RIGHTS`) in Linux's abstract
//! namespace.
//!
//! Neither the segment (a sealed memfd, see `segment`) nor the socket has a name in any file
//! system, so nothing of them outlives the processes that use them, however those end. A peer
//! gets the descriptor only if it runs as the creator's user (`SO_PEERCRED`) and first sends the
//! random token the creator published in the job's store, so only ranks of the job receive it.

use std::io::{self, IoSlice, IoSliceMut, Read, Write};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};

/// Bytes of the token a peer must send.
const TOKEN: usize = 16;
/// Longest one connection may take to send its token: a silent connection delays the others by
/// no more than this.
const PEER_WINDOW: Duration = Duration::from_secs(2);
/// How long the server sleeps when no peer is waiting to connect.
const IDLE: Duration = Duration::from_millis(1);

/// A segment's descriptor on offer to the host's other ranks, served by a thread of its own
/// until every peer took it, the deadline passed or the offer is dropped (which closes the
/// socket: its name goes with it).
pub(crate) struct Offer {
    stop: Arc<AtomicBool>,
    server: Option<JoinHandle<()>>,
}

impl Offer {
    /// Offers `fd` to up to `peers` connections until `deadline`. Returns the offer and the
    /// record a peer passes to [`take`] (the socket's name and the token), to be published in
    /// the store. `tag` goes into the socket's name, for whoever lists the host's sockets.
    pub(crate) fn start(
        fd: OwnedFd,
        tag: &str,
        peers: usize,
        deadline: Instant,
    ) -> io::Result<(Offer, String)> {
        let token: [u8; TOKEN] = random()?;
        let unique: [u8; 8] = random()?;
        let name = format!("burn-ddp-{tag}-{}-{}", std::process::id(), hex(&unique));
        let listener = UnixListener::bind_addr(&SocketAddr::from_abstract_name(name.as_bytes())?)?;
        listener.set_nonblocking(true)?;
        let stop = Arc::new(AtomicBool::new(false));
        let server = {
            let stop = stop.clone();
            std::thread::Builder::new()
                .name("burn-ddp-shm-offer".into())
                .spawn(move || serve(&listener, fd.as_fd(), &token, peers, deadline, &stop))?
        };
        let offer = Offer {
            stop,
            server: Some(server),
        };
        Ok((offer, format!("{name} {}", hex(&token))))
    }
}

impl Drop for Offer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(server) = self.server.take()
            && server.join().is_err()
        {
            log::warn!("the shared-memory segment's server panicked");
        }
    }
}

/// Accepts connections and hands `fd` to each that proves it belongs to the job.
fn serve(
    listener: &UnixListener,
    fd: BorrowedFd<'_>,
    token: &[u8; TOKEN],
    peers: usize,
    deadline: Instant,
    stop: &AtomicBool,
) {
    let mut served = 0;
    while served < peers && !stop.load(Ordering::Acquire) && Instant::now() < deadline {
        match listener.accept() {
            Ok((conn, _)) => match hand_over(&conn, fd, token, deadline) {
                Ok(()) => served += 1,
                Err(e) => log::warn!("shared memory: a connection to the segment's socket: {e}"),
            },
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => std::thread::sleep(IDLE),
            Err(e) => {
                log::warn!("shared memory: accepting on the segment's socket: {e}");
                std::thread::sleep(IDLE * 10);
            }
        }
    }
}

/// Sends `fd` over `conn` if its peer runs as this user and sends `token` in time.
fn hand_over(
    conn: &UnixStream,
    fd: BorrowedFd<'_>,
    token: &[u8; TOKEN],
    deadline: Instant,
) -> io::Result<()> {
    let peer = rustix::net::sockopt::socket_peercred(conn)?;
    let me = rustix::process::geteuid();
    if peer.uid != me {
        return Err(io::Error::other(format!(
            "refused process {} of user {} (the job runs as user {})",
            peer.pid.as_raw_nonzero(),
            peer.uid.as_raw(),
            me.as_raw()
        )));
    }
    conn.set_nonblocking(false)?;
    bound(conn, deadline)?;
    let mut got = [0u8; TOKEN];
    (&*conn).read_exact(&mut got)?;
    if got != *token {
        return Err(io::Error::other(format!(
            "refused process {}: wrong token",
            peer.pid.as_raw_nonzero()
        )));
    }
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    let fds = [fd];
    if !control.push(SendAncillaryMessage::ScmRights(&fds)) {
        return Err(io::Error::other(
            "no room for the descriptor in the message",
        ));
    }
    rustix::net::sendmsg(
        conn,
        &[IoSlice::new(b"S")],
        &mut control,
        SendFlags::NOSIGNAL,
    )?;
    Ok(())
}

/// Takes the descriptor offered under `record` (from [`Offer::start`]), by `deadline`.
pub(crate) fn take(record: &str, deadline: Instant) -> io::Result<OwnedFd> {
    let bad = || io::Error::other(format!("a bad segment record {record:?}"));
    let (name, token) = record.split_once(' ').ok_or_else(bad)?;
    let token = unhex(token).filter(|t| t.len() == TOKEN).ok_or_else(bad)?;
    let conn = UnixStream::connect_addr(&SocketAddr::from_abstract_name(name.as_bytes())?)?;
    bound(&conn, deadline)?;
    (&conn).write_all(&token)?;
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let mut byte = [0u8; 1];
    let got = rustix::net::recvmsg(
        &conn,
        &mut [IoSliceMut::new(&mut byte)],
        &mut control,
        RecvFlags::CMSG_CLOEXEC,
    )?;
    let mut fds = control.drain().filter_map(|m| match m {
        RecvAncillaryMessage::ScmRights(fds) => Some(fds),
        _ => None,
    });
    let fd = fds.next().and_then(|mut fds| fds.next());
    match (got.bytes, fd) {
        (1, Some(fd)) => Ok(fd),
        _ => Err(io::Error::other(
            "the segment's creator closed the connection without sending it",
        )),
    }
}

/// Bounds each read and write on `conn` by [`PEER_WINDOW`] and `deadline`.
fn bound(conn: &UnixStream, deadline: Instant) -> io::Result<()> {
    let left = deadline.saturating_duration_since(Instant::now());
    let window = Some(left.min(PEER_WINDOW).max(Duration::from_millis(1)));
    conn.set_read_timeout(window)?;
    conn.set_write_timeout(window)
}

fn random<const N: usize>() -> io::Result<[u8; N]> {
    let mut bytes = [0u8; N];
    getrandom::fill(&mut bytes).map_err(|e| io::Error::other(e.to_string()))?;
    Ok(bytes)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) || !s.is_ascii() {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn soon() -> Instant {
        Instant::now() + Duration::from_secs(10)
    }

    #[test]
    fn peers_with_the_token_get_the_descriptor_and_others_do_not() {
        let file = rustix::fs::memfd_create("burn-ddp-test", rustix::fs::MemfdFlags::CLOEXEC)
            .expect("memfd");
        rustix::fs::ftruncate(&file, 4096).unwrap();
        let inode = rustix::fs::fstat(&file).unwrap().st_ino;
        let (offer, record) = Offer::start(file, "unit", 2, soon()).unwrap();
        // A wrong token gets nothing, and does not use up a peer's turn.
        let (name, token) = record.split_once(' ').unwrap();
        let forged = format!("{name} {}", "0".repeat(token.len()));
        assert!(take(&forged, soon()).is_err());
        // A malformed record is an error, not a panic.
        assert!(take("nonsense", soon()).is_err());
        assert!(take(&format!("{name} zz"), soon()).is_err());
        for _ in 0..2 {
            let fd = take(&record, soon()).expect("take");
            assert_eq!(
                rustix::fs::fstat(&fd).unwrap().st_ino,
                inode,
                "the same file"
            );
        }
        drop(offer);
        // The socket's name went with the offer.
        assert!(take(&record, soon()).is_err());
    }

    #[test]
    fn hex_round_trips() {
        let bytes = [0u8, 1, 0xab, 0xff];
        assert_eq!(unhex(&hex(&bytes)).unwrap(), bytes);
        assert_eq!(unhex("abc"), None);
        assert_eq!(unhex("é0"), None);
    }
}

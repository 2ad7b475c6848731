//! Handing a host's shared-memory segment from the rank that made it to the other ranks of the
//! host: its file descriptor, passed over a Unix socket (`SCM_RIGHTS`) in Linux's abstract
//! namespace.
//!
//! Neither the segment (a sealed memfd, see `segment`) nor the socket has a name in any file
//! system, so nothing of them outlives the processes that use them, however those end. A peer
//! gets the descriptor only if it runs as the creator's user (`SO_PEERCRED`) and first sends the
//! random token the creator published in the job's store, so only ranks of the job receive it.
//!
//! The taker trusts the published record no more than the store it came from (torchrun's store
//! admits anyone who reaches it): when the group has a job secret, the record carries an
//! HMAC-SHA256 tag of the secret over the socket's name, the token and the host's index, which
//! the taker verifies before it connects; and whatever the record, the taker checks the
//! offering socket's peer (`SO_PEERCRED`) right after connecting, before it sends the token or
//! reads a byte: it must run as this user and be the process the socket's name claims. Its
//! connect waits for room in the socket's queue for a bounded time only.

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
    AddressFamily, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags, SocketAddrUnix, SocketFlags, SocketType,
};

use crate::secret::JobSecret;

/// Bytes of the token a peer must send.
const TOKEN: usize = 16;
/// Longest one connection may take to send its token: a silent connection delays the others by
/// no more than this.
const PEER_WINDOW: Duration = Duration::from_secs(2);
/// How long the server sleeps when no peer is waiting to connect.
const IDLE: Duration = Duration::from_millis(1);
/// First field of a record's tag: what it is, and its version.
const LABEL: &[u8] = b"burn-ddp shm segment v1";

/// What authenticates a segment's record: the job secret, and the index of the host whose
/// segment it is (so a record made for one host counts for no other).
#[derive(Clone, Copy)]
pub(crate) struct Seal<'a> {
    /// The group's job secret, the tag's key.
    pub secret: &'a JobSecret,
    /// The host's index among the group's hosts (its segment's key in the store).
    pub host: usize,
}

impl Seal<'_> {
    fn fields<'f>(host: &'f [u8; 8], name: &'f str, token: &'f [u8]) -> [&'f [u8]; 3] {
        [host, name.as_bytes(), token]
    }

    fn tag(&self, name: &str, token: &[u8]) -> String {
        let host = (self.host as u64).to_le_bytes();
        hex(&self.secret.tag(LABEL, &Self::fields(&host, name, token)))
    }

    fn verify(&self, name: &str, token: &[u8], tag: &[u8]) -> bool {
        let host = (self.host as u64).to_le_bytes();
        self.secret
            .verify(LABEL, &Self::fields(&host, name, token), tag)
    }
}

/// A segment's descriptor on offer to the host's other ranks, served by a thread of its own
/// until every peer took it, the deadline passed or the offer is dropped (which closes the
/// socket: its name goes with it).
pub(crate) struct Offer {
    stop: Arc<AtomicBool>,
    server: Option<JoinHandle<()>>,
}

impl Offer {
    /// Offers `fd` to up to `peers` connections until `deadline`. Returns the offer and the
    /// record a peer passes to [`take`] (the socket's name, the token and, with a `seal`, their
    /// tag), to be published in the store. `tag` goes into the socket's name, for whoever lists
    /// the host's sockets.
    pub(crate) fn start(
        fd: OwnedFd,
        tag: &str,
        peers: usize,
        deadline: Instant,
        seal: Option<Seal<'_>>,
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
        let record = match seal {
            Some(seal) => format!("{name} {} {}", hex(&token), seal.tag(&name, &token)),
            None => format!("{name} {}", hex(&token)),
        };
        Ok((offer, record))
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

/// Takes the descriptor offered under `record` (from [`Offer::start`]), by `deadline`. With a
/// `seal`, the record must carry its tag, checked before connecting; the socket must be served
/// by the process its name claims, running as this user, checked before the token is sent.
pub(crate) fn take(record: &str, seal: Option<Seal<'_>>, deadline: Instant) -> io::Result<OwnedFd> {
    let bad = || io::Error::other(format!("a bad segment record {record:?}"));
    let mut fields = record.split(' ');
    let (name, token) = (
        fields.next().ok_or_else(bad)?,
        fields.next().ok_or_else(bad)?,
    );
    let token = unhex(token).filter(|t| t.len() == TOKEN).ok_or_else(bad)?;
    let tag = fields
        .next()
        .map(|t| unhex(t).ok_or_else(bad))
        .transpose()?;
    if fields.next().is_some() {
        return Err(bad());
    }
    if let Some(seal) = seal
        && !tag.is_some_and(|tag| seal.verify(name, &token, &tag))
    {
        return Err(io::Error::other(format!(
            "refused the segment record naming socket {name:?}: it does not carry a valid tag \
             of the job secret (it was not written by a rank of this job)"
        )));
    }
    let claimed = claimed_pid(name).ok_or_else(bad)?;
    let window = deadline
        .saturating_duration_since(Instant::now())
        .min(PEER_WINDOW);
    let conn = connect(name, window)?;
    check_peer(&conn, name, claimed)?;
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

/// The process id a socket's name claims (`burn-ddp-{tag}-{pid}-{hex}`, see [`Offer::start`]).
fn claimed_pid(name: &str) -> Option<i32> {
    let mut parts = name.rsplitn(3, '-');
    let (_unique, pid, rest) = (parts.next()?, parts.next()?, parts.next()?);
    rest.starts_with("burn-ddp-")
        .then(|| pid.parse().ok())
        .flatten()
        .filter(|&p: &i32| p > 0)
}

/// Connects to the abstract socket `name`, waiting at most `window` for room in its queue: a
/// connect to a socket whose queue is full blocks as long as the socket's send timeout (Linux,
/// `unix_stream_connect`), then fails with `EAGAIN`.
fn connect(name: &str, window: Duration) -> io::Result<UnixStream> {
    let fd = rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::STREAM,
        SocketFlags::CLOEXEC,
        None,
    )?;
    let window = window.max(Duration::from_millis(1));
    rustix::net::sockopt::set_socket_timeout(
        &fd,
        rustix::net::sockopt::Timeout::Send,
        Some(window),
    )?;
    match rustix::net::connect(&fd, &SocketAddrUnix::new_abstract_name(name.as_bytes())?) {
        Ok(()) => Ok(UnixStream::from(fd)),
        Err(rustix::io::Errno::AGAIN) => Err(io::Error::new(
            io::ErrorKind::TimedOut,
            format!("the queue of the segment's socket {name:?} stayed full for {window:?}"),
        )),
        Err(e) => Err(e.into()),
    }
}

/// Refuses `conn` unless its peer (the process that listens on it) runs as this user and is
/// the process `claimed` that the socket's name `name` claims.
fn check_peer(conn: &UnixStream, name: &str, claimed: i32) -> io::Result<()> {
    let peer = rustix::net::sockopt::socket_peercred(conn)?;
    let me = rustix::process::geteuid();
    let pid = peer.pid.as_raw_nonzero().get();
    if peer.uid != me || pid != claimed {
        return Err(io::Error::other(format!(
            "refused the segment's socket {name:?}: it is served by process {pid} of user {}, \
             expected process {claimed} of user {} (this job's user); no token sent",
            peer.uid.as_raw(),
            me.as_raw()
        )));
    }
    Ok(())
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
mod tests;

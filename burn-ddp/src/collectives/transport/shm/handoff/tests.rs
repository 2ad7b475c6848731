//! Tests of the segment's hand-off: who gets the descriptor, and which offers a taker refuses
//! before it sends its token (another user's socket, a socket that lies about its process, a
//! record without the job secret's tag) or connects at all, and a socket whose queue is full.

use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::sync::mpsc;

use super::*;

/// The user (and group) `nobody`, which the test of another user's offer runs its child as.
const NOBODY: u32 = 65534;
/// Set in the environment of the child that plays another user's offer ([`foreign_offer`]).
const FOREIGN_VAR: &str = "BURN_DDP_TEST_FOREIGN_OFFER";

fn soon() -> Instant {
    Instant::now() + Duration::from_secs(10)
}

fn memfd() -> OwnedFd {
    let file =
        rustix::fs::memfd_create("burn-ddp-test", rustix::fs::MemfdFlags::CLOEXEC).expect("memfd");
    rustix::fs::ftruncate(&file, 4096).unwrap();
    file
}

/// A fresh socket name in burn-ddp's form, claiming process `pid`.
fn name_claiming(pid: u32) -> String {
    format!("burn-ddp-unit-{pid}-{}", hex(&random::<8>().unwrap()))
}

fn listen(name: &str) -> UnixListener {
    let addr = SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
    let listener = UnixListener::bind_addr(&addr).unwrap();
    listener.set_nonblocking(true).unwrap();
    listener
}

/// An attacker's server: accepts one connection within `wait`, reads what the taker sends
/// (at most a token's bytes, for a second at most), then hands it a memory file of its own.
/// The bytes it read, or `None` when no one connected.
fn serve_anyone(listener: UnixListener, wait: Duration) -> Option<Vec<u8>> {
    let end = Instant::now() + wait;
    let conn = loop {
        match listener.accept() {
            Ok((conn, _)) => break conn,
            Err(_) if Instant::now() < end => std::thread::sleep(IDLE),
            Err(_) => return None,
        }
    };
    conn.set_nonblocking(false).unwrap();
    conn.set_read_timeout(Some(Duration::from_secs(1))).unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; TOKEN];
    while got.len() < TOKEN {
        match (&conn).read(&mut buf[..TOKEN - got.len()]) {
            Ok(0) | Err(_) => break,
            Ok(n) => got.extend_from_slice(&buf[..n]),
        }
    }
    let file = memfd();
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    let fds = [file.as_fd()];
    control.push(SendAncillaryMessage::ScmRights(&fds));
    let _ = rustix::net::sendmsg(
        &conn,
        &[IoSlice::new(b"S")],
        &mut control,
        SendFlags::NOSIGNAL,
    );
    Some(got)
}

#[test]
fn peers_with_the_token_get_the_descriptor_and_others_do_not() {
    let file = memfd();
    let inode = rustix::fs::fstat(&file).unwrap().st_ino;
    let (offer, record) = Offer::start(file, "unit", 2, soon(), None).unwrap();
    // A wrong token gets nothing, and does not use up a peer's turn.
    let (name, token) = record.split_once(' ').unwrap();
    let forged = format!("{name} {}", "0".repeat(token.len()));
    assert!(take(&forged, None, soon()).is_err());
    // A malformed record is an error, not a panic.
    for bad in [
        "nonsense",
        &format!("{name} zz"),
        &format!("{record} 00 00"),
    ] {
        let e = take(bad, None, soon()).unwrap_err().to_string();
        assert!(e.contains("a bad segment record"), "{e}");
    }
    for _ in 0..2 {
        let fd = take(&record, None, soon()).expect("take");
        assert_eq!(
            rustix::fs::fstat(&fd).unwrap().st_ino,
            inode,
            "the same file"
        );
    }
    drop(offer);
    // The socket's name went with the offer.
    assert!(take(&record, None, soon()).is_err());
}

#[test]
fn a_record_without_the_secrets_tag_is_refused_before_connecting() {
    let secret = JobSecret::generate().unwrap();
    let other = JobSecret::generate().unwrap();
    let seal = Seal {
        secret: &secret,
        host: 0,
    };
    // A listener in burn-ddp's form, of this user and process: only the tag can stop a taker.
    let name = name_claiming(std::process::id());
    let listener = listen(&name);
    let token = hex(&[7u8; TOKEN]);
    let untagged = format!("{name} {token}");
    let forged_tag = format!("{untagged} {}", "00".repeat(32));
    let other_secret = Seal {
        secret: &other,
        host: 0,
    };
    let under_other = format!("{untagged} {}", other_secret.tag(&name, &[7u8; TOKEN]));
    let other_host = Seal {
        secret: &secret,
        host: 1,
    };
    let for_other_host = format!("{untagged} {}", other_host.tag(&name, &[7u8; TOKEN]));
    for record in [&untagged, &forged_tag, &under_other, &for_other_host] {
        let e = take(record, Some(seal), soon()).unwrap_err().to_string();
        assert!(e.contains("valid tag of the job secret"), "{record}: {e}");
    }
    match listener.accept() {
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
        other => panic!("a taker connected for a record that does not verify: {other:?}"),
    }
    // The creator's own record verifies, for its host, and is taken.
    let (offer, record) = Offer::start(memfd(), "unit", 1, soon(), Some(seal)).unwrap();
    assert!(take(&record, Some(other_host), soon()).is_err());
    assert!(take(&record, Some(seal), soon()).is_ok());
    drop(offer);
}

#[test]
fn a_socket_whose_name_claims_another_process_is_refused_before_the_token_is_sent() {
    let me = std::process::id();
    let name = name_claiming(if me == 1 { 2 } else { 1 });
    let server = {
        let listener = listen(&name);
        std::thread::spawn(move || serve_anyone(listener, Duration::from_secs(10)))
    };
    let record = format!("{name} {}", hex(&[7u8; TOKEN]));
    let outcome = take(&record, None, soon());
    let got = server.join().unwrap();
    assert_eq!(got, Some(Vec::new()), "the socket received the token");
    let e = outcome
        .expect_err("took a descriptor from a lying socket")
        .to_string();
    assert!(
        e.contains(&format!("served by process {me} of user")),
        "{e}"
    );
    assert!(e.contains("expected process 1 of user") || me == 1, "{e}");
}

/// Not a test by itself: the child that the test of another user's socket (below) runs as
/// user [`NOBODY`]. It offers a memory file of its own on a socket named as burn-ddp's,
/// prints its record (`RECORD ...`) and then what a taker sent it (`GOT <hex>`, or
/// `GOT none`). Does nothing unless [`FOREIGN_VAR`] is set.
#[test]
fn foreign_offer() {
    if std::env::var_os(FOREIGN_VAR).is_none() {
        return;
    }
    let name = name_claiming(std::process::id());
    let listener = listen(&name);
    println!("RECORD {name} {}", hex(&[7u8; TOKEN]));
    let got = serve_anyone(listener, Duration::from_secs(10));
    println!("GOT {}", got.map_or("none".into(), |g| hex(&g)));
}

#[test]
fn a_socket_of_another_user_is_refused_before_the_token_is_sent() {
    if !rustix::process::geteuid().is_root() {
        eprintln!("SKIPPED: running a process as another user (uid {NOBODY}) needs root");
        return;
    }
    let test = module_path!().split_once("::").map_or("", |(_, p)| p);
    let child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", &format!("{test}::foreign_offer"), "--nocapture"])
        .args(["--test-threads", "1"])
        .env(FOREIGN_VAR, "1")
        .uid(NOBODY)
        .gid(NOBODY)
        .stdout(Stdio::piped())
        .spawn();
    let mut child = match child {
        Ok(child) => child,
        Err(e) if e.kind() == io::ErrorKind::PermissionDenied => {
            eprintln!("SKIPPED: user {NOBODY} may not run this test's binary ({e})");
            return;
        }
        Err(e) => panic!("running the test binary as user {NOBODY}: {e}"),
    };
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut field = |prefix: &str| {
        lines
            .by_ref()
            .map_while(|l| l.ok())
            // libtest may print the test's name before it, on the same line.
            .find_map(|l| l.split_once(prefix).map(|(_, v)| v.to_string()))
            .unwrap_or_else(|| panic!("the child printed no {prefix:?}"))
    };
    let record = field("RECORD ");
    let outcome = take(&record, None, soon());
    let got = field("GOT ");
    assert!(child.wait().unwrap().success());
    assert_eq!(got, "", "the other user's socket received {got:?}");
    let e = outcome
        .expect_err("took another user's descriptor")
        .to_string();
    assert!(
        e.contains(&format!("of user {NOBODY}, expected process")),
        "{e}"
    );
    assert!(e.contains("of user 0 (this job's user)"), "{e}");
}

#[test]
fn a_socket_whose_queue_is_full_does_not_block_the_taker() {
    use rustix::net::{SocketAddrUnix, bind, connect, listen, socket_with};
    let name = name_claiming(std::process::id());
    let addr = SocketAddrUnix::new_abstract_name(name.as_bytes()).unwrap();
    let unix = |flags| socket_with(AddressFamily::UNIX, SocketType::STREAM, flags, None).unwrap();
    let listener = unix(SocketFlags::CLOEXEC);
    bind(&listener, &addr).unwrap();
    listen(&listener, 0).unwrap();
    // Connections no one accepts, until the queue takes no more.
    let mut queued = Vec::new();
    loop {
        let conn = unix(SocketFlags::CLOEXEC | SocketFlags::NONBLOCK);
        match connect(&conn, &addr) {
            Ok(()) => queued.push(conn),
            Err(rustix::io::Errno::AGAIN) => break,
            Err(e) => panic!("filling the queue: {e}"),
        }
        assert!(queued.len() < 1000, "the queue never fills");
    }
    let (tx, rx) = mpsc::channel();
    let record = format!("{name} {}", hex(&[7u8; TOKEN]));
    let start = Instant::now();
    std::thread::spawn(move || {
        let far = Instant::now() + Duration::from_secs(120);
        let _ = tx.send(take(&record, None, far).map(drop));
    });
    let outcome = rx.recv_timeout(PEER_WINDOW + Duration::from_secs(5));
    let took = start.elapsed();
    // Closing the socket releases a taker that still waits.
    drop(listener);
    let outcome = outcome.unwrap_or_else(|_| panic!("the taker still waits after {took:?}"));
    let e = outcome.expect_err("took a descriptor from a full queue");
    assert_eq!(e.kind(), io::ErrorKind::TimedOut, "{e}");
    assert!(e.to_string().contains("stayed full"), "{e}");
    assert!(took >= PEER_WINDOW / 2, "gave up after {took:?}");
}

#[test]
fn hex_round_trips() {
    let bytes = [0u8, 1, 0xab, 0xff];
    assert_eq!(unhex(&hex(&bytes)).unwrap(), bytes);
    assert_eq!(unhex("abc"), None);
    assert_eq!(unhex("é0"), None);
}

#[test]
fn socket_names_claim_their_process() {
    assert_eq!(claimed_pid("burn-ddp-29500-1234-00ff"), Some(1234));
    assert_eq!(claimed_pid("burn-ddp-a-b-c-77-00"), Some(77));
    for bad in [
        "burn-ddp-0-00",
        "evil-12-00",
        "burn-ddp-x--00",
        "burn-ddp-x-0-00",
    ] {
        assert_eq!(claimed_pid(bad), None, "{bad}");
    }
}

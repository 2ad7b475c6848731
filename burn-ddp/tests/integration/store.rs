//! The rendezvous store: operations, waits, late server start, garbage clients; its bounds
//! against an admitted client in `limits`.

mod limits;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use burn_ddp::DdpError;
use burn_ddp::store::{Store, StoreServer};

use crate::common::{STORE_CHALLENGE_LEN, STORE_HELLO, store_answer, store_hello};

fn pair() -> (StoreServer, Store) {
    let server = StoreServer::bind("127.0.0.1:0").unwrap();
    let client = Store::connect(&server.local_addr().to_string(), Duration::from_secs(5)).unwrap();
    (server, client)
}

#[test]
fn set_get_add_compare_set() {
    let (_server, s) = pair();
    s.set("a", b"1").unwrap();
    assert_eq!(s.get("a").unwrap(), b"1");
    assert_eq!(s.try_get("missing").unwrap(), None);
    assert_eq!(s.add("n", 5).unwrap(), 5);
    assert_eq!(s.add("n", -2).unwrap(), 3);
    assert_eq!(s.compare_set("c", b"", b"first").unwrap(), b"first");
    assert_eq!(s.compare_set("c", b"", b"second").unwrap(), b"first");
    assert_eq!(s.compare_set("c", b"first", b"third").unwrap(), b"third");
    let e = s
        .add("a", 1)
        .map(|_| ())
        .and_then(|_| s.add("c", 1).map(|_| ()));
    assert!(
        e.unwrap_err()
            .to_string()
            .contains("does not hold an integer")
    );
}

#[test]
fn get_waits_for_a_later_set_and_times_out_cleanly() {
    let (server, s) = pair();
    let addr = server.local_addr().to_string();
    let setter = std::thread::spawn(move || {
        let other = Store::connect(&addr, Duration::from_secs(5)).unwrap();
        std::thread::sleep(Duration::from_millis(200));
        other.set("late", b"v").unwrap();
    });
    assert_eq!(
        s.get_timeout("late", Duration::from_secs(10)).unwrap(),
        b"v"
    );
    setter.join().unwrap();
    let start = Instant::now();
    let e = s
        .wait(&["never".to_string()], Duration::from_millis(300))
        .unwrap_err();
    assert!(
        matches!(e, DdpError::StoreTimeout { .. }) && e.to_string().contains("never"),
        "{e}"
    );
    assert!(start.elapsed() < Duration::from_secs(5));
}

#[test]
fn barrier_counts_arrivals() {
    let server = StoreServer::bind("127.0.0.1:0").unwrap();
    let addr = server.local_addr().to_string();
    let threads: Vec<_> = (0..3)
        .map(|_| {
            let addr = addr.clone();
            std::thread::spawn(move || {
                let s = Store::connect(&addr, Duration::from_secs(5)).unwrap();
                s.barrier("b", 3, Duration::from_secs(10))
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap().unwrap();
    }
    let s = Store::connect(&addr, Duration::from_secs(5)).unwrap();
    let e = s
        .barrier("lonely", 2, Duration::from_millis(200))
        .unwrap_err();
    assert!(e.to_string().contains("1 of 2 ranks arrived"), "{e}");
}

#[test]
fn clients_wait_for_a_server_that_starts_late() {
    let port = burn_ddp::launch::free_port("127.0.0.1").unwrap();
    let addr = format!("127.0.0.1:{port}");
    let server = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(500));
        let server = StoreServer::bind(("127.0.0.1", port)).unwrap();
        std::thread::sleep(Duration::from_secs(2));
        drop(server);
    });
    let s = Store::connect(&addr, Duration::from_secs(10)).unwrap();
    s.set("k", b"v").unwrap();
    server.join().unwrap();
}

#[test]
fn unreachable_store_fails_within_the_timeout() {
    let port = burn_ddp::launch::free_port("127.0.0.1").unwrap();
    let start = Instant::now();
    let e = Store::connect(&format!("127.0.0.1:{port}"), Duration::from_millis(700)).unwrap_err();
    assert!(e.to_string().contains("not reachable"), "{e}");
    assert!(
        start.elapsed() < Duration::from_secs(3),
        "{:?}",
        start.elapsed()
    );
}

/// How long the server may take to answer or close a connection it will not serve.
const CLOSE_BOUND: Duration = Duration::from_secs(5);

/// Everything `c` receives until the peer closes it (a reset counts as a close), or why not:
/// the peer neither closed nor answered within `bound` (a hang).
fn read_until_closed(c: &mut TcpStream, bound: Duration) -> Result<Vec<u8>, String> {
    let deadline = Instant::now() + bound;
    let mut got = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(format!(
                "still open after {bound:?}, {} bytes received",
                got.len()
            ));
        }
        c.set_read_timeout(Some(left)).map_err(|e| e.to_string())?;
        match c.read(&mut chunk) {
            Ok(0) => return Ok(got),
            Ok(n) => got.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return Ok(got),
            Err(e) => {
                return Err(format!(
                    "neither answered nor closed within {bound:?} ({e}), {} bytes received",
                    got.len()
                ));
            }
        }
    }
}

#[test]
fn garbage_and_absurd_frames_do_not_hurt_the_server() {
    let (server, s) = pair();
    let addr = server.local_addr();
    // Wrong hello: closed without an answer.
    let mut c = TcpStream::connect(addr).unwrap();
    c.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    let buf = read_until_closed(&mut c, CLOSE_BOUND).expect("a stranger's connection");
    assert!(buf.is_empty(), "the server answered a stranger");
    // Right magic, then claims of 255 bytes (at most 64 allowed): the server hangs up.
    let mut c = TcpStream::connect(addr).unwrap();
    c.write_all(&[STORE_HELLO, &[255]].concat()).unwrap();
    let rest = read_until_closed(&mut c, CLOSE_BOUND).expect("absurd claims");
    assert!(rest.is_empty(), "answered absurd claims: {rest:?}");
    // Admitted without a secret (this store has none), then a 4 GiB frame length, then
    // garbage bodies: each answered with an error, then closed.
    for body in [
        vec![0xff, 0xff, 0xff, 0xff],
        vec![3, 0, 0, 0, 99, 1, 2],
        vec![5, 0, 0, 0, 1, 0xff, 0xff, 0xff, 0x7f],
    ] {
        let mut c = TcpStream::connect(addr).unwrap();
        c.set_read_timeout(Some(CLOSE_BOUND)).unwrap();
        c.write_all(&store_hello()).unwrap();
        let mut challenge = [0u8; STORE_CHALLENGE_LEN];
        c.read_exact(&mut challenge).unwrap();
        c.write_all(&store_answer(2, [0; 32])).unwrap();
        let mut verdict = [0u8; 4];
        c.read_exact(&mut verdict).unwrap();
        assert_eq!(verdict, [0, 0, 0, 0], "admitted with an empty verdict");
        c.write_all(&body).unwrap();
        let rest = read_until_closed(&mut c, CLOSE_BOUND)
            .unwrap_or_else(|e| panic!("garbage body {body:?}: {e}"));
        let answer = String::from_utf8_lossy(&rest);
        assert!(
            answer.contains("bad request"),
            "garbage body {body:?}: answered {answer:?}"
        );
    }
    // The server still serves well-behaved clients.
    s.set("after", b"ok").unwrap();
    assert_eq!(s.get("after").unwrap(), b"ok");
}

/// The check above can fail: a server that accepts and then neither answers nor closes is a
/// hang, not a pass.
#[test]
fn a_server_that_neither_answers_nor_closes_is_caught() {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let mut c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (_held, _) = l.accept().unwrap();
    c.write_all(&[0xff; 8]).unwrap();
    let started = Instant::now();
    let e = read_until_closed(&mut c, Duration::from_millis(300)).unwrap_err();
    assert!(e.contains("300ms"), "{e}");
    assert!(started.elapsed() < Duration::from_secs(3), "{e}");
}

#[test]
fn a_server_that_is_not_a_store_is_named() {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let t = std::thread::spawn(move || {
        let (mut c, _) = l.accept().unwrap();
        let _ = c.write_all(b"SSH-2.0-OpenSSH_9.2 and more bytes\r\n");
        std::thread::sleep(Duration::from_millis(300));
    });
    let e = Store::connect(&addr.to_string(), Duration::from_secs(5)).unwrap_err();
    assert!(e.to_string().contains("not a burn-ddp store"), "{e}");
    t.join().unwrap();
}

/// Descriptors this process holds on the accepted (server-side) connections of the store
/// listening on `port`, and how many such connections there are: sockets whose local port is
/// `port`, from `/proc/net/tcp{,6}`, matched to `/proc/self/fd` by inode.
fn server_side_descriptors(port: u16) -> (usize, usize) {
    let mut inodes = std::collections::HashSet::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let text = std::fs::read_to_string(table).unwrap_or_default();
        for line in text.lines().skip(1) {
            let cols: Vec<&str> = line.split_whitespace().collect();
            let local_port = cols
                .get(1)
                .and_then(|a| a.rsplit(':').next())
                .and_then(|p| u16::from_str_radix(p, 16).ok());
            // State 0A is LISTEN: the listener itself is not a connection.
            if local_port == Some(port) && cols.get(3) != Some(&"0A") {
                inodes.insert(format!("socket:[{}]", cols[9]));
            }
        }
    }
    let fds = std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter(|link| inodes.contains(&*link.to_string_lossy()))
        .count();
    (fds, inodes.len())
}

/// The store holds one descriptor per client connection (it once held two, a reader and a
/// writer, and ran out of descriptors at half the ranks).
#[test]
fn the_store_holds_one_descriptor_per_connection() {
    let server = StoreServer::bind("127.0.0.1:0").unwrap();
    let addr = server.local_addr().to_string();
    let clients: Vec<Store> = (0..16)
        .map(|i| {
            let c = Store::connect(&addr, Duration::from_secs(5)).unwrap();
            c.set(&format!("k{i}"), b"v").unwrap();
            c
        })
        .collect();
    // Every client was served, so the server holds every connection.
    let (fds, connections) = server_side_descriptors(server.local_addr().port());
    assert_eq!(
        connections,
        clients.len(),
        "connections the server accepted"
    );
    assert_eq!(fds, connections, "descriptors the server holds for them");
}

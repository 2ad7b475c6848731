//! The shared-memory transport when someone else writes the store: a segment record forged
//! into it before the ranks start (torchrun's store admits anyone who reaches `MASTER_PORT`)
//! is never taken, and the group still forms within its rendezvous timeout.

use std::io::Read;
use std::os::fd::OwnedFd;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use burn_ddp::secret::JobSecret;
use burn_ddp::store::{Store, StoreServer};
use burn_ddp::{ProcessGroup, ReduceOp, Transport};

use crate::common::options;

/// The store key of host 0's segment record (`store::keys::shm_segment`).
const SEGMENT_KEY: &str = "bddp/shm/segment/0";
const T: Duration = Duration::from_secs(10);

/// A socket name in the form of a segment's offer, claiming this process (the forger runs as
/// the ranks' user and in their process here, so only the record's tag or a bounded connect
/// can stop a taker).
fn forged_name(port: u16) -> String {
    format!("burn-ddp-{port}-{}-5eed5eed5eed5eed", std::process::id())
}

/// Writes a forged record for `name` into the store at `port`, as anyone who can write the
/// store could (a store client that holds the secret, where burn-ddp's store needs one).
/// Returns the client and the record, to write it again.
fn forge(port: u16, secret: Option<&JobSecret>, name: &str) -> (Store, Vec<u8>) {
    let store = Store::connect_with_secret(&format!("127.0.0.1:{port}"), T, secret).unwrap();
    let record = format!("ok {name} {}", "ab".repeat(16)).into_bytes();
    store.set(SEGMENT_KEY, &record).unwrap();
    (store, record)
}

/// Forms a group of two ranks (threads) through the store at `port` and all-reduces
/// `[rank + 1; 100]`: each rank's transport and result, or why it could not join.
fn pair(
    port: u16,
    secret: Option<JobSecret>,
    transport: Transport,
    rendezvous: Duration,
) -> Vec<Result<(Transport, Vec<f32>), String>> {
    std::thread::scope(|s| {
        let ranks: Vec<_> = (0..2)
            .map(|rank| {
                let secret = secret.clone();
                s.spawn(move || {
                    let mut b = ProcessGroup::builder(rank, 2)
                        .master_addr("127.0.0.1")
                        .master_port(port)
                        .host_store(false)
                        .options(options(10))
                        .transport(transport)
                        .rendezvous_timeout(rendezvous);
                    if let Some(secret) = secret {
                        b = b.secret(secret);
                    }
                    let g = b.build().map_err(|e| e.to_string())?;
                    let r = g.all_reduce(vec![rank as f32 + 1.0; 100], ReduceOp::Sum);
                    Ok((g.transport(), r.wait().map_err(|e| e.to_string())?))
                })
            })
            .collect();
        ranks.into_iter().map(|r| r.join().unwrap()).collect()
    })
}

/// Until `stop`, writes the forged record again whenever the store holds another (the
/// creator's), so that the ranks read the forged one whoever writes first.
fn keep_forging((store, forged): &(Store, Vec<u8>), stop: &AtomicBool) {
    while !stop.load(Ordering::Acquire) {
        if store.try_get(SEGMENT_KEY).unwrap().as_ref() != Some(forged) {
            store.set(SEGMENT_KEY, forged).unwrap();
        }
        std::thread::sleep(Duration::from_micros(100));
    }
}

/// Accepts every connection to `listener` until `stop`, and records what each sent.
fn spy(listener: &UnixListener, stop: &AtomicBool, received: &Mutex<Vec<Vec<u8>>>) {
    listener.set_nonblocking(true).unwrap();
    while !stop.load(Ordering::Acquire) {
        match listener.accept() {
            Ok((mut conn, _)) => {
                conn.set_nonblocking(false).unwrap();
                conn.set_read_timeout(Some(Duration::from_secs(1))).unwrap();
                let mut got = [0u8; 64];
                let n = conn.read(&mut got).unwrap_or(0);
                received.lock().unwrap().push(got[..n].to_vec());
            }
            Err(_) => std::thread::sleep(Duration::from_millis(1)),
        }
    }
}

/// Someone who can write the store (torchrun's, in real life) pre-sets host 0's segment
/// record to a socket of its own, and writes it again over the creator's: with the job secret
/// the record carries no valid tag, so no rank connects to that socket (it never receives a
/// token), and the group forms (on TCP, or on the real segment where a rank read the creator's
/// record) with the right sums; demanded shared memory fails naming the rank and the refusal.
#[test]
fn a_forged_segment_record_in_the_store_is_never_taken() {
    for transport in [Transport::Auto, Transport::Shm] {
        let secret = JobSecret::generate().unwrap();
        let server = StoreServer::bind_with_secret("127.0.0.1:0", Some(secret.clone())).unwrap();
        let port = server.local_addr().port();
        let name = forged_name(port);
        let listener =
            UnixListener::bind_addr(&SocketAddr::from_abstract_name(name.as_bytes()).unwrap())
                .unwrap();
        let forger = forge(port, Some(&secret), &name);
        let (stop, received) = (AtomicBool::new(false), Mutex::new(Vec::new()));
        let outcomes = std::thread::scope(|s| {
            s.spawn(|| spy(&listener, &stop, &received));
            s.spawn(|| keep_forging(&forger, &stop));
            let outcomes = pair(
                port,
                Some(secret.clone()),
                transport,
                Duration::from_secs(20),
            );
            stop.store(true, Ordering::Release);
            outcomes
        });
        let received = received.into_inner().unwrap();
        assert!(
            received.is_empty(),
            "{transport}: the forged socket was connected to and received {received:?}"
        );
        for (rank, outcome) in outcomes.into_iter().enumerate() {
            match (transport, outcome) {
                (_, Ok((used, sum))) => {
                    assert_eq!(sum, vec![3.0; 100], "{transport}, rank {rank} on {used}");
                    eprintln!("{transport}: rank {rank} formed the group on {used}");
                }
                // Demanded shared memory fails, naming the rank refused and why.
                (Transport::Shm, Err(e)) => {
                    assert!(e.contains("BURN_DDP_TRANSPORT=shm"), "{e}");
                    assert!(e.contains("rank 1 could not map"), "{e}");
                    assert!(e.contains("valid tag of the job secret"), "{e}");
                    eprintln!("{transport}: rank {rank} failed as it should: {e}");
                }
                (_, Err(e)) => panic!("{transport}, rank {rank}: {e}"),
            }
        }
    }
}

/// A socket whose queue is full and never served, as a forged record (without a job secret,
/// records are not authenticated) can name: the rank that reads it gives up its connect after a
/// bounded wait, and the group falls back to TCP well within its rendezvous timeout instead of
/// failing whole (before, that rank waited in `connect` for ever).
#[test]
fn a_segment_socket_whose_queue_is_full_does_not_fail_the_group() {
    use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};
    let server = StoreServer::bind("127.0.0.1:0").unwrap();
    let port = server.local_addr().port();
    let name = forged_name(port);
    let addr = SocketAddrUnix::new_abstract_name(name.as_bytes()).unwrap();
    let unix = |flags| {
        rustix::net::socket_with(AddressFamily::UNIX, SocketType::STREAM, flags, None).unwrap()
    };
    let listener = unix(SocketFlags::CLOEXEC);
    rustix::net::bind(&listener, &addr).unwrap();
    rustix::net::listen(&listener, 0).unwrap();
    // Connections no one accepts, until the queue takes no more.
    let mut queued: Vec<OwnedFd> = Vec::new();
    loop {
        let conn = unix(SocketFlags::CLOEXEC | SocketFlags::NONBLOCK);
        if rustix::net::connect(&conn, &addr).is_err() {
            break;
        }
        queued.push(conn);
        assert!(queued.len() < 1000, "the queue never fills");
    }
    assert!(!queued.is_empty());
    let forger = forge(port, None, &name);
    let rendezvous = Duration::from_secs(15);
    let start = Instant::now();
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    let stop = AtomicBool::new(false);
    let outcomes = std::thread::scope(|s| {
        s.spawn(|| keep_forging(&forger, &stop));
        // Closing the socket releases a rank that would wait on it for ever.
        s.spawn(move || {
            let _ = done_rx.recv_timeout(rendezvous + Duration::from_secs(5));
            drop(listener);
        });
        let outcomes = pair(port, None, Transport::Auto, rendezvous);
        stop.store(true, Ordering::Release);
        drop(done_tx);
        outcomes
    });
    let took = start.elapsed();
    for (rank, outcome) in outcomes.into_iter().enumerate() {
        let (used, sum) = outcome.unwrap_or_else(|e| panic!("rank {rank} after {took:?}: {e}"));
        assert_eq!(sum, vec![3.0; 100], "rank {rank} on {used}");
        eprintln!("rank {rank} formed the group on {used} in {took:?}");
    }
    assert!(took < rendezvous, "the group took {took:?}");
}

//! Half-open connections: the store closes connections that do not complete their hello within
//! `StoreServer::HELLO_TIMEOUT` (however slowly they send), keeps at most
//! `StoreServer::MAX_PENDING` of them, and a job running through a flood of them is unaffected.

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use burn_ddp::secret::JobSecret;
use burn_ddp::store::{Store, StoreServer};
use burn_ddp::{ProcessGroup, ReduceOp};
use rand::{Rng, SeedableRng};

use crate::common::{STORE_HELLO, options, store_answer, store_hello};

/// The first bytes of the store protocol (`store::protocol::HELLO`).
const HELLO: &[u8] = STORE_HELLO;
/// Scheduling slack on a loaded 2-core machine.
const SLACK: Duration = Duration::from_secs(3);

/// Polls `conns` until each reads end-of-file or an error (the server closed it) or `limit`
/// passes; returns when each was seen closed, measured from `since` (`None`: still open).
fn closed_after(conns: &[TcpStream], since: Instant, limit: Duration) -> Vec<Option<Duration>> {
    let mut closed = vec![None; conns.len()];
    for c in conns {
        c.set_nonblocking(true).unwrap();
    }
    let mut buf = [0u8; 256];
    while closed.iter().any(Option::is_none) && since.elapsed() < limit {
        for (c, at) in conns.iter().zip(closed.iter_mut()) {
            if at.is_some() {
                continue;
            }
            let mut c = c;
            loop {
                match c.read(&mut buf) {
                    Ok(0) => *at = Some(since.elapsed()),
                    Ok(_) => continue, // the server's challenge, and its verdict
                    Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                    Err(_) => *at = Some(since.elapsed()),
                }
                break;
            }
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    closed
}

/// "n closed within MIN..MAX" for a report line; fails the test if any is still open.
fn summary(what: &str, times: &[Option<Duration>]) -> (Duration, Duration) {
    let open = times.iter().filter(|t| t.is_none()).count();
    assert_eq!(
        open, 0,
        "{open} {what} connections are still open: {times:?}"
    );
    let times: Vec<Duration> = times.iter().flatten().copied().collect();
    let (min, max) = (*times.iter().min().unwrap(), *times.iter().max().unwrap());
    println!(
        "{what}: {} closed after {min:.2?} .. {max:.2?}",
        times.len()
    );
    (min, max)
}

fn connect(addr: SocketAddr) -> TcpStream {
    TcpStream::connect_timeout(&addr, Duration::from_secs(5)).expect("connecting to the store")
}

#[test]
fn unadmitted_connections_are_closed_within_the_hello_timeout() {
    let secret = JobSecret::generate().unwrap();
    let server = StoreServer::bind_with_secret("127.0.0.1:0", Some(secret)).unwrap();
    let addr = server.local_addr();
    let start = Instant::now();
    let silent: Vec<TcpStream> = (0..10).map(|_| connect(addr)).collect();
    let partial: Vec<TcpStream> = (0..10)
        .map(|_| {
            let mut c = connect(addr);
            c.write_all(&HELLO[..8]).unwrap();
            c
        })
        .collect();
    let partial_nonce: Vec<TcpStream> = (0..10)
        .map(|_| {
            let mut c = connect(addr);
            c.write_all(HELLO).unwrap();
            c.write_all(&[0]).unwrap(); // no claims
            c.write_all(b"12345").unwrap(); // 5 of the nonce's 32 bytes
            c
        })
        .collect();
    let bad_hello: Vec<TcpStream> = (0..10)
        .map(|_| {
            let mut c = connect(addr);
            c.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
            c
        })
        .collect();
    // One byte of a valid hello every 300 ms: progress, but never a complete hello in time.
    let trickle: Vec<TcpStream> = (0..5).map(|_| connect(addr)).collect();
    let stop = AtomicBool::new(false);
    let limit = StoreServer::HELLO_TIMEOUT + SLACK;
    std::thread::scope(|s| {
        for c in &trickle {
            let stop = &stop;
            s.spawn(move || {
                let mut c = c;
                for b in HELLO {
                    if stop.load(Ordering::Relaxed) || c.write_all(&[*b]).is_err() {
                        return;
                    }
                    std::thread::sleep(Duration::from_millis(300));
                }
            });
        }
        let bound = StoreServer::HELLO_TIMEOUT;
        let groups = [
            ("silent", &silent),
            ("partial hello", &partial),
            ("partial nonce", &partial_nonce),
            ("trickling", &trickle),
            ("bad hello", &bad_hello),
        ];
        let all: Vec<TcpStream> = groups
            .iter()
            .flat_map(|(_, conns)| conns.iter().map(|c| c.try_clone().unwrap()))
            .collect();
        let mut times = closed_after(&all, start, limit).into_iter();
        for (what, conns) in groups {
            let mine: Vec<_> = times.by_ref().take(conns.len()).collect();
            let (min, max) = summary(what, &mine);
            if what == "bad hello" {
                assert!(
                    max < Duration::from_secs(1),
                    "a bad hello is closed at once"
                );
            } else {
                assert!(max <= limit, "{what}: closed only after {max:?}");
                assert!(min >= bound - Duration::from_millis(100), "{what}: {min:?}");
            }
        }
        stop.store(true, Ordering::Relaxed);
    });
}

/// One stray connection of a flood: silent, or garbage of some kind.
fn stray(addr: SocketAddr, i: usize, rng: &mut impl Rng) -> TcpStream {
    let mut c = connect(addr);
    let garbage: Vec<u8> = match i % 5 {
        0 | 1 => Vec::new(),
        2 => (0..rng.random_range(1..40)).map(|_| rng.random()).collect(),
        3 => HELLO[..rng.random_range(1..HELLO.len())].to_vec(),
        // A well-formed hello and a wrong proof.
        _ => [store_hello(), store_answer(1, [0; 32])].concat(),
    };
    let _ = c.write_all(&garbage);
    c
}

#[test]
fn a_flood_of_unadmitted_connections_leaves_a_running_group_alone() {
    const WORLD: usize = 3;
    const STRAYS: usize = 500;
    let secret = JobSecret::generate().unwrap();
    let server = StoreServer::bind_with_secret("127.0.0.1:0", Some(secret.clone())).unwrap();
    let addr = server.local_addr();
    let flood_done = AtomicBool::new(false);
    std::thread::scope(|s| {
        let ranks: Vec<_> = (0..WORLD)
            .map(|rank| {
                let (secret, flood_done) = (secret.clone(), &flood_done);
                s.spawn(move || {
                    let group = ProcessGroup::builder(rank, WORLD)
                        .master_addr("127.0.0.1")
                        .master_port(addr.port())
                        .host_store(false)
                        .secret(secret)
                        .options(options(60))
                        .build()
                        .unwrap_or_else(|e| panic!("rank {rank} could not join: {e}"));
                    // All-reduce until rank 0 has seen the flood end (the flag travels in
                    // element 0), checking every result.
                    let mut rounds = 0usize;
                    loop {
                        let stop = rank == 0 && flood_done.load(Ordering::Relaxed);
                        let mut data = vec![(rank + rounds) as f32; 4096];
                        data[0] = if stop { 1.0 } else { 0.0 };
                        let out = group.all_reduce(data, ReduceOp::Sum).wait().unwrap();
                        let want = (0..WORLD).map(|r| (r + rounds) as f32).sum::<f32>();
                        assert!(out[1..].iter().all(|x| *x == want), "round {rounds}");
                        rounds += 1;
                        if out[0] > 0.0 {
                            return rounds;
                        }
                    }
                })
            })
            .collect();

        let mut rng = rand::rngs::StdRng::seed_from_u64(9);
        let start = Instant::now();
        let mut strays = Vec::with_capacity(STRAYS);
        let mut fresh = Vec::new();
        for i in 0..STRAYS {
            strays.push(stray(addr, i, &mut rng));
            // A new client in the middle of the flood still gets in.
            if i % 50 == 25 {
                let t = Instant::now();
                let store = Store::connect_with_secret(
                    &addr.to_string(),
                    Duration::from_secs(10),
                    Some(&secret),
                )
                .unwrap_or_else(|e| panic!("a client during the flood was refused: {e}"));
                store.set("fresh", b"1").unwrap();
                fresh.push(t.elapsed());
            }
        }
        let flood_took = start.elapsed();
        let times = closed_after(
            &strays,
            start,
            flood_took + StoreServer::HELLO_TIMEOUT + SLACK,
        );
        flood_done.store(true, Ordering::Relaxed);
        let still_open_at_1s = times
            .iter()
            .filter(|t| t.is_none_or(|t| t > flood_took + Duration::from_secs(1)))
            .count();
        let (_, max) = summary("flood", &times);
        let rounds: Vec<usize> = ranks.into_iter().map(|r| r.join().unwrap()).collect();
        println!(
            "flood of {STRAYS} in {flood_took:.2?}: last closed {max:.2?} after the first, \
             {still_open_at_1s} still open 1 s after the flood (at most {} pending); {} new \
             clients connected in {:.2?} at most; the group did {rounds:?} all-reduces",
            StoreServer::MAX_PENDING,
            fresh.len(),
            fresh.iter().max().unwrap()
        );
        assert!(still_open_at_1s <= StoreServer::MAX_PENDING);
        assert!(rounds.iter().all(|r| *r == rounds[0] && *r > 0));
    });
}

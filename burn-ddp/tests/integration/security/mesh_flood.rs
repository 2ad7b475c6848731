//! A flood of unauthenticated connections at the ranks' data-plane ports during a rendezvous:
//! the job forms within 2 s of the time it takes without the flood, and trains. The ranks run
//! in a process of their own whose open-file limit is 1024 (a common default), so a rank that
//! kept every connection it ever accepted would run out of descriptors.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use burn_ddp::secret::JobSecret;
use burn_ddp::store::Store;
use burn_ddp::{ProcessGroup, ReduceOp};

use super::store_client;
use crate::common::options;

const WORLD: usize = 4;
/// Connections the flood opens in all.
const FLOOD: usize = 2_000;
/// Flood connections opened before rank 3 starts (the rest come during its rendezvous).
const BEFORE: usize = FLOOD * 3 / 4;
/// Most flood connections held open at once (a descriptor each, in this process).
const HELD: usize = 900;
/// The child's environment variable: the store's port and the job secret.
const CHILD_VAR: &str = "BDDP_TEST_MESH_FLOOD";
/// Store keys the test and its child meet on.
const ACCEPTING: &str = "test/flood/accepting";
const GO: &str = "test/flood/go";

fn join(rank: usize, port: u16, secret: &JobSecret) -> ProcessGroup {
    super::join(rank, WORLD, port, secret, options(20))
        .unwrap_or_else(|e| panic!("rank {rank}: {e}"))
}

/// The data-plane addresses ranks 0 to `n - 1` published.
fn addresses(store: &Store, n: usize) -> Vec<SocketAddr> {
    (0..n)
        .map(|r| {
            let raw = store.get(&burn_ddp::testing::mesh_addr_key(r)).unwrap();
            String::from_utf8_lossy(&raw).parse().unwrap()
        })
        .collect()
}

/// Opens up to [`FLOOD`] connections spread over `targets` until `stop`, from four threads:
/// half stay silent, half send bytes that are not a burn-ddp hello; counts them in `opened`.
fn flood(targets: &[SocketAddr], opened: &AtomicUsize, stop: &AtomicBool) {
    std::thread::scope(|s| {
        for thread in 0..4 {
            s.spawn(move || {
                let mut held = std::collections::VecDeque::new();
                for i in (thread..FLOOD).step_by(4) {
                    if stop.load(Ordering::Relaxed) {
                        return;
                    }
                    let target = targets[i % targets.len()];
                    let Ok(mut conn) = TcpStream::connect_timeout(&target, Duration::from_secs(2))
                    else {
                        continue;
                    };
                    opened.fetch_add(1, Ordering::Relaxed);
                    if i % 2 == 1 {
                        let _ = conn.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n");
                    }
                    held.push_back(conn);
                    if held.len() > HELD / 4 {
                        held.pop_front();
                    }
                }
                // Hold the last ones until the job has formed.
                while !stop.load(Ordering::Relaxed) {
                    std::thread::sleep(Duration::from_millis(10));
                }
            });
        }
    });
}

/// The ranks' process: ranks 0 to 2 form first, accepting (a placeholder address for rank 3
/// lets them past the wait for every address); once the test says go, rank 3 joins. Prints
/// the time from rank 3's start to every rank's group, then trains a few steps.
#[test]
fn flood_child_ranks() {
    let Ok(arg) = std::env::var(CHILD_VAR) else {
        return; // Only as the child of the test below.
    };
    let (port, secret) = arg.split_once(' ').unwrap();
    let (port, secret): (u16, _) = (port.parse().unwrap(), JobSecret::new(secret).unwrap());
    let store = store_client(port, &secret);
    let groups = std::thread::scope(|s| {
        let early: Vec<_> = (0..WORLD - 1)
            .map(|r| {
                let secret = &secret;
                s.spawn(move || join(r, port, secret))
            })
            .collect();
        addresses(&store, WORLD - 1);
        let last_key = burn_ddp::testing::mesh_addr_key(WORLD - 1);
        store.set(&last_key, b"127.0.0.1:1").unwrap();
        store.set(ACCEPTING, b"").unwrap();
        store
            .wait(&[GO.to_string()], Duration::from_secs(30))
            .unwrap();
        let started = Instant::now();
        let last = join(WORLD - 1, port, &secret);
        let mut groups: Vec<ProcessGroup> = early.into_iter().map(|h| h.join().unwrap()).collect();
        println!("FORMED {}", started.elapsed().as_micros());
        groups.push(last);
        groups
    });
    // The job trains: a few all-reduces on every rank.
    std::thread::scope(|s| {
        for g in &groups {
            s.spawn(move || {
                for step in 0..5 {
                    let got = g
                        .all_reduce(vec![step as f32 + g.rank() as f32; 1000], ReduceOp::Sum)
                        .wait()
                        .unwrap();
                    assert_eq!(got, vec![4.0 * step as f32 + 6.0; 1000]);
                }
            });
        }
    });
    println!("TRAINED");
}

/// Runs the ranks' process under a limit of 1024 open files, with a flood of connections at
/// its ranks' data plane when `flooded`. Returns the time rank 3's rendezvous took and how
/// many flood connections were opened.
fn form(flooded: bool) -> (Duration, usize) {
    let (secret, server) = super::secured_store();
    let port = server.local_addr().port();
    let store = store_client(port, &secret);
    let exe = std::env::current_exe().unwrap();
    let mut child = Command::new("sh")
        .arg("-c")
        .arg("ulimit -n 1024 && exec \"$0\" \"$@\"")
        .arg(exe)
        .args([
            "security::mesh_flood::flood_child_ranks",
            "--exact",
            "--nocapture",
        ])
        .env(CHILD_VAR, format!("{port} {}", secret.to_env_value()))
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let (opened, stop) = (AtomicUsize::new(0), AtomicBool::new(false));
    let out = std::thread::scope(|s| {
        store
            .wait(&[ACCEPTING.to_string()], Duration::from_secs(30))
            .unwrap();
        let targets = addresses(&store, WORLD - 1);
        let (opened, stop) = (&opened, &stop);
        let flooding = flooded.then(|| s.spawn(move || flood(&targets, opened, stop)));
        let until = Instant::now() + Duration::from_secs(20);
        while flooded && opened.load(Ordering::Relaxed) < BEFORE && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(1));
        }
        store.set(GO, b"").unwrap();
        let mut out = String::new();
        let mut stdout = child.stdout.take().unwrap();
        // The child's own timeouts (20 s collectives, 30 s rendezvous) bound this read.
        stdout.read_to_string(&mut out).unwrap();
        stop.store(true, Ordering::Relaxed);
        if let Some(flooding) = flooding {
            flooding.join().unwrap();
        }
        out
    });
    let status = child.wait().unwrap();
    assert!(
        status.success() && out.contains("TRAINED"),
        "{status}: {out}"
    );
    let micros: u64 = out
        .lines()
        .find_map(|l| l.strip_prefix("FORMED "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no FORMED line in {out}"));
    (
        Duration::from_micros(micros),
        opened.load(Ordering::Relaxed),
    )
}

#[test]
fn a_flood_of_connections_does_not_hold_up_the_rendezvous() {
    let (normal, _) = form(false);
    let (flooded, opened) = form(true);
    eprintln!(
        "rendezvous of {WORLD} ranks: {normal:?} alone, {flooded:?} during a flood of {opened} \
         unauthenticated connections"
    );
    assert!(
        opened >= BEFORE,
        "the flood opened only {opened} connections"
    );
    assert!(
        flooded <= normal + Duration::from_secs(2),
        "the rendezvous took {flooded:?} during the flood, {normal:?} without"
    );
}

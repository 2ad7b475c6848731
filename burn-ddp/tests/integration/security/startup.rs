//! What admission costs at start-up: a world of 8 ranks (threads) forming its group with a job
//! secret, and store connections opened one after the other. Prints the figures; fails only
//! when they are far beyond any reasonable cost.

use std::time::{Duration, Instant};

use burn_ddp::secret::JobSecret;
use burn_ddp::store::Store;

use crate::common::options;

const WORLD: usize = 8;

/// Forms a group of `WORLD` threads with `secret`; returns how long the slowest rank took.
fn form_world(secret: &JobSecret) -> Duration {
    let server = super::store_holding(secret);
    let port = server.local_addr().port();
    let start = Instant::now();
    let took: Vec<Duration> = std::thread::scope(|s| {
        let ranks: Vec<_> = (0..WORLD)
            .map(|rank| {
                s.spawn(move || {
                    let group = super::join(rank, WORLD, port, secret, options(30))
                        .unwrap_or_else(|e| panic!("rank {rank} could not join: {e}"));
                    let took = start.elapsed();
                    group.barrier().wait().unwrap();
                    took
                })
            })
            .collect();
        ranks.into_iter().map(|r| r.join().unwrap()).collect()
    });
    took.into_iter().max().unwrap()
}

#[test]
fn admission_costs_little_at_start_up() {
    let secret = JobSecret::generate().unwrap();
    const WORLDS: usize = 15;
    let mut worlds: Vec<Duration> = (0..WORLDS).map(|_| form_world(&secret)).collect();
    worlds.sort();
    let median = worlds[WORLDS / 2];

    const CONNECTIONS: usize = 500;
    let server = super::store_holding(&secret);
    let addr = server.local_addr().to_string();
    let mut each: Vec<Duration> = (0..CONNECTIONS)
        .map(|_| {
            let start = Instant::now();
            let store = Store::connect_with_secret(&addr, Duration::from_secs(10), Some(&secret));
            store.unwrap().set("k", b"v").unwrap();
            start.elapsed()
        })
        .collect();
    each.sort();
    let per_connection = each[each.len() / 2];
    let (p99, slowest) = (each[each.len() * 99 / 100], each[each.len() - 1]);
    println!(
        "world of {WORLD} formed in {median:.1?} (median of {WORLDS}; min {:.1?}, max {:.1?}); \
         a store connection with admission and one request: {per_connection:.0?} (median of \
         {CONNECTIONS}; 99th percentile {p99:.0?}, slowest {slowest:.0?})",
        worlds[0],
        worlds[WORLDS - 1]
    );
    assert!(median < Duration::from_secs(10), "{worlds:?}");
    assert!(
        per_connection < Duration::from_millis(100),
        "{per_connection:?}"
    );
}

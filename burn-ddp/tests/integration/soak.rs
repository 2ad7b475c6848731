//! Soak: thousands of all-reduces of random sizes, types and operators on 4 ranks, every
//! result checked exactly, resident memory sampled to show it stays flat. A short run is part
//! of the normal tests; `cargo xtask soak` runs the long one (`BDDP_SOAK_ITERS`, default 5000).

use std::time::{Duration, Instant};

use burn_ddp::{ProcessGroup, ReduceOp};
use half::{bf16, f16};

use crate::common::{TestFloat, options, run_world, splitmix};

const WORLD: usize = 4;
/// Largest buffer, in elements (4 MiB of f32).
const MAX_LEN: usize = 1 << 20;

/// A small integer in -8..8 for (iteration, rank, index): sums of 4 are exact in every type.
fn int(iter: u64, rank: usize, i: usize) -> f32 {
    (splitmix(iter ^ ((rank as u64) << 48) ^ ((i as u64) << 8)) % 16) as f32 - 8.0
}

/// Resident memory of this process in bytes (0 where /proc is missing).
fn rss() -> u64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<u64>().ok())
        .map_or(0, |pages| pages * 4096)
}

/// One all-reduce of iteration `iter`, checked against the exact result.
fn step<T: TestFloat>(g: &ProcessGroup, iter: u64, len: usize, op: ReduceOp) -> usize {
    let mine: Vec<T> = (0..len)
        .map(|i| T::from_f32(int(iter, g.rank(), i)))
        .collect();
    let out = g.all_reduce(mine, op).wait().expect("all_reduce");
    assert_eq!(out.len(), len, "iteration {iter}");
    for (i, got) in out.iter().enumerate() {
        let xs = (0..WORLD).map(|r| int(iter, r, i) as f64);
        let want = match op {
            ReduceOp::Sum => xs.sum::<f64>(),
            ReduceOp::Avg => xs.sum::<f64>() / WORLD as f64,
            ReduceOp::Max => xs.fold(f64::MIN, f64::max),
            ReduceOp::Min => xs.fold(f64::MAX, f64::min),
        };
        assert_eq!(
            got.to_f64(),
            want,
            "iteration {iter}: {} {op:?} of {len}, element {i}",
            std::any::type_name::<T>()
        );
    }
    len * size_of::<T>()
}

/// Runs `iters` random all-reduces; returns bytes reduced per rank and RSS samples.
fn soak(iters: u64) {
    let start = Instant::now();
    let samples = std::sync::Mutex::new(Vec::new());
    let bytes = run_world(WORLD, options(60), |g| {
        let mut bytes = 0;
        for iter in 0..iters {
            let r = splitmix(iter.wrapping_mul(0x51));
            // Log-uniform sizes from 1 to MAX_LEN elements, now and then empty.
            let len = match r % 97 {
                0 => 0,
                _ => (1usize << ((r >> 8) % 21)).min(MAX_LEN) + ((r >> 16) as usize % 1000),
            }
            .min(MAX_LEN);
            let op = [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min]
                [(r >> 24) as usize % 4];
            bytes += match (r >> 32) % 4 {
                0 => step::<f32>(&g, iter, len, op),
                1 => step::<f16>(&g, iter, len, op),
                2 => step::<bf16>(&g, iter, len, op),
                _ => step::<f64>(&g, iter, len, op),
            };
            if g.rank() == 0 && iter % (iters / 20).max(1) == 0 {
                samples.lock().unwrap().push((iter, rss()));
            }
        }
        g.barrier().wait().expect("final barrier");
        bytes
    });
    let took = start.elapsed();
    let samples = samples.into_inner().unwrap();
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    let (warm, last) = (
        samples[samples.len() / 4].1,
        samples.last().map_or(0, |s| s.1),
    );
    let peak = samples.iter().map(|s| s.1).max().unwrap_or(0);
    println!(
        "soak: {iters} all-reduces on {WORLD} ranks in {:.1} s, {:.0} MiB reduced per rank",
        took.as_secs_f64(),
        mib(bytes[0] as u64)
    );
    println!(
        "soak: resident memory at 25% {:.1} MiB, at the end {:.1} MiB, peak {:.1} MiB",
        mib(warm),
        mib(last),
        mib(peak)
    );
    // Buffers come and go (up to 8 MiB each, several per rank in flight), so the bound has
    // room for the allocator; a leak that grows with the number of operations does not fit.
    if warm > 0 {
        assert!(
            last <= warm + (24 << 20),
            "resident memory grew from {:.1} MiB to {:.1} MiB",
            mib(warm),
            mib(last)
        );
    }
    assert!(took < Duration::from_secs(3600));
}

#[test]
fn soak_short() {
    soak(200);
}

#[test]
#[ignore = "long: run by `cargo xtask soak`"]
fn soak_long() {
    let iters = std::env::var("BDDP_SOAK_ITERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5000);
    soak(iters);
}

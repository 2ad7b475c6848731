//! Rank program of `cargo xtask bench-collectives`: times all-reduce over the TCP transport for
//! message sizes from 4 KiB to 256 MiB and prints, on rank 0, median time, algorithm and bus
//! bandwidth, and the ratio of bus bandwidth to a memcpy measured in the same run.
//!
//! Run it under a launcher (`burn-ddp-run --nproc 2 target/release/examples/bench_collectives`)
//! or through `cargo xtask bench-collectives --world 2`. Options: `--sizes 4K,64M`,
//! `--chunk 512K`, `--spin-us 20`, `--op sum|avg|max`.

use std::time::{Duration, Instant};

use burn_ddp::{GroupOptions, ProcessGroup, ReduceOp, env::LaunchEnv};

const DEFAULT_SIZES: &str = "4K,16K,64K,256K,1M,4M,16M,64M,256M";

fn parse_size(s: &str) -> Result<usize, String> {
    let s = s.trim();
    let (num, mult) = match s.chars().last() {
        Some('K' | 'k') => (&s[..s.len() - 1], 1 << 10),
        Some('M' | 'm') => (&s[..s.len() - 1], 1 << 20),
        Some('G' | 'g') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<usize>()
        .map(|n| n * mult)
        .map_err(|_| format!("bad size {s:?} (examples: 4K, 64M, 1G)"))
}

fn human(bytes: usize) -> String {
    match bytes {
        b if b >= 1 << 30 && b % (1 << 30) == 0 => format!("{} GiB", b >> 30),
        b if b >= 1 << 20 && b % (1 << 20) == 0 => format!("{} MiB", b >> 20),
        b if b >= 1 << 10 && b % (1 << 10) == 0 => format!("{} KiB", b >> 10),
        b => format!("{b} B"),
    }
}

fn median(mut xs: Vec<Duration>) -> Duration {
    xs.sort();
    xs[xs.len() / 2]
}

/// Median single-thread memcpy bandwidth over `bytes`, in GB/s.
fn memcpy_gbps(bytes: usize) -> f64 {
    let src = vec![1u8; bytes];
    let mut dst = vec![0u8; bytes];
    let times: Vec<Duration> = (0..7)
        .map(|_| {
            let t = Instant::now();
            dst.copy_from_slice(std::hint::black_box(&src));
            std::hint::black_box(&mut dst);
            t.elapsed()
        })
        .collect();
    bytes as f64 / median(times).as_secs_f64() / 1e9
}

struct Args {
    sizes: Vec<usize>,
    chunk: usize,
    spin: Duration,
    op: ReduceOp,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        sizes: Vec::new(),
        chunk: GroupOptions::default().chunk_bytes,
        spin: GroupOptions::default().spin,
        op: ReduceOp::Sum,
    };
    let mut sizes = DEFAULT_SIZES.to_string();
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        let mut value = || it.next().ok_or(format!("{a} needs a value"));
        match a.as_str() {
            "--sizes" => sizes = value()?,
            "--chunk" => args.chunk = parse_size(&value()?)?,
            "--spin-us" => {
                let v = value()?;
                let us = v.parse().map_err(|_| format!("bad --spin-us {v:?}"))?;
                args.spin = Duration::from_micros(us);
            }
            "--op" => {
                args.op = match value()?.as_str() {
                    "sum" => ReduceOp::Sum,
                    "avg" => ReduceOp::Avg,
                    "max" => ReduceOp::Max,
                    o => return Err(format!("unknown op {o}")),
                }
            }
            other => return Err(format!("unknown argument {other}")),
        }
    }
    args.sizes = sizes.split(',').map(parse_size).collect::<Result<_, _>>()?;
    Ok(args)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = parse_args()?;
    let env = LaunchEnv::from_env()?;
    let mut builder = ProcessGroup::builder(env.rank, env.world_size)
        .master_port(env.master_port)
        .options(GroupOptions {
            chunk_bytes: args.chunk,
            spin: args.spin,
            timeout: Duration::from_secs(120),
            ..GroupOptions::default()
        });
    if let Some(addr) = env.master_addr {
        builder = builder.master_addr(addr);
    }
    let group = builder.build()?;
    let (rank, n) = (group.rank(), group.world_size());

    let largest = args.sizes.iter().copied().max().unwrap_or(0).max(1 << 20);
    let memcpy = if rank == 0 { memcpy_gbps(largest) } else { 0.0 };
    group.barrier().wait()?;
    if rank == 0 {
        println!(
            "burn-ddp all-reduce (TCP ring), world {n}, f32 {:?}, chunk {}, spin {:?}",
            args.op,
            human(args.chunk),
            args.spin
        );
        println!("memcpy ({}, one thread): {memcpy:.2} GB/s", human(largest));
        println!(
            "{:>9} {:>6} {:>12} {:>12} {:>12} {:>13}",
            "size", "iters", "median(us)", "algbw(GB/s)", "busbw(GB/s)", "busbw/memcpy"
        );
    }
    for &size in &args.sizes {
        let elems = (size / 4).max(1);
        // The same count on every rank, so that all ranks run the same collectives.
        let iters = ((2usize << 30) / size.max(1)).clamp(5, 200);
        let mut buf = vec![0.0f32; elems];
        for _ in 0..(iters / 4).max(2) {
            buf = group.all_reduce(buf, args.op).wait()?;
        }
        let mut times = Vec::with_capacity(iters);
        for _ in 0..iters {
            let t = Instant::now();
            buf = group.all_reduce(buf, args.op).wait()?;
            times.push(t.elapsed());
        }
        // The slowest rank's median is the operation's time.
        let mine = median(times).as_secs_f64();
        let t = group.all_reduce(vec![mine], ReduceOp::Max).wait()?[0];
        if rank == 0 {
            let bytes = (elems * 4) as f64;
            let algbw = bytes / t / 1e9;
            let busbw = algbw * 2.0 * (n as f64 - 1.0) / n as f64;
            println!(
                "{:>9} {:>6} {:>12.1} {:>12.3} {:>12.3} {:>13.3}",
                human(elems * 4),
                iters,
                t * 1e6,
                algbw,
                busbw,
                busbw / memcpy
            );
        }
    }
    Ok(())
}

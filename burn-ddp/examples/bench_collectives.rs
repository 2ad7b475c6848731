//! Rank program of `cargo xtask bench-collectives`: times all-reduce and reduce-scatter over the
//! TCP or the shared-memory transport for message sizes from 4 KiB to 256 MiB and prints, on
//! rank 0, median time, algorithm and bus bandwidth, and the ratio of bus bandwidth to a memcpy
//! measured in the same run.
//!
//! Bus bandwidth is defined as nccl-tests define it, so that it compares with the link's speed
//! whatever the collective: a size `S` is the whole buffer each rank gives (for reduce-scatter,
//! all the parts), algbw is `S / time`, and busbw is algbw times `2(n-1)/n` for all-reduce and
//! `(n-1)/n` for reduce-scatter (the bytes each rank must send, over `S`).
//!
//! Run it under a launcher (`burn-ddp-run --nproc 2 target/release/examples/bench_collectives`)
//! or through `cargo xtask bench-collectives --world 2`; it forms its group from the
//! launcher's environment. Flags (`--help`): `--sizes 4K,64M`, `--chunk 512K`, `--spin-us 20`,
//! `--op sum|avg|max`, `--transport tcp|shm|auto`, `--shm-slot 1M`, `--dtype f32|bf16`,
//! `--collectives all-reduce,reduce-scatter`, `--report FILE`.
//!
//! With `--dtype bf16` a size `S` stands for `S` bytes of f32 gradients sent compressed, as
//! DdpLearner's `Compression::Bf16` sends them: an all-reduce of `S / 2` bytes of bf16. Its
//! sizes, algbw and busbw are those `S` bytes of f32 over the time, so the rows compare with the
//! f32 ones directly (the conversions to and from bf16 are not timed).

use std::time::{Duration, Instant};

use anyhow::Context;
use burn_ddp::{GroupOptions, ReduceOp, Transport, init_process_group_with};
use clap::Parser;

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

/// Runs small all-reduces until `at_least` has passed on the slowest rank (every rank sees the
/// same maximum, so all run the same number). Measured on 2 cores: right after the ranks start,
/// a few hundred collectives take about 100 µs instead of 4 µs at 4 KiB (with the default spin;
/// not with no spin or a 2 ms one), more than the per-size warm-up covers.
fn settle(group: &burn_ddp::ProcessGroup, at_least: Duration) -> anyhow::Result<()> {
    let start = Instant::now();
    while group
        .all_reduce(vec![start.elapsed().as_secs_f64()], ReduceOp::Max)
        .wait()?[0]
        < at_least.as_secs_f64()
    {}
    Ok(())
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

/// Times all-reduce over a transport; rank 0 prints the table.
#[derive(Debug, Parser)]
#[command(name = "bench_collectives")]
struct Args {
    /// Message sizes, comma-separated (K, M, G: binary multiples)
    #[arg(long, value_name = "SIZES", value_delimiter = ',', value_parser = parse_size,
          default_value = DEFAULT_SIZES)]
    sizes: Vec<usize>,
    /// Pipelining chunk of the transport
    #[arg(long, value_name = "BYTES", value_parser = parse_size, default_value = "512K")]
    chunk: usize,
    /// How long a collective spins on its sockets before sleeping, in microseconds
    #[arg(long, value_name = "US", default_value_t = 20)]
    spin_us: u64,
    /// Reduction operator
    #[arg(long, value_enum, default_value_t = Op::Sum)]
    op: Op,
    /// Transport: auto (the default: shared memory between the ranks of a host), tcp or shm
    #[arg(long, value_name = "KIND", default_value = "auto", value_parser = parse_transport)]
    transport: Transport,
    /// Bytes of each rank's slot in the shared-memory segment
    #[arg(long, value_name = "BYTES", value_parser = parse_size, default_value = "1M")]
    shm_slot: usize,
    /// Element type: f32, or bf16 standing for f32 gradients sent compressed (a size S is an
    /// all-reduce of S/2 bytes of bf16; figures are of the S bytes of f32)
    #[arg(long, value_enum, default_value_t = Dtype::F32)]
    dtype: Dtype,
    /// Collectives to time, comma-separated, each in a table of its own
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "all-reduce,reduce-scatter"
    )]
    collectives: Vec<Collective>,
    /// Rank 0 also writes its all-reduce figures to this file, one line per size:
    /// `bytes median_us busbw_gbps` (for `cargo xtask bench-collectives --gloo`); with
    /// `--dtype bf16`, bytes are the f32 bytes the bf16 stand for
    #[arg(long, value_name = "FILE")]
    report: Option<std::path::PathBuf>,
}

fn parse_transport(s: &str) -> Result<Transport, String> {
    s.parse()
}

/// The element types the benchmark reduces.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Dtype {
    /// 32-bit floats.
    F32,
    /// bfloat16, standing for f32 gradients sent compressed.
    Bf16,
}

/// The collectives the benchmark times.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Collective {
    /// `all_reduce`: busbw = algbw x 2(n-1)/n.
    AllReduce,
    /// `reduce_scatter` in equal parts: busbw = algbw x (n-1)/n.
    ReduceScatter,
}

impl Collective {
    fn name(self) -> &'static str {
        match self {
            Collective::AllReduce => "all-reduce",
            Collective::ReduceScatter => "reduce-scatter",
        }
    }

    /// busbw over algbw on `n` ranks (nccl-tests' factors).
    fn bus_factor(self, n: usize) -> f64 {
        let n = n as f64;
        match self {
            Collective::AllReduce => 2.0 * (n - 1.0) / n,
            Collective::ReduceScatter => (n - 1.0) / n,
        }
    }
}

/// Times `iters` runs of `collective` on `elems` elements of `T` after a warm-up; this rank's
/// median. An all-reduce's result is the next one's input (the buffer stays warm, as a
/// reducer's bucket does); a reduce-scatter's input is a copy made before the clock starts, and
/// its result is dropped after the clock stops.
fn time_collective<T>(
    group: &burn_ddp::ProcessGroup,
    collective: Collective,
    elems: usize,
    iters: usize,
    op: ReduceOp,
) -> anyhow::Result<Duration>
where
    T: burn_ddp::Reduce + Default + Clone,
    Vec<T>: burn_ddp::Reducible,
{
    let mut buf = vec![T::default(); elems];
    let mut run = || -> anyhow::Result<Duration> {
        Ok(match collective {
            Collective::AllReduce => {
                let t = Instant::now();
                buf = group.all_reduce(std::mem::take(&mut buf), op).wait()?;
                t.elapsed()
            }
            Collective::ReduceScatter => {
                let input = buf.clone();
                let t = Instant::now();
                let part = group.reduce_scatter(input, op).wait()?;
                let took = t.elapsed();
                drop(part);
                took
            }
        })
    };
    for _ in 0..(iters / 4).max(2) {
        run()?;
    }
    let times = (0..iters)
        .map(|_| run())
        .collect::<anyhow::Result<Vec<_>>>()?;
    Ok(median(times))
}

/// The reductions the benchmark offers.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum Op {
    Sum,
    Avg,
    Max,
}

impl From<Op> for ReduceOp {
    fn from(op: Op) -> Self {
        match op {
            Op::Sum => ReduceOp::Sum,
            Op::Avg => ReduceOp::Avg,
            Op::Max => ReduceOp::Max,
        }
    }
}

/// The title and column names of `collective`'s table.
fn print_header(
    collective: Collective,
    group: &burn_ddp::ProcessGroup,
    args: &Args,
    (op, spin): (ReduceOp, Duration),
) {
    println!(
        "burn-ddp {} ({}), world {}, {} {:?}, chunk {}, spin {:?}",
        collective.name(),
        group.transport(),
        group.world_size(),
        match args.dtype {
            Dtype::F32 => "f32",
            Dtype::Bf16 => "bf16 (sizes, algbw, busbw: of the f32 bytes they stand for)",
        },
        op,
        human(args.chunk),
        spin
    );
    println!(
        "{:>9} {:>6} {:>12} {:>12} {:>12} {:>13}",
        "size", "iters", "median(us)", "algbw(GB/s)", "busbw(GB/s)", "busbw/memcpy"
    );
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let (op, spin) = (ReduceOp::from(args.op), Duration::from_micros(args.spin_us));
    // The launcher's group (its store, its secret), with this benchmark's transport settings;
    // BURN_DDP_TIMEOUT still overrides the timeout.
    let group = init_process_group_with(GroupOptions {
        chunk_bytes: args.chunk,
        spin,
        timeout: Duration::from_secs(120),
        transport: args.transport,
        shm_slot_bytes: args.shm_slot,
        ..GroupOptions::default()
    })
    .context("forming the process group")?;
    let (rank, n) = (group.rank(), group.world_size());

    let largest = args.sizes.iter().copied().max().unwrap_or(0).max(1 << 20);
    let memcpy = if rank == 0 { memcpy_gbps(largest) } else { 0.0 };
    group.barrier().wait()?;
    settle(&group, Duration::from_millis(200))?;
    if rank == 0 {
        println!("memcpy ({}, one thread): {memcpy:.2} GB/s", human(largest));
    }
    let mut report = String::new();
    for &collective in &args.collectives {
        if rank == 0 {
            print_header(collective, &group, &args, (op, spin));
        }
        for &size in &args.sizes {
            // A reduce-scatter cuts the buffer in equal parts.
            let elems = match collective {
                Collective::AllReduce => (size / 4).max(1),
                Collective::ReduceScatter => (size / 4 / n).max(1) * n,
            };
            // The same count on every rank, so that all ranks run the same collectives.
            let iters = ((2usize << 30) / size.max(1)).clamp(5, 200);
            let mine = match args.dtype {
                Dtype::F32 => time_collective::<f32>(&group, collective, elems, iters, op)?,
                Dtype::Bf16 => time_collective::<half::bf16>(&group, collective, elems, iters, op)?,
            };
            // The slowest rank's median is the operation's time.
            let mine = mine.as_secs_f64();
            let t = group.all_reduce(vec![mine], ReduceOp::Max).wait()?[0];
            if rank == 0 {
                let bytes = (elems * 4) as f64;
                let algbw = bytes / t / 1e9;
                let busbw = algbw * collective.bus_factor(n);
                println!(
                    "{:>9} {:>6} {:>12.1} {:>12.3} {:>12.3} {:>13.3}",
                    human(elems * 4),
                    iters,
                    t * 1e6,
                    algbw,
                    busbw,
                    busbw / memcpy
                );
                if collective == Collective::AllReduce {
                    report.push_str(&format!("{} {:.3} {busbw:.6}\n", elems * 4, t * 1e6));
                }
            }
        }
    }
    if let (0, Some(path)) = (rank, &args.report) {
        std::fs::write(path, report)
            .with_context(|| format!("writing the report {}", path.display()))?;
    }
    Ok(())
}

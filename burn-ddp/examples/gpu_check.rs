//! The multi-rank half of the GPU check (`cargo xtask gpu-bundle`, `run.sh`): one rank of a
//! world formed from the launch environment (two processes on one GPU, or one per GPU), with
//! every check compared against a result computed on the host, not against the other rank.
//!
//! - `collectives`: all-reduce (sum, avg, max, min) of f32, f16, bf16 and f64 (where burn's CUDA
//!   backend has f64) at several lengths against the host's reduction of every rank's input,
//!   broadcast from the last rank, all-gather, reduce-scatter in equal and in given parts; the
//!   input is left as it was.
//! - `syncbn`: `SyncBatchNorm` forward and backward on each rank's half of a batch against
//!   burn's `BatchNorm` on the whole batch (relative error at most 1e-5).
//! - `die`: rank 1 exits (0.5 s in) while rank 0 waits in an all-reduce; rank 0 must fail with
//!   an error that names rank 1 within 10 s.
//! - `bandwidth`: 8 buckets of 32 MiB all-reduced in flight through the process group (the
//!   bucket path) against a device-to-device copy of the same bytes.
//!
//! Each check prints `CHECK <name>: ok ...` or `CHECK <name>: FAILED ...`; the exit status is
//! non-zero if one failed. Needs a GPU (and burn-ddp's `nccl` feature).

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use burn::module::Param;
use burn::nn::{BatchNorm, BatchNormConfig};
use burn::tensor::{DType, Device, Tensor, TensorData};
use burn_ddp::nn::{BatchNormSyncExt, SyncBatchNorm};
use burn_ddp::{ProcessGroup, ReduceOp};
use clap::{Parser, Subcommand};

/// One rank of the GPU check's multi-rank part (world from RANK, WORLD_SIZE, MASTER_ADDR...).
#[derive(Debug, Parser)]
#[command(name = "gpu_check")]
struct Cli {
    /// The CUDA ordinal of this rank's GPU (default: LOCAL_RANK)
    #[arg(long, value_name = "N")]
    gpu: Option<usize>,
    #[command(subcommand)]
    check: Check,
}

#[derive(Debug, Subcommand)]
enum Check {
    /// All-reduce, broadcast and all-gather against the host's result
    Collectives {
        /// Lengths to check
        #[arg(long, value_delimiter = ',', default_values_t = [1usize, 7, 1_000_003])]
        sizes: Vec<usize>,
    },
    /// SyncBatchNorm on halves of a batch against BatchNorm on the whole batch
    Syncbn,
    /// Rank 1 dies while rank 0 waits in an all-reduce; rank 0 must name it within 10 s
    Die,
    /// Bucket all-reduce bandwidth against a device copy
    Bandwidth,
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    // Says which library is missing instead of a loader panic at the first CUDA tensor.
    burn_ddp_nccl::check_libraries()?;
    let group = Arc::new(ProcessGroup::from_env().context("forming the group")?);
    let device = Device::cuda(cli.gpu.unwrap_or(group.local_rank()));
    let failed = match cli.check {
        Check::Collectives { sizes } => collectives(&group, &device, &sizes)?,
        Check::Syncbn => syncbn(&group, &device)?,
        Check::Die => die(&group, &device)?,
        Check::Bandwidth => bandwidth(&group, &device)?,
    };
    if failed > 0 {
        bail!("rank {}: {failed} check(s) failed", group.rank());
    }
    Ok(())
}

/// Prints a check's outcome; returns 1 if it failed.
fn report(name: &str, outcome: std::result::Result<String, String>) -> usize {
    match outcome {
        Ok(detail) => {
            println!("CHECK {name}: ok {detail}");
            0
        }
        Err(detail) => {
            println!("CHECK {name}: FAILED {detail}");
            1
        }
    }
}

/// Rank `rank`'s input at index `i`: small integers, exact in every type and in their sums.
fn value(rank: usize, i: usize) -> f64 {
    ((i * 7 + rank * 13) % 17) as f64 - 8.0
}

fn host(t: Tensor<1>) -> Vec<f64> {
    t.into_data()
        .convert::<f64>()
        .try_to_vec::<f64>()
        .unwrap_or_default()
}

/// The largest difference between `got` and `want` relative to the type's precision.
fn compare(got: &[f64], want: &[f64], dtype: DType) -> std::result::Result<(), String> {
    if got.len() != want.len() {
        return Err(format!("{} values, expected {}", got.len(), want.len()));
    }
    let eps = match dtype {
        DType::F64 => 1e-12,
        DType::F32 => 1e-6,
        DType::F16 => 1e-3,
        _ => 8e-3,
    };
    match got
        .iter()
        .zip(want)
        .position(|(g, w)| (g - w).abs() > eps * w.abs().max(1.0))
    {
        None => Ok(()),
        Some(i) => Err(format!("index {i}: {} instead of {}", got[i], want[i])),
    }
}

fn collectives(group: &ProcessGroup, device: &Device, sizes: &[usize]) -> Result<usize> {
    let (rank, world) = (group.rank(), group.world_size());
    let mut dtypes = vec![DType::F32, DType::F16, DType::BF16];
    if device.supports_dtype(DType::F64) {
        dtypes.push(DType::F64);
    } else {
        println!("CHECK f64: skipped (burn's CUDA backend has no f64 tensors)");
    }
    let mut failed = 0;
    for &dtype in &dtypes {
        for &n in sizes {
            let input = |r: usize| (0..n).map(move |i| value(r, i)).collect::<Vec<f64>>();
            let tensor = || {
                Tensor::<1>::from_data(
                    TensorData::new(input(rank), [n]).convert_dtype(dtype),
                    device,
                )
            };
            for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min] {
                let want: Vec<f64> = (0..n)
                    .map(|i| {
                        let all = (0..world).map(|r| value(r, i));
                        match op {
                            ReduceOp::Sum => all.sum(),
                            ReduceOp::Avg => all.sum::<f64>() / world as f64,
                            ReduceOp::Max => all.fold(f64::MIN, f64::max),
                            ReduceOp::Min => all.fold(f64::MAX, f64::min),
                        }
                    })
                    .collect();
                let t = tensor();
                let got = group.all_reduce(t.clone(), op).wait()?;
                let outcome = compare(&host(got), &want, dtype)
                    .and_then(|()| {
                        compare(&host(t), &input(rank), dtype)
                            .map_err(|e| format!("the input changed: {e}"))
                    })
                    .map(|()| String::new());
                failed += report(&format!("all_reduce {op:?} {dtype:?} n={n}"), outcome);
            }
            let root = world - 1;
            let got = group.broadcast(tensor(), root).wait()?;
            let outcome = compare(&host(got), &input(root), dtype).map(|()| String::new());
            failed += report(
                &format!("broadcast from rank {root} {dtype:?} n={n}"),
                outcome,
            );
            let got = group.all_gather(tensor()).wait()?;
            let outcome = got
                .into_iter()
                .enumerate()
                .try_for_each(|(r, t)| {
                    compare(&host(t), &input(r), dtype).map_err(|e| format!("rank {r}'s part: {e}"))
                })
                .map(|()| String::new());
            failed += report(&format!("all_gather {dtype:?} n={n}"), outcome);
            failed += reduce_scatter(group, (n, dtype), &input, &tensor)?;
        }
    }
    Ok(failed)
}

/// Reduce-scatter of `n` values (`tensor`, the rank's `input`) cut in equal parts (the first
/// `n - n % world` values: `ncclReduceScatter`) and in parts of `n` given lengths (padded to the
/// longest on the way), against the host's sum of every rank's input.
fn reduce_scatter(
    group: &ProcessGroup,
    (n, dtype): (usize, DType),
    input: &dyn Fn(usize) -> Vec<f64>,
    tensor: &dyn Fn() -> Tensor<1>,
) -> Result<usize> {
    let (rank, world) = (group.rank(), group.world_size());
    let sum = |range: std::ops::Range<usize>| -> Vec<f64> {
        range
            .map(|i| (0..world).map(|r| input(r)[i]).sum())
            .collect()
    };
    let mut failed = 0;
    let even = n - n % world;
    let part = even / world;
    if even > 0 {
        let got = group
            .reduce_scatter(tensor().narrow(0, 0, even), ReduceOp::Sum)
            .wait()?;
        let outcome = compare(&host(got), &sum(rank * part..(rank + 1) * part), dtype);
        failed += report(
            &format!("reduce_scatter {dtype:?} n={even}"),
            outcome.map(|()| String::new()),
        );
    }
    // Rank r gets r + 1 parts' worth of the rest, the last rank what remains.
    let mut parts: Vec<usize> = (0..world)
        .map(|r| (r + 1) * n / (world * world + world))
        .collect();
    let given: usize = parts.iter().sum();
    parts[world - 1] += n - given;
    let start: usize = parts[..rank].iter().sum();
    let got = group
        .reduce_scatter_parts(tensor(), &parts, ReduceOp::Sum)
        .wait()?;
    let outcome = compare(&host(got), &sum(start..start + parts[rank]), dtype);
    failed += report(
        &format!("reduce_scatter_parts {dtype:?} {parts:?}"),
        outcome.map(|()| String::new()),
    );
    Ok(failed)
}

const BATCH: usize = 8;
const CHANNELS: usize = 4;
const LENGTH: usize = 5;

fn floats<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.into_data()
        .convert::<f32>()
        .try_to_vec::<f32>()
        .unwrap_or_default()
}

/// max |a - b| / max |b|.
fn relative_error(a: &[f32], b: &[f32]) -> f64 {
    let diff = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    let scale = b.iter().map(|y| y.abs()).fold(f32::MIN_POSITIVE, f32::max);
    f64::from(diff / scale)
}

/// Forward and backward of a batch norm on `x` (rows `rows` of the whole batch); returns the
/// output, d(loss)/d(input), d/d(gamma), d/d(beta).
fn run_norm(
    forward: impl Fn(Tensor<3>) -> Tensor<3>,
    gamma: &Param<Tensor<1>>,
    beta: &Param<Tensor<1>>,
    rows: std::ops::Range<usize>,
    device: &Device,
) -> [Vec<f32>; 4] {
    let data =
        |seed: usize| {
            let values: Vec<f32> = (0..BATCH * CHANNELS * LENGTH)
                .map(|i| ((i * 31 + seed * 17) % 23) as f32 / 7.0 - 1.5)
                .collect();
            Tensor::<3>::from_data(TensorData::new(values, [BATCH, CHANNELS, LENGTH]), device)
                .narrow(0, rows.start, rows.len())
        };
    let x = data(1).require_grad();
    let weight = data(2);
    let y = forward(x.clone());
    let grads = (y.clone() * weight).sum().backward();
    let grad = |t: &Tensor<1>| t.grad(&grads).map(floats).unwrap_or_default();
    [
        floats(y),
        x.grad(&grads).map(floats).unwrap_or_default(),
        grad(&gamma.val()),
        grad(&beta.val()),
    ]
}

fn syncbn(group: &Arc<ProcessGroup>, device: &Device) -> Result<usize> {
    let (rank, world) = (group.rank(), group.world_size());
    let device = device.clone().autodiff();
    let config = BatchNormConfig::new(CHANNELS);
    let rows = rank * BATCH / world..(rank + 1) * BATCH / world;
    let sync: SyncBatchNorm = config.init_sync(&device);
    let mine = {
        let _scope = burn_ddp::nn::scope(group.clone());
        run_norm(|x| sync.forward(x), &sync.gamma, &sync.beta, rows, &device)
    };
    // Every rank's parts on every rank (through the host), then the reference on the whole batch.
    let mut parts = Vec::new();
    for part in &mine {
        let bytes: Vec<u8> = part.iter().flat_map(|v| v.to_le_bytes()).collect();
        let all = group.all_gather(bytes).wait()?;
        parts.push(
            all.into_iter()
                .map(|b| {
                    b.chunks_exact(4)
                        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                        .collect::<Vec<f32>>()
                })
                .collect::<Vec<_>>(),
        );
    }
    let plain: BatchNorm = config.init(&device);
    let want = run_norm(
        |x| plain.forward(x),
        &plain.gamma,
        &plain.beta,
        0..BATCH,
        &device,
    );
    let concat = |p: &[Vec<f32>]| p.concat();
    let sum = |p: &[Vec<f32>]| {
        (0..p[0].len())
            .map(|i| p.iter().map(|v| v[i]).sum())
            .collect::<Vec<f32>>()
    };
    let got = [
        concat(&parts[0]),
        concat(&parts[1]),
        sum(&parts[2]),
        sum(&parts[3]),
    ];
    let mut failed = 0;
    for (name, (got, want)) in [
        "output",
        "input gradient",
        "gamma gradient",
        "beta gradient",
    ]
    .iter()
    .zip(got.iter().zip(&want))
    {
        let err = relative_error(got, want);
        let outcome = if got.len() == want.len() && err <= 1e-5 {
            Ok(format!("relative error {err:.2e}"))
        } else {
            Err(format!(
                "relative error {err:.2e} ({} vs {} values)",
                got.len(),
                want.len()
            ))
        };
        failed += report(&format!("SyncBatchNorm world {world} {name}"), outcome);
    }
    Ok(failed)
}

fn die(group: &ProcessGroup, device: &Device) -> Result<usize> {
    let n = 64 << 20;
    let t = || Tensor::<1>::ones([n], device);
    // One all-reduce first, so the communicator is joined and both ranks are in step.
    group.all_reduce(t(), ReduceOp::Sum).wait()?;
    if group.rank() == 1 {
        // Dies while rank 0 is inside the next all-reduce (which cannot finish without it).
        std::thread::sleep(Duration::from_millis(500));
        println!("rank 1: exiting while rank 0 waits in an all-reduce");
        std::process::exit(3);
    }
    let start = Instant::now();
    let outcome = match group.all_reduce(t(), ReduceOp::Sum).wait() {
        Ok(_) => Err("the all-reduce succeeded without rank 1".to_string()),
        Err(e) => {
            let took = start.elapsed();
            let message = e.to_string();
            if message.contains("rank 1") && took <= Duration::from_secs(10) {
                Ok(format!("in {:.2} s: {message}", took.as_secs_f64()))
            } else {
                Err(format!("after {:.2} s: {message}", took.as_secs_f64()))
            }
        }
    };
    Ok(report("a rank killed mid-all-reduce is named", outcome))
}

fn bandwidth(group: &ProcessGroup, device: &Device) -> Result<usize> {
    const BUCKETS: usize = 8;
    const BUCKET: usize = 8 << 20; // f32 elements: 32 MiB
    let world = group.world_size();
    let buckets: Vec<Tensor<1>> = (0..BUCKETS)
        .map(|_| Tensor::ones([BUCKET], device))
        .collect();
    let whole = Tensor::<1>::ones([BUCKETS * BUCKET], device);
    let median = |mut runs: Vec<Duration>| {
        runs.sort();
        runs[runs.len() / 2]
    };
    let mut reduce = Vec::new();
    let mut copy = Vec::new();
    for run in 0..6 {
        group.barrier().wait()?;
        let t = Instant::now();
        let works: Vec<_> = buckets
            .iter()
            .map(|b| group.all_reduce(b.clone(), ReduceOp::Avg))
            .collect();
        for w in works {
            w.wait()?;
        }
        let r = t.elapsed();
        let t = Instant::now();
        let copied = whole.clone().add_scalar(0.0);
        device.sync().map_err(|e| anyhow::anyhow!("{e:?}"))?;
        let c = t.elapsed();
        drop(copied);
        if run > 0 {
            reduce.push(r);
            copy.push(c);
        }
    }
    let (r, c) = (median(reduce), median(copy));
    let bytes = (BUCKETS * BUCKET * 4) as f64;
    let algbw = bytes / r.as_secs_f64() / 1e9;
    let busbw = algbw * 2.0 * (world - 1) as f64 / world as f64;
    let copybw = 2.0 * bytes / c.as_secs_f64() / 1e9;
    let detail = format!(
        "256 MiB in 8 buckets: {:.1} ms, algbw {algbw:.1} GB/s, busbw {busbw:.1} GB/s; device \
         copy {:.2} ms ({copybw:.0} GB/s read+write); all-reduce / copy time = {:.1}",
        r.as_secs_f64() * 1e3,
        c.as_secs_f64() * 1e3,
        r.as_secs_f64() / c.as_secs_f64()
    );
    Ok(report(
        &format!("bucket all-reduce bandwidth, world {world}"),
        Ok(detail),
    ))
}

//! `gpu_check die`, `bandwidth` and `precision`: a dead rank recorded as the culprit, the
//! bucket path's speed against a device copy (its results checked), and the f32 matmul's error.

use std::time::{Duration, Instant};

use anyhow::Result;
use burn::tensor::{Device, Tensor, TensorData};
use burn_ddp::testing::FailureRecord;
use burn_ddp::{ProcessGroup, ReduceOp};

use crate::verdict::{buckets_hold, names_the_dead_rank, relative_error};
use crate::{host, report};

/// How long rank 0 may take to fail once rank 1 is gone.
const DEATH_NOTICED: Duration = Duration::from_secs(10);

/// Rank 1 exits while rank 0 waits in an all-reduce; returns 1 if rank 0 did not fail within
/// [`DEATH_NOTICED`] with rank 1 recorded as the culprit.
pub(crate) fn die(group: &ProcessGroup, device: &Device) -> Result<usize> {
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
    let result = group.all_reduce(t(), ReduceOp::Sum).wait();
    let took = start.elapsed();
    let outcome = result.map(drop).map_err(|e| e.to_string());
    // Rank 0 hosts the store: the record every rank agreed on is there.
    let culprit = FailureRecord::read(group.store()).and_then(|r| r.culprit);
    Ok(report(
        "a rank killed mid-all-reduce is recorded as the culprit",
        names_the_dead_rank(outcome, culprit, 1, (took, DEATH_NOTICED)),
    ))
}

/// Bucket `b` of rank `rank` holds `(rank + 1) * (b + 1)`; their mean over the ranks.
fn bucket_mean(world: usize, b: usize) -> f64 {
    (world + 1) as f64 / 2.0 * (b + 1) as f64
}

/// Each bucket's (min, max) on the host.
fn extremes(buckets: &[Tensor<1>]) -> Vec<(f64, f64)> {
    let one = |t: Tensor<1>| host(t).first().copied().unwrap_or(f64::NAN);
    buckets
        .iter()
        .map(|b| (one(b.clone().min()), one(b.clone().max())))
        .collect()
}

/// 8 buckets of 32 MiB all-reduced (average) in flight, 5 timed runs after a warm-up, every
/// run's results checked; the row gives the median time and its ratio to a device copy of the
/// same bytes. Returns 1 if a result was wrong.
pub(crate) fn bandwidth(group: &ProcessGroup, device: &Device) -> Result<usize> {
    const BUCKETS: usize = 8;
    const BUCKET: usize = 8 << 20; // f32 elements: 32 MiB
    let (rank, world) = (group.rank(), group.world_size());
    let buckets: Vec<Tensor<1>> = (0..BUCKETS)
        .map(|b| Tensor::full([BUCKET], ((rank + 1) * (b + 1)) as f64, device))
        .collect();
    let want: Vec<f64> = (0..BUCKETS).map(|b| bucket_mean(world, b)).collect();
    let whole = Tensor::<1>::ones([BUCKETS * BUCKET], device);
    let median = |mut runs: Vec<Duration>| {
        runs.sort();
        runs[runs.len() / 2]
    };
    let (mut reduce, mut copy) = (Vec::new(), Vec::new());
    let mut wrong = None;
    for run in 0..6 {
        group.barrier().wait()?;
        let t = Instant::now();
        let works: Vec<_> = buckets
            .iter()
            .map(|b| group.all_reduce(b.clone(), ReduceOp::Avg))
            .collect();
        let mut results = Vec::with_capacity(BUCKETS);
        for w in works {
            results.push(w.wait()?);
        }
        let r = t.elapsed();
        if let Err(e) = buckets_hold(&extremes(&results), &want) {
            wrong.get_or_insert(format!("run {run}: {e}"));
        }
        drop(results);
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
    let outcome = match wrong {
        None => Ok(format!("results checked; {detail}")),
        Some(e) => Err(format!("{e}; {detail}")),
    };
    Ok(report(
        &format!("bucket all-reduce bandwidth, world {world}"),
        outcome,
    ))
}

/// The largest relative error of an f32 matmul may be that of f16 inputs (TF32 keeps 10 bits of
/// mantissa, as f16 does); above it the matmul is broken, not rounded.
const MATMUL_LIMIT: f64 = 1e-2;

/// The f32 matmul of 32 x 64 by 64 x 64 against the exact product on the host, and the first
/// 16 rows multiplied alone against the same rows of the whole (the batch shapes of run.sh's
/// comparisons). Prints `relative error E` (run.sh reads it); returns 1 above [`MATMUL_LIMIT`].
pub(crate) fn precision(device: &Device) -> Result<usize> {
    const ROWS: usize = 32;
    const K: usize = 64;
    let values = |n: usize, seed: usize| -> Vec<f32> {
        (0..n)
            .map(|i| ((i * 37 + seed * 11) % 101) as f32 / 50.0 - 1.0)
            .collect()
    };
    let (x, w) = (values(ROWS * K, 1), values(K * K, 2));
    let exact: Vec<f64> = (0..ROWS * K)
        .map(|o| {
            let (i, j) = (o / K, o % K);
            (0..K)
                .map(|k| f64::from(x[i * K + k]) * f64::from(w[k * K + j]))
                .sum()
        })
        .collect();
    let xt = Tensor::<2>::from_data(TensorData::new(x, [ROWS, K]), device);
    let wt = Tensor::<2>::from_data(TensorData::new(w, [K, K]), device);
    let whole = host(xt.clone().matmul(wt.clone()));
    let half = host(xt.narrow(0, 0, ROWS / 2).matmul(wt));
    let error = relative_error(&whole, &exact);
    let shapes = relative_error(&half, whole.get(..half.len()).unwrap_or_default());
    let detail = format!(
        "relative error {error:.3e} against the exact product (TF32 if above 1e-5); 16 rows \
         alone vs the same rows of 32: {shapes:.3e}"
    );
    let outcome = if whole.len() == exact.len() && error <= MATMUL_LIMIT {
        Ok(detail)
    } else {
        Err(format!("{detail} (limit {MATMUL_LIMIT:e})"))
    };
    Ok(report("f32 matmul precision", outcome))
}

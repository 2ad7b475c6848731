//! `gpu_check collectives`: every collective of the process group on CUDA tensors against the
//! host's result, each output poisoned (NaN) first.

use anyhow::Result;
use burn::tensor::{DType, Device, Tensor, TensorData};
use burn_ddp::{ProcessGroup, ReduceOp};

use crate::verdict::compare;
use crate::{host, report};

/// Rank `rank`'s input at index `i`: small integers, exact in every type and in their sums.
fn value(rank: usize, i: usize) -> f64 {
    ((i * 7 + rank * 13) % 17) as f64 - 8.0
}

/// The relative precision a value of `dtype` keeps.
fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::F64 => 1e-12,
        DType::F32 => 1e-6,
        DType::F16 => 1e-3,
        _ => 8e-3,
    }
}

/// How many NaN buffers [`poison`] frees: one for the output, one for the input's copy (a
/// tensor still held elsewhere is copied before NCCL reads it), one spare.
const POISONED: usize = 3;

/// Fills [`POISONED`] buffers of `count` values of `dtype` with NaN and frees them, so that the
/// next allocations of that size (the operation's output) come from memory that holds NaN: a
/// collective that writes nothing leaves NaN, which no comparison passes. Fails if a buffer does
/// not read back as NaN (then the poison proves nothing).
fn poison(device: &Device, count: usize, dtype: DType) -> Result<(), String> {
    if count == 0 {
        return Ok(());
    }
    let buffers: Vec<Tensor<1>> = (0..POISONED)
        .map(|_| Tensor::full([count], f64::NAN, (device, dtype)))
        .collect();
    // Reading a reduction of each writes it: the buffers are alive, so they are materialized.
    for b in &buffers {
        if !b.clone().is_nan().all().into_scalar::<bool>() {
            return Err(format!(
                "a {dtype:?} buffer filled with NaN reads back as a number"
            ));
        }
    }
    drop(buffers);
    device.sync().map_err(|e| format!("{e:?}"))
}

/// Checks every collective at every length in `sizes` and dtype; returns how many failed.
pub(crate) fn collectives(group: &ProcessGroup, device: &Device, sizes: &[usize]) -> Result<usize> {
    let mut dtypes = vec![DType::F32, DType::F16, DType::BF16];
    if device.supports_dtype(DType::F64) {
        dtypes.push(DType::F64);
    } else {
        println!("CHECK f64: skipped (burn's CUDA backend has no f64 tensors)");
    }
    let mut failed = 0;
    for &dtype in &dtypes {
        for &n in sizes {
            failed += one_length(group, device, (n, dtype))?;
        }
    }
    Ok(failed)
}

/// The collectives on `n` values of `dtype`; returns how many failed.
fn one_length(group: &ProcessGroup, device: &Device, (n, dtype): (usize, DType)) -> Result<usize> {
    let (rank, world) = (group.rank(), group.world_size());
    let input = |r: usize| (0..n).map(move |i| value(r, i)).collect::<Vec<f64>>();
    let tensor = || {
        Tensor::<1>::from_data(
            TensorData::new(input(rank), [n]).convert_dtype(dtype),
            device,
        )
    };
    let eps = tolerance(dtype);
    let mut failed = 0;
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
        let outcome = poison(device, n, dtype).and_then(|()| {
            let got = group
                .all_reduce(t.clone(), op)
                .wait()
                .map_err(|e| e.to_string())?;
            compare(&host(got), &want, eps)?;
            compare(&host(t), &input(rank), eps).map_err(|e| format!("the input changed: {e}"))
        });
        failed += report(
            &format!("all_reduce {op:?} {dtype:?} n={n} world {world}"),
            outcome.map(|()| String::new()),
        );
    }
    let root = world - 1;
    let outcome = poison(device, n, dtype).and_then(|()| {
        let got = group.broadcast(tensor(), root).wait();
        compare(&host(got.map_err(|e| e.to_string())?), &input(root), eps)
    });
    failed += report(
        &format!("broadcast from rank {root} {dtype:?} n={n} world {world}"),
        outcome.map(|()| String::new()),
    );
    let outcome = poison(device, n * world, dtype).and_then(|()| {
        let got = group
            .all_gather(tensor())
            .wait()
            .map_err(|e| e.to_string())?;
        got.into_iter().enumerate().try_for_each(|(r, t)| {
            compare(&host(t), &input(r), eps).map_err(|e| format!("rank {r}'s part: {e}"))
        })
    });
    failed += report(
        &format!("all_gather {dtype:?} n={n} world {world}"),
        outcome.map(|()| String::new()),
    );
    failed += reduce_scatter(group, device, (n, dtype), &input, &tensor)?;
    Ok(failed)
}

/// Reduce-scatter of `n` values (`tensor`, the rank's `input`) cut in equal parts (the first
/// `n - n % world` values: `ncclReduceScatter`) and in parts of `n` given lengths (padded to the
/// longest on the way), against the host's sum of every rank's input.
fn reduce_scatter(
    group: &ProcessGroup,
    device: &Device,
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
    let eps = tolerance(dtype);
    let mut failed = 0;
    let even = n - n % world;
    let part = even / world;
    if even > 0 {
        let outcome = poison(device, part, dtype).and_then(|()| {
            let got = group
                .reduce_scatter(tensor().narrow(0, 0, even), ReduceOp::Sum)
                .wait()
                .map_err(|e| e.to_string())?;
            compare(&host(got), &sum(rank * part..(rank + 1) * part), eps)
        });
        failed += report(
            &format!("reduce_scatter {dtype:?} n={even} world {world}"),
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
    let longest = parts.iter().copied().max().unwrap_or(0);
    let outcome = poison(device, longest, dtype).and_then(|()| {
        let got = group
            .reduce_scatter_parts(tensor(), &parts, ReduceOp::Sum)
            .wait()
            .map_err(|e| e.to_string())?;
        compare(&host(got), &sum(start..start + parts[rank]), eps)
    });
    failed += report(
        &format!("reduce_scatter_parts {dtype:?} {parts:?}"),
        outcome.map(|()| String::new()),
    );
    Ok(failed)
}

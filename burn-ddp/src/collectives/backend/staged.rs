//! Host staging: a tensor on any burn device travels device -> host -> TCP ring -> device.
//!
//! The whole round trip is one job on the group's collective thread, so the read-back waits
//! there, not on the thread that computes: on wgpu or another asynchronous device the caller
//! queues its next kernels while this tensor is read, reduced and written back. On `flex` (the
//! CPU) the read-back is the tensor's own memory. A rank whose read-back fails stops the group,
//! so its peers fail at once with its reason instead of waiting for it.

use burn::tensor::{DType, Tensor, TensorData};
use half::{bf16, f16};

use super::{Request, invalid};
use crate::collectives::worker::Queue;
use crate::collectives::worker::Worker;
use crate::collectives::{Reduce, ReduceOp, Work};
use crate::error::Result;

/// Starts `request` on `tensor` through the host: one job on the collective thread, whose
/// result's tensors `done` turns into the caller's.
pub(crate) fn start<T: Send + 'static>(
    queue: &Queue,
    tensor: Tensor<1>,
    request: Request,
    done: impl FnOnce(Vec<Tensor<1>>) -> T + Send + 'static,
) -> Work<T> {
    queue.on_worker(move |w| {
        let pieces = match request {
            Request::AllReduce(op) => vec![all_reduce(w, tensor, op)?],
            Request::ReduceScatter(parts, op) => vec![reduce_scatter(w, tensor, &parts, op)?],
            Request::Broadcast(root) => vec![broadcast(w, tensor, root)?],
            Request::AllGather => all_gather(w, tensor)?,
            Request::AllGatherParts(parts) => vec![all_gather_parts(w, tensor, &parts)?],
        };
        Ok(done(pieces))
    })
}

/// The all-reduce of a float tensor through the host, on the collective thread.
pub(super) fn all_reduce(w: &mut Worker, tensor: Tensor<1>, op: ReduceOp) -> Result<Tensor<1>> {
    let (device, dtype) = (tensor.device(), tensor.dtype());
    let mut data = read_back(w, "all_reduce", tensor)?;
    reduce(w, &mut data, None, op)?;
    Ok(Tensor::from_data(data, (&device, dtype)))
}

/// The reduce-scatter of a float tensor through the host: this rank's part of `parts`.
pub(super) fn reduce_scatter(
    w: &mut Worker,
    tensor: Tensor<1>,
    parts: &[usize],
    op: ReduceOp,
) -> Result<Tensor<1>> {
    let (device, dtype) = (tensor.device(), tensor.dtype());
    let mut data = read_back(w, "reduce_scatter", tensor)?;
    let mine = reduce(w, &mut data, Some(parts), op)?;
    let elem = dtype.size();
    let bytes = data.as_bytes()[mine.start * elem..mine.end * elem].to_vec();
    let part = TensorData::from_bytes_vec(bytes, [mine.len()], dtype);
    Ok(Tensor::from_data(part, (&device, dtype)))
}

/// The broadcast of a tensor from `root` through the host.
pub(super) fn broadcast(w: &mut Worker, tensor: Tensor<1>, root: usize) -> Result<Tensor<1>> {
    let (device, dtype) = (tensor.device(), tensor.dtype());
    let data = read_back(w, "broadcast", tensor)?;
    let shape = data.shape().clone();
    let mut bytes = data.as_bytes().to_vec();
    w.run(|t| t.broadcast(&mut bytes, root))?;
    let data = TensorData::from_bytes_vec(bytes, shape, dtype);
    Ok(Tensor::from_data(data, (&device, dtype)))
}

/// The all-gather of a tensor through the host: every rank's tensor, by rank. Every rank must
/// give the same length and element type.
fn all_gather(w: &mut Worker, tensor: Tensor<1>) -> Result<Vec<Tensor<1>>> {
    let (rank, device, dtype) = (w.rank(), tensor.device(), tensor.dtype());
    let data = read_back(w, "all_gather", tensor)?;
    let shape = data.shape().clone();
    let all = w.run(|t| t.all_gather(data.as_bytes()))?;
    let mine = data.as_bytes().len();
    if let Some(other) = all.iter().position(|b| b.len() != mine) {
        let reason = format!(
            "rank {rank} gives {mine} bytes but rank {other} {}: tensors gathered must have \
             the same length and element type on every rank",
            all[other].len()
        );
        return Err(invalid(rank, "all_gather", reason));
    }
    Ok(all
        .into_iter()
        .map(|b| {
            let data = TensorData::from_bytes_vec(b, shape.clone(), dtype);
            Tensor::from_data(data, (&device, dtype))
        })
        .collect())
}

/// The all-gather of tensors of `parts` elements by rank through the host: every rank's,
/// concatenated in rank order.
pub(super) fn all_gather_parts(
    w: &mut Worker,
    tensor: Tensor<1>,
    parts: &[usize],
) -> Result<Tensor<1>> {
    let (rank, device, dtype) = (w.rank(), tensor.device(), tensor.dtype());
    let data = read_back(w, "all_gather", tensor)?;
    let all = w.run(|t| t.all_gather(data.as_bytes()))?;
    let elem = dtype.size();
    let sizes: Vec<usize> = all.iter().map(|b| b.len() / elem.max(1)).collect();
    if sizes != parts {
        let reason =
            format!("the ranks give {sizes:?} elements of {dtype:?}, the parts say {parts:?}");
        return Err(invalid(rank, "all_gather", reason));
    }
    let bytes = all.concat();
    let n = bytes.len() / elem.max(1);
    let data = TensorData::from_bytes_vec(bytes, [n], dtype);
    Ok(Tensor::from_data(data, (&device, dtype)))
}

/// The tensor's values on the host (waits for the kernels that produce it). A failure stops
/// the group, so the peers do not wait for this rank.
fn read_back(w: &mut Worker, op: &str, tensor: Tensor<1>) -> Result<TensorData> {
    tensor.try_into_data().map_err(|e| {
        let cause = format!("reading a tensor back from its device failed: {e:?}");
        w.fail_here(format!("{op} of a tensor"), cause)
    })
}

/// Reduces `data` (a float tensor's values) across the ranks as `op` says: all of it, or with
/// `parts` this rank's part (its element range is returned).
fn reduce(
    w: &mut Worker,
    data: &mut TensorData,
    parts: Option<&[usize]>,
    op: ReduceOp,
) -> Result<std::ops::Range<usize>> {
    match data.dtype() {
        DType::F32 => reduce_as::<f32>(w, data, parts, op),
        DType::F64 => reduce_as::<f64>(w, data, parts, op),
        DType::F16 => reduce_as::<f16>(w, data, parts, op),
        DType::BF16 => reduce_as::<bf16>(w, data, parts, op),
        other => {
            let name = name_of(parts);
            let cause = format!("{name} of a tensor: element type {other:?} cannot be reduced");
            Err(w.fail_here(format!("{name} of a tensor"), cause))
        }
    }
}

/// [`reduce`] of values of element type `T`.
fn reduce_as<T: Reduce + burn::tensor::Element>(
    w: &mut Worker,
    data: &mut TensorData,
    parts: Option<&[usize]>,
    op: ReduceOp,
) -> Result<std::ops::Range<usize>> {
    match data.as_mut_slice::<T>() {
        Ok(values) => match parts {
            Some(parts) => w.run(|t| t.reduce_scatter(values, parts, op)),
            None => {
                let all = 0..values.len();
                w.run(|t| t.all_reduce(values, op)).map(|()| all)
            }
        },
        Err(e) => {
            let cause = format!(
                "a tensor's data cannot be read as {}: {e:?}",
                T::DTYPE.name()
            );
            Err(w.fail_here(format!("{} of a tensor", name_of(parts)), cause))
        }
    }
}

/// The collective [`reduce`] runs.
fn name_of(parts: Option<&[usize]>) -> &'static str {
    match parts {
        Some(_) => "reduce_scatter",
        None => "all_reduce",
    }
}

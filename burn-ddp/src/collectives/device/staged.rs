//! Host staging: a tensor on any burn device travels device -> host -> TCP ring -> device.
//!
//! The whole round trip is one job on the group's collective thread, so the read-back waits
//! there, not on the thread that computes: on wgpu or another asynchronous device the caller
//! queues its next kernels while this tensor is read, reduced and written back. On `flex` (the
//! CPU) the read-back is the tensor's own memory. A rank whose read-back fails stops the group,
//! so its peers fail at once with its reason instead of waiting for it.

use burn::tensor::{DType, Tensor, TensorData};
use half::{bf16, f16};

use super::invalid;
use crate::ProcessGroup;
use crate::collectives::tcp::TcpTransport;
use crate::collectives::{Reduce, ReduceOp, Work};
use crate::error::{DdpError, Result};
use crate::failure::FailureRecord;

/// Starts the all-reduce of a float tensor through the host.
pub(super) fn all_reduce(group: &ProcessGroup, tensor: Tensor<1>, op: ReduceOp) -> Work<Tensor<1>> {
    let rank = group.rank();
    group.submit(move |t| {
        let (device, dtype) = (tensor.device(), tensor.dtype());
        let mut data = read_back(t, rank, "all_reduce", tensor)?;
        match data.dtype() {
            DType::F32 => reduce::<f32>(t, rank, &mut data, op)?,
            DType::F64 => reduce::<f64>(t, rank, &mut data, op)?,
            DType::F16 => reduce::<f16>(t, rank, &mut data, op)?,
            DType::BF16 => reduce::<bf16>(t, rank, &mut data, op)?,
            other => {
                let reason = format!("element type {other:?} cannot be reduced");
                return Err(stop(t, rank, invalid(rank, "all_reduce", reason)));
            }
        }
        Ok(Tensor::from_data(data, (&device, dtype)))
    })
}

/// Starts the broadcast of a tensor from `root` through the host.
pub(super) fn broadcast(group: &ProcessGroup, tensor: Tensor<1>, root: usize) -> Work<Tensor<1>> {
    let rank = group.rank();
    group.submit(move |t| {
        let device = tensor.device();
        let data = read_back(t, rank, "broadcast", tensor)?;
        let (shape, dtype) = (data.shape().clone(), data.dtype());
        let mut bytes = data.as_bytes().to_vec();
        t.broadcast(&mut bytes, root)?;
        let data = TensorData::from_bytes_vec(bytes, shape, dtype);
        Ok(Tensor::from_data(data, (&device, dtype)))
    })
}

/// Starts the all-gather of a tensor through the host: every rank's tensor, by rank. Every rank
/// must give the same length and element type.
pub(super) fn all_gather(group: &ProcessGroup, tensor: Tensor<1>) -> Work<Vec<Tensor<1>>> {
    let rank = group.rank();
    group.submit(move |t| {
        let device = tensor.device();
        let data = read_back(t, rank, "all_gather", tensor)?;
        let (shape, dtype) = (data.shape().clone(), data.dtype());
        let all = t.all_gather(data.as_bytes())?;
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
                Tensor::from_data(TensorData::from_bytes_vec(b, shape.clone(), dtype), &device)
            })
            .collect())
    })
}

/// The tensor's values on the host (waits for the kernels that produce it).
fn read_back(t: &mut TcpTransport, rank: usize, op: &str, tensor: Tensor<1>) -> Result<TensorData> {
    tensor.try_into_data().map_err(|e| {
        let reason = format!("reading the tensor back from its device failed: {e:?}");
        stop(t, rank, invalid(rank, op, reason))
    })
}

/// Sums (or as `op` says) `data`, of element type `T`, across the ranks.
fn reduce<T: Reduce + burn::tensor::Element>(
    t: &mut TcpTransport,
    rank: usize,
    data: &mut TensorData,
    op: ReduceOp,
) -> Result<()> {
    match data.as_mut_slice::<T>() {
        Ok(values) => t.all_reduce(values, op),
        Err(e) => {
            let reason = format!(
                "the tensor's data cannot be read as {}: {e:?}",
                T::DTYPE.name()
            );
            Err(stop(t, rank, invalid(rank, "all_reduce", reason)))
        }
    }
}

/// Stops the group for an error found on this rank before its peers could see it, so they
/// fail with it instead of waiting; returns the error.
fn stop(t: &mut TcpTransport, rank: usize, error: DdpError) -> DdpError {
    t.abort(FailureRecord {
        culprit: Some(rank),
        cause: error.to_string(),
    });
    error
}

//! NCCL for tensors on CUDA devices: the communicator joined through the group's store, and
//! collectives that start on the caller's thread (a fence on its CubeCL stream after the kernels
//! that produced the tensor) and finish on the group's collective thread (NCCL on its own stream,
//! waited for within the group's timeout). A failure stops the group: the communicator is
//! aborted, the cause recorded in the store, and every rank's next collective fails with it.

use burn::tensor::Tensor;
use burn_ddp_nccl::{NcclComm, NcclError, Pending};

use super::invalid;
use crate::collectives::{ReduceOp, Work};
use crate::error::{DdpError, Result};
use crate::group::{ProcessGroup, Worker};

/// The store key of the NCCL id (under the group's prefix for this attempt).
const ID_KEY: &str = "bddp/nccl/id";

/// Joins the group's NCCL communicator on GPU `local_rank`: rank 0 creates the id and puts it in
/// the store, the others read it.
pub(super) fn join(group: &ProcessGroup) -> Result<NcclComm> {
    let rank = group.rank();
    let failed = |what: &'static str| {
        move |e: NcclError| DdpError::Rendezvous {
            rank,
            reason: format!("{what}: {e}"),
        }
    };
    let id: [u8; 128] = if rank == 0 {
        let id = burn_ddp_nccl::unique_id(0).map_err(failed("creating the NCCL id"))?;
        group.store().set(ID_KEY, &id)?;
        id
    } else {
        let bytes = group.store().get(ID_KEY)?;
        bytes
            .as_slice()
            .try_into()
            .map_err(|_| DdpError::Rendezvous {
                rank,
                reason: format!(
                    "the NCCL id in the store has {} bytes, not 128",
                    bytes.len()
                ),
            })?
    };
    let comm = NcclComm::new(
        rank,
        group.world_size(),
        group.local_rank(),
        &id,
        group.options().timeout,
    )
    .map_err(failed("joining the NCCL communicator"))?;
    Ok(comm)
}

/// Starts an all-reduce in place.
pub(super) fn all_reduce(
    group: &ProcessGroup,
    comm: &NcclComm,
    tensor: Tensor<1>,
    op: ReduceOp,
) -> Work<Tensor<1>> {
    let op = match op {
        ReduceOp::Sum => burn_ddp_nccl::ReduceOp::Sum,
        ReduceOp::Avg => burn_ddp_nccl::ReduceOp::Avg,
        ReduceOp::Max => burn_ddp_nccl::ReduceOp::Max,
        ReduceOp::Min => burn_ddp_nccl::ReduceOp::Min,
    };
    finish(group, "all_reduce", comm.start_all_reduce(tensor, op))
}

/// Starts a broadcast from `root` in place.
pub(super) fn broadcast(
    group: &ProcessGroup,
    comm: &NcclComm,
    tensor: Tensor<1>,
    root: usize,
) -> Work<Tensor<1>> {
    finish(group, "broadcast", comm.start_broadcast(tensor, root))
}

/// Starts an all-gather; every rank's length is checked first (through the TCP transport, in
/// the same job) so that NCCL never reads past a shorter rank's buffer.
pub(super) fn all_gather(
    group: &ProcessGroup,
    comm: &NcclComm,
    tensor: Tensor<1>,
) -> Work<Vec<Tensor<1>>> {
    let (rank, world) = (group.rank(), group.world_size());
    let n = tensor.shape().num_elements();
    let started = comm.start_all_gather(tensor);
    group.on_worker(move |w| {
        let lengths = w.run(|t| t.all_gather(&(n as u64).to_le_bytes()))?;
        if let Some(other) = lengths
            .iter()
            .position(|l| l[..] != (n as u64).to_le_bytes())
        {
            let reason = format!(
                "rank {rank} gathers {n} elements but rank {other} another length: tensors \
                 gathered must have the same length on every rank"
            );
            return Err(invalid(rank, "all_gather", reason));
        }
        let all = wait(w, "all_gather", started)?;
        Ok((0..world)
            .map(|r| all.clone().narrow(0, r * n, n))
            .collect())
    })
}

/// Queues the NCCL half of a started collective on the collective thread.
fn finish(
    group: &ProcessGroup,
    op: &'static str,
    started: std::result::Result<Pending, NcclError>,
) -> Work<Tensor<1>> {
    group.on_worker(move |w| wait(w, op, started))
}

/// Waits for a started collective; a failure (NCCL's error, or its timeout, after which the
/// communicator is aborted) stops the group on every rank.
fn wait(
    w: &mut Worker,
    op: &'static str,
    started: std::result::Result<Pending, NcclError>,
) -> Result<Tensor<1>> {
    started
        .and_then(Pending::wait)
        .map_err(|e| w.fail_here(format!("NCCL {op}"), e.to_string()))
}

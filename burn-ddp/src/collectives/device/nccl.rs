//! NCCL for tensors on CUDA devices: the communicator joined on the GPU of the rank's tensors,
//! and collectives that start on the caller's thread (a fence on its CubeCL stream after the
//! kernels that produced the tensor) and finish on the group's collective thread (NCCL on its
//! own stream).
//!
//! Every wait there, the join included, watches the group while it polls NCCL: a peer whose
//! connection to this rank closed without a goodbye (it died) or a failure another rank
//! recorded ends it within [`burn_ddp_nccl::WATCH_INTERVAL`], and the communicator is aborted.
//! A failure of this rank's own (NCCL's error, the timeout) is recorded in the store, so the
//! peers' waits end the same way instead of sitting out their timeouts.
//!
//! The NCCL id travels from rank 0 over the group's own transport (a host all-gather), not
//! through a store key: each communicator's id is scoped to the group and to the moment it is
//! joined, so no rank can read a stale id of an earlier communicator or group.

use burn::tensor::{Device, Tensor};
use burn_ddp_nccl::{NcclComm, NcclError, Pending};

use super::invalid;
use crate::collectives::agreement::Said;
use crate::collectives::backend::Backends;
use crate::collectives::worker::{Elsewhere, Worker};
use crate::collectives::{ReduceOp, Work};
use crate::error::{DdpError, Result};
use crate::wire::{Reader, Writer};

/// Joins the group's NCCL communicator on the GPU of `device`.
pub(super) fn join(group: &Backends, device: &Device) -> Result<NcclComm> {
    let gpu = burn_ddp_nccl::cuda_ordinal(device)
        .ok_or_else(|| DdpError::Disagreement(format!("{device:?} is not a CUDA device")))?;
    let (world, timeout) = (group.world(), group.timeout());
    group
        .on_worker(move |w| {
            let id = exchange_id(w)?;
            let rank = w.rank();
            let op = format!("joining the NCCL communicator on GPU {gpu}");
            let mut found = None;
            let joined =
                NcclComm::new(rank, world, gpu, &id, timeout, &mut || watch(w, &mut found));
            joined.map_err(|e| failed(w, op, e, found))
        })
        .wait()
}

/// Rank 0's NCCL id on every rank, sent over the group's transport (an all-gather in which only
/// rank 0 says anything). Rank 0 sends its failure to create one instead, so that every rank
/// reports it rather than waiting for an id.
fn exchange_id(w: &mut Worker) -> Result<[u8; 128]> {
    let rank = w.rank();
    let message = if rank == 0 {
        match burn_ddp_nccl::unique_id(0) {
            Ok(id) => Writer::default().u8(1).bytes(&id).buf.clone(),
            Err(e) => Writer::default()
                .u8(0)
                .bytes(e.to_string().as_bytes())
                .buf
                .clone(),
        }
    } else {
        Vec::new()
    };
    let all = w.run(|t| t.all_gather(&message))?;
    decode_id(&all[0]).map_err(|reason| DdpError::Rendezvous { rank, reason })
}

/// The id in rank 0's message, or what rank 0 said went wrong.
fn decode_id(message: &[u8]) -> std::result::Result<[u8; 128], String> {
    let mut r = Reader::new(message);
    let malformed = |_| "rank 0 sent a malformed NCCL id message".to_string();
    let ok = r.u8().map_err(malformed)?;
    let body = r.bytes().map_err(malformed)?;
    match ok {
        1 => body
            .try_into()
            .map_err(|_| format!("rank 0 sent an NCCL id of {} bytes, not 128", body.len())),
        _ => Err(format!(
            "rank 0 could not create the NCCL id: {}",
            String::from_utf8_lossy(body)
        )),
    }
}

/// The watch of a wait: what [`Worker::failure_elsewhere`] finds, kept in `found` for the error.
fn watch(w: &Worker, found: &mut Option<Elsewhere>) -> Option<String> {
    let elsewhere = w.failure_elsewhere()?;
    let reason = elsewhere.to_string();
    *found = Some(elsewhere);
    Some(reason)
}

/// The group's error for `op` that failed with `e`: a failure found elsewhere names its cause
/// (an abort of the group recorded its reason before it aborted the communicator); this rank's
/// own is recorded, so the peers stop too.
fn failed(w: &mut Worker, op: String, e: NcclError, found: Option<Elsewhere>) -> DdpError {
    let found = match (found, &e) {
        (None, NcclError::Stopped { .. }) => w.failure_elsewhere(),
        (found, _) => found,
    };
    match found {
        Some(elsewhere) => w.failed_elsewhere(op, elsewhere),
        None => w.fail_here(op, e.to_string()),
    }
}

/// Starts an all-reduce.
pub(super) fn all_reduce(
    group: &Backends,
    comm: &NcclComm,
    tensor: Tensor<1>,
    op: ReduceOp,
) -> Work<Tensor<1>> {
    let started = comm.start_all_reduce(tensor, nccl_op(op));
    group.on_worker(move |w| wait(w, "NCCL all_reduce", started))
}

/// Starts a broadcast from `root`.
pub(super) fn broadcast(
    group: &Backends,
    comm: &NcclComm,
    tensor: Tensor<1>,
    root: usize,
) -> Work<Tensor<1>> {
    let started = comm.start_broadcast(tensor, root);
    group.on_worker(move |w| wait(w, "NCCL broadcast", started))
}

/// Starts an all-gather; every rank's length and element type are compared first (through the
/// host transport, in the same job), so that NCCL never reads past a shorter rank's buffer nor
/// mixes types.
pub(super) fn all_gather(
    group: &Backends,
    comm: &NcclComm,
    tensor: Tensor<1>,
) -> Work<Vec<Tensor<1>>> {
    let world = group.world();
    let n = tensor.shape().num_elements();
    let shape = gather_shape(n, &format!("{:?}", tensor.dtype()));
    let started = comm.start_all_gather(tensor);
    group.on_worker(move |w| {
        let said = w.gather_said(&shape)?;
        if let Some(reason) = shape_mismatch(&said, "gathers") {
            return Err(invalid(w.rank(), "all_gather", reason));
        }
        let all = wait(w, "NCCL all_gather", started)?;
        Ok((0..world)
            .map(|r| all.clone().narrow(0, r * n, n))
            .collect())
    })
}

/// Starts a reduce-scatter into `parts` (`ncclReduceScatter`): every rank's length, element
/// type and parts are compared first (through the host transport, in the same job). Unequal
/// parts travel padded with zeros to the longest, as NCCL cuts a buffer in equal parts only.
pub(super) fn reduce_scatter(
    group: &Backends,
    comm: &NcclComm,
    tensor: Tensor<1>,
    parts: Vec<usize>,
    op: ReduceOp,
) -> Work<Tensor<1>> {
    let (rank, n, dtype) = (group.rank(), tensor.shape().num_elements(), tensor.dtype());
    let shape = gather_shape(n, &format!("{dtype:?} in parts {parts:?}"));
    let valid = parts.len() == group.world() && parts.iter().sum::<usize>() == n;
    let longest = parts.iter().copied().max().unwrap_or(0);
    let padded = if !valid || parts.iter().all(|&p| p == longest) {
        tensor
    } else {
        let device = tensor.device();
        let mut start = 0;
        let pieces = (parts.iter())
            .flat_map(|&p| {
                let piece = tensor.clone().narrow(0, start, p);
                start += p;
                let pad = (p < longest).then(|| Tensor::zeros([longest - p], (&device, dtype)));
                std::iter::once(piece).chain(pad)
            })
            .collect();
        Tensor::cat(pieces, 0)
    };
    let started = if valid {
        Some(comm.start_reduce_scatter(padded, nccl_op(op)))
    } else {
        None
    };
    let own = parts.get(rank).copied().unwrap_or(0);
    group.on_worker(move |w| {
        let said = w.gather_said(&shape)?;
        if let Some(reason) = shape_mismatch(&said, "reduce-scatters") {
            return Err(invalid(w.rank(), "reduce_scatter", reason));
        }
        let Some(started) = started else {
            let reason = format!("parts {parts:?} do not cut {n} elements among the ranks");
            return Err(invalid(w.rank(), "reduce_scatter", reason));
        };
        let part = wait(w, "NCCL reduce_scatter", started)?;
        Ok(part.narrow(0, 0, own))
    })
}

/// Starts an all-gather of tensors of `parts` elements by rank, concatenated in rank order:
/// each rank's travels padded with zeros to the longest part (NCCL gathers equal lengths), and
/// the padding is cut away on arrival. Every rank's length, element type and parts are compared
/// first (through the host transport, in the same job).
pub(super) fn all_gather_parts(
    group: &Backends,
    comm: &NcclComm,
    tensor: Tensor<1>,
    parts: Vec<usize>,
) -> Work<Tensor<1>> {
    let (rank, n, dtype) = (group.rank(), tensor.shape().num_elements(), tensor.dtype());
    let shape = gather_shape(n, &format!("{dtype:?} in parts {parts:?}"));
    let valid = parts.len() == group.world() && parts.get(rank) == Some(&n);
    let longest = parts.iter().copied().max().unwrap_or(0);
    let started = valid.then(|| {
        let padded = if n < longest {
            let pad = Tensor::zeros([longest - n], (&tensor.device(), dtype));
            Tensor::cat(vec![tensor, pad], 0)
        } else {
            tensor
        };
        comm.start_all_gather(padded)
    });
    group.on_worker(move |w| {
        let said = w.gather_said(&shape)?;
        if let Some(reason) = shape_mismatch(&said, "gathers") {
            return Err(invalid(w.rank(), "all_gather", reason));
        }
        let Some(started) = started else {
            let reason = format!("rank {rank} gives {n} elements, its part of {parts:?} differs");
            return Err(invalid(w.rank(), "all_gather", reason));
        };
        let all = wait(w, "NCCL all_gather", started)?;
        let pieces = (parts.iter().enumerate())
            .map(|(r, &p)| all.clone().narrow(0, r * longest, p))
            .collect();
        Ok(Tensor::cat(pieces, 0))
    })
}

/// NCCL's reduction for `op`.
fn nccl_op(op: ReduceOp) -> burn_ddp_nccl::ReduceOp {
    match op {
        ReduceOp::Sum => burn_ddp_nccl::ReduceOp::Sum,
        ReduceOp::Avg => burn_ddp_nccl::ReduceOp::Avg,
        ReduceOp::Max => burn_ddp_nccl::ReduceOp::Max,
        ReduceOp::Min => burn_ddp_nccl::ReduceOp::Min,
    }
}

/// What every rank's input must share: its length and element type (with, for a
/// reduce-scatter, its parts), as `dtype` says it.
fn gather_shape(n: usize, dtype: &str) -> Vec<u8> {
    Writer::default()
        .u64(n as u64)
        .bytes(dtype.as_bytes())
        .buf
        .clone()
}

/// The first disagreement of the gathered shapes with rank 0's, in words (`verb`: what the
/// ranks do with them, "gathers").
fn shape_mismatch(said: &Said, verb: &str) -> Option<String> {
    let other = *said.differing().first()?;
    let words = |r: usize| {
        let mut reader = Reader::new(&said.all[r]);
        match (reader.u64(), reader.string()) {
            (Ok(n), Ok(dtype)) => format!("{n} x {dtype}"),
            _ => "a malformed shape".to_string(),
        }
    };
    Some(format!(
        "rank 0 {verb} {} but rank {other} {}: the tensors must have the same length and element \
         type on every rank",
        words(0),
        words(other)
    ))
}

/// Waits for a started collective, watching the group; a failure stops the group on every rank.
fn wait(
    w: &mut Worker,
    op: &'static str,
    started: std::result::Result<Pending, NcclError>,
) -> Result<Tensor<1>> {
    let mut found = None;
    let done = started.and_then(|pending| pending.wait(&mut || watch(w, &mut found)));
    done.map_err(|e| failed(w, op.to_string(), e, found))
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::DType;

    #[test]
    fn the_id_or_rank_0s_failure_reaches_every_rank() {
        let id: [u8; 128] = std::array::from_fn(|i| i as u8);
        let sent = Writer::default().u8(1).bytes(&id).buf.clone();
        assert_eq!(decode_id(&sent), Ok(id));
        let failed = Writer::default()
            .u8(0)
            .bytes(b"libnccl not found (looked for ...)")
            .buf
            .clone();
        assert_eq!(
            decode_id(&failed),
            Err("rank 0 could not create the NCCL id: libnccl not found (looked for ...)".into())
        );
        let short = Writer::default().u8(1).bytes(&id[..100]).buf.clone();
        assert_eq!(
            decode_id(&short),
            Err("rank 0 sent an NCCL id of 100 bytes, not 128".into())
        );
        assert!(decode_id(&[1, 200]).unwrap_err().contains("malformed"));
    }

    #[test]
    fn gathers_compare_length_and_type() {
        let said = |shapes: &[Vec<u8>]| Said {
            all: shapes.to_vec(),
        };
        let shape = |n, dtype: DType| gather_shape(n, &format!("{dtype:?}"));
        let mine = shape(10, DType::BF16);
        let same = said(&[mine.clone(), mine.clone(), mine.clone()]);
        assert_eq!(shape_mismatch(&same, "gathers"), None);
        // Same bytes, other type: 10 bf16 against 5 f32.
        let other = said(&[mine.clone(), shape(5, DType::F32)]);
        assert_eq!(
            shape_mismatch(&other, "gathers").unwrap(),
            "rank 0 gathers 10 x BF16 but rank 1 5 x F32: the tensors must have the same length \
             and element type on every rank"
        );
        let typed = said(&[shape(10, DType::F16), mine.clone(), mine]);
        let message = shape_mismatch(&typed, "gathers").unwrap();
        assert!(
            message.contains("rank 0 gathers 10 x F16 but rank 1 10 x BF16"),
            "{message}"
        );
    }
}

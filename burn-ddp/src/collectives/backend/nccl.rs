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

use std::time::{Duration, Instant};

use burn::tensor::{Device, Tensor};
use burn_ddp_nccl::{NcclComm, NcclError, Pending};

use super::Request;
use super::plan::{self, Call, Plan};
use crate::collectives::worker::Queue;
use crate::collectives::worker::{RemoteFailure, Worker};
use crate::collectives::{ReduceOp, Work};
use crate::error::{DdpError, Result};
use crate::wire::{Reader, Writer};

/// Joins the group's NCCL communicator on the GPU of `device`.
pub(crate) fn join(queue: &Queue, device: &Device) -> Result<NcclComm> {
    let gpu = burn_ddp_nccl::cuda_ordinal(device)
        .ok_or_else(|| DdpError::Disagreement(format!("{device:?} is not a CUDA device")))?;
    let (world, timeout) = (queue.world(), queue.limits().timeout);
    queue
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

/// The watch of a wait: what [`Worker::remote_failure`] finds, kept in `found` for the error.
fn watch(w: &Worker, found: &mut Option<RemoteFailure>) -> Option<String> {
    let elsewhere = w.remote_failure()?;
    let reason = elsewhere.to_string();
    *found = Some(elsewhere);
    Some(reason)
}

/// The group's error for `op` that failed with `e`: a failure found elsewhere names its cause
/// (a dead peer, or what another rank recorded); only a failure found nowhere else is recorded
/// as this rank's own, so the peers stop too.
fn failed(w: &mut Worker, op: String, e: NcclError, found: Option<RemoteFailure>) -> DdpError {
    let found = remote_cause(&e, found, burn_ddp_nccl::GRACE, || w.remote_failure());
    match found {
        Some(elsewhere) => w.failed_remotely(op, elsewhere),
        None => w.fail_here(op, e.to_string()),
    }
}

/// What stopped an NCCL operation that failed with `e`, if it was elsewhere in the group: what
/// the watch `found`, or else, for a failure a peer can cause (NCCL's own error, a stop, a
/// timeout), what `look` finds within `grace`. A peer that exits makes NCCL's socket transport
/// fail here within a millisecond (`ncclRemoteError`), before the watch, asked every
/// [`burn_ddp_nccl::WATCH_INTERVAL`], sees the peer's connection close: without the grace this
/// rank would record itself as the culprit.
fn remote_cause<E>(
    e: &NcclError,
    found: Option<E>,
    grace: Duration,
    mut look: impl FnMut() -> Option<E>,
) -> Option<E> {
    let peers_can_cause = matches!(
        e,
        NcclError::Nccl { .. } | NcclError::Stopped { .. } | NcclError::Timeout { .. }
    );
    if found.is_some() || !peers_can_cause {
        return found;
    }
    let deadline = Instant::now() + grace;
    loop {
        if let Some(elsewhere) = look() {
            return Some(elsewhere);
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Starts `request` on `tensor` by NCCL: planned ([`Plan`]), its input fenced on this thread's
/// stream, then agreed and run on the collective thread; `done` turns the result's tensors into
/// the caller's.
pub(crate) fn start<T: Send + 'static>(
    queue: &Queue,
    comm: &NcclComm,
    tensor: Tensor<1>,
    request: Request,
    done: impl FnOnce(Vec<Tensor<1>>) -> T + Send + 'static,
) -> Work<T> {
    let begin = |call, input| begin(comm, call, input);
    let finish = |w: &mut Worker, plan: &Plan, started| wait(w, plan.name, started);
    plan::run(queue, tensor, request, begin, finish, done)
}

/// The NCCL collective `call` started on `input` (the one place this backend calls NCCL).
fn begin(comm: &NcclComm, call: Call, input: Tensor<1>) -> std::result::Result<Pending, NcclError> {
    match call {
        Call::AllReduce(op) => comm.start_all_reduce(input, nccl_op(op)),
        Call::Broadcast(root) => comm.start_broadcast(input, root),
        Call::AllGather => comm.start_all_gather(input),
        Call::ReduceScatter(op) => comm.start_reduce_scatter(input, nccl_op(op)),
    }
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

/// Waits for a started collective, watching the group; a failure stops the group on every rank.
fn wait(
    w: &mut Worker,
    name: &str,
    started: std::result::Result<Pending, NcclError>,
) -> Result<Tensor<1>> {
    let mut found = None;
    let done = started.and_then(|pending| pending.wait(&mut || watch(w, &mut found)));
    done.map_err(|e| failed(w, format!("NCCL {name}"), e, found))
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn_ddp_nccl::GRACE;

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

    fn nccl_error(message: &str) -> NcclError {
        NcclError::Nccl {
            rank: 0,
            call: "all_reduce",
            message: message.into(),
        }
    }

    /// A peer that exits makes NCCL fail here (`ncclRemoteError`) before the watch sees it
    /// die: the group's record, found within the grace, names the dead peer, not this rank.
    #[test]
    fn an_nccl_error_looks_for_the_peer_that_caused_it() {
        let mut asked = 0;
        let found = remote_cause(&nccl_error("remote process exited"), None, GRACE, || {
            asked += 1;
            (asked == 3).then_some("rank 1 died")
        });
        assert_eq!(found, Some("rank 1 died"), "asked {asked} times");

        let timeout = NcclError::Timeout {
            rank: 0,
            op: "all_reduce".into(),
            timeout: Duration::from_secs(1),
        };
        assert_eq!(remote_cause(&timeout, None, GRACE, || Some(2)), Some(2));
        // What the watch found stands; nothing else is asked.
        let mut asked = false;
        let kept = remote_cause(&nccl_error("x"), Some(7), GRACE, || {
            asked = true;
            Some(8)
        });
        assert_eq!((kept, asked), (Some(7), false));
    }

    /// This rank's own fault (a tensor NCCL cannot take) is its own at once; a failure found
    /// nowhere within the grace is this rank's too, after the grace and not much later.
    #[test]
    fn own_faults_are_not_blamed_elsewhere() {
        let tensor = NcclError::Tensor {
            rank: 0,
            reason: "not contiguous".into(),
        };
        assert_eq!(remote_cause(&tensor, None, GRACE, || Some(1)), None);
        let start = Instant::now();
        let grace = Duration::from_millis(60);
        assert_eq!(
            remote_cause(&nccl_error("x"), None, grace, || None::<u8>),
            None
        );
        let took = start.elapsed();
        assert!(
            took >= grace && took < grace + Duration::from_secs(2),
            "{took:?}"
        );
    }
}

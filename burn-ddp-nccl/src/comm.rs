//! `NcclComm`: one NCCL communicator per process group on the GPU of the rank's tensors;
//! collectives on burn CUDA tensors read from their CubeCL buffers and write into fresh ones, on
//! a stream of our own, with no host copy.
//!
//! **Reaching the CubeCL buffer.** burn's default features turn on kernel fusion, and Cargo
//! unifies features: one crate anywhere in a user's graph that depends on burn with its
//! defaults makes every CubeCL tensor a fusion handle (`burn_cubecl::Cube` is then
//! `Fusion<CubeBackend>`). So this crate turns fusion on itself, making `Cube` one type in every
//! build, and reaches the buffer through the fusion client: `resolve_tensor_float` runs what is
//! queued for the tensor and hands over its `CubeTensor`; the result goes back as a fusion
//! tensor registered with an `Init` operation, as burn-fusion's own `float_from_data` does
//! (`buffer.rs`).
//!
//! **Out of place.** Every collective writes a new buffer: the input may be shared (a clone of
//! the tensor, a view of a parameter), and writing into it would change the caller's other
//! copies. NCCL is as fast out of place, and at world size 1 an out-of-place collective still
//! copies, so a check there proves NCCL read and wrote the right memory.
//!
//! **Two halves.** [`NcclComm::start_all_reduce`] (and the broadcast and gather) runs on the
//! thread that produced the tensor, takes a fence on that thread's CubeCL stream right after
//! the kernels that wrote it and the collective's turn (its place in the start order);
//! [`Pending::wait`], on any thread, waits for the fence and for its turn, enqueues NCCL on the
//! communicator's stream and polls until it finishes (`pending.rs`). Every wait is bounded: by
//! the timeout, by [`NcclComm::abort`] from another thread (seen within a poll), by NCCL's own
//! asynchronous error (a peer's network failure), and by the caller's watch, asked every
//! [`crate::WATCH_INTERVAL`] (burn-ddp's reports a dead peer or the group's failure record; the
//! wait then ends unless the collective finishes within [`crate::GRACE`]).
//! The communicator is non-blocking (`ncclCommInitRankConfig` with `blocking = 0`), so joining
//! is bounded the same way. Every thread binds the GPU's primary context before calling NCCL,
//! so no other GPU gets a context.

pub(crate) mod pending;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use burn::tensor::Tensor;
use cudarc::driver::{CudaContext, CudaStream};

use self::pending::Pending;
use crate::buffer::DeviceBuffer;
use crate::error::NcclError;
use crate::ffi::{self, Failure, RawComm, RawOp, State};
use crate::library::Located;
use crate::tables::{ReduceOp, check_nccl_version, join_advice};
use crate::turns::Turns;
use crate::waiting::{Stop, poll_until};

/// How long a dropped communicator may take to flush before it is aborted instead.
const FINALIZE_LIMIT: Duration = Duration::from_secs(10);

/// Checks that libcuda, libnccl and libnvrtc (burn's CUDA kernels are compiled by it) can be
/// loaded and that the NCCL is 2.14 or newer, so that
/// nothing later panics in a loader ([`NcclError::MissingLibrary`],
/// [`NcclError::UnsupportedNccl`]).
pub fn check_libraries() -> Result<(), NcclError> {
    match ffi::libraries_present() {
        (true, true) if !ffi::nvrtc_present() => Err(Located::from_env().missing("libnvrtc")),
        (true, true) => check_nccl_version(ffi::nccl_version()),
        (false, _) => Err(Located::from_env().missing("libcuda")),
        (true, false) => Err(Located::from_env().missing("libnccl")),
    }
}

/// A fresh NCCL unique id, created on rank 0 and passed to the others. Needs libnccl (2.14 or
/// newer) but no GPU.
pub fn unique_id(rank: usize) -> Result<[u8; 128], NcclError> {
    if !ffi::libraries_present().1 {
        return Err(Located::from_env().missing("libnccl"));
    }
    check_nccl_version(ffi::nccl_version())?;
    ffi::unique_id().map_err(|failure| NcclError::Nccl {
        rank,
        call: "ncclGetUniqueId",
        message: failure.to_string(),
    })
}

/// An NCCL communicator on one GPU of this rank. Cloning shares it.
///
/// **Order.** NCCL pairs collectives across ranks by the order each rank enqueues them. Here
/// that is the order they are started (`start_*`) on this communicator, and its clones: a
/// [`Pending`] waited for before an earlier-started one waits (bounded) until the earlier one
/// is enqueued or dropped. So every rank must start the same collectives, of the same lengths,
/// in the same order; the threads that wait for them do not matter. A dropped [`Pending`]
/// skips its collective; see its docs.
#[derive(Clone)]
pub struct NcclComm {
    pub(crate) inner: Arc<Inner>,
}

/// Fields drop in order: the communicator, then its stream, then the context they need.
pub(crate) struct Inner {
    pub(crate) raw: Mutex<RawComm>,
    pub(crate) stream: Arc<CudaStream>,
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) rank: usize,
    world: usize,
    gpu: usize,
    /// Set by [`NcclComm::abort`] (and by a wait that gave up); the thread holding `raw`
    /// aborts it at its next poll.
    pub(crate) aborted: AtomicBool,
    /// Bounds each wait (for the whole of [`Pending::wait`]).
    pub(crate) timeout: Duration,
    /// The start order of its collectives, the order they are enqueued in.
    turns: Arc<Turns>,
}

impl NcclComm {
    /// Joins the communicator `id` as `rank` of `world` on CUDA GPU `gpu` (the ordinal of the
    /// rank's tensors' device, see [`crate::cuda_ordinal`]). Every rank calls it with the same
    /// id. Bounded like a collective: by `timeout`, and by `watch` (asked every
    /// [`crate::WATCH_INTERVAL`]; a reason it returns stops the join).
    pub fn new(
        rank: usize,
        world: usize,
        gpu: usize,
        id: &[u8; 128],
        timeout: Duration,
        watch: &mut dyn FnMut() -> Option<String>,
    ) -> Result<Self, NcclError> {
        check_libraries()?;
        let cuda = |call: &'static str| {
            move |e: cudarc::driver::DriverError| NcclError::Cuda {
                rank,
                call,
                message: e.to_string(),
            }
        };
        // The GPU's primary context: the one cubecl-cuda uses for burn's buffers.
        let ctx = CudaContext::new(gpu).map_err(|e| NcclError::Cuda {
            rank,
            call: "cuDevicePrimaryCtxRetain",
            message: format!("GPU {gpu}: {e}"),
        })?;
        ctx.bind_to_thread().map_err(cuda("cuCtxSetCurrent"))?;
        let stream = ctx.new_stream().map_err(cuda("cuStreamCreate"))?;
        let join_error = |failure: Failure| NcclError::Nccl {
            rank,
            call: "ncclCommInitRankConfig",
            message: join_advice(&failure.to_string()),
        };
        let mut raw = RawComm::start(world, id, rank).map_err(join_error)?;
        let joined = poll_until(timeout, &AtomicBool::new(false), watch, || {
            ready(raw.state())
        });
        if let Err(stop) = joined {
            raw.abort();
            let op = "joining the communicator".to_string();
            return Err(stopped(rank, op, timeout, stop, join_error));
        }
        Ok(NcclComm {
            inner: Arc::new(Inner {
                raw: Mutex::new(raw),
                stream,
                ctx,
                rank,
                world,
                gpu,
                aborted: AtomicBool::new(false),
                timeout,
                turns: Arc::default(),
            }),
        })
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.inner.world
    }

    /// The GPU (CUDA ordinal) the communicator runs on.
    pub fn gpu(&self) -> usize {
        self.inner.gpu
    }

    /// All-reduces a flat CUDA tensor and returns the result (blocking:
    /// [`NcclComm::start_all_reduce`] then [`Pending::wait`] with no watch).
    pub fn all_reduce(&self, tensor: Tensor<1>, op: ReduceOp) -> Result<Tensor<1>, NcclError> {
        self.start_all_reduce(tensor, op)?.wait(&mut || None)
    }

    /// Starts an all-reduce of a flat CUDA tensor (f64, f32, f16 or bf16) into a new tensor.
    pub fn start_all_reduce(&self, tensor: Tensor<1>, op: ReduceOp) -> Result<Pending, NcclError> {
        let input = self.buffer(tensor)?;
        let output = self.output_like(&input, input.count)?;
        let raw = RawOp::AllReduce {
            send: input.ptr,
            recv: output.ptr,
            count: input.count,
            op,
        };
        Ok(self.pending(raw, "all_reduce", input, output))
    }

    /// Starts a broadcast: the result is `root`'s tensor on every rank (same length and type
    /// on every rank).
    pub fn start_broadcast(&self, tensor: Tensor<1>, root: usize) -> Result<Pending, NcclError> {
        if root >= self.inner.world {
            return Err(self.tensor_error(format!(
                "broadcast root {root} >= world size {}",
                self.inner.world
            )));
        }
        let input = self.buffer(tensor)?;
        let output = self.output_like(&input, input.count)?;
        let raw = RawOp::Broadcast {
            send: input.ptr,
            recv: output.ptr,
            count: input.count,
            root,
        };
        Ok(self.pending(raw, "broadcast", input, output))
    }

    /// Starts an all-gather: every rank's tensor (the same length and type on every rank, which
    /// the caller checks) concatenated in rank order, `world * len` elements.
    pub fn start_all_gather(&self, tensor: Tensor<1>) -> Result<Pending, NcclError> {
        let input = self.buffer(tensor)?;
        let output = self.output_like(&input, input.count * self.inner.world)?;
        let raw = RawOp::AllGather {
            send: input.ptr,
            recv: output.ptr,
            count: input.count,
        };
        Ok(self.pending(raw, "all_gather", input, output))
    }

    /// Starts a reduce-scatter of a flat CUDA tensor whose length is a multiple of the world
    /// size (the same on every rank, which the caller checks): the result is this rank's part,
    /// `len / world` elements of the reduction (`ncclReduceScatter`).
    pub fn start_reduce_scatter(
        &self,
        tensor: Tensor<1>,
        op: ReduceOp,
    ) -> Result<Pending, NcclError> {
        let world = self.inner.world;
        let input = self.buffer(tensor)?;
        if !input.count.is_multiple_of(world) {
            return Err(self.tensor_error(format!(
                "reduce_scatter of {} elements: not a multiple of the world size {world}",
                input.count
            )));
        }
        let output = self.output_like(&input, input.count / world)?;
        let raw = RawOp::ReduceScatter {
            send: input.ptr,
            recv: output.ptr,
            count: input.count / world,
            op,
        };
        Ok(self.pending(raw, "reduce_scatter", input, output))
    }

    /// Aborts the communicator (after a failure elsewhere in the group): a collective waiting on
    /// another thread ends within a poll, and later ones fail at once.
    pub fn abort(&self) {
        let inner = &self.inner;
        inner.aborted.store(true, Ordering::Release);
        // A waiting thread holds the lock and aborts at its next poll; otherwise abort here.
        if let Ok(mut raw) = inner.raw.try_lock() {
            let _ = inner.ctx.bind_to_thread();
            raw.abort();
        }
    }

    fn pending(
        &self,
        op: RawOp,
        name: &'static str,
        input: DeviceBuffer,
        output: DeviceBuffer,
    ) -> Pending {
        // The fence is recorded on this thread's CubeCL stream, after the kernels that wrote
        // the input and allocated the output (reading their addresses made this stream wait for
        // the streams that wrote them): waiting for it waits for exactly those.
        let ready = input.fence();
        Pending {
            comm: self.clone(),
            op,
            name,
            ready,
            ticket: self.inner.turns.take(),
            input,
            output,
        }
    }

    fn tensor_error(&self, reason: String) -> NcclError {
        NcclError::Tensor {
            rank: self.inner.rank,
            reason,
        }
    }

    /// A new buffer of `count` elements of `like`'s type on its device, pinned.
    fn output_like(&self, like: &DeviceBuffer, count: usize) -> Result<DeviceBuffer, NcclError> {
        like.new_like(count, self.inner.gpu)
            .map_err(|reason| self.tensor_error(reason))
    }

    /// The tensor's CubeCL buffer, contiguous and pinned.
    fn buffer(&self, tensor: Tensor<1>) -> Result<DeviceBuffer, NcclError> {
        DeviceBuffer::of(tensor, self.inner.gpu).map_err(|reason| self.tensor_error(reason))
    }
}

impl Drop for Inner {
    /// Flushes a healthy communicator (bounded) before [`RawComm`] destroys it.
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        let raw = self.raw.get_mut().unwrap_or_else(|p| p.into_inner());
        if !self.aborted.load(Ordering::Acquire) && raw.start_finalize().is_ok() {
            let _ = poll_until(FINALIZE_LIMIT, &self.aborted, &mut || None, || {
                ready(raw.state())
            });
        } else {
            raw.abort();
        }
    }
}

/// A poll of a communicator's state: done when ready.
pub(crate) fn ready(state: State) -> Result<bool, Failure> {
    match state {
        State::Ready => Ok(true),
        State::InProgress => Ok(false),
        State::Failed(message) => Err(message),
    }
}

/// The error of a wait for `op` that ended before its work did (the communicator is aborted);
/// the work's own failure becomes `failed`'s error.
pub(crate) fn stopped<E>(
    rank: usize,
    op: String,
    timeout: Duration,
    stop: Stop<E>,
    failed: impl FnOnce(E) -> NcclError,
) -> NcclError {
    match stop {
        Stop::TimedOut => NcclError::Timeout { rank, op, timeout },
        Stop::Watched(reason) => NcclError::Stopped { rank, op, reason },
        Stop::Aborted => NcclError::Stopped {
            rank,
            op,
            reason: "the communicator was aborted after a failure in the group".into(),
        },
        Stop::Failed(failure) => failed(failure),
    }
}

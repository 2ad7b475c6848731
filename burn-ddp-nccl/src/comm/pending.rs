//! [`Pending`]: a collective started by [`crate::NcclComm`], run and finished by
//! [`Pending::wait`] on any thread.
//!
//! A wait goes through three stages, each bounded by what is left of the communicator's
//! timeout, by [`crate::NcclComm::abort`] and by the caller's watch:
//! 1. the kernels that wrote the input: CubeCL's fence is an event synchronize that cannot be
//!    polled, so a helper thread waits on it and the wait polls the helper (`wait_blocking`);
//! 2. its turn: collectives are enqueued in the order they were started on this communicator
//!    (`turns.rs`), whichever thread waits for them and in whatever order;
//! 3. NCCL: enqueued on the communicator's stream, then polled until issued and finished.
//!
//! A wait that ends early aborts the communicator (this rank no longer keeps step with the
//! others). Once NCCL has the buffers' addresses, they are handed back to CubeCL only after the
//! abort returned and NCCL's stream drained; if it does not drain they are leaked, never reused
//! while a kernel may still write them.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use burn::tensor::Tensor;
use burn_cubecl::cubecl::future::block_on;
use cudarc::driver::sys::CUstream;

use super::{Inner, NcclComm, ready, stopped};
use crate::buffer::{DeviceBuffer, Fence};
use crate::error::NcclError;
use crate::ffi::{self, Failure, RawComm, RawOp, State};
use crate::turns::Ticket;
use crate::waiting::{Stop, keep_until_drained, poll_until, wait_blocking};

/// How long the buffers of an aborted collective are kept for NCCL's stream to drain before
/// they are leaked instead of handed back.
const DRAIN_LIMIT: Duration = Duration::from_secs(5);

/// A collective started by [`NcclComm`]: wait for it (on any thread) to get the result.
///
/// **Order.** A communicator enqueues its collectives in the order they were started (each
/// start takes the next turn), whichever thread waits for them and in whatever order: a wait
/// first waits, bounded like the rest of it, until every collective started before it on the
/// same communicator has been enqueued or dropped. Across ranks the collectives pair in that
/// order, so every rank starts the same collectives in the same order (as NCCL requires).
///
/// **Dropping** a `Pending` without waiting skips its collective on this rank and gives its
/// turn to the next one; the communicator stays usable only if every rank skips the same
/// collectives (otherwise the next one pairs with a different collective on another rank: abort
/// the communicator instead).
#[must_use = "the collective runs only in Pending::wait"]
pub struct Pending {
    pub(crate) comm: NcclComm,
    pub(crate) op: RawOp,
    pub(crate) name: &'static str,
    pub(crate) ready: Fence,
    pub(crate) ticket: Ticket,
    pub(crate) input: DeviceBuffer,
    pub(crate) output: DeviceBuffer,
}

impl Pending {
    /// Waits for the input's kernels and for this collective's turn, runs it on NCCL's stream
    /// and polls until it finishes, then returns the result (for a gather the concatenation of
    /// every rank's tensor). Every stage is bounded: the wait ends early, aborting the
    /// communicator, on NCCL's asynchronous error, on the communicator's timeout (for the whole
    /// wait), on [`NcclComm::abort`], or when `watch` (asked every [`crate::WATCH_INTERVAL`])
    /// returns a reason.
    pub fn wait(self, watch: &mut dyn FnMut() -> Option<String>) -> Result<Tensor<1>, NcclError> {
        let inner = &*self.comm.inner;
        let (rank, timeout) = (inner.rank, inner.timeout);
        let start = Instant::now();
        let left = || timeout.saturating_sub(start.elapsed());
        let what = format!(
            "{} of {} x {:?}",
            self.name, self.input.count, self.input.dtype
        );
        let fence = self.ready;
        let kernels = wait_blocking(left(), &inner.aborted, watch, move || {
            block_on(fence).map_err(|e| format!("the kernels that produced the tensor failed: {e}"))
        });
        if let Err(stop) = kernels {
            self.comm.abort();
            let failed = |reason| NcclError::Tensor { rank, reason };
            return Err(stopped(rank, what, timeout, stop, failed));
        }
        if let Err(stop) = self.ticket.wait_turn(left(), &inner.aborted, watch) {
            self.comm.abort();
            let op = format!("{what} ({})", self.ticket.waiting_for());
            return Err(stopped(rank, op, timeout, stop, |never| match never {}));
        }
        let call = Call {
            inner,
            op: self.op,
            name: self.name,
            what,
            start,
        };
        let buffers = (self.input, self.output);
        match call.run(self.ticket, &buffers, watch) {
            Ok(()) => Ok(buffers.1.into_tensor()),
            Err((mut raw, error)) => {
                give_up(&mut raw, inner, buffers);
                Err(error)
            }
        }
    }
}

/// What NCCL's part of a wait returns when it fails: the communicator, still locked (the
/// buffers are handed back only after it is aborted), and the error.
type Failed<'a> = (std::sync::MutexGuard<'a, RawComm>, NcclError);

/// A collective whose input is ready and whose turn has come.
struct Call<'a> {
    inner: &'a Inner,
    op: RawOp,
    name: &'static str,
    /// The collective in words, for errors.
    what: String,
    /// When the wait began: the timeout bounds the whole wait.
    start: Instant,
}

impl<'a> Call<'a> {
    /// What is left of the timeout.
    fn left(&self) -> Duration {
        self.inner.timeout.saturating_sub(self.start.elapsed())
    }

    /// Enqueues the collective on `buffers` (`ticket` is given up once it is enqueued) and
    /// polls until NCCL's stream ran it.
    fn run(
        &self,
        ticket: Ticket,
        buffers: &(DeviceBuffer, DeviceBuffer),
        watch: &mut dyn FnMut() -> Option<String>,
    ) -> Result<(), Failed<'a>> {
        let inner = self.inner;
        let (rank, timeout, call) = (inner.rank, inner.timeout, self.name);
        let nccl_error = |failure: Failure| NcclError::Nccl {
            rank,
            call,
            message: failure.to_string(),
        };
        let stop_error = |stop| stopped(rank, self.what.clone(), timeout, stop, nccl_error);
        let mut raw = inner.raw.lock().unwrap_or_else(|p| p.into_inner());
        if let Err(e) = inner.ctx.bind_to_thread() {
            let (call, message) = ("cuCtxSetCurrent", e.to_string());
            let error = NcclError::Cuda {
                rank,
                call,
                message,
            };
            return Err((raw, error));
        }
        if inner.aborted.load(Ordering::Acquire) {
            return Err((raw, stop_error(Stop::Aborted)));
        }
        let stream = inner.stream.cu_stream();
        let enqueued = raw.enqueue(self.op, buffers.0.dtype, stream);
        // The next collective's turn: it enqueues after this one (once it has the lock).
        drop(ticket);
        if let Err(failure) = enqueued {
            return Err((raw, nccl_error(failure)));
        }
        // First until NCCL has issued the collective (a non-blocking communicator may still be
        // issuing it), then until the stream ran it, watching NCCL's asynchronous error.
        let issued = poll_until(self.left(), &inner.aborted, watch, || ready(raw.state()));
        let finished = issued.and_then(|()| {
            poll_until(self.left(), &inner.aborted, watch, || match raw.state() {
                State::Failed(message) => Err(message),
                _ => ffi::stream_finished(stream),
            })
        });
        match finished {
            // NCCL's stream is finished: the pins may go and burn may read the result.
            Ok(()) => Ok(()),
            Err(stop) => Err((raw, stop_error(stop))),
        }
    }
}

/// Aborts the communicator (every later wait on it ends at once), then hands `buffers` back to
/// CubeCL only once NCCL's stream drained, or leaks them if it does not within
/// [`DRAIN_LIMIT`].
fn give_up(raw: &mut RawComm, inner: &Inner, buffers: (DeviceBuffer, DeviceBuffer)) {
    inner.aborted.store(true, Ordering::Release);
    raw.abort();
    let stream: CUstream = inner.stream.cu_stream();
    keep_until_drained(buffers, DRAIN_LIMIT, || {
        matches!(ffi::stream_finished(stream), Ok(true))
    });
}

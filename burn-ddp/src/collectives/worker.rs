//! The collective thread (below the backends, as c10d's `Work` is below its `Backend`s): every
//! backend hands its operations to the thread's [`Queue`]; they run on the thread ([`Worker`])
//! one at a time, in the order they were issued, and each caller holds a [`Work`] to wait on.
//! The thread turns what the transport reports into the group's errors.
//!
//! A failed operation is where the group agrees on the root cause: the transport names the peer
//! it saw fail, this thread records that in the store unless another rank recorded a failure
//! first ([`FailureRecord::agree`]), and only then closes the connections, so the neighbours
//! that notice the close find the root cause already recorded and every rank's error names the
//! rank that failed first.

use std::sync::Arc;
use std::sync::mpsc::{self, Receiver, Sender, TryRecvError};
use std::thread::JoinHandle;
use std::time::Duration;

use super::transport::host::{HostTransport, OpError, OpResult};
use super::transport::tcp::PeerFailure;
use crate::error::{DdpError, Result};
use crate::failure::FailureRecord;
use crate::status::StatusCell;
use crate::store::Store;

/// Handle of a started collective. Operations run in the order they were issued, the same order
/// on every rank; [`Work::wait`] returns the result (the reduced buffer, the gathered data).
///
/// Dropping a `Work` without waiting does not cancel the operation: it still runs, so ranks stay
/// in step.
#[must_use = "a collective's result (and error) is only seen through wait()"]
pub struct Work<T> {
    rank: usize,
    state: State<T>,
}

enum State<T> {
    Pending(Receiver<Result<T>>),
    Done(Result<T>),
    Taken,
}

impl<T> Work<T> {
    pub(crate) fn pending(rank: usize, rx: Receiver<Result<T>>) -> Self {
        Work {
            rank,
            state: State::Pending(rx),
        }
    }

    pub(crate) fn done(rank: usize, result: Result<T>) -> Self {
        Work {
            rank,
            state: State::Done(result),
        }
    }

    /// Blocks until the operation finished and returns its result. Bounded by the group's
    /// timeout: a peer that stops answering turns into an error, not a hang.
    pub fn wait(mut self) -> Result<T> {
        match std::mem::replace(&mut self.state, State::Taken) {
            State::Pending(rx) => rx
                .recv()
                .unwrap_or(Err(DdpError::WorkerGone { rank: self.rank })),
            State::Done(r) => r,
            State::Taken => Err(DdpError::WorkerGone { rank: self.rank }),
        }
    }

    /// Whether the operation has finished (then [`Work::wait`] returns at once).
    pub fn is_completed(&mut self) -> bool {
        if let State::Pending(rx) = &self.state {
            match rx.try_recv() {
                Ok(r) => self.state = State::Done(r),
                Err(TryRecvError::Empty) => return false,
                Err(TryRecvError::Disconnected) => {
                    self.state = State::Done(Err(DdpError::WorkerGone { rank: self.rank }))
                }
            }
        }
        true
    }
}

/// The limits a backend enforces, from the group's options.
pub(crate) struct Limits {
    /// Longest a collective may go without progress (the host transport has its own copy;
    /// only NCCL's waits read this one).
    #[cfg_attr(not(feature = "nccl"), allow(dead_code))]
    pub timeout: Duration,
    /// Largest total an all-gather may produce.
    pub max_gather_bytes: usize,
    /// Host tensors take the NCCL backend's plans with host collectives (tests only).
    #[cfg(all(feature = "train", feature = "test-support"))]
    pub nccl_plans_on_host: bool,
}

/// The queue of a group's collective thread, and the limits every backend enforces.
pub(crate) struct Queue {
    rank: usize,
    world: usize,
    limits: Limits,
    jobs: Option<Sender<Job>>,
    thread: Option<JoinHandle<()>>,
}

impl Queue {
    /// Starts the collective thread of `rank` of `world` over `transport`; the thread reports
    /// each operation in `status` and agrees on failures through `store`.
    pub(crate) fn start(
        rank: usize,
        world: usize,
        transport: HostTransport,
        store: Arc<Store>,
        status: Arc<StatusCell>,
        limits: Limits,
    ) -> Result<Self> {
        let (jobs, thread) = Worker::spawn(rank, transport, store, status)?;
        Ok(Queue {
            rank,
            world,
            limits,
            jobs: Some(jobs),
            thread: Some(thread),
        })
    }

    /// This rank.
    pub(crate) fn rank(&self) -> usize {
        self.rank
    }

    /// Ranks in the group.
    pub(crate) fn world(&self) -> usize {
        self.world
    }

    /// The limits the backends enforce.
    #[cfg_attr(not(feature = "train"), allow(dead_code))]
    pub(crate) fn limits(&self) -> &Limits {
        &self.limits
    }

    /// Queues a host transport operation on the collective thread, after every collective
    /// issued before it; a failure becomes the group's error there.
    pub(crate) fn submit<T: Send + 'static>(
        &self,
        job: impl FnOnce(&mut HostTransport) -> OpResult<T> + Send + 'static,
    ) -> Work<T> {
        self.on_worker(move |w| w.run(job))
    }

    /// Queues `job` on the collective thread, with the whole [`Worker`] (the transport, and the
    /// group's failure agreement) at hand.
    pub(crate) fn on_worker<T: Send + 'static>(
        &self,
        job: impl FnOnce(&mut Worker) -> Result<T> + Send + 'static,
    ) -> Work<T> {
        let (tx, rx) = mpsc::sync_channel(1);
        let boxed: Job = Box::new(move |t| {
            let _ = tx.send(job(t));
        });
        match self.jobs.as_ref().map(|j| j.send(boxed)) {
            Some(Ok(())) => Work::pending(self.rank, rx),
            _ => Work::done(self.rank, Err(DdpError::WorkerGone { rank: self.rank })),
        }
    }
}

impl Drop for Queue {
    /// Lets queued collectives finish (each bounded by the timeout); the collective thread then
    /// tells the peers this rank leaves.
    fn drop(&mut self) {
        self.jobs.take();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// An operation queued for the collective thread.
pub(crate) type Job = Box<dyn FnOnce(&mut Worker) + Send>;

/// What a wait outside the transport learned of the group (see [`Worker::remote_failure`]).
#[cfg(feature = "nccl")]
pub(crate) enum RemoteFailure {
    /// A peer's connection closed without a goodbye.
    Peer {
        /// The peer.
        culprit: usize,
        /// What happened, naming it.
        detail: String,
    },
    /// A rank recorded the group's failure: its cause.
    Recorded(String),
}

#[cfg(feature = "nccl")]
impl std::fmt::Display for RemoteFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RemoteFailure::Peer { detail, .. } => f.write_str(detail),
            RemoteFailure::Recorded(cause) => write!(f, "the group failed: {cause}"),
        }
    }
}

/// The collective thread's state: the transport and what the group agreed went wrong.
pub(crate) struct Worker {
    rank: usize,
    transport: HostTransport,
    store: Arc<Store>,
    status: Arc<StatusCell>,
    /// The group's agreed failure, once there is one.
    failed: Option<String>,
}

impl Worker {
    /// Starts the collective thread of `rank`; it runs the jobs sent to the returned queue and,
    /// once the queue closes, tells the peers this rank leaves.
    pub(super) fn spawn(
        rank: usize,
        mut transport: HostTransport,
        store: Arc<Store>,
        status: Arc<StatusCell>,
    ) -> Result<(Sender<Job>, JoinHandle<()>)> {
        let (jobs, rx) = mpsc::channel::<Job>();
        // The operation in flight is this rank's published collective.
        let cell = status.clone();
        transport.report_to(Box::new(move |op| {
            cell.update(|s| s.collective = op.map(|op| op.to_string()))
        }));
        let mut worker = Worker {
            rank,
            transport,
            store,
            status,
            failed: None,
        };
        let handle = std::thread::Builder::new()
            .name(format!("burn-ddp-rank{rank}"))
            .spawn(move || {
                for job in rx {
                    job(&mut worker);
                }
                worker.transport.leave();
            })
            .map_err(|e| DdpError::io("starting the collective thread", e))?;
        Ok((jobs, handle))
    }

    /// This rank.
    #[cfg(feature = "train")]
    pub(crate) fn rank(&self) -> usize {
        self.rank
    }

    /// Runs one transport operation; its failure becomes the group's error.
    pub(crate) fn run<T>(
        &mut self,
        op: impl FnOnce(&mut HostTransport) -> OpResult<T>,
    ) -> Result<T> {
        op(&mut self.transport).map_err(|e| match e {
            OpError::Peer(failure) => self.fail(failure),
            OpError::Invalid { op, reason } => DdpError::InvalidArgument {
                rank: self.rank,
                op: op.to_string(),
                reason,
            },
            OpError::Refused { op } => DdpError::Aborted {
                rank: self.rank,
                op: op.to_string(),
                cause: self
                    .failed
                    .clone()
                    .unwrap_or_else(|| "the connections were closed".to_string()),
            },
        })
    }

    /// A peer failed: agrees on the root cause, stops the group on this rank, and builds the
    /// error (also written to torchrun's error file).
    fn fail(&mut self, failure: PeerFailure) -> DdpError {
        let PeerFailure {
            culprit,
            detail,
            op,
        } = failure;
        self.peer_failed(culprit, detail, op.to_string())
    }

    /// Peer `culprit` failed (`detail`) during `op`: as [`Worker::fail`].
    fn peer_failed(&mut self, culprit: usize, detail: String, op: String) -> DdpError {
        let record = FailureRecord {
            culprit: Some(culprit),
            cause: format!("{detail}; seen by rank {} in {op}", self.rank),
        };
        let cause = self.stop(record, |own, e| {
            format!(
                "{own}; the store is unreachable too ({e}), so rank 0, which hosts it, has \
                 probably failed{}",
                if culprit == 0 { "" } else { " as well" }
            )
        });
        self.collective_error(op, cause)
    }

    /// For a wait outside the transport (NCCL's), asked while it waits: a peer whose connection
    /// closed without a goodbye, or a failure another rank recorded.
    #[cfg(feature = "nccl")]
    pub(crate) fn remote_failure(&self) -> Option<RemoteFailure> {
        if let Some((culprit, detail)) = self.transport.dead_peer() {
            return Some(RemoteFailure::Peer { culprit, detail });
        }
        FailureRecord::read(&self.store).map(|r| RemoteFailure::Recorded(r.cause))
    }

    /// The group's error for `op`, stopped by what [`Worker::remote_failure`] found: a dead
    /// peer is recorded as the culprit (unless a failure was recorded first), a recorded
    /// failure is the cause.
    #[cfg(feature = "nccl")]
    pub(crate) fn failed_remotely(&mut self, op: String, found: RemoteFailure) -> DdpError {
        match found {
            RemoteFailure::Peer { culprit, detail } => self.peer_failed(culprit, detail, op),
            RemoteFailure::Recorded(cause) => {
                let cause = self.abort(FailureRecord {
                    culprit: None,
                    cause,
                });
                self.collective_error(op, cause)
            }
        }
    }

    /// Stops the group for a failure of this rank's own part of `op` (reading a tensor back
    /// from its device, NCCL): recorded with this rank as the culprit unless a failure was
    /// recorded first, so the peers fail with it instead of waiting. Returns the group's error.
    #[cfg(feature = "train")]
    pub(crate) fn fail_here(&mut self, op: String, cause: String) -> DdpError {
        let cause = self.abort(FailureRecord {
            culprit: Some(self.rank),
            cause,
        });
        self.collective_error(op, cause)
    }

    /// The group's error for `op` failing with the agreed `cause`, with where every rank was;
    /// logged and written to torchrun's error file.
    fn collective_error(&mut self, op: String, cause: String) -> DdpError {
        // Reported while the failed operation is still published as this rank's collective.
        let ranks = self.status.report();
        self.status.update(|s| s.collective = None);
        log::error!("rank {}: {op} failed: {cause}; ranks: {ranks}", self.rank);
        let error = DdpError::Collective {
            rank: self.rank,
            op,
            cause,
            ranks,
        };
        crate::elastic::record_error(&error);
        error
    }

    /// Stops the group on this rank for a failure found above the collectives (a desync, a
    /// panic): records it as the group's failure unless one is recorded already, and closes
    /// every connection so the peers stop too. Returns the agreed cause.
    pub(crate) fn abort(&mut self, record: FailureRecord) -> String {
        self.stop(record, |own, _| own.to_string())
    }

    /// Records `record` as the group's failure unless one is recorded already (first report
    /// wins), then closes every connection so the peers notice at once, and remembers the
    /// failure. Returns the agreed cause; `unreachable` words it from this rank's own cause when
    /// the store cannot be reached.
    fn stop(
        &mut self,
        record: FailureRecord,
        unreachable: impl FnOnce(&str, DdpError) -> String,
    ) -> String {
        let own = record.cause.clone();
        let cause = match record.agree(&self.store) {
            Ok(agreed) => agreed.cause,
            Err(e) => unreachable(&own, e),
        };
        self.transport.close();
        self.failed.get_or_insert_with(|| cause.clone());
        cause
    }
}

//! The backends of a group (c10d's Backend layer): what moves the bytes of a collective, one per
//! kind of memory a buffer lives in.
//!
//! - Host buffers (`Vec<T>`) go to the host transport ([`HostTransport`]: the TCP ring, shared
//!   memory or the hierarchical schedule, chosen inside it at rendezvous), run on the collective
//!   thread ([`Worker`]) one at a time, in issue order.
//! - Burn tensors (feature `train`) go to the backend of their device kind
//!   ([`super::device::DeviceBackend`], chosen on the first tensor of a kind and agreed across
//!   the ranks): NCCL for CUDA, host staging (device -> host transport -> device) for the rest.
//!
//! [`Backends`] is what a process group holds: the queue of the collective thread and the device
//! backends chosen so far. The group hands it every operation through the buffer traits
//! ([`super::Reducible`] and its siblings), whose implementations say which backend their buffer
//! travels by; nothing below this layer knows the group.

use std::sync::Arc;
use std::sync::mpsc::{self, Sender};
use std::thread::JoinHandle;
use std::time::Duration;

use super::Work;
use super::host::{HostTransport, OpResult};
use super::worker::{Job, Worker};
use crate::error::{DdpError, Result};
use crate::failure::FailureRecord;
use crate::status::StatusCell;
use crate::store::Store;

/// A group's backends: the collective thread with its host transport, and (feature `train`)
/// the device backends chosen so far. (Nominally `pub` because the buffer traits' hidden
/// methods take it; it is not reachable from outside the crate.)
pub struct Backends {
    rank: usize,
    world: usize,
    limits: Limits,
    jobs: Option<Sender<Job>>,
    thread: Option<JoinHandle<()>>,
    #[cfg(feature = "train")]
    devices: super::device::DeviceBackends,
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

impl Backends {
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
        #[cfg(feature = "train")]
        #[cfg(feature = "train")]
        let devices = super::device::DeviceBackends::new(&limits);
        Ok(Backends {
            rank,
            world,
            limits,
            jobs: Some(jobs),
            thread: Some(thread),
            #[cfg(feature = "train")]
            devices,
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

    /// Longest a collective may go without progress.
    #[cfg(feature = "nccl")]
    pub(crate) fn timeout(&self) -> Duration {
        self.limits.timeout
    }

    /// Largest total an all-gather may produce.
    pub(crate) fn max_gather_bytes(&self) -> usize {
        self.limits.max_gather_bytes
    }

    /// The device backends chosen so far.
    #[cfg(feature = "train")]
    pub(crate) fn devices(&self) -> &super::device::DeviceBackends {
        &self.devices
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

    /// Stops every backend for `record` (already agreed in the store by the caller, so that a
    /// device collective the abort stops reports it): device communicators are aborted, then
    /// the collective thread closes the connections. Returns the agreed cause.
    pub(crate) fn abort(&self, record: FailureRecord) -> Result<String> {
        #[cfg(feature = "train")]
        self.devices.abort();
        self.on_worker(move |w| Ok(w.abort(record))).wait()
    }

    /// Queues an abort for `record` without waiting for it (a rank that panics).
    pub(crate) fn abort_later(&self, record: FailureRecord) {
        let _ = self.on_worker(move |w| Ok(w.abort(record)));
    }
}

impl Drop for Backends {
    /// Lets queued collectives finish (each bounded by the timeout); the collective thread then
    /// tells the peers this rank leaves.
    fn drop(&mut self) {
        self.jobs.take();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

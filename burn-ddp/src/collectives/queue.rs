//! The collective thread's queue (below the backends, as c10d's `Work` is below its
//! `Backend`s): every backend hands its operations here, and they run on the collective thread
//! ([`Worker`]) one at a time, in the order they were issued, each returning a [`Work`].

use std::sync::Arc;
use std::sync::mpsc::{self, Sender};
use std::thread::JoinHandle;
use std::time::Duration;

use super::Work;
use super::transport::host::{HostTransport, OpResult};
use super::worker::{Job, Worker};
use crate::error::{DdpError, Result};
use crate::status::StatusCell;
use crate::store::Store;

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

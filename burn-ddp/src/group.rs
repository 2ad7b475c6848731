//! The process group: who this process is, who its peers are, and the collectives between them.
//!
//! Forming a group is the rendezvous: rank 0 serves the store at `MASTER_ADDR:MASTER_PORT`,
//! every rank connects to it (retrying until the rendezvous timeout, so rank 0 may start last),
//! the ranks exchange data-plane addresses through it and connect to each other. Collectives
//! then run on a background thread, one at a time, in the order they were issued; each call
//! returns a [`Work`] to wait on.

use std::any::Any;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

#[cfg(feature = "train")]
use crate::collectives::agreement::Gathered;
use crate::collectives::backends::Backends;
use crate::collectives::{Broadcastable, Gatherable, ReduceOp, Reducible, Work};
use crate::env::LaunchEnv;
use crate::env::Transport;
use crate::error::{DdpError, Result};
use crate::failure::FailureRecord;
use crate::status::StatusBoard;
use crate::store::{Store, StoreServer};

mod builder;
mod init;

pub use builder::{GroupOptions, ProcessGroupBuilder};
pub use init::{init_process_group, init_process_group_with};

/// A connected group of ranks, as PyTorch's default process group. In a world of one,
/// collectives complete at once on the calling thread.
///
/// ```no_run
/// // Run under `burn-ddp-run --nproc 2 ...`, torchrun, srun or mpirun:
/// let group = burn_ddp::init_process_group().unwrap();
/// let summed = group
///     .all_reduce(vec![group.rank() as f32; 4], burn_ddp::ReduceOp::Sum)
///     .wait()
///     .unwrap();
/// println!("rank {} of {}: {summed:?}", group.rank(), group.world_size());
/// ```
pub struct ProcessGroup {
    rank: usize,
    world_size: usize,
    local_rank: usize,
    local_world_size: usize,
    /// Dropped first (fields drop in order): the collective thread finishes its queue while
    /// the status is still published and the store still served.
    backends: Backends,
    store: Arc<Store>,
    status: StatusBoard,
    options: GroupOptions,
    all_reduces: AtomicU64,
    /// Blocks wrapped for fully sharded training with this group so far (their default names).
    #[cfg(feature = "train")]
    pub(crate) fsdp_blocks: std::sync::atomic::AtomicUsize,
    transport: Transport,
    /// State the layers above keep per group, one value per type (see
    /// [`ProcessGroup::attachment`]).
    attachments: Mutex<Vec<Arc<dyn Any + Send + Sync>>>,
    _server: Option<StoreServer>,
}

impl std::fmt::Debug for ProcessGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProcessGroup")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("local_rank", &self.local_rank)
            .finish()
    }
}

impl ProcessGroup {
    /// A builder for rank `rank` of `world_size`.
    pub fn builder(rank: usize, world_size: usize) -> ProcessGroupBuilder {
        ProcessGroupBuilder::new(rank, world_size)
    }

    /// Forms the group described by the process environment. A failure is also written to
    /// torchrun's error file, when there is one ([`crate::elastic::record_error`]).
    pub fn from_env() -> Result<Self> {
        Self::from_env_with(GroupOptions::default())
    }

    /// Forms the group described by `env`.
    pub fn from_launch_env(env: &LaunchEnv) -> Result<Self> {
        Self::builder_from_env(env, GroupOptions::default()).build()
    }

    /// The builder of the group `env` describes, with `options` under the environment's
    /// settings (`BURN_DDP_TIMEOUT` and `BURN_DDP_RENDEZVOUS_TIMEOUT` replace their timeouts,
    /// `BURN_DDP_TRANSPORT` the transport).
    /// The one mapping from launcher variables to a group: every way of forming a group from
    /// the environment goes through it.
    pub fn builder_from_env(env: &LaunchEnv, options: GroupOptions) -> ProcessGroupBuilder {
        let mut b = Self::builder(env.rank, env.world_size)
            .options(options)
            .local_rank(env.local_rank)
            .local_world_size(env.local_world_size)
            .master_port(env.master_port);
        if let Some(addr) = &env.master_addr {
            b = b.master_addr(addr.clone());
        }
        if let Some(t) = env.timeout {
            b = b.timeout(t);
        }
        if let Some(t) = env.rendezvous_timeout {
            b = b.rendezvous_timeout(t);
        }
        if let Some(t) = env.transport {
            b = b.transport(t);
        }
        if let Some(s) = &env.secret {
            b = b.secret(s.clone());
        }
        if let Some(host) = &env.store_bind {
            b = b.store_bind(host.clone());
        }
        if env.agent_store {
            b = b.host_store(false);
        }
        b = b.store_kind(env.store_kind.clone());
        if let Some(name) = &env.socket_ifname {
            b = b.socket_ifname(name.clone());
        }
        b
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }
    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.world_size
    }
    /// Rank on this node (selects the GPU).
    pub fn local_rank(&self) -> usize {
        self.local_rank
    }
    /// Ranks on this node.
    pub fn local_world_size(&self) -> usize {
        self.local_world_size
    }
    /// The rendezvous store (shared by all ranks).
    pub fn store(&self) -> &Arc<Store> {
        &self.store
    }
    /// This rank's status (phase, epoch, step, activity), published for failure reports.
    pub fn status(&self) -> &StatusBoard {
        &self.status
    }
    /// How many all-reduces this rank has issued: a check of communication volume (for
    /// example that gradient accumulation reduces once per optimizer step, not per batch).
    pub fn all_reduce_count(&self) -> u64 {
        self.all_reduces.load(Ordering::Relaxed)
    }

    /// The transport the group's collectives use: [`Transport::Shm`] (shared memory on one
    /// host, or the hierarchical all-reduce on several) or [`Transport::Tcp`] (never `Auto`: the
    /// choice made at rendezvous; `Tcp` for a world of one).
    pub fn transport(&self) -> Transport {
        self.transport
    }

    /// The options the group was formed with.
    pub fn options(&self) -> &GroupOptions {
        &self.options
    }

    /// The group's value of type `T`, made on first use: state a layer above keeps per group
    /// (the training crate keeps the samplers made for the group), so that the group need not
    /// know the layers above it.
    #[cfg_attr(not(feature = "train"), allow(dead_code))]
    pub(crate) fn attachment<T: Any + Default + Send + Sync>(&self) -> Arc<T> {
        let mut all = crate::sync::lock(&self.attachments);
        if let Some(found) = all.iter().find_map(|a| a.clone().downcast::<T>().ok()) {
            return found;
        }
        let made = Arc::new(T::default());
        all.push(made.clone());
        made
    }

    /// Gathers every rank's `mine` (a description of something every rank must agree on):
    /// the one way the ranks compare what they say ([`Gathered::differing`]).
    #[cfg(feature = "train")]
    pub(crate) fn all_gather_object(&self, mine: Vec<u8>) -> Result<Gathered> {
        self.backends.host().all_gather_object(mine)
    }

    /// Starts an all-reduce of `data`; [`Work::wait`] returns the reduced buffer, identical on
    /// every rank. Every rank must pass a buffer of the same length and type: a `Vec` of a
    /// [`crate::Reduce`] element type, or (feature `train`) a flat float `Tensor<1>` on any burn
    /// device (NCCL for CUDA with feature `nccl`, host staging for the others).
    pub fn all_reduce<B: Reducible>(&self, data: B, op: ReduceOp) -> Work<B> {
        self.all_reduces.fetch_add(1, Ordering::Relaxed);
        data.start_all_reduce(&self.backends, op)
    }

    /// Starts a reduce-scatter of `data` (PyTorch's `reduce_scatter_tensor`): the ranks' buffers
    /// are reduced element-wise as by [`Self::all_reduce`], and rank `r` gets the `r`-th of
    /// `world_size` equal parts of the result, which [`Work::wait`] returns. Each part has
    /// exactly the bits of the same slice of an all-reduce of the same buffers (on the host
    /// transports; NCCL makes no such promise between its own algorithms). Every rank must pass
    /// a buffer of the same type and length, a multiple of the world size (pad it; any other
    /// length is an [`DdpError::InvalidArgument`] on every rank, and nothing is sent). Parts of
    /// other lengths: [`Self::reduce_scatter_parts`].
    ///
    /// ```no_run
    /// # fn main() -> burn_ddp::Result<()> {
    /// # let group = burn_ddp::ProcessGroup::from_env()?;
    /// let world = group.world_size();
    /// let grads = vec![1.0f32; 4 * world];
    /// let mine = group.reduce_scatter(grads, burn_ddp::ReduceOp::Sum).wait()?;
    /// assert_eq!(mine, vec![world as f32; 4]);
    /// # Ok(())
    /// # }
    /// ```
    pub fn reduce_scatter<B: Reducible>(&self, data: B, op: ReduceOp) -> Work<B> {
        let (len, world) = (data.elements(), self.world_size);
        if !len.is_multiple_of(world) {
            let reason = format!(
                "{len} elements do not cut into {world} equal parts: pad the buffer to a \
                 multiple of the world size, or give the parts (reduce_scatter_parts)"
            );
            let op = "reduce_scatter".to_string();
            let rank = self.rank;
            return Work::done(rank, Err(DdpError::InvalidArgument { rank, op, reason }));
        }
        self.reduce_scatter_parts(data, &vec![len / world; world], op)
    }

    /// Starts a reduce-scatter in which rank `r` gets `parts[r]` elements (MPI's
    /// `MPI_Reduce_scatter`): the parts, the same list on every rank, cut the buffer in rank
    /// order and must sum to its length. On CUDA (NCCL) unequal parts travel padded to the
    /// longest.
    pub fn reduce_scatter_parts<B: Reducible>(
        &self,
        data: B,
        parts: &[usize],
        op: ReduceOp,
    ) -> Work<B> {
        data.start_reduce_scatter(&self.backends, parts.to_vec(), op)
    }

    /// Starts an all-gather of flat tensors of the lengths `parts` (rank `r`'s has `parts[r]`
    /// elements; the same list on every rank): every rank's, concatenated in rank order (MPI's
    /// `MPI_Allgatherv`). The sharded optimizer's way back from [`Self::reduce_scatter_parts`].
    #[cfg(feature = "train")]
    pub(crate) fn all_gather_parts(
        &self,
        tensor: burn::tensor::Tensor<1>,
        parts: &[usize],
    ) -> Work<burn::tensor::Tensor<1>> {
        use crate::collectives::backend::{Request, one};
        (self.backends).start_tensor(tensor, Request::AllGatherParts(parts.to_vec()), one)
    }

    /// Starts a broadcast: every rank's buffer (a `Vec` or a `Tensor<1>`) becomes `root`'s.
    /// Lengths must match.
    pub fn broadcast<B: Broadcastable>(&self, data: B, root: usize) -> Work<B> {
        data.start_broadcast(&self.backends, root)
    }

    /// Starts an all-gather; the result is indexed by rank. Byte buffers (`Vec<u8>`) may differ
    /// in length between ranks; tensors (`Tensor<1>`) must not.
    pub fn all_gather<B: Gatherable>(&self, data: B) -> Work<B::Gathered> {
        data.start_all_gather(&self.backends)
    }

    /// Starts a barrier: completes once every rank has reached it.
    pub fn barrier(&self) -> Work<()> {
        if self.world_size == 1 {
            return Work::done(self.rank, Ok(()));
        }
        self.backends.host().submit(|t| t.barrier())
    }
}

impl ProcessGroup {
    /// Stops the group on every rank for `reason` (for failures found above the collectives,
    /// such as ranks reducing different steps): the reason becomes the group's recorded failure
    /// unless another was recorded first, this rank's connections close, and the peers' next
    /// collectives fail with it. Returns the agreed cause.
    pub fn abort(&self, reason: impl std::fmt::Display) -> String {
        let record = FailureRecord {
            culprit: None,
            cause: reason.to_string(),
        };
        // The reason is recorded before the device communicators are aborted, so that a
        // collective the abort stops reports it rather than the abort.
        let _ = record.clone().agree(&self.store);
        let cause = self
            .backends
            .abort(record)
            .unwrap_or_else(|e| e.to_string());
        crate::elastic::record_error_with(|| {
            format!(
                "rank {}: stopped the group: {cause}; where the ranks were: {}",
                self.rank,
                self.status.report()
            )
        });
        cause
    }

    /// The group's recorded failure, if any rank recorded one (read from the store).
    pub fn recorded_failure(&self) -> Option<String> {
        FailureRecord::read(&self.store).map(|r| r.cause)
    }
}

impl Drop for ProcessGroup {
    /// Dropped while the thread panics, the group is aborted, and the peers learn that this
    /// rank panicked and where. Then (dropping the fields) queued collectives finish, each
    /// bounded by the timeout, the peers are told this rank leaves, and the store stops if this
    /// rank serves it.
    fn drop(&mut self) {
        if std::thread::panicking() && self.world_size > 1 {
            let record = FailureRecord {
                culprit: Some(self.rank),
                cause: format!(
                    "rank {} panicked while {}",
                    self.rank,
                    self.status.current()
                ),
            };
            crate::elastic::record_error(&record.cause);
            self.backends.abort_later(record);
        }
    }
}

/// Runs `f` on `n` ranks, threads of this process over loopback TCP, with `options` and a store
/// served here; the results in rank order (the unit tests' world; the integration tests have
/// their own in `tests/integration/common.rs`).
#[cfg(test)]
pub(crate) fn thread_world<T: Send>(
    n: usize,
    options: crate::GroupOptions,
    f: impl Fn(usize, ProcessGroup) -> T + Sync,
) -> Vec<T> {
    let server = crate::store::StoreServer::bind("127.0.0.1:0").expect("a store on loopback");
    let port = server.local_addr().port();
    std::thread::scope(|s| {
        let ranks: Vec<_> = (0..n)
            .map(|rank| {
                let (f, options) = (&f, options.clone());
                s.spawn(move || {
                    let group = ProcessGroup::builder(rank, n)
                        .master_addr("127.0.0.1")
                        .master_port(port)
                        .host_store(false)
                        .options(options)
                        .build()
                        .unwrap_or_else(|e| panic!("rank {rank} could not join: {e}"));
                    f(rank, group)
                })
            })
            .collect();
        ranks.into_iter().map(|r| r.join().unwrap()).collect()
    })
}

impl crate::signals::StopSignals {
    /// [`StopSignals::arm`](crate::signals::StopSignals::arm) for a training loop over `group`,
    /// with its rank and collective timeout; the time the group's status shows
    /// [`Phase::Checkpointing`](crate::status::Phase::Checkpointing) does not count toward the
    /// timeout, as a checkpoint of a large model may take longer than a step (every wait there
    /// is bounded by the collectives' timeout but writing the file; a rank that hangs writing it
    /// is left to the launcher's grace, or the cluster's, after the signal).
    pub fn arm_for(group: &Arc<ProcessGroup>) -> Result<Self> {
        let weak = Arc::downgrade(group);
        let busy = move || {
            weak.upgrade()
                .is_some_and(|g| g.status().current().phase == crate::status::Phase::Checkpointing)
        };
        let timeout = group.options().timeout;
        Self::arm_busy(group.rank(), timeout, Some(Box::new(busy)))
            .map_err(|e| DdpError::io("arming the stop signals", e))
    }
}

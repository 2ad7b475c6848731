//! One training step of the wrapped blocks on this thread: which blocks the forward pass
//! gathered (a block gathered twice is an error), the reductions their backward started, and
//! the point where they are all waited for (the last wrapped block's backward). Also the
//! counters of [`stats`].

use std::cell::RefCell;
use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use burn::backend::autodiff::NodeId;
use burn::tensor::Tensor;

use super::{ShardingStrategy, Shared};
use crate::error::Result;
use crate::{ProcessGroup, ReduceOp, Work};

/// Reductions of sharded blocks in flight at once: more waits for the oldest first, so at most
/// this many blocks' whole gradients wait for the wire.
const IN_FLIGHT: usize = 2;

/// A block's reduction, started in backward.
struct Pending {
    block: Arc<Shared>,
    /// The shard's autodiff node, which receives the result.
    node: NodeId,
    work: Work<Tensor<1>>,
}

/// A block a tracked forward pass gathered.
struct Gathered {
    /// The block's address (its `Arc<Shared>`).
    key: usize,
    /// The block and its shard, when backward may gather it ahead of its need
    /// ([`ShardingStrategy::FullShard`] with backward prefetch).
    ahead: Option<(Arc<Shared>, Tensor<1>)>,
}

/// This thread's step.
#[derive(Default)]
struct Step {
    /// The blocks gathered by tracked forward passes since the last flush, in order.
    gathered: Vec<Gathered>,
    /// The blocks whose backward ran (by address).
    backward_ran: Vec<usize>,
    /// The gather backward started ahead for a block (by address), not yet taken.
    prefetched: Option<(usize, Work<Tensor<1>>)>,
    /// Backward steps of those run so far.
    backward_done: usize,
    in_flight: VecDeque<Pending>,
    /// Finished reductions, waiting to be handed over at the flush.
    ready: Vec<(NodeId, Tensor<1>, Arc<Shared>)>,
    /// The blocks gathered again in backward whose own backward has not run yet (by address).
    regathered: Vec<usize>,
}

thread_local! {
    static STEP: RefCell<Step> = RefCell::default();
}

/// How [`Step`] tells blocks apart: the address of what every copy of a block shares.
fn key(block: &Arc<Shared>) -> usize {
    Arc::as_ptr(block) as usize
}

/// A tracked forward pass gathered `block`; `ahead` is its shard (no autodiff) when backward
/// may gather it ahead of its need (its input has a gradient, see [`ahead_of`]).
pub(super) fn forward(block: &Arc<Shared>, ahead: Option<Tensor<1>>) -> Result<()> {
    let key = key(block);
    STEP.with(|s| {
        let mut s = s.borrow_mut();
        if s.gathered.iter().any(|g| g.key == key) {
            return Err(block.error(
                "the block ran a second time before backward went through it: call each \
                 wrapped block once per forward pass (wrap a block used twice once per use, or \
                 leave it unwrapped), and back-propagate every forward pass on an autodiff \
                 device (a block whose output does not reach the loss never hands over its \
                 gradient)",
            ));
        }
        if s.backward_done > 0 {
            return Err(block.error(format!(
                "a forward pass started while backward had gone through only {} of the {} \
                 wrapped blocks of the last one: some block's output did not reach the loss",
                s.backward_done,
                s.gathered.len()
            )));
        }
        let ahead = ahead
            .filter(|_| block.strategy == ShardingStrategy::FullShard && block.backward_prefetch)
            .map(|shard| (block.clone(), shard));
        s.gathered.push(Gathered { key, ahead });
        Ok(())
    })
}

/// The gather backward started ahead for `block`, if any (taken: the caller waits for it).
pub(super) fn take_prefetched(block: &Arc<Shared>) -> Option<Work<Tensor<1>>> {
    let key = key(block);
    STEP.with(|s| {
        let mut s = s.borrow_mut();
        match &s.prefetched {
            Some((k, _)) if *k == key => s.prefetched.take().map(|(_, work)| work),
            _ => None,
        }
    })
}

/// The block backward reaches after `block` (the one before it in the forward pass) and its
/// shard, when it is to be gathered ahead: it allows it, its backward has not run, it is not
/// gathered again already, and no other gather ahead is waiting.
pub(super) fn ahead_of(block: &Arc<Shared>) -> Option<(Arc<Shared>, Tensor<1>)> {
    let key = key(block);
    STEP.with(|s| {
        let s = s.borrow();
        let at = s.gathered.iter().position(|g| g.key == key)?;
        let before = s.gathered.get(at.checked_sub(1)?)?;
        let free = s.prefetched.is_none()
            && !s.backward_ran.contains(&before.key)
            && !s.regathered.contains(&before.key);
        before.ahead.clone().filter(|_| free)
    })
}

/// Backward started gathering `block` ahead of its need (`work`).
pub(super) fn prefetched(block: &Arc<Shared>, work: Work<Tensor<1>>) {
    let key = key(block);
    STEP.with(|s| s.borrow_mut().prefetched = Some((key, work)));
    count(|s| s.backward_prefetches += 1);
}

/// The backward step of `block`'s gather, with its whole gradient `grad`: starts its reduction
/// into the shard (node `shard`, `None` when the block is frozen) and, at the last wrapped
/// block of the step, waits for them all. Returns the shards' gradients to register.
pub(super) fn backward(
    block: &Arc<Shared>,
    shard: Option<NodeId>,
    grad: Tensor<1>,
) -> Result<Vec<(NodeId, Tensor<1>, Arc<Shared>)>> {
    let key = key(block);
    STEP.with(|s| {
        let mut s = s.borrow_mut();
        s.regathered.retain(|k| *k != key);
        s.backward_ran.push(key);
        // A gather ahead that backward did not need (burn kept the block's parameters): the
        // collective runs on (every rank started it), its result is dropped.
        if s.prefetched.as_ref().is_some_and(|(k, _)| *k == key) {
            s.prefetched = None;
        }
    });
    if let Some(node) = shard {
        let work = start_reduce(block, grad.inner());
        let oldest = STEP.with(|s| {
            let mut s = s.borrow_mut();
            s.in_flight.push_back(Pending {
                block: block.clone(),
                node,
                work,
            });
            // Only sharded blocks count: with `NoShard` the whole gradients are the result
            // anyway (as DDP's buckets), so backward never waits for their wire before its end.
            let sharded = |p: &Pending| p.block.strategy.shards();
            match s.in_flight.iter().filter(|p| sharded(p)).count() > IN_FLIGHT {
                true => (s.in_flight.iter().position(sharded)).and_then(|i| s.in_flight.remove(i)),
                false => None,
            }
        });
        if let Some(p) = oldest {
            let done = restored(&p.block, wait_exposed(p.work, Wait::Reduce)?);
            STEP.with(|s| s.borrow_mut().ready.push((p.node, done, p.block)));
        }
    }
    let last = STEP.with(|s| {
        let mut s = s.borrow_mut();
        s.backward_done += 1;
        s.backward_done >= s.gathered.len()
    });
    if !last {
        return Ok(Vec::new());
    }
    let (in_flight, mut ready) = STEP.with(|s| {
        let mut s = s.borrow_mut();
        let taken = (
            std::mem::take(&mut s.in_flight),
            std::mem::take(&mut s.ready),
        );
        *s = Step::default();
        taken
    });
    for p in in_flight {
        ready.push((
            p.node,
            restored(&p.block, wait_exposed(p.work, Wait::Reduce)?),
            p.block,
        ));
    }
    Ok(ready)
}

/// Starts the reduction of a block's whole gradient (no autodiff) into this rank's shard: a
/// reduce-scatter, or with `NoShard` an all-reduce, averaging over the ranks.
fn start_reduce(block: &Shared, grad: Tensor<1>) -> Work<Tensor<1>> {
    let group = &block.group;
    if group.world_size() == 1 {
        let shard = grad.narrow(0, 0, block.shard_len.min(block.gathered_len()));
        return Work::done(group.rank(), Ok(shard));
    }
    count(|s| {
        s.reduces += 1;
        s.elements_reduced += block.gathered_len() as u64;
    });
    // In a narrower type, divided by the world size before it travels and summed: a sum of f16
    // values could pass f16's range where their average does not.
    let (grad, op) = match block.reduce_dtype {
        Some(dtype) => {
            let world = group.world_size() as f32;
            (grad.div_scalar(world).cast(dtype), ReduceOp::Sum)
        }
        None => (grad, ReduceOp::Avg),
    };
    match block.strategy.shards() {
        true => group.reduce_scatter(grad, op),
        false => group.all_reduce(grad, op),
    }
}

/// A block's reduced gradient `done` in the parameters' element type again.
fn restored(block: &Shared, done: Tensor<1>) -> Tensor<1> {
    match block.reduce_dtype {
        Some(_) => done.cast(block.layout.dtype),
        None => done,
    }
}

/// What the training thread waits for inside the wrapped blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Wait {
    /// A block's parameters (a gather in forward, or again in backward).
    Gather,
    /// A block's gradient (its reduce-scatter or all-reduce).
    Reduce,
}

impl Wait {
    /// The wait's name in traces.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Wait::Gather => "fsdp: waiting for a gather",
            Wait::Reduce => "fsdp: waiting for a reduction",
        }
    }
}

/// One wait of the training thread: what for, from when to when.
pub(crate) type Waited = (Wait, Instant, Instant);

thread_local! {
    /// The waits recorded on this thread, while [`recording_waits`] records them.
    static WAITS: RefCell<Option<Vec<Waited>>> = const { RefCell::new(None) };
}

/// Runs `f` recording each wait inside the wrapped blocks on this thread (for a trace): its
/// result and the waits.
pub(crate) fn recording_waits<T>(f: impl FnOnce() -> T) -> (T, Vec<Waited>) {
    struct Stop;
    impl Drop for Stop {
        fn drop(&mut self) {
            WAITS.with(|w| w.borrow_mut().take());
        }
    }
    WAITS.with(|w| *w.borrow_mut() = Some(Vec::new()));
    let stop = Stop;
    let out = f();
    let waits = WAITS.with(|w| w.borrow_mut().take()).unwrap_or_default();
    drop(stop);
    (out, waits)
}

/// Waits for `work`, counting the time as communication the step waited for (and recording
/// it, while [`recording_waits`] does).
pub(super) fn wait_exposed<T: Send + 'static>(work: Work<T>, what: Wait) -> Result<T> {
    let start = Instant::now();
    let out = work.wait();
    let end = Instant::now();
    count(|s| s.exposed += end - start);
    WAITS.with(|w| {
        if let Some(waits) = w.borrow_mut().as_mut() {
            waits.push((what, start, end));
        }
    });
    out
}

/// Backward gathered `block` again (its gather's retro-forward).
pub(super) fn regathered(block: &Arc<Shared>) {
    let key = key(block);
    let held = STEP.with(|s| {
        let mut s = s.borrow_mut();
        s.regathered.push(key);
        s.regathered.len() as u64
    });
    count(|s| s.most_regathered = s.most_regathered.max(held));
}

/// A gather of `elements` started.
pub(super) fn count_gather(elements: usize) {
    count(|s| {
        s.gathers += 1;
        s.elements_gathered += elements as u64;
    });
}

thread_local! {
    static STATS: RefCell<FsdpStats> = RefCell::default();
}

/// Adds to this thread's counters.
fn count(f: impl FnOnce(&mut FsdpStats)) {
    STATS.with(|s| f(&mut s.borrow_mut()));
}

/// What the wrapped blocks run by this thread (the training thread) have done since it started
/// (counters only grow: subtract two readings for a span).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FsdpStats {
    /// Time the training thread waited for gathers and reductions (communication not hidden
    /// behind computation).
    pub exposed: Duration,
    /// Gathers of a block's parameters started (forward, prefetch, and again in backward).
    pub gathers: u64,
    /// Of those, the gathers backward started ahead of a block's need (with
    /// [`super::ShardingStrategy::FullShard`] under gradient checkpointing: the next block's
    /// gather while this one's backward computes, see [`super::FsdpConfig::backward_prefetch`]).
    pub backward_prefetches: u64,
    /// Reductions of a block's gradient started.
    pub reduces: u64,
    /// Elements of the gathered flat parameters (every rank's shard).
    pub elements_gathered: u64,
    /// Elements of the reduced gradients (before the scatter).
    pub elements_reduced: u64,
    /// With [`super::ShardingStrategy::FullShard`] on a device with gradient checkpointing: the
    /// most blocks gathered again in backward and waiting for their own backward at any one
    /// time, each holding its whole parameters. Backward needs 1 or 2 (burn's checkpointing
    /// gathers a block when the next one's backward recomputes its input from it). A
    /// high-water mark, not a counter: subtraction keeps the later reading's.
    pub most_regathered: u64,
}

impl std::ops::Sub for FsdpStats {
    type Output = FsdpStats;
    fn sub(self, rhs: FsdpStats) -> FsdpStats {
        FsdpStats {
            exposed: self.exposed.saturating_sub(rhs.exposed),
            gathers: self.gathers - rhs.gathers,
            backward_prefetches: self.backward_prefetches - rhs.backward_prefetches,
            reduces: self.reduces - rhs.reduces,
            elements_gathered: self.elements_gathered - rhs.elements_gathered,
            elements_reduced: self.elements_reduced - rhs.elements_reduced,
            most_regathered: self.most_regathered,
        }
    }
}

/// The counters of the wrapped blocks this thread ran (forward, backward and their waits).
///
/// ```
/// let before = burn_ddp::fsdp::stats();
/// assert_eq!((burn_ddp::fsdp::stats() - before).gathers, 0);
/// ```
pub fn stats() -> FsdpStats {
    STATS.with(|s| *s.borrow())
}

/// The index of the next block wrapped with `group` in this process (0, 1, ...).
pub(super) fn next_block_index(group: &ProcessGroup) -> usize {
    group.fsdp_blocks.fetch_add(1, Ordering::Relaxed)
}

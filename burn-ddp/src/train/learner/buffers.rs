//! Buffers: the float state of a model that receives no gradient (BatchNorm's running mean and
//! variance, and the like). Gradient averaging leaves them as each rank's own batches made them,
//! so without help every replica validates and saves a different model. [`BufferSync`] chooses
//! how they are kept identical; the periodic [replica check](check_replicas) proves it.
//!
//! burn keeps a `RunningState`'s updates per thread until something merges them (its
//! `value_sync`, or `Module::valid`); the model's clones share that state. So the buffers are
//! merged first, then read in visit order, and what the ranks agreed on is written back through a
//! mapper over a clone of the learner's model: the clone's running states are the learner's.

use std::sync::Arc;

use burn::module::Module;
use burn::tensor::Tensor;

use crate::ProcessGroup;
use crate::collectives::{ReduceOp, Work};
use crate::error::{DdpError, Result};
use crate::status::name_ranks;
use crate::train::learner::checkpoint::checksum;
use crate::train::reducer::params::{Assign, Flatten, Select, flat_values, layout};
use crate::wire::Writer;

/// How `DdpLearner` keeps buffers (float state without gradient, such as BatchNorm's running
/// statistics) identical across ranks.
///
/// ```
/// # use burn::train::LearnerModel;
/// use burn_ddp::train::{BufferSync, DdpLearner};
/// # fn configure<M: LearnerModel>(learner: DdpLearner<M>) -> DdpLearner<M> {
/// let learner = learner.buffer_sync(BufferSync::Average);
/// # learner }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BufferSync {
    /// Rank 0's buffers replace every rank's at each optimizer step, in one broadcast that
    /// travels while the gradients are reduced (PyTorch DDP's `broadcast_buffers=True`). The
    /// replicas stay bit-identical after every step.
    #[default]
    Broadcast,
    /// Each rank keeps its own during the epoch; they are averaged across ranks at the end of
    /// each training epoch (so before validation) and before each checkpoint. One all-reduce
    /// per epoch instead of one broadcast per step.
    Average,
    /// Never synchronised: each rank validates with its own; checkpoints hold rank 0's.
    Off,
}

impl std::fmt::Display for BufferSync {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            BufferSync::Broadcast => "broadcast",
            BufferSync::Average => "average",
            BufferSync::Off => "off",
        })
    }
}

/// Applies a [`BufferSync`] to a model in a process group.
pub(crate) struct Buffers {
    mode: BufferSync,
    group: Arc<ProcessGroup>,
    /// Whether the model has buffers at all (and more than one rank shares them).
    active: bool,
}

/// Rank 0's buffers on their way (see [`Buffers::start_step`]).
pub(crate) struct PendingBuffers(Work<Tensor<1>>);

impl PendingBuffers {
    /// Writes rank 0's buffers into `model` (a clone of the learner's: they share the running
    /// states).
    pub(crate) fn finish<M: Module>(self, model: M) -> Result<()> {
        Assign::module(model, Select::Buffers, self.0.wait()?);
        Ok(())
    }
}

impl Buffers {
    /// Buffer synchronisation for `model` (on its training device) in `group`.
    pub(crate) fn new<M: Module>(mode: BufferSync, group: Arc<ProcessGroup>, model: &M) -> Self {
        let has_buffers = layout(model).iter().any(|p| !p.trainable);
        let active = has_buffers && group.world_size() > 1 && mode != BufferSync::Off;
        Buffers {
            mode,
            group,
            active,
        }
    }

    /// At an optimizer step, after the forward passes updated the buffers: starts the
    /// broadcast of rank 0's ([`BufferSync::Broadcast`]; nothing otherwise). Finish it before
    /// the next forward pass.
    pub(crate) fn start_step<M: Module>(&self, model: &M) -> Option<PendingBuffers> {
        if !self.active || self.mode != BufferSync::Broadcast {
            return None;
        }
        let flat = current(model)?;
        Some(PendingBuffers(self.group.broadcast(flat, 0)))
    }

    /// At the end of a training epoch and before a checkpoint: merges the buffers' pending
    /// updates (so that records hold the last one) and averages them across ranks
    /// ([`BufferSync::Average`]; broadcast buffers already agree, others stay apart).
    pub(crate) fn settle<M: Module>(&self, model: &M) -> Result<()> {
        merge_updates(model);
        if !self.active || self.mode != BufferSync::Average {
            return Ok(());
        }
        if let Some(flat) = current(model) {
            let mean = self.group.all_reduce(flat, ReduceOp::Avg).wait()?;
            Assign::module(model.clone(), Select::Buffers, mean);
        }
        Ok(())
    }

    /// Checks that every rank holds the same model: parameters, and buffers unless they are
    /// not synchronised. `when` says at which point of training, for the error.
    pub(crate) fn check_replicas<M: Module>(&self, model: &M, when: &str) -> Result<()> {
        let select = if self.mode == BufferSync::Off {
            Select::Parameters
        } else {
            Select::All
        };
        merge_updates(model);
        // Shards differ between ranks by design: the replicas are the rest.
        let values = crate::fsdp::replicated(|| flat_values(model, select));
        check_replicas(&self.group, &values, when)
    }
}

/// Merges the running states' pending per-thread updates into their shared values (see the
/// module's documentation): `Module::valid` does it on the states the model's clones share.
fn merge_updates<M: Module>(model: &M) {
    let _ = model.valid();
}

/// The model's buffers now, flattened (`None` without buffers).
fn current<M: Module>(model: &M) -> Option<Tensor<1>> {
    merge_updates(model);
    Flatten::module(model, Select::Buffers)
}

/// The replica check: every rank's `values` (its model, flattened) hashed and gathered; a rank
/// whose hash differs from rank 0's is a disagreement naming it. Costs one read of the model
/// to the host and an all-gather of 8 bytes per rank.
pub(crate) fn check_replicas(group: &ProcessGroup, values: &[f32], when: &str) -> Result<()> {
    if group.world_size() == 1 {
        return Ok(());
    }
    let hash = Writer::default()
        .u64(checksum(bytemuck::cast_slice(values)))
        .buf
        .clone();
    let differ = group.all_gather_object(hash)?.differing();
    if differ.is_empty() {
        return Ok(());
    }
    Err(DdpError::Disagreement(format!(
        "the replicas diverged {when}: {} hold(s) another model than rank 0 \
         (parameters or buffers differ); a rank changed its model outside the optimizer step, \
         or the ranks synchronise buffers differently",
        name_ranks(&differ)
    )))
}

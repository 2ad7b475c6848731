//! burn-train's own checkpointer (`SupervisedTraining::with_default_checkpointers` or
//! `with_custom_checkpointers`) in a `DdpLearner` run. It saves the optimizer record of the
//! rank it runs on (rank 0): in a sharded run that is rank 0's share only, and resuming from it
//! would silently reset the other ranks' state. As PyTorch's `ZeroRedundancyOptimizer`
//! refuses `state_dict()` of an unconsolidated state, the combination is refused before
//! training; burn-ddp's own checkpoints ([`CheckpointConfig`](crate::train::learner::checkpoint::CheckpointConfig)) hold
//! the whole state.

use crate::ProcessGroup;
use crate::error::{DdpError, Result};
use crate::wire::Writer;

/// Refuses burn-train's checkpointer in a `sharded` run, on every rank alike if any rank
/// `has_checkpointer`; a run without sharding keeps it (nothing is exchanged then: whether a
/// run is sharded is agreed at start).
pub(crate) fn refuse_in_sharded_run(
    group: &ProcessGroup,
    sharded: bool,
    has_checkpointer: bool,
) -> Result<()> {
    if !sharded {
        return Ok(());
    }
    let said =
        group.all_gather_object(Writer::default().u8(has_checkpointer.into()).buf.clone())?;
    let flags = said.decode_each("whether burn-train checkpoints", |r| r.u8())?;
    let ranks: Vec<usize> = (flags.iter().enumerate())
        .filter(|(_, f)| **f != 0)
        .map(|(r, _)| r)
        .collect();
    if ranks.is_empty() {
        return Ok(());
    }
    Err(DdpError::InvalidConfig(format!(
        "rank {}: burn-train's own checkpointer (SupervisedTraining::with_default_checkpointers \
         or with_custom_checkpointers) is set on rank(s) {ranks:?}, but this run shards the \
         optimizer (DdpLearner::shard_optimizer): it would save only rank 0's share of the \
         optimizer state, and resuming from it would reset the other ranks' share. Remove it \
         and use burn-ddp's checkpoints, DdpLearner::checkpoints(CheckpointConfig::new(dir)), \
         which hold the whole state and resume at any world size (checked before training)",
        group.rank()
    )))
}

//! The training state on disk: checkpoints written (by rank 0, agreed by all), the resume at
//! start, and the checkpoint and error of a stop by signal.

use burn::module::Module;
use burn::train::metric::store::EventStoreClient;
use burn::train::{Learner, LearnerModel};

use crate::error::{DdpError, Result};
use crate::status::Phase;
use crate::train::learner::checkpoint::{self, Position, Snapshot};
use crate::train::learner::strategy::DdpStrategy;

impl DdpStrategy {
    /// Refuses checkpoints (burn-ddp's or burn-train's) of a model with wrapped blocks
    /// ([`crate::fsdp`]): each rank holds another shard of their parameters and optimizer state,
    /// which neither writes yet. `fsdp::full_record` saves the whole model instead.
    pub(super) fn refuse_checkpoints_of_blocks<M: Module>(
        &self,
        model: &M,
        burn_checkpointer: bool,
    ) -> Result<()> {
        let Some(block) = crate::fsdp::first_block(model) else {
            return Ok(());
        };
        let which = match (self.checkpoints.is_some(), burn_checkpointer) {
            (true, _) => "DdpLearner::checkpoints",
            (false, true) => "burn-train's own checkpointer",
            (false, false) => return Ok(()),
        };
        Err(DdpError::Fsdp {
            rank: self.group.rank(),
            block,
            reason: format!(
                "{which} is set, but checkpoints of a model with wrapped blocks are not written \
                 yet (each rank holds another shard of their parameters and optimizer state): \
                 remove it, and save the whole model with burn_ddp::fsdp::full_record (rank 0 \
                 gets the unwrapped model's record; load it at any world size with \
                 fsdp::load_full_record)"
            ),
        })
    }

    /// Writes a checkpoint (rank 0) at `at`; every rank learns whether it worked.
    pub(super) fn checkpoint<M: LearnerModel>(
        &self,
        learner: &Learner<M>,
        at: Position,
        events: &EventStoreClient,
    ) -> Result<()> {
        let Some(config) = &self.checkpoints else {
            return Ok(());
        };
        self.buffers.settle(&learner.model())?;
        let status = self.group.status();
        let phase = status.current().phase;
        status.enter(Phase::Checkpointing, Some(at.epoch));
        if at.batches > 0 {
            status.step(at.batches);
        }
        let timeout = self.group.options().timeout;
        let snapshot = if self.reducer.shards() {
            // Each rank holds the state of its own parameters: rank 0 gathers and merges them.
            checkpoint::gather::take_merged(&self.group, learner, at, events, timeout)?
        } else {
            self.is_main()
                .then(|| Snapshot::take(learner, at, events, timeout))
        };
        checkpoint::save(&self.group, config, snapshot)?;
        status.enter(phase, Some(at.epoch));
        Ok(())
    }

    /// At the end of training: this rank's optimizer state counted, if the telemetry asks for
    /// it (a failure to count is logged, not an error of training).
    pub(super) fn count_optimizer_state<M: LearnerModel>(
        &self,
        learner: &Learner<M>,
        events: &EventStoreClient,
    ) {
        if !self.telemetry.counts_optimizer_state() {
            return;
        }
        let timeout = self.group.options().timeout;
        let counted = Snapshot::take(learner, Position::default(), events, timeout)
            .and_then(|s| checkpoint::optimizer_records::state_bytes(s.optim()));
        match counted {
            Ok(bytes) => self.telemetry.set_optimizer_state(bytes),
            Err(e) => log::warn!(
                "rank {}: counting the optimizer state: {e}",
                self.group.rank()
            ),
        }
    }

    /// After the ranks agreed to stop for `signal`: the checkpoint at `at` (if configured), and
    /// the error that ends training (or the checkpoint's failure).
    pub(super) fn stopped<M: LearnerModel>(
        &self,
        learner: &Learner<M>,
        at: Position,
        signal: i32,
        events: &EventStoreClient,
    ) -> DdpError {
        match self.checkpoint(learner, at, events) {
            Ok(()) => {
                let path = self.checkpoints.as_ref().map(|c| c.path());
                self.stopped_error(at, signal, path)
            }
            Err(e) => e,
        }
    }

    pub(super) fn stopped_error(
        &self,
        at: Position,
        signal: i32,
        checkpoint: Option<std::path::PathBuf>,
    ) -> DdpError {
        self.group.status().enter(Phase::Finished, None);
        DdpError::Stopped {
            rank: self.group.rank(),
            signal,
            epoch: at.epoch,
            step: at.batches,
            checkpoint,
        }
    }

    /// Loads the checkpoint, if configured and present: where to continue from.
    pub(super) fn resume<M: LearnerModel>(
        &self,
        learner: &mut Learner<M>,
    ) -> Result<Option<Position>> {
        let Some(config) = &self.checkpoints else {
            return Ok(None);
        };
        self.group.status().enter(Phase::Resuming, None);
        let Some(snapshot) = checkpoint::load(&self.group, config)? else {
            return Ok(None);
        };
        snapshot
            .restore(learner, |model| self.reducer.owned_ids(model))
            .map_err(|e| DdpError::Checkpoint {
                rank: self.group.rank(),
                reason: e.to_string(),
            })?;
        let p = snapshot.position;
        if self.is_main() {
            log::info!(
                "resuming from {}: epoch {}, after {} batches ({} samples) written by {} ranks",
                config.path().display(),
                p.epoch,
                p.batches,
                p.samples,
                p.world_size
            );
            if p.world_size != self.group.world_size() {
                log::warn!(
                    "the checkpoint was written by {} ranks, this job has {}: epoch {} continues \
                     with the samples not seen yet, and the global batch changes",
                    p.world_size,
                    self.group.world_size(),
                    p.epoch
                );
            }
        }
        Ok(Some(p))
    }
}

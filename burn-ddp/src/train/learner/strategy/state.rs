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
    /// Refuses burn-train's own checkpointer with a model with wrapped blocks
    /// ([`crate::fsdp`]): it would save rank 0's shards of their parameters and optimizer
    /// state. [`DdpLearner::checkpoints`](crate::train::DdpLearner::checkpoints) saves the whole
    /// model instead.
    pub(super) fn refuse_checkpoints_of_blocks<M: Module>(
        &self,
        model: &M,
        burn_checkpointer: bool,
    ) -> Result<()> {
        let Some(block) = crate::fsdp::first_block(model).filter(|_| burn_checkpointer) else {
            return Ok(());
        };
        Err(DdpError::Fsdp {
            rank: self.group.rank(),
            block,
            reason: "burn-train's own checkpointer is set, but it would save rank 0's shards \
                     of the wrapped blocks only: remove it and use DdpLearner::checkpoints, \
                     which saves the whole model and its optimizer state (or save the model \
                     with burn_ddp::fsdp::full_record)"
                .into(),
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
        let take = || Snapshot::take(learner, at, events, timeout);
        let model = learner.model();
        let mine = match crate::fsdp::first_block(&model) {
            // Every rank takes part: the blocks' parameters and optimizer state are gathered.
            Some(_) => Some(self.take_whole(&model, take)?),
            None if self.reducer.shards() => Some(take()),
            None => self.is_main().then(take),
        };
        let snapshot = match (self.reducer.shards(), mine) {
            // Each rank holds the state of its own parameters: rank 0 gathers and merges them.
            (true, Some(mine)) => checkpoint::gather::take_merged(&self.group, learner, mine)?,
            (_, mine) => mine.filter(|_| self.is_main()),
        };
        checkpoint::save(&self.group, config, snapshot)?;
        status.enter(phase, Some(at.epoch));
        Ok(())
    }

    /// This rank's state for a checkpoint of a model with wrapped blocks (a collective): the
    /// whole model's record on rank 0, and the optimizer's record with the blocks' state
    /// whole on rank 0 and left out on the others (which keep their other entries, for the
    /// sharded optimizer's merge).
    fn take_whole<M: Module>(
        &self,
        model: &M,
        take: impl FnOnce() -> std::result::Result<Snapshot, checkpoint::SnapshotError>,
    ) -> Result<std::result::Result<Snapshot, checkpoint::SnapshotError>> {
        let mine = crate::fsdp::saving_whole(&self.group, take)?;
        let record = mine
            .as_ref()
            .map(Snapshot::optim)
            .map_err(|e| e.to_string());
        let optim = crate::fsdp::whole_state(model, &self.group, record, self.is_main())?;
        // A failure of this rank alone goes into its snapshot: the outcome is still exchanged.
        Ok(mine.and_then(|s| match optim {
            Ok(optim) => Ok(s.with_optim(optim)),
            Err(e) => Err(checkpoint::SnapshotError::Encode(e)),
        }))
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
        let p = snapshot.position;
        snapshot
            .restore(learner, |model| {
                // The shards' entries are this rank's own, whatever the optimizer owns.
                let mut ids = self.reducer.owned_ids(model)?;
                ids.extend(crate::fsdp::shard_ids(model));
                Some(ids)
            })
            .map_err(|e| DdpError::Checkpoint {
                rank: self.group.rank(),
                reason: e.to_string(),
            })?;
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

//! Taking a learner's state for a checkpoint. burn-train hands the optimizer and schedule
//! records only to a `LearningCheckpointer`, so one is built over an in-memory [`Part`] per
//! record, and the records are collected as its threads hand them over.

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use burn::train::checkpoint::{
    AsyncCheckpointer, Checkpoint, Checkpointer, CheckpointerError, CheckpointingAction,
    CheckpointingStrategy,
};
use burn::train::metric::store::EventStoreClient;
use burn::train::{Learner, LearnerModel, LearningCheckpointer};

use super::{Position, Snapshot, SnapshotError};

impl Snapshot {
    /// Takes the learner's state. burn-train hands the optimizer and schedule records only to a
    /// `LearningCheckpointer`, so one is built over an in-memory [`Part`] per record.
    pub(crate) fn take<M: LearnerModel>(
        learner: &Learner<M>,
        position: Position,
        events: &EventStoreClient,
        timeout: Duration,
    ) -> std::result::Result<Self, SnapshotError> {
        fn part<R: Checkpoint>(slot: usize, parts: &Arc<Parts>) -> AsyncCheckpointer<R> {
            AsyncCheckpointer::new(Part {
                slot,
                parts: parts.clone(),
            })
        }
        let parts = Arc::new(Parts::default());
        let mut checkpointer: LearningCheckpointer<M> = LearningCheckpointer::new(
            part(0, &parts),
            part(1, &parts),
            part(2, &parts),
            Box::new(SaveAlways),
        );
        checkpointer.checkpoint(learner, position.epoch, events);
        let [model, optim, scheduler] = parts.wait(timeout)?;
        Ok(Snapshot {
            position,
            model,
            optim,
            scheduler,
        })
    }
}

/// A record's bytes, or why it could not be encoded.
type Encoded = std::result::Result<Vec<u8>, SnapshotError>;

/// Records arriving from burn-train's checkpointer threads.
#[derive(Default)]
struct Parts {
    slots: Mutex<[Option<Encoded>; 3]>,
    ready: Condvar,
}

impl Parts {
    fn wait(&self, timeout: Duration) -> std::result::Result<[Vec<u8>; 3], SnapshotError> {
        let deadline = Instant::now() + timeout;
        let mut slots = crate::sync::lock(&self.slots);
        while slots.iter().any(Option::is_none) {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(SnapshotError::HandOver(timeout));
            }
            slots = crate::sync::wait_timeout(&self.ready, slots, left).0;
        }
        let mut out: [Vec<u8>; 3] = Default::default();
        for (o, s) in out.iter_mut().zip(slots.iter_mut()) {
            *o = s.take().unwrap_or_else(|| Ok(Vec::new()))?;
        }
        Ok(out)
    }
}

/// One record's in-memory checkpointer.
struct Part {
    slot: usize,
    parts: Arc<Parts>,
}

impl<R: Checkpoint> Checkpointer<R> for Part {
    fn save(&self, _epoch: usize, record: R) -> std::result::Result<(), CheckpointerError> {
        let bytes = record
            .checkpoint_into_bytes()
            .map(|b| b.to_vec())
            .map_err(|e| SnapshotError::Encode(e.to_string()));
        let mut slots = crate::sync::lock(&self.parts.slots);
        slots[self.slot] = Some(bytes);
        self.parts.ready.notify_all();
        Ok(())
    }

    fn delete(&self, _epoch: usize) -> std::result::Result<(), CheckpointerError> {
        Ok(())
    }

    fn restore(&self, _epoch: usize) -> std::result::Result<R, CheckpointerError> {
        Err(CheckpointerError::Unknown(
            "burn-ddp restores its checkpoints itself".into(),
        ))
    }
}

struct SaveAlways;

impl CheckpointingStrategy for SaveAlways {
    fn checkpointing(&mut self, _: usize, _: &EventStoreClient) -> Vec<CheckpointingAction> {
        vec![CheckpointingAction::Save]
    }
}

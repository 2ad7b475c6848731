//! Checkpoints of a data-parallel run and resuming from them.
//!
//! Rank 0 writes one file, `checkpoint.bddp` in the configured directory, holding the model, the
//! optimizer state, the learning-rate schedule and the position in the data (epoch, batches done
//! in it, samples of the epoch already seen by the whole job, world size). It is written to a
//! temporary file, flushed to disk and renamed over the previous one, so a run killed while
//! writing leaves the previous checkpoint whole. Every rank then learns whether the write
//! succeeded before training goes on.
//!
//! Resuming: rank 0 reads the file and broadcasts it, so other nodes need no shared file system;
//! every rank loads the three records and the data position. With the same world size the run
//! continues exactly as an uninterrupted one would (the sampler skips the batches already done).
//! With another world size the epoch continues with the samples the job has not yet seen, in the
//! same shuffled order, sharded over the new ranks; the global batch is then the per-rank batch
//! times the new world size, and learning-rate schedules count optimizer steps as before.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use burn::optim::OptimizerRecord;
use burn::optim::lr_scheduler::LrSchedulerRecord;
use burn::store::ModuleRecord;
use burn::tensor::Bytes;
use burn::train::checkpoint::{
    AsyncCheckpointer, Checkpoint, Checkpointer, CheckpointerError, CheckpointingAction,
    CheckpointingStrategy,
};
use burn::train::metric::store::EventStoreClient;
use burn::train::{Learner, LearnerModel, LearningCheckpointer};

use crate::ProcessGroup;
use crate::error::{DdpError, Result};
use crate::wire::{Reader, Writer};

/// File name of the checkpoint inside the directory.
pub const CHECKPOINT_FILE: &str = "checkpoint.bddp";
const MAGIC: &[u8; 8] = b"BDDPCKPT";
const VERSION: u32 = 1;

/// Where and how often [`DdpLearner`](super::DdpLearner) writes checkpoints.
///
/// ```
/// use burn_ddp::train::CheckpointConfig;
/// let config = CheckpointConfig::new("/tmp/run1").every(500).resume(true);
/// assert_eq!(config.every_steps, Some(500));
/// ```
#[derive(Debug, Clone)]
pub struct CheckpointConfig {
    /// Directory of the checkpoint file (rank 0 creates it).
    pub dir: PathBuf,
    /// Also write one every this many optimizer steps within an epoch (always at epoch ends).
    pub every_steps: Option<usize>,
    /// Start from the checkpoint in `dir` when there is one (default true).
    pub resume: bool,
}

impl CheckpointConfig {
    /// Checkpoints in `dir` at the end of every epoch; resumes from one found there.
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        CheckpointConfig {
            dir: dir.into(),
            every_steps: None,
            resume: true,
        }
    }

    /// Also every `steps` optimizer steps (0: only at epoch ends).
    pub fn every(mut self, steps: usize) -> Self {
        self.every_steps = (steps > 0).then_some(steps);
        self
    }

    /// Whether to resume from a checkpoint found in the directory.
    pub fn resume(mut self, resume: bool) -> Self {
        self.resume = resume;
        self
    }

    /// The checkpoint file.
    pub fn path(&self) -> PathBuf {
        self.dir.join(CHECKPOINT_FILE)
    }
}

/// Where training continues from: `epoch` (1-based), after `batches` of it, which together
/// with the other ranks' consumed the first `samples` of the epoch's order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Position {
    /// The epoch to continue (1-based).
    pub epoch: usize,
    /// Batches of that epoch each rank has done.
    pub batches: usize,
    /// Samples of that epoch's order the whole job has consumed.
    pub samples: usize,
    /// World size when the checkpoint was written.
    pub world_size: usize,
}

/// A checkpoint's contents.
pub(crate) struct Snapshot {
    pub position: Position,
    model: Vec<u8>,
    optim: Vec<u8>,
    scheduler: Vec<u8>,
}

/// FNV-1a over the file body, to tell a damaged file from a valid one.
fn checksum(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ *b as u64).wrapping_mul(0x100_0000_01b3)
    })
}

impl Snapshot {
    fn encode(&self) -> Vec<u8> {
        let p = &self.position;
        let mut w = Writer::default();
        w.buf.extend_from_slice(MAGIC);
        w.u32(VERSION)
            .u64(p.epoch as u64)
            .u64(p.batches as u64)
            .u64(p.samples as u64)
            .u64(p.world_size as u64)
            .bytes(&self.model)
            .bytes(&self.optim)
            .bytes(&self.scheduler);
        let sum = checksum(&w.buf);
        w.u64(sum);
        w.buf
    }

    fn decode(raw: &[u8]) -> std::result::Result<Self, String> {
        if raw.len() < MAGIC.len() + 12 || &raw[..MAGIC.len()] != MAGIC {
            return Err("not a burn-ddp checkpoint".into());
        }
        let (body, sum) = raw.split_at(raw.len() - 8);
        let mut tail = Reader::new(sum);
        if tail.u64()? != checksum(body) {
            return Err("the checksum does not match: the file is damaged".into());
        }
        let mut r = Reader::new(&body[MAGIC.len()..]);
        let version = r.u32()?;
        if version != VERSION {
            return Err(format!("format version {version}, expected {VERSION}"));
        }
        let size = |v: u64| usize::try_from(v).map_err(|_| "a size does not fit".to_string());
        let position = Position {
            epoch: size(r.u64()?)?,
            batches: size(r.u64()?)?,
            samples: size(r.u64()?)?,
            world_size: size(r.u64()?)?,
        };
        let snapshot = Snapshot {
            position,
            model: r.bytes()?.to_vec(),
            optim: r.bytes()?.to_vec(),
            scheduler: r.bytes()?.to_vec(),
        };
        r.finish()?;
        Ok(snapshot)
    }

    /// Takes the learner's state. burn-train hands the optimizer and schedule records only to a
    /// `LearningCheckpointer`, so one is built over an in-memory [`Part`] per record.
    pub(crate) fn take<M: LearnerModel>(
        learner: &Learner<M>,
        position: Position,
        events: &EventStoreClient,
        timeout: Duration,
    ) -> std::result::Result<Self, String> {
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

    /// Loads the records into `learner` (model parameters keep their device).
    pub(crate) fn restore<M: LearnerModel>(
        &self,
        learner: &mut Learner<M>,
    ) -> std::result::Result<(), String> {
        let bytes = |v: &Vec<u8>| Bytes::from_bytes_vec(v.clone());
        let model = ModuleRecord::from_bytes(bytes(&self.model))
            .map_err(|e| format!("model record: {e}"))?;
        let optim = OptimizerRecord::from_bytes(bytes(&self.optim))
            .map_err(|e| format!("optimizer record: {e}"))?;
        let scheduler = LrSchedulerRecord::from_bytes(bytes(&self.scheduler))
            .map_err(|e| format!("learning-rate schedule record: {e}"))?;
        // burn's `load_model` panics on a record that does not fit: try it on a copy first.
        learner
            .model()
            .try_load_record(model.clone())
            .map_err(|e| format!("the checkpoint's model does not fit this model: {e}"))?;
        learner.load_model(model);
        learner.load_optim(optim);
        learner.load_scheduler(scheduler);
        Ok(())
    }
}

/// A record's bytes, or why it could not be encoded.
type Encoded = std::result::Result<Vec<u8>, String>;

/// Records arriving from burn-train's checkpointer threads.
#[derive(Default)]
struct Parts {
    slots: Mutex<[Option<Encoded>; 3]>,
    ready: Condvar,
}

impl Parts {
    fn wait(&self, timeout: Duration) -> std::result::Result<[Vec<u8>; 3], String> {
        let deadline = Instant::now() + timeout;
        let mut slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        while slots.iter().any(Option::is_none) {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(format!(
                    "burn-train did not hand over the records in {timeout:?}"
                ));
            }
            slots = self
                .ready
                .wait_timeout(slots, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
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
            .map_err(|e| e.to_string());
        let mut slots = self.parts.slots.lock().unwrap_or_else(|p| p.into_inner());
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

/// Writes `bytes` to `path` atomically: a temporary file in the same directory, flushed to
/// disk, renamed over `path`, and the directory flushed.
pub(crate) fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)?;
    let tmp = path.with_extension("tmp");
    {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
    }
    std::fs::rename(&tmp, path)?;
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

/// Reads the position stored in a checkpoint file (and checks the file is whole).
///
/// ```no_run
/// let at = burn_ddp::train::inspect_checkpoint("run1/checkpoint.bddp".as_ref())?;
/// println!("continues at epoch {} after {} batches", at.epoch, at.batches);
/// # Ok::<(), burn_ddp::DdpError>(())
/// ```
pub fn inspect_checkpoint(path: &Path) -> Result<Position> {
    let raw =
        std::fs::read(path).map_err(|e| DdpError::io(format!("reading {}", path.display()), e))?;
    Snapshot::decode(&raw)
        .map(|s| s.position)
        .map_err(|reason| DdpError::Checkpoint {
            rank: 0,
            reason: format!("{}: {reason}", path.display()),
        })
}

/// Rank 0 writes `snapshot` (taken on rank 0 only); every rank learns the outcome.
pub(crate) fn save(
    group: &ProcessGroup,
    config: &CheckpointConfig,
    snapshot: Option<std::result::Result<Snapshot, String>>,
) -> Result<()> {
    let outcome = match snapshot {
        None => String::new(),
        Some(Err(e)) => e,
        Some(Ok(s)) => match write_atomically(&config.path(), &s.encode()) {
            Ok(()) => {
                log::info!(
                    "rank 0: checkpoint written to {} ({:?})",
                    config.path().display(),
                    s.position
                );
                String::new()
            }
            Err(e) => format!("writing {}: {e}", config.path().display()),
        },
    };
    rank_0_outcome(group, "write", outcome)
}

/// Every rank learns whether rank 0 managed to `verb` the checkpoint (`problem` is empty when it
/// did; only rank 0's counts), so a failure stops every rank with rank 0's reason.
fn rank_0_outcome(group: &ProcessGroup, verb: &str, problem: String) -> Result<()> {
    let all = group.all_gather(problem.into_bytes()).wait()?;
    match all.first().filter(|e| !e.is_empty()) {
        None => Ok(()),
        Some(e) => Err(DdpError::Checkpoint {
            rank: group.rank(),
            reason: format!("rank 0 could not {verb} it: {}", String::from_utf8_lossy(e)),
        }),
    }
}

/// Rank 0 reads the checkpoint (if resuming and one exists) and sends it to every rank.
pub(crate) fn load(group: &ProcessGroup, config: &CheckpointConfig) -> Result<Option<Snapshot>> {
    let fail = |reason: String| DdpError::Checkpoint {
        rank: group.rank(),
        reason,
    };
    let (raw, problem) = if group.rank() == 0 && config.resume {
        match std::fs::read(config.path()) {
            Ok(raw) => (raw, String::new()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => (Vec::new(), String::new()),
            Err(e) => (
                Vec::new(),
                format!("reading {}: {e}", config.path().display()),
            ),
        }
    } else {
        (Vec::new(), String::new())
    };
    rank_0_outcome(group, "read", problem)?;
    let len = group
        .broadcast((raw.len() as u64).to_le_bytes().to_vec(), 0)
        .wait()?;
    let len = u64::from_le_bytes(len.try_into().unwrap_or_default());
    if len == 0 {
        return Ok(None);
    }
    let len = usize::try_from(len).map_err(|_| fail(format!("{len} bytes do not fit")))?;
    let raw = if group.rank() == 0 {
        group.broadcast(raw, 0).wait()?
    } else {
        group.broadcast(vec![0u8; len], 0).wait()?
    };
    Snapshot::decode(&raw)
        .map(Some)
        .map_err(|e| fail(format!("{}: {e}", config.path().display())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snapshots_round_trip_and_damage_is_detected() {
        let s = Snapshot {
            position: Position {
                epoch: 3,
                batches: 7,
                samples: 56,
                world_size: 2,
            },
            model: vec![1, 2, 3],
            optim: vec![],
            scheduler: vec![9; 100],
        };
        let raw = s.encode();
        let back = Snapshot::decode(&raw).unwrap();
        assert_eq!(back.position, s.position);
        assert_eq!(
            (back.model, back.optim, back.scheduler),
            (s.model, s.optim, s.scheduler)
        );
        for cut in [0, 8, raw.len() / 2, raw.len() - 1] {
            assert!(Snapshot::decode(&raw[..cut]).is_err(), "cut at {cut}");
        }
        let mut flipped = raw.clone();
        flipped[30] ^= 1;
        assert!(matches!(Snapshot::decode(&flipped), Err(e) if e.contains("damaged")));
    }
}

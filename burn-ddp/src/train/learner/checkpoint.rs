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
//!
//! The file's format ([`format`]) holds records of any size (64-bit lengths, in a header in
//! front of them); it is written and checked streaming, never held twice or whole.

use std::path::{Path, PathBuf};
use std::time::Duration;

use burn::optim::OptimizerRecord;
use burn::optim::lr_scheduler::LrSchedulerRecord;
use burn::store::{ModuleRecord, RecordError};
use burn::tensor::Bytes;
use burn::train::{Learner, LearnerModel};

use crate::ProcessGroup;
use crate::error::{DdpError, Result};
use crate::wire::{DecodeError, Reader, Writer};

/// File name of the checkpoint inside the directory.
pub const CHECKPOINT_FILE: &str = "checkpoint.bddp";

pub(crate) mod burn_train;
mod capture;
mod format;
pub(crate) mod gather;
pub(crate) mod optimizer_records;

pub(crate) use format::checksum;

#[cfg(feature = "test-support")]
pub use gather::{GatherStats, last_gather};

/// Where and how often [`DdpLearner`](crate::train::DdpLearner) writes checkpoints.
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

impl Position {
    /// The start of `epoch` in a job of `world_size` ranks.
    pub(crate) fn start_of(epoch: usize, world_size: usize) -> Self {
        Position {
            epoch,
            world_size,
            ..Position::default()
        }
    }
}

/// Why a checkpoint could not be taken, decoded or loaded.
#[derive(Debug, thiserror::Error)]
pub(crate) enum SnapshotError {
    /// The file does not start with the checkpoint magic.
    #[error("not a burn-ddp checkpoint")]
    NotACheckpoint,
    /// The checksum does not match the contents.
    #[error("the checksum does not match: the file is damaged")]
    Damaged,
    /// Another format version (the one found).
    #[error("format version {0}: this build reads versions 1 and 2")]
    Version(u32),
    /// The file ends inside its header (after this many bytes).
    #[error("the file ends inside its header, after {0} bytes: it was cut short")]
    HeaderCut(u64),
    /// The file's length is not the one its header describes.
    #[error(
        "its header describes a file of {described} bytes, but it holds {holds}: it was cut \
         short, or is not one whole checkpoint"
    )]
    Size {
        /// Bytes the header describes.
        described: u64,
        /// Bytes the file holds.
        holds: u64,
    },
    /// Reading the file failed.
    #[error("reading it: {0}")]
    Io(#[from] std::io::Error),
    /// A stored size does not fit this machine's `usize`.
    #[error("a size does not fit")]
    SizeOverflow,
    /// The body does not decode.
    #[error("{0}")]
    Decode(#[from] DecodeError),
    /// burn cannot read one of the records.
    #[error("{what} record: {source}")]
    Record {
        /// Which record: `model`, `optimizer` or `learning-rate schedule`.
        what: &'static str,
        /// burn's error.
        source: RecordError,
    },
    /// The model record does not fit the model (burn's error).
    #[error("the checkpoint's model does not fit this model: {0}")]
    ModelMismatch(RecordError),
    /// burn-train's checkpointer did not hand over the records within the timeout.
    #[error("burn-train did not hand over the records in {0:?}")]
    HandOver(Duration),
    /// burn could not encode a record (its error).
    #[error("{0}")]
    Encode(String),
}

/// A checkpoint's contents.
pub(crate) struct Snapshot {
    pub position: Position,
    model: Vec<u8>,
    optim: Vec<u8>,
    scheduler: Vec<u8>,
}

impl Snapshot {
    /// The optimizer's record (burnpack bytes).
    pub(crate) fn optim(&self) -> &[u8] {
        &self.optim
    }

    /// The snapshot with `optim` as the optimizer's record.
    pub(crate) fn with_optim(self, optim: Vec<u8>) -> Self {
        Snapshot { optim, ..self }
    }

    /// Loads the records into `learner` (model parameters keep their device); of the optimizer's
    /// state, only that of the parameters `keep` names in the loaded model (all when `None`).
    /// The records are handed to burn as they are, not copied.
    pub(crate) fn restore<M: LearnerModel>(
        self,
        learner: &mut Learner<M>,
        keep: impl FnOnce(&M) -> Option<std::collections::HashSet<u64>>,
    ) -> std::result::Result<(), SnapshotError> {
        let record = |what| move |source| SnapshotError::Record { what, source };
        let model =
            ModuleRecord::from_bytes(Bytes::from_bytes_vec(self.model)).map_err(record("model"))?;
        let scheduler = LrSchedulerRecord::from_bytes(Bytes::from_bytes_vec(self.scheduler))
            .map_err(record("learning-rate schedule"))?;
        // A whole model's record: wrapped blocks ([`crate::fsdp`]) keep this rank's piece.
        let blocks = |e: crate::DdpError| SnapshotError::Encode(e.to_string());
        // burn's `load_model` panics on a record that does not fit: try it on a copy first.
        let current = learner.model();
        crate::fsdp::loading_whole(|| current.try_load_record(model.clone()))
            .map_err(blocks)?
            .map_err(SnapshotError::ModelMismatch)?;
        crate::fsdp::loading_whole(|| learner.load_model(model)).map_err(blocks)?;
        // The blocks' parameters' state becomes this rank's shards' (the loaded blocks carry
        // the record's parameter ids).
        let optim = crate::fsdp::shard_state(&learner.model(), self.optim).map_err(blocks)?;
        let optim = match keep(&learner.model()) {
            Some(ids) => optimizer_records::keep(optim, &ids)?,
            None => optim,
        };
        let optim = OptimizerRecord::from_bytes(Bytes::from_bytes_vec(optim))
            .map_err(record("optimizer"))?;
        learner.load_optim(optim);
        learner.load_scheduler(scheduler);
        Ok(())
    }
}

/// Writes `path` atomically with `write`: to a temporary file in the same directory, flushed to
/// disk, renamed over `path`, and the directory flushed. A failed write removes the temporary
/// file and leaves `path` as it was.
pub(crate) fn write_atomically(
    path: &Path,
    write: impl FnOnce(&mut std::fs::File) -> std::io::Result<()>,
) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)?;
    let tmp = path.with_extension("tmp");
    let written = std::fs::File::create(&tmp).and_then(|mut f| {
        write(&mut f)?;
        f.sync_all()
    });
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    std::fs::rename(&tmp, path)?;
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

/// Reads the position stored in a checkpoint file, checking that the file is whole (its length
/// is the one its header describes) and undamaged (its checksum). The file is read in pieces of
/// 1 MiB, never held whole, whatever its size.
///
/// ```no_run
/// let at = burn_ddp::train::inspect_checkpoint("run1/checkpoint.bddp".as_ref())?;
/// println!("continues at epoch {} after {} batches", at.epoch, at.batches);
/// # Ok::<(), burn_ddp::DdpError>(())
/// ```
pub fn inspect_checkpoint(path: &Path) -> Result<Position> {
    let opened = std::fs::File::open(path).and_then(|f| Ok((f.metadata()?.len(), f)));
    let (len, mut file) =
        opened.map_err(|e| DdpError::io(format!("reading {}", path.display()), e))?;
    format::inspect(&mut file, len).map_err(|reason| DdpError::Checkpoint {
        rank: 0,
        reason: format!("{}: {reason}", path.display()),
    })
}

/// Rank 0 writes `snapshot` (taken on rank 0 only); every rank learns the outcome.
pub(crate) fn save(
    group: &ProcessGroup,
    config: &CheckpointConfig,
    snapshot: Option<std::result::Result<Snapshot, SnapshotError>>,
) -> Result<()> {
    let outcome = match snapshot {
        None => String::new(),
        Some(Err(e)) => e.to_string(),
        Some(Ok(s)) => match write_atomically(&config.path(), |f| format::write(&s, f)) {
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
    let mine = Writer::default().bytes(problem.as_bytes()).buf.clone();
    let said = group.all_gather_object(mine)?;
    let problems = said.decode_each("a checkpoint outcome", |r| r.string())?;
    match problems.first().filter(|e| !e.is_empty()) {
        None => Ok(()),
        Some(e) => Err(DdpError::Checkpoint {
            rank: group.rank(),
            reason: format!("rank 0 could not {verb} it: {e}"),
        }),
    }
}

/// Creates `dir` if needed and writes and removes a file in it.
fn probe_writable(dir: &std::path::Path) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let probe = dir.join(format!(".burn-ddp-probe-{}", std::process::id()));
    std::fs::write(&probe, b"")?;
    std::fs::remove_file(&probe)
}

/// Rank 0 checks that it can write the checkpoint's directory, reads the checkpoint (if
/// resuming and one exists) and sends it to every rank.
pub(crate) fn load(group: &ProcessGroup, config: &CheckpointConfig) -> Result<Option<Snapshot>> {
    let fail = |reason: String| DdpError::Checkpoint {
        rank: group.rank(),
        reason,
    };
    // Before the first step, not at the first checkpoint: a directory that cannot be written
    // would otherwise be found only after the work the checkpoint was to keep.
    let unwritable = match group.rank() {
        0 => probe_writable(&config.dir)
            .err()
            .map_or(String::new(), |e| {
                format!(
                    "its directory {} cannot be written ({e}), checked before training",
                    config.dir.display()
                )
            }),
        _ => String::new(),
    };
    rank_0_outcome(group, "write", unwritable)?;
    let (raw, problem) = if group.rank() == 0 && config.resume {
        match std::fs::read(config.path()) {
            // Only a missing file is "no checkpoint": an empty one is a write or a copy cut
            // short, and starting afresh would later overwrite it.
            Ok(raw) if raw.is_empty() => (
                Vec::new(),
                format!(
                    "{} is empty (a checkpoint cut short?): remove it to start afresh",
                    config.path().display()
                ),
            ),
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
    let len = Writer::default().u64(raw.len() as u64).buf.clone();
    let len = group.broadcast(len, 0).wait()?;
    let len = Reader::new(&len)
        .u64()
        .map_err(|e| fail(format!("rank 0 sent a malformed length: {e}")))?;
    if len == 0 {
        return Ok(None);
    }
    let len = usize::try_from(len).map_err(|_| fail(format!("{len} bytes do not fit")))?;
    let raw = if group.rank() == 0 {
        group.broadcast(raw, 0).wait()?
    } else {
        // The length is rank 0's word: an absurd one is an error, not an abort of the process.
        let mut buffer = Vec::new();
        buffer.try_reserve_exact(len).map_err(|e| {
            fail(format!(
                "rank 0 sends {len} bytes, which do not fit here: {e}"
            ))
        })?;
        buffer.resize(len, 0);
        group.broadcast(buffer, 0).wait()?
    };
    Snapshot::decode(raw)
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
        let back = Snapshot::decode(raw.clone()).unwrap();
        assert_eq!(back.position, s.position);
        assert_eq!(
            (back.model, back.optim, back.scheduler),
            (s.model, s.optim, s.scheduler)
        );
        for cut in [0, 8, raw.len() / 2, raw.len() - 1] {
            assert!(
                Snapshot::decode(raw[..cut].to_vec()).is_err(),
                "cut at {cut}"
            );
        }
        let mut flipped = raw.clone();
        flipped[30] ^= 1;
        assert!(matches!(
            Snapshot::decode(flipped.clone()),
            Err(SnapshotError::Damaged)
        ));
    }

    /// Whichever record is the largest (it keeps the file's buffer), every record comes back
    /// as it was written, empty ones included.
    #[test]
    fn each_record_decodes_whichever_is_the_largest() {
        let record = |n: usize, seed: u8| (0..n).map(|i| (i as u8).wrapping_mul(seed)).collect();
        for sizes in [
            [1000, 3, 0],
            [3, 1000, 7],
            [0, 5, 1000],
            [10, 10, 10],
            [0, 0, 0],
        ] {
            let s = Snapshot {
                position: Position::default(),
                model: record(sizes[0], 3),
                optim: record(sizes[1], 5),
                scheduler: record(sizes[2], 7),
            };
            let back = Snapshot::decode(s.encode()).unwrap();
            assert_eq!(
                (back.model, back.optim, back.scheduler),
                (s.model, s.optim, s.scheduler),
                "sizes {sizes:?}"
            );
        }
    }

    /// A model record of 4 GiB and 5 bytes is written and read back whole (about 9 GiB of
    /// memory: run with `--ignored`).
    #[test]
    #[ignore]
    fn a_record_over_4_gib_round_trips_in_memory() {
        let n = (1usize << 32) + 5;
        let s = Snapshot {
            position: Position {
                epoch: 1,
                batches: 2,
                samples: 3,
                world_size: 4,
            },
            model: vec![0; n],
            optim: vec![7; 3],
            scheduler: vec![9; 2],
        };
        let raw = s.encode();
        let back = Snapshot::decode(raw).unwrap();
        assert_eq!(back.position, s.position);
        assert_eq!(back.model.len(), n);
        assert_eq!((back.optim, back.scheduler), (s.optim, s.scheduler));
    }
}

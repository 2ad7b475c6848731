//! Checkpoints of sharded (ZeRO) runs: the ranks' optimizer records reach rank 0 in pieces no
//! larger than the group's gather limit, so a state above that limit is written and resumed,
//! and the other ranks never hold more than their own share and one piece; burn-train's own
//! checkpointer (which would save rank 0's share only) is refused before training.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use burn::data::dataloader::DataLoaderBuilder;
use burn::data::dataset::{Dataset, DatasetError};
use burn::optim::AdamConfig;
use burn::train::SupervisedTraining;
use burn_ddp::GroupOptions;
use burn_ddp::testing::{GatherStats, last_checkpoint_gather};
use burn_ddp::train::{
    CheckpointConfig, DdpLearner, DdpTraining, ProgressOutput, QuietRenderer, Sharding,
    inspect_checkpoint,
};

use super::super::job::{Job, train_rank};
use super::super::model::{Points, ToBatch, flex, new_net};
use super::scratch_dir;
use crate::common::{digest, options, run_world};

/// The gather limit of these tests: above what the ranks' agreement at start gathers, below
/// the whole optimizer state of the test model under Adam.
const SMALL_GATHER: usize = 2048;

/// `job` in groups with `max_gather_bytes` lowered to `limit`; rank 0's seed-7 model is
/// broadcast to the others. Each rank's parameters (or error) and what its last checkpoint's
/// gather moved through it.
fn run_sharded(limit: usize, job: &Job) -> Vec<(Result<Vec<f32>, String>, GatherStats)> {
    let device = flex();
    let net = Mutex::new(Some(new_net(&device, Some(7), false)));
    let opts = GroupOptions {
        max_gather_bytes: limit,
        ..options(60)
    };
    run_world(job.world, opts, |group| {
        let model = match group.rank() {
            0 => net.lock().unwrap().take().unwrap(),
            _ => new_net(&device, None, false),
        };
        let group = Arc::new(group);
        let outcome = train_rank(group.clone(), model, job, 0);
        (outcome, last_checkpoint_gather(&group))
    })
}

fn job(world: usize, checkpoints: Option<CheckpointConfig>) -> Job {
    Job {
        sharding: Sharding::Optimizer,
        ..Job::plain(world, checkpoints)
    }
}

/// A sharded run whose optimizer state is above the group's gather limit writes its
/// checkpoints (it used to fail at the first one, after the work it was to keep) and resumes
/// from one exactly as a run that never stopped: at world 2, where a record takes several
/// pieces, and at world 3, where a rank other than 0 relays another's pieces.
#[test]
fn a_sharded_checkpoint_above_the_gather_limit_is_written_and_resumes_exactly() {
    // Per rank and epoch 24 or 16 samples, batches of 4, a checkpoint every 2 steps: a crash
    // while loading the 5th (world 2) or 4th (world 3) batch of epoch 2 leaves epoch 2 after
    // 4 or 2 batches.
    for (world, crash, batches) in [(2, 17, 4), (3, 13, 2)] {
        let straight = run_sharded(SMALL_GATHER, &job(world, None));
        let straight = straight[0].0.as_ref().unwrap();
        let dir = scratch_dir(&format!("sharded-streamed-{world}"));
        let config = CheckpointConfig::new(&dir).every(2);
        let crashed = run_sharded(
            SMALL_GATHER,
            &Job {
                fail_at: Some((2, crash)),
                ..job(world, Some(config.clone()))
            },
        );
        for (r, (outcome, _)) in crashed.iter().enumerate() {
            let e = outcome.as_ref().unwrap_err();
            assert!(
                e.contains("simulated crash"),
                "world {world}, rank {r}: {e}"
            );
        }
        let at = inspect_checkpoint(&config.path()).unwrap();
        assert_eq!((at.epoch, at.batches, at.world_size), (2, batches, world));
        let resumed = run_sharded(SMALL_GATHER, &job(world, Some(config)));
        for (r, (params, _)) in resumed.iter().enumerate() {
            let params = params.as_ref().unwrap();
            assert_eq!(
                digest(bytemuck::cast_slice(params)),
                digest(bytemuck::cast_slice(straight)),
                "world {world}: rank {r} differs from the run that never stopped"
            );
        }
        assert_bounded(&resumed.iter().map(|(_, s)| *s).collect::<Vec<_>>());
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// What the last checkpoint's gather moved through each rank: the whole state was above the
/// gather limit; at world 2 a record took several pieces, at world 3 rank 1 relayed rank 2's;
/// no rank other than 0 ever held more than its own share and one piece of another's.
fn assert_bounded(stats: &[GatherStats]) {
    let world = stats.len();
    let all = stats[0];
    eprintln!("checkpoint gather at world {world}, by rank: {stats:?}");
    assert!(
        all.total > SMALL_GATHER,
        "the state fits one gather: {all:?}"
    );
    assert!(all.piece <= SMALL_GATHER, "{all:?}");
    assert_eq!(
        all.foreign_peak,
        all.total - all.own,
        "rank 0 holds every record"
    );
    for (r, s) in stats.iter().enumerate().skip(1) {
        assert_eq!(
            (s.total, s.piece, s.pieces),
            (all.total, all.piece, all.pieces)
        );
        assert!(s.foreign_peak <= s.piece, "rank {r}: {s:?}");
        assert!(
            s.own + s.foreign_peak < s.total,
            "rank {r} held it all: {s:?}"
        );
    }
    match world {
        2 => assert!(all.pieces > 1, "no record took several pieces: {all:?}"),
        _ => assert!(
            stats[1].foreign_peak > 0,
            "rank 1 relayed nothing: {stats:?}"
        ),
    }
}

/// A dataset that counts the samples read.
struct Counted(Points, Arc<AtomicUsize>);

impl Dataset<(Vec<f32>, usize)> for Counted {
    fn get(&self, i: usize) -> Result<(Vec<f32>, usize), DatasetError> {
        self.1.fetch_add(1, Ordering::Relaxed);
        self.0.get(i)
    }
    fn len(&self) -> usize {
        self.0.len()
    }
}

/// Trains a sharded or plain learner at world 2 for one epoch with burn-train's own
/// checkpointers set; every rank's outcome, and how many samples were read for training.
fn with_burn_train_checkpointers(sharding: Sharding) -> (Vec<Result<(), String>>, usize) {
    let read = Arc::new(AtomicUsize::new(0));
    let dir = scratch_dir(&format!("burn-train-checkpointers-{sharding:?}"));
    let outcomes = run_world(2, options(60), |group| {
        let model = new_net(&flex(), Some(7), false);
        let learner = DdpLearner::with_group(Arc::new(group), model, AdamConfig::new().init(), 0.1)
            .shard_optimizer(sharding)
            .progress(ProgressOutput::Keep);
        let rank_dir = dir.join(format!("rank-{}", learner.group().rank()));
        let loader = |n| {
            DataLoaderBuilder::new(ToBatch)
                .batch_size(4)
                .build(Counted(Points(n), read.clone()))
        };
        let outcome = SupervisedTraining::new(&rank_dir, loader(16), loader(8))
            .renderer(Box::new(QuietRenderer))
            .with_application_logger(None)
            .with_default_checkpointers()
            .num_epochs(1)
            .launch_ddp(learner);
        match outcome {
            Ok(r) => r
                .error
                .map_or(Ok(()), |e| Err(format!("training error: {e}"))),
            Err(e) => Err(e.to_string()),
        }
    });
    let _ = std::fs::remove_dir_all(&dir);
    (outcomes, read.load(Ordering::Relaxed))
}

/// burn-train's checkpointer saves the optimizer record of the rank it runs on: in a sharded
/// run, rank 0's share only, and resuming through it would silently reset the others' state.
/// As PyTorch's `ZeroRedundancyOptimizer.state_dict()` refuses an unconsolidated state, the
/// combination is refused before training on every rank, naming burn-ddp's checkpoints; a
/// plain run keeps burn-train's checkpointer.
#[test]
fn burn_trains_own_checkpointer_is_refused_in_a_sharded_run_before_training() {
    let (outcomes, read) = with_burn_train_checkpointers(Sharding::Optimizer);
    for (r, outcome) in outcomes.iter().enumerate() {
        let e = outcome.as_ref().unwrap_err();
        assert!(
            e.contains("with_default_checkpointers")
                && e.contains("DdpLearner::checkpoints")
                && e.contains("shard"),
            "rank {r}: {e}"
        );
    }
    assert_eq!(read, 0, "samples were read for training");
    let (outcomes, _) = with_burn_train_checkpointers(Sharding::None);
    for (r, outcome) in outcomes.into_iter().enumerate() {
        outcome.unwrap_or_else(|e| panic!("plain run, rank {r}: {e}"));
    }
}

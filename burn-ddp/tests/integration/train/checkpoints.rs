//! Checkpoints of DdpLearner jobs: resuming is bit-identical to never stopping (or continues
//! the epoch at another world size), and a damaged, foreign or unreachable checkpoint is an
//! error on every rank. A sharded run's optimizer state reaches rank 0 in bounded pieces
//! (`checkpoints/sharded.rs`); the file's format: version 1 files still resume, files over
//! 4 GiB are checked streaming (`checkpoints/format.rs`).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use burn::optim::SgdConfig;
use burn_ddp::train::{
    CHECKPOINT_FILE, CheckpointConfig, DdpLearner, ProgressOutput, inspect_checkpoint,
};

use super::job::{JOB_EPOCHS, Job, run_job};
use super::launch_to_error;
use super::model::{DATA, flex, new_net};
use crate::common::{digest, options, run_world};

mod format;
mod sharded;

fn scratch_dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("burn-ddp-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

#[test]
fn resuming_continues_exactly_as_an_uninterrupted_run() {
    let world = 2;
    let uninterrupted: Vec<Vec<f32>> = run_job(&Job::plain(world, None))
        .into_iter()
        .map(Result::unwrap)
        .collect();

    // A run that writes a checkpoint every 2 optimizer steps and "crashes" while loading its
    // 5th batch of epoch 2 (position 17 of each rank's 24 samples): the last checkpoint is
    // epoch 2 after 4 batches.
    let dir = scratch_dir("resume");
    let config = CheckpointConfig::new(&dir).every(2);
    let crashed = run_job(&Job {
        fail_at: Some((2, 17)),
        ..Job::plain(world, Some(config.clone()))
    });
    for r in &crashed {
        let e = r.as_ref().unwrap_err();
        assert!(e.contains("simulated crash"), "{e}");
    }
    let at = inspect_checkpoint(&config.path()).unwrap();
    assert_eq!(
        (at.epoch, at.batches, at.samples, at.world_size),
        (2, 4, 32, 2)
    );
    let other_world_dir = scratch_dir("resume-world1");
    std::fs::create_dir_all(&other_world_dir).unwrap();
    std::fs::copy(config.path(), other_world_dir.join(CHECKPOINT_FILE)).unwrap();

    // Same world size: bit-identical to the uninterrupted run, on every rank.
    let resumed = run_job(&Job::plain(world, Some(config.clone())));
    for (r, params) in resumed.into_iter().enumerate() {
        let params = params.unwrap();
        assert_eq!(
            digest(bytemuck::cast_slice(&params)),
            digest(bytemuck::cast_slice(&uninterrupted[0])),
            "rank {r} differs from the uninterrupted run"
        );
    }
    let done = inspect_checkpoint(&config.path()).unwrap();
    assert_eq!((done.epoch, done.batches), (JOB_EPOCHS + 1, 0));

    // Another world size: one rank continues epoch 2 with the 16 samples not seen yet.
    let seen = Arc::new(AtomicUsize::new(0));
    let single = run_job(&Job {
        count: Some((2, seen.clone())),
        ..Job::plain(1, Some(CheckpointConfig::new(&other_world_dir)))
    });
    let params = single.into_iter().next().unwrap().unwrap();
    assert!(params.iter().all(|x| x.is_finite()));
    assert_eq!(seen.load(Ordering::Relaxed), DATA - 32);
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_dir_all(&other_world_dir);
}

#[test]
fn a_damaged_checkpoint_is_an_error_on_every_rank() {
    let dir = scratch_dir("damaged");
    std::fs::create_dir_all(&dir).unwrap();
    let config = CheckpointConfig::new(&dir);
    std::fs::write(config.path(), b"BDDPCKPT and then nothing useful").unwrap();
    let results = run_job(&Job::plain(2, Some(config)));
    for r in results {
        let e = r.unwrap_err();
        assert!(e.contains("checkpoint") && e.contains("damaged"), "{e}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Only a missing file means "no checkpoint": an empty one (a write cut short, a truncated copy)
/// is an error naming it on every rank, and training does not start over and overwrite it.
#[test]
fn an_empty_checkpoint_file_is_an_error_not_a_fresh_start() {
    let dir = scratch_dir("empty");
    std::fs::create_dir_all(&dir).unwrap();
    let config = CheckpointConfig::new(&dir);
    std::fs::write(config.path(), b"").unwrap();
    let results = run_job(&Job::plain(2, Some(config.clone())));
    for (rank, r) in results.into_iter().enumerate() {
        let e = r.expect_err("an empty checkpoint must not start training afresh");
        let name = config.path().display().to_string();
        assert!(
            e.contains("is empty") && e.contains(&name),
            "rank {rank}: {e}"
        );
    }
    let left = std::fs::metadata(config.path())
        .expect("the file stays")
        .len();
    assert_eq!(left, 0, "the empty file is left as it was, not overwritten");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_checkpoint_of_another_model_is_an_error_not_a_panic() {
    let dir = scratch_dir("other-model");
    let config = CheckpointConfig::new(&dir);
    let written = run_job(&Job::plain(1, Some(config.clone())));
    assert!(written[0].is_ok());
    // The same directory, a model with an extra layer.
    let errors = run_world(1, options(30), |group| {
        let model = new_net(&flex(), None, true);
        let learner = DdpLearner::with_group(Arc::new(group), model, SgdConfig::new().init(), 0.1)
            .checkpoints(config.clone())
            .progress(ProgressOutput::Keep);
        launch_to_error(learner, 4)
    });
    assert!(
        errors[0].contains("checkpoint") && errors[0].contains("does not fit this model"),
        "{}",
        errors[0]
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_checkpoint_rank_0_cannot_read_or_write_stops_every_rank_naming_it() {
    let job = |dir: std::path::PathBuf| run_job(&Job::plain(2, Some(CheckpointConfig::new(dir))));
    let expect = |results: Vec<Result<Vec<f32>, String>>, verb: &str| {
        for (r, result) in results.into_iter().enumerate() {
            let e = result.unwrap_err();
            let want = format!("rank {r}: checkpoint: rank 0 could not {verb} it");
            assert!(e.contains(&want), "rank {r}: {e}");
        }
    };
    // A directory stands where the checkpoint file is: rank 0 cannot read it. (A directory
    // that cannot be written at all is found before training: the test below.)
    let unreadable = scratch_dir("unreadable");
    std::fs::create_dir_all(unreadable.join(CHECKPOINT_FILE)).unwrap();
    expect(job(unreadable.clone()), "read");
    let _ = std::fs::remove_dir_all(&unreadable);
    // A directory stands where the temporary file goes: the first write fails.
    let dir = scratch_dir("unwritable");
    std::fs::create_dir_all(dir.join("checkpoint.tmp")).unwrap();
    expect(job(dir.clone()), "write");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A checkpoint directory that cannot be written stops every rank before the first step, with
/// rank 0's reason (it used to be found only when the first checkpoint was written, after the
/// work it was to keep). Root may write almost anywhere: the directory is one /proc refuses to
/// create, where looking for a checkpoint finds none, as on a read-only file system.
#[test]
fn an_unwritable_checkpoint_directory_stops_every_rank_before_training() {
    let dir = std::path::PathBuf::from("/proc/self/burn-ddp-checkpoints");
    let config = CheckpointConfig::new(&dir);
    let read = Arc::new(AtomicUsize::new(0));
    let outcomes = run_job(&Job {
        count: Some((1, read.clone())),
        ..Job::plain(2, Some(config))
    });
    for (rank, outcome) in outcomes.iter().enumerate() {
        let e = outcome.as_ref().unwrap_err();
        assert!(
            e.contains("rank 0 could not write it")
                && e.contains("/proc/self/burn-ddp-checkpoints")
                && e.contains("checked before training"),
            "rank {rank}: {e}"
        );
    }
    assert_eq!(
        read.load(Ordering::Relaxed),
        0,
        "a sample was read for training"
    );
}

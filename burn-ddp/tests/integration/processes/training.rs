//! Rank processes of a DdpLearner job that die (before joining, exiting or panicking in a
//! forward pass, killed while writing a checkpoint): the others stop, naming the rank and where
//! it was, and a checkpoint interrupted mid-write leaves the previous one to resume from.

use std::time::{Duration, Instant};

use burn_ddp::status::Phase;
use burn_ddp::testing::{decode_status, status_key};
use burn_ddp::train::{CheckpointConfig, inspect_checkpoint};

use super::{COLLECTIVE_FAILED, finish, rank_error, training_job};

#[test]
fn a_rank_that_dies_before_joining_is_named_within_the_rendezvous_timeout() {
    let timeout = Duration::from_secs(3);
    let env = [("BURN_DDP_RENDEZVOUS_TIMEOUT", timeout.as_secs().to_string())];
    let start = Instant::now();
    let (_store, mut ranks) = training_job(3, &env, |r| {
        if r == 1 {
            vec![("BDDP_DIE_BEFORE_JOIN", "1".to_string())]
        } else {
            vec![]
        }
    });
    for r in [0, 2] {
        let (code, err) = finish(&mut ranks.0[r], start + timeout * 3);
        assert_eq!(code, Some(COLLECTIVE_FAILED), "rank {r}: {err}");
        assert!(err.contains("rank 1 did not join"), "rank {r}: {err}");
    }
    assert!(start.elapsed() < timeout * 2, "{:?}", start.elapsed());
}

/// Rank 1 of 3 dies in its third forward pass (`how`: extra variables); the others must name
/// it and where it was.
fn rank_dies_in_forward(how: &[(&'static str, String)], expected_code: i32, cause: &str) {
    let timeout = Duration::from_secs(5);
    let env = [("BURN_DDP_TIMEOUT", timeout.as_secs().to_string())];
    let (_store, mut ranks) = training_job(3, &env, |r| {
        let mut vars = how.to_vec();
        if r == 1 {
            vars.push(("BDDP_DIE_AT_FORWARD", "3".to_string()));
        }
        vars
    });
    let (code, err) = finish(&mut ranks.0[1], Instant::now() + Duration::from_secs(120));
    assert_eq!(code, Some(expected_code), "{err}");
    let died = Instant::now();
    for r in [0, 2] {
        let (code, err) = finish(&mut ranks.0[r], died + timeout * 2);
        let line = rank_error(&err);
        assert_eq!(code, Some(COLLECTIVE_FAILED), "rank {r}: {err}");
        assert!(line.contains(cause), "rank {r}: {line}");
        assert!(
            line.contains("rank 1: training, epoch 1, step 3"),
            "rank {r}: {line}"
        );
    }
}

#[test]
fn a_rank_that_exits_in_its_forward_pass_is_named_with_where_it_was() {
    rank_dies_in_forward(&[], 9, "rank 1 closed its connection");
}

/// The same with a sharded optimizer (ZeRO-2: reduce-scatter, and the parameters' all-gather).
#[test]
fn a_sharded_rank_that_exits_in_its_forward_pass_is_named_with_where_it_was() {
    let sharded = [("BDDP_SHARDING", "gradients".to_string())];
    rank_dies_in_forward(&sharded, 9, "rank 1 closed its connection");
}

#[test]
fn a_rank_that_panics_in_its_forward_pass_is_named_with_where_it_was() {
    // The test harness turns the panic into exit code 101. The peers learn of the panic when
    // unwinding drops the group, after the panic hook: with RUST_BACKTRACE=1 that hook
    // symbolises a backtrace of this (1 GB with the wgpu feature) debug binary, which on a
    // loaded 2-core machine can outlast the 5 s timeout, and the peers then report a timeout.
    rank_dies_in_forward(
        &[
            ("BDDP_DIE_BY_PANIC", "1".to_string()),
            ("RUST_BACKTRACE", "0".to_string()),
        ],
        101,
        "rank 1 panicked while training, epoch 1, step 3",
    );
}

#[test]
fn rank_0_killed_while_writing_a_checkpoint_leaves_the_previous_one_and_is_named() {
    let dir = std::env::temp_dir().join(format!("burn-ddp-kill-ckpt-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let file = CheckpointConfig::new(&dir).path();
    let timeout = Duration::from_secs(5);
    let env = [
        ("BURN_DDP_TIMEOUT", timeout.as_secs().to_string()),
        ("BDDP_CKPT_DIR", dir.display().to_string()),
        ("BDDP_CKPT_EVERY", "1".to_string()),
        // 64 MiB of frozen parameters: each checkpoint takes a while to write.
        ("BDDP_BALLAST", (16 << 20).to_string()),
    ];
    let (store, mut ranks) = training_job(2, &env, |_| vec![]);
    // Once a checkpoint exists, kill rank 0 in the middle of writing the next one.
    let give_up = Instant::now() + Duration::from_secs(300);
    loop {
        let phase = store
            .value(&status_key(0))
            .and_then(|raw| decode_status(&raw))
            .map(|s| s.phase);
        if file.exists() && phase == Some(Phase::Checkpointing) {
            break;
        }
        assert!(Instant::now() < give_up, "rank 0 never checkpointed twice");
        std::thread::sleep(Duration::from_millis(1));
    }
    ranks.0[0].kill().unwrap();
    let killed = Instant::now();
    let (code, err) = finish(&mut ranks.0[1], killed + timeout * 2);
    let line = rank_error(&err);
    assert_eq!(code, Some(COLLECTIVE_FAILED), "{err}");
    assert!(line.contains("rank 0 closed its connection"), "{line}");
    assert!(line.contains("rank 0: checkpointing, epoch"), "{line}");
    // The previous checkpoint is whole, and a new job resumes from it to the end.
    let at = inspect_checkpoint(&file).unwrap();
    assert!(at.epoch >= 1 && at.world_size == 2, "{at:?}");
    let (_store, mut again) = training_job(2, &env, |_| vec![]);
    for (r, child) in again.0.iter_mut().enumerate() {
        let (code, err) = finish(child, Instant::now() + Duration::from_secs(300));
        assert_eq!(code, Some(0), "resumed rank {r}: {err}");
    }
    let done = inspect_checkpoint(&file).unwrap();
    assert!(
        done.epoch > at.epoch || done.batches > at.batches,
        "{done:?} after {at:?}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

//! Stop signals: SIGTERM to the launcher (`burn-ddp-run`) is forwarded to the ranks, which stop
//! together at a step boundary, write a checkpoint there and exit with 143; the launcher exits
//! with it, and the job started again resumes and ends bit-identical to one never stopped.

use std::process::Command;
use std::time::{Duration, Instant};

use burn_ddp::train::inspect_checkpoint;

use crate::bins::run_bounded;
use crate::processes::ENTRY;

/// Runs the `train` scenario on 2 ranks under the real launcher binary; returns its exit code
/// and stderr, and how long it ran (at most `bound`, see [`crate::bins::run_bounded`]).
fn launch_job(env: &[(&str, String)], bound: Duration) -> (Option<i32>, String, Duration) {
    let exe = std::env::current_exe().unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_burn-ddp-run"));
    cmd.args(["--nproc", "2"])
        .arg(exe)
        .args(["--exact", ENTRY, "--ignored", "--nocapture"])
        .env("BDDP_TEST_SCENARIO", "train")
        .env("BURN_DDP_TIMEOUT", "20")
        .envs(env.iter().map(|(k, v)| (k, v)));
    let start = Instant::now();
    let out = run_bounded(cmd, bound);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    (out.status.code(), stderr, start.elapsed())
}

#[test]
fn sigterm_to_the_launcher_stops_the_job_at_a_step_with_a_checkpoint_and_it_resumes() {
    let scratch = std::env::temp_dir().join(format!("burn-ddp-sigterm-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&scratch);
    let (ckpt, results) = (scratch.join("ckpt"), scratch.join("results"));
    std::fs::create_dir_all(&results).unwrap();
    let common = [
        ("BDDP_CKPT_DIR", ckpt.display().to_string()),
        ("BDDP_RESULT_DIR", results.display().to_string()),
    ];
    // Rank 1 signals the launcher in forward pass 12: epoch 2 (6 training and 3 validation
    // passes per epoch), its 3rd step. Checkpoints are written at epoch ends only, so the one
    // found mid-epoch is the stop's.
    let mut stopped = common.to_vec();
    stopped.extend([
        ("BDDP_DIE_RANK", "1".to_string()),
        ("BDDP_DIE_AT_FORWARD", "12".to_string()),
        ("BDDP_DIE_BY_SIGNALLING_LAUNCHER", "1".to_string()),
    ]);
    let (code, err, took) = launch_job(&stopped, Duration::from_secs(60));
    assert_eq!(
        code,
        Some(143),
        "the launcher exits with 128 + SIGTERM; stderr:\n{err}"
    );
    assert!(err.contains("SIGTERM: forwarded to the ranks"), "{err}");
    assert!(err.contains("stopped by SIGTERM"), "{err}");
    println!("stopped job ended {took:?} after its start");
    let position = inspect_checkpoint(&ckpt.join(burn_ddp::train::CHECKPOINT_FILE))
        .expect("a checkpoint was written at the stop");
    // Rank 1 ends step 3 after the signal came back to it; the ranks vote after every 4th step
    // (step 4 here, see burn-ddp's train/stop.rs) and read the vote after the next: they stop
    // after step 5.
    assert_eq!(
        (position.epoch, position.batches),
        (2, 5),
        "stopped mid-epoch 2 after step 5: {position:?}"
    );
    assert!(
        std::fs::read_dir(&results).unwrap().next().is_none(),
        "no rank finished training"
    );

    // Started again: resumes from the stop's checkpoint and finishes.
    let (code, err, _) = launch_job(&common, Duration::from_secs(120));
    assert_eq!(code, Some(0), "the resumed job ends; stderr:\n{err}");
    let read = |r: usize| std::fs::read_to_string(results.join(format!("rank-{r}"))).unwrap();
    assert_eq!(read(0), read(1), "ranks differ");
    let want = crate::train::uninterrupted_digest();
    assert_eq!(
        read(0),
        want,
        "the resumed job differs from one never stopped"
    );
    let _ = std::fs::remove_dir_all(&scratch);
}

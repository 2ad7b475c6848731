//! `burn_ddp::launch` with rank processes: it names the rank that failed first and stops the
//! others, restarts a failed job when asked (which then resumes bit-identically from its
//! checkpoint), and two launchers form one job as two nodes.

use std::time::{Duration, Instant};

use burn_ddp::DdpError;
use burn_ddp::launch::{LaunchConfig, free_port, launch};
use burn_ddp::secret::JobSecret;

use super::ENTRY;

#[test]
fn the_launcher_names_the_rank_that_failed_first_and_stops_the_others() {
    let exe = std::env::current_exe().unwrap();
    let cfg = LaunchConfig::new(exe, 3)
        .args(["--exact", ENTRY, "--ignored", "--nocapture"])
        .env("BDDP_TEST_SCENARIO", "fail_rank_1")
        .env("BURN_DDP_TIMEOUT", "30");
    let start = Instant::now();
    match launch(&cfg) {
        Err(DdpError::RankFailed { rank, status }) => {
            assert_eq!(rank, 1, "{status}");
            assert!(status.contains("code 7"), "{status}");
            assert!(
                status.contains("it last reported: training, epoch 1, step 5"),
                "{status}"
            );
        }
        other => panic!("expected rank 1 to be named, got {other:?}"),
    }
    assert!(
        start.elapsed() < Duration::from_secs(30),
        "{:?}",
        start.elapsed()
    );
}

#[test]
fn two_launchers_form_one_job_as_two_nodes_sharing_a_secret() {
    let exe = std::env::current_exe().unwrap();
    let port = free_port("127.0.0.1").unwrap();
    let secret = JobSecret::generate().unwrap();
    let node = |node_rank| {
        let mut cfg = LaunchConfig::new(exe.clone(), 2)
            .args(["--exact", ENTRY, "--ignored", "--nocapture"])
            .env("BDDP_TEST_SCENARIO", "sum")
            .env("BURN_DDP_TIMEOUT", "30");
        cfg.nnodes = 2;
        cfg.node_rank = node_rank;
        cfg.master_port = Some(port);
        cfg.secret = Some(secret.clone());
        cfg
    };
    std::thread::scope(|s| {
        let nodes: Vec<_> = (0..2).map(|n| s.spawn(move || launch(&node(n)))).collect();
        for (n, h) in nodes.into_iter().enumerate() {
            h.join()
                .unwrap()
                .unwrap_or_else(|e| panic!("node {n}: {e}"));
        }
    });
    // Without a shared secret, a multi-node launcher refuses to start.
    if std::env::var_os("BURN_DDP_SECRET").is_none() {
        let mut cfg = node(1);
        cfg.secret = None;
        let e = launch(&cfg).unwrap_err().to_string();
        assert!(e.contains("BURN_DDP_SECRET"), "{e}");
    }
}

#[test]
fn the_launcher_restarts_a_failed_job_when_asked() {
    let exe = std::env::current_exe().unwrap();
    let cfg = |restarts| {
        let mut cfg = LaunchConfig::new(exe.clone(), 2)
            .args(["--exact", ENTRY, "--ignored", "--nocapture"])
            .env("BDDP_TEST_SCENARIO", "fail_first_start")
            .env("BURN_DDP_TIMEOUT", "30");
        cfg.max_restarts = restarts;
        cfg
    };
    match launch(&cfg(0)) {
        Err(DdpError::RankFailed { rank: 1, .. }) => {}
        other => panic!("without restarts the job fails naming rank 1, got {other:?}"),
    }
    launch(&cfg(1)).expect("the restarted job succeeds");
}

#[test]
fn a_killed_job_restarted_by_the_launcher_resumes_bit_identically() {
    let scratch = std::env::temp_dir().join(format!("burn-ddp-restart-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&scratch);
    let results = scratch.join("results");
    std::fs::create_dir_all(&results).unwrap();
    let mut cfg = LaunchConfig::new(std::env::current_exe().unwrap(), 2)
        .args(["--exact", ENTRY, "--ignored", "--nocapture"])
        .env("BDDP_TEST_SCENARIO", "train")
        .env("BURN_DDP_TIMEOUT", "10")
        .env("BDDP_CKPT_DIR", scratch.join("ckpt"))
        .env("BDDP_CKPT_EVERY", "1")
        .env("BDDP_RESULT_DIR", &results)
        // Rank 1 dies in epoch 2 (6 training and 3 validation passes per epoch) on the first
        // start; the launcher restarts both ranks, which resume from the last checkpoint.
        .env("BDDP_DIE_RANK", "1")
        .env("BDDP_DIE_AT_FORWARD", "12");
    cfg.max_restarts = 1;
    launch(&cfg).expect("the restarted job finishes");
    let read = |r: usize| std::fs::read_to_string(results.join(format!("rank-{r}"))).unwrap();
    let (d0, d1) = (read(0), read(1));
    assert_eq!(d0, d1, "ranks differ");
    // The same job without a failure, as threads.
    let want = crate::train::uninterrupted_digest();
    assert_eq!(
        d0, want,
        "the resumed job differs from an uninterrupted one"
    );
    let _ = std::fs::remove_dir_all(&scratch);
}

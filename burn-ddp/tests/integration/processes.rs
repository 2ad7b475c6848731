//! Ranks as separate processes: this test binary re-runs itself as each rank (the ignored test
//! `rank_process` is the entry point), with the launcher variables in its environment.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use std::sync::Arc;

use burn_ddp::env::AGENT_STORE_VAR;
use burn_ddp::launch::{LaunchConfig, free_port, launch};
use burn_ddp::secret::JobSecret;
use burn_ddp::status::{PUBLISH_INTERVAL, Phase, RankStatus, status_key};
use burn_ddp::store::StoreServer;
use burn_ddp::train::{CheckpointConfig, inspect_checkpoint};
use burn_ddp::{DdpError, ProcessGroup, ReduceOp};

use crate::common::digest;
use crate::train::{Job, new_net, train_rank};

pub(crate) const ENTRY: &str = "processes::rank_process";
/// Exit code of a rank whose collective failed as expected.
const COLLECTIVE_FAILED: i32 = 3;

/// Entry point of rank processes; does nothing useful when run directly.
#[test]
#[ignore = "entry point of the rank processes the other tests start"]
fn rank_process() {
    let scenario = std::env::var("BDDP_TEST_SCENARIO").unwrap_or_default();
    if std::env::var("BDDP_DIE_BEFORE_JOIN").is_ok() {
        eprintln!("DYING before joining");
        std::process::exit(9);
    }
    let group = match ProcessGroup::from_env() {
        Ok(g) => g,
        Err(e) => {
            eprintln!("RANK_ERROR: {e}");
            std::process::exit(COLLECTIVE_FAILED);
        }
    };
    let rank = group.rank();
    match scenario.as_str() {
        // Sum ranks, check, exit.
        "sum" => {
            let out = group
                .all_reduce(vec![rank as f32; 1000], ReduceOp::Sum)
                .wait()
                .unwrap();
            let n = group.world_size();
            assert_eq!(out, vec![(n * (n - 1) / 2) as f32; 1000]);
            println!("SUM_OK {}", out[0]);
        }
        // All-reduce large buffers until something fails.
        "loop" => {
            let mut buf = vec![1.0f32; 4 << 20];
            for i in 0.. {
                match group.all_reduce(buf, ReduceOp::Avg).wait() {
                    Ok(b) => buf = b,
                    Err(e) => {
                        eprintln!("RANK_ERROR: {e}");
                        std::process::exit(COLLECTIVE_FAILED);
                    }
                }
                if i == 3 {
                    println!("READY");
                }
            }
        }
        // Rank 1 fails at once; the others are busy for a long time (the launcher must stop
        // them), then would all-reduce.
        "fail_rank_1" => {
            if rank == 1 {
                group.status().enter(Phase::Training, Some(1));
                group.status().step(5);
                std::thread::sleep(PUBLISH_INTERVAL * 3);
                std::process::exit(7);
            }
            std::thread::sleep(Duration::from_secs(60));
            if let Err(e) = group.all_reduce(vec![0f32; 10], ReduceOp::Sum).wait() {
                eprintln!("RANK_ERROR: {e}");
                std::process::exit(COLLECTIVE_FAILED);
            }
        }
        // Rank 1 fails on the job's first start only.
        "fail_first_start" => {
            if rank == 1 && burn_ddp::elastic::restart_count() == 0 {
                std::process::exit(7);
            }
            if let Err(e) = group.barrier().wait() {
                eprintln!("RANK_ERROR: {e}");
                std::process::exit(COLLECTIVE_FAILED);
            }
            println!("SUM_OK");
        }
        // DdpLearner training of the test model; checkpoints, ballast and dying come from the
        // environment.
        "train" => {
            let var = |k: &str| std::env::var(k).ok();
            let checkpoints = var("BDDP_CKPT_DIR").map(|dir| {
                let every = var("BDDP_CKPT_EVERY").map_or(0, |v| v.parse().unwrap());
                CheckpointConfig::new(dir).every(every)
            });
            let ballast = var("BDDP_BALLAST").map_or(0, |v| v.parse().unwrap());
            let job = Job {
                world: group.world_size(),
                checkpoints,
                fail_at: None,
                count: None,
            };
            let model = new_net((rank == 0).then_some(7), false);
            match train_rank(Arc::new(group), model, &job, ballast) {
                Ok(params) => {
                    let digest = digest(bytemuck::cast_slice(&params));
                    println!("TRAINED {digest}");
                    if let Some(dir) = var("BDDP_RESULT_DIR") {
                        let file = std::path::Path::new(&dir).join(format!("rank-{rank}"));
                        std::fs::write(file, digest.to_string()).unwrap();
                    }
                }
                Err(e) => {
                    eprintln!("RANK_ERROR: {e}");
                    let code = crate::train::EXIT_CODE.load(std::sync::atomic::Ordering::Relaxed);
                    std::process::exit(code);
                }
            }
        }
        other => panic!("unknown scenario {other:?}"),
    }
}

fn rank_command(scenario: &str, rank: usize, world: usize, port: u16) -> Command {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args([
        "--exact",
        ENTRY,
        "--ignored",
        "--nocapture",
        "--test-threads=1",
    ])
    .env("BDDP_TEST_SCENARIO", scenario)
    .env("RANK", rank.to_string())
    .env("WORLD_SIZE", world.to_string())
    .env("MASTER_ADDR", "127.0.0.1")
    .env("MASTER_PORT", port.to_string())
    .env("BURN_DDP_RENDEZVOUS_TIMEOUT", "60")
    .stdin(Stdio::null())
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    cmd
}

/// Kills whatever is still running when a test ends, passed or failed.
struct Ranks(Vec<Child>);

impl Drop for Ranks {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Waits for a child with a bound; returns its exit code and stderr.
fn finish(child: &mut Child, deadline: Instant) -> (Option<i32>, String) {
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            let mut err = String::new();
            if let Some(mut e) = child.stderr.take() {
                let _ = std::io::Read::read_to_string(&mut e, &mut err);
            }
            return (status.code(), err);
        }
        assert!(Instant::now() < deadline, "a rank did not exit in time");
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn ranks_as_processes_read_the_environment() {
    let port = free_port("127.0.0.1").unwrap();
    let mut ranks = Ranks(
        (0..3)
            .map(|r| rank_command("sum", r, 3, port).spawn().unwrap())
            .collect(),
    );
    let deadline = Instant::now() + Duration::from_secs(60);
    for child in &mut ranks.0 {
        let mut out = String::new();
        let mut stdout = child.stdout.take().unwrap();
        let (code, err) = finish(child, deadline);
        let _ = std::io::Read::read_to_string(&mut stdout, &mut out);
        assert_eq!(code, Some(0), "{err}");
        assert!(out.contains("SUM_OK 3"), "{out}");
    }
}

#[test]
fn invalid_environment_stops_the_process_with_the_variable_named() {
    let port = free_port("127.0.0.1").unwrap();
    let mut cmd = rank_command("sum", 0, 2, port);
    cmd.env("RANK", "2");
    let mut ranks = Ranks(vec![cmd.spawn().unwrap()]);
    let (code, err) = finish(&mut ranks.0[0], Instant::now() + Duration::from_secs(30));
    assert_eq!(code, Some(COLLECTIVE_FAILED), "{err}");
    assert!(
        err.contains("RANK=\"2\"") && err.contains("below WORLD_SIZE=2"),
        "{err}"
    );
}

#[test]
fn a_rank_killed_mid_all_reduce_is_named_by_every_other_rank() {
    let (world, victim) = (4, 2);
    let timeout = Duration::from_secs(4);
    let port = free_port("127.0.0.1").unwrap();
    let mut ranks = Ranks(
        (0..world)
            .map(|r| {
                let mut cmd = rank_command("loop", r, world, port);
                cmd.env("BURN_DDP_TIMEOUT", timeout.as_secs().to_string());
                cmd.spawn().unwrap()
            })
            .collect(),
    );
    // Wait until every rank has done a few all-reduces.
    let (tx, rx) = mpsc::channel();
    for child in &mut ranks.0 {
        let out = child.stdout.take().unwrap();
        let tx = tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if line.contains("READY") {
                    let _ = tx.send(());
                }
            }
        });
    }
    for _ in 0..world {
        rx.recv_timeout(Duration::from_secs(120))
            .expect("ranks never got going");
    }
    std::thread::sleep(Duration::from_millis(100));
    ranks.0[victim].kill().unwrap(); // SIGKILL
    let killed_at = Instant::now();
    let deadline = killed_at + timeout * 2;
    for (r, child) in ranks.0.iter_mut().enumerate() {
        if r == victim {
            continue;
        }
        let (code, err) = finish(child, deadline + Duration::from_secs(1));
        let took = killed_at.elapsed();
        assert_eq!(code, Some(COLLECTIVE_FAILED), "rank {r}: {err}");
        assert!(took < timeout * 2, "rank {r} took {took:?}");
        let line = err
            .lines()
            .find(|l| l.contains("RANK_ERROR"))
            .unwrap_or_default();
        assert!(
            line.contains(&format!("rank {victim} closed its connection")),
            "rank {r}: {line}"
        );
        assert!(line.contains("all_reduce #"), "rank {r}: {line}");
        assert!(line.contains("where the ranks were: "), "rank {r}: {line}");
    }
}

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

/// Ranks of the `train` scenario with a store served by the test (as the launcher's agent
/// store), so that the ranks' status reports outlive any rank; `extra` sets per-rank variables.
fn training_job(
    world: usize,
    env: &[(&str, String)],
    extra: impl Fn(usize) -> Vec<(&'static str, String)>,
) -> (StoreServer, Ranks) {
    let store = StoreServer::bind("127.0.0.1:0").unwrap();
    let port = store.local_addr().port();
    let ranks = (0..world)
        .map(|r| {
            let mut cmd = rank_command("train", r, world, port);
            cmd.env(AGENT_STORE_VAR, "1");
            for (k, v) in env.iter().cloned().chain(extra(r)) {
                cmd.env(k, v);
            }
            cmd.spawn().unwrap()
        })
        .collect();
    (store, Ranks(ranks))
}

/// The `RANK_ERROR` line of a rank's stderr.
fn rank_error(err: &str) -> &str {
    err.lines()
        .find(|l| l.contains("RANK_ERROR"))
        .unwrap_or_default()
}

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
        assert!(err.contains("ranks [1] did not join"), "rank {r}: {err}");
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

#[test]
fn a_rank_that_panics_in_its_forward_pass_is_named_with_where_it_was() {
    // The test harness turns the panic into exit code 101.
    rank_dies_in_forward(
        &[("BDDP_DIE_BY_PANIC", "1".to_string())],
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
            .and_then(|raw| RankStatus::from_bytes(&raw))
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

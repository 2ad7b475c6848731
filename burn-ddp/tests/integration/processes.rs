//! Ranks as separate processes: this test binary re-runs itself as each rank (the ignored test
//! `rank_process` is the entry point), with the launcher variables in its environment.
//!
//! - `ranks`: rank processes the test starts itself: the environment, a rank killed
//!   mid-collective;
//! - `training`: ranks of a DdpLearner job that die (before joining, in a forward pass, while
//!   writing a checkpoint) are named by the others;
//! - `launcher`: `burn_ddp::launch` stops, restarts and spans nodes with these processes;
//! - `forwarding`: ranks of the launcher binary get its stop signals only while they run, and
//!   the open-file limit it was started with.

mod forwarding;
mod launcher;
mod ranks;
mod training;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use burn_ddp::env::AGENT_STORE_VAR;
use burn_ddp::status::Phase;
use burn_ddp::store::StoreServer;
use burn_ddp::testing::PUBLISH_INTERVAL;
use burn_ddp::train::{CheckpointConfig, Sharding};
use burn_ddp::{ProcessGroup, ReduceOp};

use crate::common::digest;
use crate::train::{EXIT_CODE, Job, flex, new_net, train_rank};

pub(crate) const ENTRY: &str = "processes::rank_process";
/// Exit code of a rank whose collective failed as expected.
pub(crate) const COLLECTIVE_FAILED: i32 = 3;

/// Entry point of rank processes; does nothing useful when run directly.
#[test]
#[ignore = "entry point of the rank processes the other tests start"]
fn rank_process() {
    let scenario = std::env::var("BDDP_TEST_SCENARIO").unwrap_or_default();
    forwarding::before_joining(&scenario);
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
                        // Rank 0 serves the store the others read the agreed root cause from:
                        // it stays a moment, as a launcher's store would outlive the ranks,
                        // so that a rank that saw rank 0 leave first still learns the cause.
                        if rank == 0 {
                            std::thread::sleep(Duration::from_secs(1));
                        }
                        std::process::exit(COLLECTIVE_FAILED);
                    }
                }
                if i == 3 {
                    println!("READY {}", group.transport());
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
            let sharding = match var("BDDP_SHARDING").as_deref() {
                Some("optimizer") => Sharding::Optimizer,
                Some("gradients") => Sharding::OptimizerAndGradients,
                _ => Sharding::None,
            };
            let job = Job {
                sharding,
                ..Job::plain(group.world_size(), checkpoints)
            };
            let model = new_net(&flex(), (rank == 0).then_some(7), false);
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
                    let code = EXIT_CODE.load(std::sync::atomic::Ordering::Relaxed);
                    std::process::exit(code);
                }
            }
        }
        other => panic!("unknown scenario {other:?}"),
    }
}

/// This test binary, run as a rank process: only the (ignored) test `entry`.
pub(crate) fn rank_entry_command(entry: &str) -> Command {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args([
        "--exact",
        entry,
        "--ignored",
        "--nocapture",
        "--test-threads=1",
    ]);
    cmd
}

/// The command that runs this binary as rank `rank` of `world` in `scenario`.
pub(crate) fn rank_command(scenario: &str, rank: usize, world: usize, port: u16) -> Command {
    let mut cmd = rank_entry_command(ENTRY);
    cmd.env("BDDP_TEST_SCENARIO", scenario)
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
pub(crate) struct Ranks(pub(crate) Vec<Child>);

impl Drop for Ranks {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// `world` ranks of the `loop` scenario (all-reduces until killed) on `port`, with
/// `BURN_DDP_TIMEOUT` = `timeout` and the extra environment `env`; returns once every rank has
/// printed its READY line, with those lines.
pub(crate) fn looping_ranks(
    world: usize,
    port: u16,
    timeout: Duration,
    env: &[(&str, &str)],
) -> (Ranks, Vec<String>) {
    let mut ranks = Ranks(
        (0..world)
            .map(|r| {
                let mut cmd = rank_command("loop", r, world, port);
                cmd.env("BURN_DDP_TIMEOUT", timeout.as_secs().to_string())
                    .envs(env.iter().copied());
                cmd.spawn().unwrap()
            })
            .collect(),
    );
    let (tx, rx) = mpsc::channel();
    for child in &mut ranks.0 {
        let out = child.stdout.take().unwrap();
        let tx = tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if line.contains("READY") {
                    let _ = tx.send(line);
                }
            }
        });
    }
    let ready = (0..world)
        .map(|_| {
            rx.recv_timeout(Duration::from_secs(120))
                .expect("ranks never got going")
        })
        .collect();
    (ranks, ready)
}

/// SIGKILLs rank `victim` of `ranks`; every other rank must exit with [`COLLECTIVE_FAILED`]
/// within `within`, naming the victim in an all-reduce. Returns their error lines.
pub(crate) fn kill_and_expect_named(
    ranks: &mut Ranks,
    victim: usize,
    within: Duration,
) -> Vec<String> {
    std::thread::sleep(Duration::from_millis(100));
    ranks.0[victim].kill().unwrap(); // SIGKILL
    let killed_at = Instant::now();
    let mut lines = Vec::new();
    for (r, child) in ranks.0.iter_mut().enumerate() {
        if r == victim {
            continue;
        }
        let (code, err) = finish(child, killed_at + within + Duration::from_secs(1));
        let took = killed_at.elapsed();
        assert_eq!(code, Some(COLLECTIVE_FAILED), "rank {r}: {err}");
        assert!(took < within, "rank {r} took {took:?}");
        let line = err
            .lines()
            .find(|l| l.contains("RANK_ERROR"))
            .unwrap_or_default()
            .to_string();
        assert!(
            line.contains(&format!("rank {victim} closed its connection")),
            "rank {r}: {line}"
        );
        assert!(line.contains("all_reduce #"), "rank {r}: {line}");
        lines.push(line);
    }
    lines
}

/// Waits for a child with a bound; returns its exit code and stderr.
pub(crate) fn finish(child: &mut Child, deadline: Instant) -> (Option<i32>, String) {
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

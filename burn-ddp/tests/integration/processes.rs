//! Ranks as separate processes: this test binary re-runs itself as each rank (the ignored test
//! `rank_process` is the entry point), with the launcher variables in its environment.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use burn_ddp::launch::{LaunchConfig, free_port, launch};
use burn_ddp::{DdpError, ProcessGroup, ReduceOp};

const ENTRY: &str = "processes::rank_process";
/// Exit code of a rank whose collective failed as expected.
const COLLECTIVE_FAILED: i32 = 3;

/// Entry point of rank processes; does nothing useful when run directly.
#[test]
#[ignore = "entry point of the rank processes the other tests start"]
fn rank_process() {
    let scenario = std::env::var("BDDP_TEST_SCENARIO").unwrap_or_default();
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
                std::process::exit(7);
            }
            std::thread::sleep(Duration::from_secs(60));
            if let Err(e) = group.all_reduce(vec![0f32; 10], ReduceOp::Sum).wait() {
                eprintln!("RANK_ERROR: {e}");
                std::process::exit(COLLECTIVE_FAILED);
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
        }
        other => panic!("expected rank 1 to be named, got {other:?}"),
    }
    assert!(
        start.elapsed() < Duration::from_secs(30),
        "{:?}",
        start.elapsed()
    );
}

//! Under real torchrun (`torchrun` on PATH, e.g. `PATH=/path/to/venv/bin:$PATH`; skipped loudly
//! otherwise): hello_ddp and a quickstart epoch at world 2, and a failing rank whose error
//! reaches torchrun's "Root Cause" report through `TORCHELASTIC_ERROR_FILE`. Also the error
//! file as the library writes it, without torchrun.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use burn_ddp::elastic::ERROR_FILE_VAR;
use burn_ddp::launch::free_port;
use burn_ddp::{ProcessGroup, ReduceOp};

const ENTRY: &str = "torchrun::torchrun_rank";
const REASON: &str = "rank 1 gave up on purpose";
const LATER: &str = "a later error that must not replace the first";

/// Entry point of the rank processes below (under torchrun or started by a test).
#[test]
#[ignore = "entry point of the rank processes the other tests start"]
fn torchrun_rank() {
    let group = match ProcessGroup::from_env() {
        Ok(g) => g,
        Err(e) => {
            burn_ddp::elastic::record_error(&e);
            eprintln!("RANK_ERROR: {e}");
            std::process::exit(4);
        }
    };
    let ones = group.all_reduce(vec![1.0f32; 100], ReduceOp::Sum).wait();
    assert_eq!(ones.unwrap()[0], group.world_size() as f32);
    if group.rank() == 1 {
        group.abort(REASON);
        std::process::exit(5);
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        if let Err(e) = group.all_reduce(vec![0f32; 10], ReduceOp::Sum).wait() {
            eprintln!("RANK_ERROR: {e}");
            burn_ddp::elastic::record_error(&LATER);
            std::process::exit(3);
        }
    }
    std::process::exit(6);
}

fn on_path(program: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|dir| dir.join(program))
        .find(|p| p.is_file())
}

macro_rules! torchrun_or_skip {
    () => {
        match on_path("torchrun") {
            Some(t) => t,
            None => {
                eprintln!(
                    "SKIPPED: torchrun not on PATH (install torch in a venv and put its bin \
                     first on PATH to run this test)"
                );
                return;
            }
        }
    };
}

/// Runs `cmd` to completion within `limit` (see [`crate::bins::run_bounded`]); returns the exit
/// code and stdout + stderr.
fn run_bounded(cmd: Command, limit: Duration) -> (Option<i32>, String) {
    let out = crate::bins::run_bounded(cmd, limit);
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code(), text)
}

fn torchrun_command(torchrun: &Path, program: &Path, args: &[&str]) -> Command {
    let mut cmd = Command::new(torchrun);
    cmd.args(["--nproc-per-node", "2", "--no-python"])
        .arg(program)
        .args(args)
        .env("BURN_DDP_RENDEZVOUS_TIMEOUT", "60")
        .env("BURN_DDP_TIMEOUT", "60");
    cmd
}

#[test]
fn hello_ddp_runs_under_torchrun() {
    let torchrun = torchrun_or_skip!();
    let hello = crate::bins::example_bin("hello_ddp", "hello_ddp");
    let cmd = torchrun_command(&torchrun, &hello, &[]);
    let (code, out) = run_bounded(cmd, Duration::from_secs(180));
    println!("{out}");
    assert_eq!(code, Some(0), "{out}");
    for rank in 0..2 {
        let line = format!("rank {rank} of 2: sum of ranks 1 over 2 ranks");
        assert!(out.contains(&line), "no {line:?} in:\n{out}");
    }
}

#[test]
fn a_quickstart_epoch_runs_under_torchrun() {
    let torchrun = torchrun_or_skip!();
    let quickstart = crate::bins::example_bin("quickstart", "quickstart");
    let args = ["--epochs", "1", "--samples", "256"];
    let cmd = torchrun_command(&torchrun, &quickstart, &args);
    let (code, out) = run_bounded(cmd, Duration::from_secs(600));
    println!("{out}");
    assert_eq!(code, Some(0), "{out}");
    let digests: Vec<&str> = out
        .lines()
        .filter_map(|l| l.split("parameters digest ").nth(1))
        .collect();
    assert_eq!(digests.len(), 2, "{out}");
    assert_eq!(digests[0], digests[1], "replicas differ:\n{out}");
    assert!(out.contains("2 rank(s), 1 epochs"), "{out}");
}

/// Reads an error file and returns its `message.message`, checking torchrun's layout.
fn error_file_message(path: &Path) -> String {
    let raw = std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("reading the error file {}: {e}", path.display()));
    let json: serde_json::Value = serde_json::from_str(&raw).unwrap();
    let message = &json["message"];
    let text = message["message"].as_str().unwrap().to_string();
    assert_eq!(message["extraInfo"]["py_callstack"].as_str(), Some(&*text));
    let ts: u64 = message["extraInfo"]["timestamp"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(ts > 1_600_000_000, "{raw}");
    text
}

#[test]
fn a_failing_rank_is_torchruns_root_cause() {
    let torchrun = torchrun_or_skip!();
    let me = std::env::current_exe().unwrap();
    let args = [
        "--exact",
        ENTRY,
        "--ignored",
        "--nocapture",
        "--test-threads=1",
    ];
    let cmd = torchrun_command(&torchrun, &me, &args);
    let (code, out) = run_bounded(cmd, Duration::from_secs(180));
    println!("{out}");
    assert_ne!(code, Some(0), "{out}");
    let root = out
        .split("Root Cause (first observed failure):")
        .nth(1)
        .unwrap_or_else(|| panic!("no root cause in:\n{out}"));
    assert!(root.contains(REASON), "{out}");
    // The rank that gave up wrote its file when it stopped the group.
    let file = root
        .lines()
        .find_map(|l| l.trim().strip_prefix("error_file: "))
        .unwrap_or_else(|| panic!("no error file named in:\n{out}"));
    let message = error_file_message(Path::new(file.trim()));
    assert!(message.contains(REASON), "{message}");
    assert!(!message.contains(LATER), "{message}");
}

#[test]
fn failing_ranks_write_the_error_file_torchrun_reads() {
    let dir = std::env::temp_dir().join(format!("bddp-error-file-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let port = free_port("127.0.0.1").unwrap();
    // Both ranks at once, each bounded (see crate::bins::run_bounded).
    let ranks: Vec<_> = (0..2)
        .map(|rank| {
            let mut cmd = crate::processes::rank_entry_command(ENTRY);
            cmd.env("RANK", rank.to_string())
                .env("WORLD_SIZE", "2")
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .env("BURN_DDP_RENDEZVOUS_TIMEOUT", "60")
                .env(ERROR_FILE_VAR, dir.join(format!("{rank}.json")));
            std::thread::spawn(move || {
                crate::bins::run_bounded(cmd, Duration::from_secs(120))
                    .status
                    .code()
            })
        })
        .collect();
    let codes: Vec<_> = ranks.into_iter().map(|t| t.join().unwrap()).collect();
    assert_eq!(codes, vec![Some(3), Some(5)]);
    let gave_up = error_file_message(&dir.join("1.json"));
    assert!(
        gave_up.starts_with(&format!(
            "rank 1: stopped the group: {REASON}; where the ranks were:"
        )),
        "{gave_up}"
    );
    // The first failure of rank 0 (its collective), not the later error from its main.
    let saw = error_file_message(&dir.join("0.json"));
    assert!(saw.starts_with("rank 0: all_reduce #"), "{saw}");
    assert!(
        saw.contains(REASON) && saw.contains("where the ranks were"),
        "{saw}"
    );
    assert!(!saw.contains(LATER), "{saw}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn torchrun_variables_select_its_store_and_the_attempt() {
    use burn_ddp::env::LaunchEnv;
    use burn_ddp::store::StoreKind;
    let vars = |extra: &[(&'static str, &'static str)]| {
        let mut v = vec![
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "localhost"),
            ("MASTER_PORT", "43917"),
        ];
        v.extend_from_slice(extra);
        LaunchEnv::from_lookup(move |k| v.iter().find(|(n, _)| *n == k).map(|(_, x)| x.to_string()))
    };
    let plain = vars(&[]).unwrap();
    assert_eq!(
        (plain.store_kind.clone(), plain.agent_store),
        (StoreKind::BurnDdp, false)
    );
    assert_eq!(plain.restart_count, 0);
    let env = vars(&[
        ("TORCHELASTIC_USE_AGENT_STORE", "True"),
        ("TORCHELASTIC_RESTART_COUNT", "3"),
    ])
    .unwrap();
    assert!(env.agent_store);
    assert_eq!(env.restart_count, 3);
    let namespace = "burn_ddp/attempt_3/".to_string();
    assert_eq!(env.store_kind, StoreKind::C10d { namespace });
    // burn-ddp-run's count wins over torchrun's.
    let ours = vars(&[
        ("TORCHELASTIC_RESTART_COUNT", "3"),
        ("BURN_DDP_RESTART_COUNT", "1"),
    ]);
    assert_eq!(ours.unwrap().restart_count, 1);
    let err = vars(&[("TORCHELASTIC_USE_AGENT_STORE", "maybe")]).unwrap_err();
    assert!(
        err.to_string().contains("TORCHELASTIC_USE_AGENT_STORE"),
        "{err}"
    );
}

#[test]
fn a_job_restarted_by_torchrun_starts_afresh_in_the_same_store() {
    let torchrun = torchrun_or_skip!();
    let me = std::env::current_exe().unwrap();
    // Rank 1 exits on the first attempt; torchrun restarts both ranks, which then meet in the
    // same agent store. Keys of attempt 0 (taken rank numbers, the failure record) would
    // refuse or fail attempt 1 if they were visible to it.
    let mut cmd = Command::new(torchrun);
    cmd.args([
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "--no-python",
    ])
    .arg(me)
    .args([
        "--exact",
        "processes::rank_process",
        "--ignored",
        "--nocapture",
        "--test-threads=1",
    ])
    .env("BDDP_TEST_SCENARIO", "fail_first_start")
    .env("BURN_DDP_RENDEZVOUS_TIMEOUT", "60")
    .env("BURN_DDP_TIMEOUT", "60");
    let (code, out) = run_bounded(cmd, Duration::from_secs(240));
    println!("{out}");
    assert_eq!(code, Some(0), "{out}");
    assert_eq!(out.matches("SUM_OK").count(), 2, "{out}");
}

//! Where the ranks' output goes under the real launcher binary: rank 0 gets the terminal (no
//! prefix) when the launcher runs in one, every line is prefixed otherwise; `--log-dir`,
//! `--tee` and `--local-ranks-filter` as torchrun's.

use std::process::Command;
use std::time::Duration;

use crate::bins::run_bounded;
use crate::processes::ENTRY;

/// `burn-ddp-run FLAGS --nproc 2 <this test binary as ranks of the "sum" scenario>` as a shell
/// command line.
fn command_line(flags: &str) -> String {
    let exe = std::env::current_exe().unwrap();
    format!(
        "{} --nproc 2 {flags} {} --exact {ENTRY} --ignored --nocapture",
        env!("CARGO_BIN_EXE_burn-ddp-run"),
        exe.display()
    )
}

/// Runs a shell command with the "sum" scenario's environment; returns its stdout, within a
/// bound (see [`crate::bins::run_bounded`]).
fn run(shell: &str) -> String {
    let mut cmd = Command::new("sh");
    cmd.args(["-c", shell])
        .env("BDDP_TEST_SCENARIO", "sum")
        .env("BURN_DDP_TIMEOUT", "20");
    let out = run_bounded(cmd, Duration::from_secs(60));
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    );
    assert!(out.status.success(), "{shell}: {stdout}\n{stderr}");
    stdout
}

fn scratch(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("burn-ddp-out-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

#[test]
fn in_a_pipe_every_rank_is_prefixed_and_the_filter_shows_only_its_ranks() {
    let out = run(&command_line(""));
    assert!(
        out.contains("[rank 0] SUM_OK") && out.contains("[rank 1] SUM_OK"),
        "{out}"
    );
    let out = run(&command_line("--local-ranks-filter 1"));
    assert!(out.contains("[rank 1] SUM_OK"), "{out}");
    assert!(!out.contains("[rank 0]"), "rank 0 is filtered out: {out}");
}

#[test]
fn log_dir_writes_one_file_per_rank_and_tee_also_shows_it() {
    let dir = scratch("logs");
    let out = run(&command_line(&format!("--log-dir {}", dir.display())));
    assert!(
        !out.contains("SUM_OK"),
        "without --tee the output goes to files only: {out}"
    );
    for r in 0..2 {
        let log = std::fs::read_to_string(dir.join(format!("rank-{r}.log"))).unwrap();
        assert!(
            log.lines().any(|l| l.starts_with("SUM_OK")),
            "rank {r}: {log}"
        );
    }
    let out = run(&command_line(&format!("--log-dir {} --tee", dir.display())));
    assert!(
        out.contains("[rank 0] SUM_OK") && out.contains("[rank 1] SUM_OK"),
        "{out}"
    );
    assert!(
        std::fs::read_to_string(dir.join("rank-1.log"))
            .unwrap()
            .contains("SUM_OK")
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn in_a_terminal_rank_0_has_it_unprefixed() {
    if Command::new("script").arg("--version").output().is_err() {
        println!("SKIPPED: `script` (util-linux) is not installed, so no terminal can be made");
        return;
    }
    // `script` runs the launcher on a new pseudo-terminal and copies what it shows.
    let out = run(&format!(
        "script -qfec '{}' /dev/null",
        command_line("").replace('\'', "'\\''")
    ));
    let lines: Vec<&str> = out.lines().map(|l| l.trim_end_matches('\r')).collect();
    assert!(
        lines.contains(&"SUM_OK 1"),
        "rank 0 writes to the terminal itself: {out}"
    );
    assert!(lines.contains(&"[rank 1] SUM_OK 1"), "{out}");
}

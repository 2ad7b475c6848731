//! Real Open MPI: `mpirun` starts the example programs, which read `OMPI_COMM_WORLD_*` and the
//! exported `MASTER_ADDR`/`MASTER_PORT`. Skipped, loudly, where `mpirun` is not installed
//! (`.ci/run` installs Debian's `openmpi-bin`).

use std::process::Command;
use std::time::Duration;

use burn_ddp::launch::free_port;

use crate::bins::{example_bin, run_bounded};

/// Longest one mpirun job may take (start-up, rendezvous, an epoch on a loaded 2-core machine).
const LIMIT: Duration = Duration::from_secs(240);

/// Whether `mpirun` is on PATH; says loudly that the test is skipped when not.
fn have_mpirun() -> bool {
    let found = std::env::var_os("PATH")
        .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join("mpirun").is_file()));
    if !found {
        println!("SKIPPED: mpirun not on PATH (install Debian's openmpi-bin to run this test)");
    }
    found
}

/// `mpirun` ready to start `np` copies of `program` on this machine.
fn mpirun(np: usize, program: &std::path::Path) -> Command {
    let port = free_port("127.0.0.1").expect("a free port");
    let mut cmd = Command::new("mpirun");
    cmd.args(["--allow-run-as-root", "--oversubscribe", "-np"])
        .arg(np.to_string())
        .args(["-x", "MASTER_ADDR", "-x", "MASTER_PORT"])
        .args([
            "-x",
            "BURN_DDP_RENDEZVOUS_TIMEOUT",
            "-x",
            "BURN_DDP_TIMEOUT",
        ])
        .arg(program)
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .env("BURN_DDP_RENDEZVOUS_TIMEOUT", "120")
        .env("BURN_DDP_TIMEOUT", "120")
        // Only Open MPI's variables may describe the ranks.
        .env_remove("RANK")
        .env_remove("WORLD_SIZE")
        .env_remove("SLURM_PROCID")
        .env_remove("SLURM_NTASKS");
    cmd
}

fn text(out: &std::process::Output) -> String {
    format!(
        "{}\n--- stderr ---\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

#[test]
fn mpirun_runs_a_three_rank_all_reduce() {
    if !have_mpirun() {
        return;
    }
    let hello = example_bin("hello_ddp", "hello_ddp");
    let cmd = mpirun(3, &hello);
    let out = run_bounded(cmd, LIMIT);
    let shown = text(&out);
    assert!(out.status.success(), "{shown}");
    for rank in 0..3 {
        assert!(
            shown.contains(&format!("rank {rank} of 3: sum of ranks 3 over 3 ranks")),
            "rank {rank} missing:\n{shown}"
        );
    }
    // Rank 0 lists what every rank gathered: three distinct processes.
    assert_eq!(shown.matches("  rank ").count(), 3, "{shown}");
}

#[test]
fn mpirun_trains_the_quickstart_with_identical_replicas() {
    if !have_mpirun() {
        return;
    }
    let quickstart = example_bin("quickstart", "quickstart");
    let mut cmd = mpirun(2, &quickstart);
    cmd.args(["--epochs", "1", "--samples", "256", "--quiet"]);
    let out = run_bounded(cmd, LIMIT);
    let shown = text(&out);
    assert!(out.status.success(), "{shown}");
    let digests: Vec<&str> = shown
        .lines()
        .filter_map(|l| l.trim().strip_prefix("parameters digest "))
        .collect();
    assert_eq!(digests.len(), 2, "one digest per rank expected:\n{shown}");
    assert_eq!(digests[0], digests[1], "the replicas differ:\n{shown}");
    assert!(shown.contains("2 rank(s), 1 epochs"), "{shown}");
}

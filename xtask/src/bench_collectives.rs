//! `bench-collectives`: the all-reduce and reduce-scatter benchmark on N rank processes,
//! optionally with PyTorch gloo's all-reduce in the same run (and, with `--hosts`, across hosts
//! of network namespaces: `across_hosts`; the rank program's reports: `report`). It prints
//! figures, it does not pass or fail; it builds in the release profile unless given `--debug`
//! (the smoke test's way to run it quickly).

mod across_hosts;
mod report;

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};
use burn_ddp::launch::{LaunchConfig, launch};
use clap::Args;

use across_hosts::AcrossHosts;
use report::{Row, human, read_report};

use crate::build::build_cpu_program;

/// The all-reduce and reduce-scatter benchmark on N rank processes: time, algbw and busbw
/// against memcpy.
#[derive(Debug, Args)]
pub struct BenchCollectives {
    /// Rank processes
    #[arg(long, value_name = "N", default_value_t = 2)]
    world: usize,
    /// Message sizes, comma-separated (K, M, G: binary multiples) [default: 4K to 256M]
    #[arg(long, value_name = "SIZES")]
    sizes: Option<String>,
    /// Pipelining chunk of the transport [default: 512K]
    #[arg(long, value_name = "BYTES")]
    chunk: Option<String>,
    /// How long a collective spins before sleeping, in microseconds [default: 20]
    #[arg(long, value_name = "US")]
    spin_us: Option<u64>,
    /// Reduction operator [default: sum]
    #[arg(long, value_parser = ["sum", "avg", "max"])]
    op: Option<String>,
    /// Collectives to time, comma-separated (all-reduce, reduce-scatter; busbw as nccl-tests
    /// define it for each) [default: both]
    #[arg(long, value_name = "LIST")]
    collectives: Option<String>,
    /// Transport of the collectives [default: auto, shared memory on one host]
    #[arg(long, value_parser = ["tcp", "shm", "auto"])]
    transport: Option<String>,
    /// Element type: f32, or bf16 standing for f32 gradients sent compressed (a size S is an
    /// all-reduce of S/2 bytes of bf16, its algbw that of S bytes) [default: f32; with
    /// --hosts: both]
    #[arg(long, value_parser = ["f32", "bf16"])]
    dtype: Option<String>,
    /// Also time PyTorch gloo's all-reduce in the same run, with this Python (one with torch
    /// installed), and print the ratios
    #[arg(long, value_name = "PYTHON")]
    gloo: Option<PathBuf>,
    /// Run on this many hosts made of network namespaces (root; see `cargo xtask cluster`),
    /// comparing the flat TCP ring with the hierarchical all-reduce
    #[arg(long, value_name = "N")]
    hosts: Option<usize>,
    /// With --hosts: ranks per host
    #[arg(long, value_name = "N", default_value_t = 2, requires = "hosts")]
    nproc_per_host: usize,
    /// With --hosts: rate of each host's link in tc syntax (`1gbit`) [default: unlimited]
    #[arg(long, value_name = "RATE", requires = "hosts")]
    link_rate: Option<String>,
    /// Build in the dev profile (quick to build, not for figures)
    #[arg(long)]
    debug: bool,
}

impl BenchCollectives {
    /// The flags of the rank program that this task forwards (not the transport nor the
    /// element type).
    fn forwarded(&self) -> Vec<String> {
        let mut out = Vec::new();
        let spin = self.spin_us.map(|us| us.to_string());
        for (name, value) in [
            ("--sizes", &self.sizes),
            ("--chunk", &self.chunk),
            ("--spin-us", &spin),
            ("--op", &self.op),
            ("--collectives", &self.collectives),
        ] {
            if let Some(v) = value {
                out.extend([name.to_string(), v.clone()]);
            }
        }
        out
    }
}

/// Runs `bench-collectives`.
pub fn bench_collectives(task: BenchCollectives) -> Result<()> {
    if let Some(hosts) = task.hosts {
        return across_hosts::bench(&AcrossHosts {
            hosts,
            per_host: task.nproc_per_host,
            link_rate: task.link_rate.as_deref(),
            dtype: task.dtype.as_deref(),
            forwarded: task.forwarded(),
            debug: task.debug,
        });
    }
    let exe = build_cpu_program("bench_collectives", !task.debug)?;
    let scratch = std::env::temp_dir().join(format!("burn-ddp-bench-coll-{}", std::process::id()));
    std::fs::create_dir_all(&scratch)?;
    let ours = scratch.join("burn-ddp.txt");
    let mut forwarded = vec!["--report".to_string(), ours.display().to_string()];
    forwarded.extend(task.forwarded());
    for (name, value) in [("--transport", &task.transport), ("--dtype", &task.dtype)] {
        if let Some(v) = value {
            forwarded.extend([name.to_string(), v.clone()]);
        }
    }
    launch(&LaunchConfig::new(exe, task.world).args(forwarded)).context("benchmark failed")?;
    if let Some(python) = &task.gloo {
        let theirs = scratch.join("gloo.txt");
        let sizes: Vec<String> = read_report(&ours)?
            .iter()
            .map(|r| r.0.to_string())
            .collect();
        run_gloo(python, task.world, &sizes.join(","), &scratch, &theirs)?;
        print_comparison(&read_report(&ours)?, &read_report(&theirs)?);
    }
    let _ = std::fs::remove_dir_all(&scratch);
    Ok(())
}

/// Runs gloo's all-reduce benchmark under torchrun with `python`.
fn run_gloo(python: &Path, world: usize, sizes: &str, scratch: &Path, report: &Path) -> Result<()> {
    let script = scratch.join("gloo_all_reduce.py");
    std::fs::write(&script, include_str!("gloo_all_reduce.py"))?;
    let port = burn_ddp::launch::free_port("127.0.0.1").context("finding a free port")?;
    println!(
        "PyTorch gloo all-reduce, world {world} (torchrun, {})",
        python.display()
    );
    let status = Command::new(python)
        .args(["-m", "torch.distributed.run", "--nproc-per-node"])
        .arg(world.to_string())
        .args(["--master-addr", "127.0.0.1", "--master-port"])
        .arg(port.to_string())
        .arg(&script)
        .args(["--sizes", sizes, "--report"])
        .arg(report)
        .env("OMP_NUM_THREADS", "1")
        .status()
        .with_context(|| format!("running {} (is torch installed there?)", python.display()))?;
    if !status.success() {
        bail!(
            "the gloo benchmark failed ({status}); does {} have torch?",
            python.display()
        );
    }
    Ok(())
}

/// Prints burn-ddp's figures next to gloo's, size by size, with their ratios.
fn print_comparison(ours: &[Row], gloo: &[Row]) {
    println!(
        "{:>9} {:>14} {:>14} {:>12} {:>13} {:>13} {:>12}",
        "size",
        "burn-ddp(us)",
        "gloo(us)",
        "time ratio",
        "busbw(GB/s)",
        "gloo(GB/s)",
        "busbw ratio"
    );
    for (o, g) in ours.iter().zip(gloo) {
        println!(
            "{:>9} {:>14.1} {:>14.1} {:>12.3} {:>13.3} {:>13.3} {:>12.2}",
            human(o.0),
            o.1,
            g.1,
            o.1 / g.1,
            o.2,
            g.2,
            o.2 / g.2
        );
    }
}

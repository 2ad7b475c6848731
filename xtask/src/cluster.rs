//! `cluster`: runs a program on several hosts made of network namespaces on this machine
//! (`burn_ddp::testing::cluster`, the same hosts the cross-host tests use): one `burn-ddp-run`
//! per host, each host's output prefixed with `[host i]`, everything removed afterwards (Ctrl-C
//! included). Needs root.

use std::ffi::OsString;
use std::io::{BufRead, BufReader, Read};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use burn_ddp::secret::JobSecret;
use burn_ddp::testing::cluster::{Cluster, ClusterConfig, ClusterJob};
use clap::Args;

use crate::build::build_cpu_program;

/// Hosts of network namespaces on this machine, one launcher per host.
#[derive(Debug, Args)]
pub struct ClusterTask {
    /// Hosts (network namespaces joined by a bridge, 10.77.0.1, 10.77.0.2, ...)
    #[arg(long, value_name = "N", default_value_t = 2)]
    hosts: usize,
    /// Ranks on each host
    #[arg(long, value_name = "N", default_value_t = 1)]
    nproc_per_host: usize,
    /// Rate of each host's link in tc syntax (`1gbit`, `100mbit`) [default: unlimited]
    #[arg(long, value_name = "RATE")]
    link_rate: Option<String>,
    /// The program and its arguments (after `--`)
    #[arg(required = true, trailing_var_arg = true, value_name = "PROGRAM")]
    program: Vec<OsString>,
}

/// Runs `cluster`.
pub fn cluster(task: ClusterTask) -> Result<()> {
    let launcher = build_cpu_program("burn-ddp-run", true)?;
    let mut program = task.program.clone();
    let exe = PathBuf::from(&program[0]);
    if exe.components().count() > 1 {
        program[0] = exe
            .canonicalize()
            .with_context(|| format!("the program {}", exe.display()))?
            .into_os_string();
    }
    let cluster = create(task.hosts, task.link_rate.clone())?;
    let job = job(&launcher, task.nproc_per_host, program, Vec::new())?;
    eprintln!(
        "cluster: {} hosts x {} ranks ({}), links {}",
        task.hosts,
        task.nproc_per_host,
        (0..task.hosts)
            .map(|i| format!("{}: {}", cluster.namespace(i), cluster.address(i)))
            .collect::<Vec<_>>()
            .join(", "),
        task.link_rate.as_deref().unwrap_or("unlimited")
    );
    let stop = Arc::new(AtomicBool::new(false));
    for signal in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(signal, stop.clone()).context("handling Ctrl-C")?;
    }
    let mut children = Vec::new();
    let mut pumps = Vec::new();
    for i in 0..task.hosts {
        let mut child = cluster
            .spawn(&job, i)
            .with_context(|| format!("starting host {i}'s launcher"))?;
        let out: Box<dyn Read + Send> = Box::new(child.stdout.take().context("stdout")?);
        let err: Box<dyn Read + Send> = Box::new(child.stderr.take().context("stderr")?);
        for stream in [out, err] {
            pumps.push(std::thread::spawn(move || {
                for line in BufReader::new(stream).lines().map_while(|l| l.ok()) {
                    println!("[host {i}] {line}");
                }
            }));
        }
        children.push(child);
    }
    let mut statuses = vec![None; children.len()];
    while statuses.iter().any(Option::is_none) {
        if stop.load(Ordering::Relaxed) {
            eprintln!("cluster: stopped; removing the hosts");
            break;
        }
        for (child, status) in children.iter_mut().zip(&mut statuses) {
            if status.is_none() {
                *status = child.try_wait().context("waiting for a launcher")?;
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    // Kills what still runs in the namespaces, then removes them.
    drop(cluster);
    for p in pumps {
        let _ = p.join();
    }
    let failed: Vec<String> = statuses
        .iter()
        .enumerate()
        .filter(|(_, s)| !s.is_some_and(|s| s.success()))
        .map(|(i, s)| match s {
            Some(s) => format!("host {i} ({s})"),
            None => format!("host {i} (stopped)"),
        })
        .collect();
    if !failed.is_empty() {
        bail!("failed: {}", failed.join(", "));
    }
    Ok(())
}

/// `hosts` hosts of network namespaces, each link limited to `link_rate` (tc syntax) if given.
pub fn create(hosts: usize, link_rate: Option<String>) -> Result<Cluster> {
    let mut config = ClusterConfig::new(hosts);
    config.link_rate = link_rate;
    Ok(Cluster::create(&config)?)
}

/// Runs `job` on every host of `cluster` (one launcher each) and waits for all of them; a host
/// that fails is an error carrying its output.
pub fn run_job(cluster: &Cluster, job: &ClusterJob) -> Result<()> {
    let children: Vec<_> = (0..cluster.hosts())
        .map(|i| cluster.spawn(job, i))
        .collect::<std::io::Result<_>>()
        .context("starting the launchers")?;
    for (i, child) in children.into_iter().enumerate() {
        let out = child.wait_with_output().context("waiting for a launcher")?;
        if !out.status.success() {
            bail!(
                "host {i} failed ({}):\n{}{}",
                out.status,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
    Ok(())
}

/// A job of `program` with `nproc_per_host` ranks per host, a fresh secret and the port the
/// cluster tasks use.
pub fn job(
    launcher: &std::path::Path,
    nproc_per_host: usize,
    program: Vec<OsString>,
    env: Vec<(String, String)>,
) -> Result<ClusterJob> {
    Ok(ClusterJob {
        launcher: launcher.to_path_buf(),
        nproc_per_host,
        program,
        env,
        master_port: 29_500,
        secret: JobSecret::generate()?.to_env_value(),
    })
}

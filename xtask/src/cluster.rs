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

/// `bench-collectives --hosts N`: the all-reduce benchmark on a cluster of namespaces, over the
/// flat TCP ring and the hierarchical all-reduce, in f32 and in bf16 (standing for f32
/// gradients sent compressed), with algbw as a fraction of the link rate.
pub fn bench_across_hosts(task: &crate::bench_collectives::BenchCollectives) -> Result<()> {
    use crate::bench_collectives::{human, read_report};
    let (hosts, per_host, debug) = (task.hosts.unwrap_or(1), task.nproc_per_host, task.debug);
    let rate = task.link_rate.as_deref();
    let launcher = build_cpu_program("burn-ddp-run", !debug)?;
    let exe = build_cpu_program("bench_collectives", !debug)?;
    let cluster = create(hosts, rate.map(str::to_string))?;
    let scratch = std::env::temp_dir().join(format!("burn-ddp-bench-hosts-{}", std::process::id()));
    std::fs::create_dir_all(&scratch)?;
    let dtypes: Vec<&str> = match task.dtype.as_deref() {
        Some(d) => vec![d],
        None => vec!["f32", "bf16"],
    };
    let algorithms = [("flat ring (tcp)", "tcp"), ("hierarchical (auto)", "auto")];
    let mut tables = Vec::new();
    for dtype in &dtypes {
        for (label, transport) in algorithms {
            let report = scratch.join(format!("{transport}-{dtype}.txt"));
            let mut program: Vec<OsString> = vec![exe.clone().into_os_string()];
            program.extend(task.forwarded().into_iter().map(OsString::from));
            program.extend(["--transport", transport, "--dtype", dtype].map(OsString::from));
            program.extend(["--report".into(), report.clone().into_os_string()]);
            eprintln!("bench-collectives: {label}, {dtype}, on {hosts} hosts x {per_host}");
            run_job(&cluster, &job(&launcher, per_host, program, Vec::new())?)?;
            tables.push((label, *dtype, read_report(&report)?));
        }
    }
    drop(cluster);
    let _ = std::fs::remove_dir_all(&scratch);
    let link = rate.and_then(link_bytes_per_sec);
    println!(
        "all-reduce across {hosts} hosts x {per_host} ranks, links {}; algbw = size / time; \
         the limit between two hosts is algbw = link rate",
        rate.unwrap_or("unlimited")
    );
    if dtypes.contains(&"bf16") {
        println!(
            "bf16 rows: gradients of `size` bytes of f32 sent as bf16 (an all-reduce of size/2 \
             bytes); their algbw is of the f32 size, so it compares with the f32 rows \
             (conversions not timed); `vs f32`: the same algorithm's f32 time over this one"
        );
    }
    println!(
        "{:>9} {:>20} {:>5} {:>12} {:>12} {:>8} {:>7}",
        "size", "algorithm", "dtype", "median(us)", "algbw(MB/s)", "of link", "vs f32"
    );
    for row in 0..tables[0].2.len() {
        for (label, dtype, rows) in &tables {
            let Some(&(bytes, us, _)) = rows.get(row) else {
                continue;
            };
            let algbw = bytes as f64 / (us * 1e-6);
            let frac = link.map_or("-".to_string(), |l| format!("{:.3}", algbw / l));
            let f32_us = tables
                .iter()
                .find(|(l, d, _)| l == label && *d == "f32")
                .and_then(|(_, _, rows)| rows.get(row))
                .filter(|r| r.0 == bytes && *dtype != "f32");
            let speedup = f32_us.map_or("-".to_string(), |r| format!("{:.2}x", r.1 / us));
            println!(
                "{:>9} {:>20} {:>5} {:>12.1} {:>12.1} {:>8} {:>7}",
                human(bytes),
                label,
                dtype,
                us,
                algbw / 1e6,
                frac,
                speedup
            );
        }
    }
    Ok(())
}

/// A `tc` rate (`1gbit`, `100mbit`, `500kbit`) in bytes per second.
fn link_bytes_per_sec(rate: &str) -> Option<f64> {
    let r = rate.trim().to_ascii_lowercase();
    let (num, mult) = [("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3), ("bit", 1.0)]
        .into_iter()
        .find_map(|(suffix, m)| r.strip_suffix(suffix).map(|n| (n.to_string(), m)))?;
    num.trim().parse::<f64>().ok().map(|n| n * mult / 8.0)
}

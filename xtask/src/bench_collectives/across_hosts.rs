//! `bench-collectives --hosts N`: the all-reduce benchmark on a cluster of network namespaces
//! (`crate::cluster`), over the flat TCP ring and the hierarchical all-reduce, in f32 and in
//! bf16 (standing for f32 gradients sent compressed), with algbw as a fraction of the link
//! rate. It is given what it runs ([`AcrossHosts`]) and reaches neither the task's flags nor
//! back into `bench_collectives`.

use std::ffi::OsString;

use anyhow::Result;

use super::report::{human, read_report};
use crate::build::build_cpu_program;
use crate::cluster::{create, job, run_job};

/// What the benchmark across hosts runs: the cluster's shape, the element types and the rank
/// program's other flags.
pub(super) struct AcrossHosts<'a> {
    /// Hosts of network namespaces.
    pub hosts: usize,
    /// Ranks per host.
    pub per_host: usize,
    /// Rate of each host's link in tc syntax (`1gbit`); unlimited when `None`.
    pub link_rate: Option<&'a str>,
    /// One element type, or both f32 and bf16 when `None`.
    pub dtype: Option<&'a str>,
    /// The rank program's flags besides the transport, the element type and the report.
    pub forwarded: Vec<String>,
    /// Build in the dev profile.
    pub debug: bool,
}

/// Runs the benchmark on `task.hosts` hosts, each link limited to `task.link_rate`, and prints
/// the table.
pub(super) fn bench(task: &AcrossHosts) -> Result<()> {
    let (hosts, per_host, debug) = (task.hosts, task.per_host, task.debug);
    let rate = task.link_rate;
    let launcher = build_cpu_program("burn-ddp-run", !debug)?;
    let exe = build_cpu_program("bench_collectives", !debug)?;
    let cluster = create(hosts, rate.map(str::to_string))?;
    let scratch = std::env::temp_dir().join(format!("burn-ddp-bench-hosts-{}", std::process::id()));
    std::fs::create_dir_all(&scratch)?;
    let dtypes: Vec<&str> = match task.dtype {
        Some(d) => vec![d],
        None => vec!["f32", "bf16"],
    };
    let algorithms = [("flat ring (tcp)", "tcp"), ("hierarchical (auto)", "auto")];
    let mut tables = Vec::new();
    for dtype in &dtypes {
        for (label, transport) in algorithms {
            let report = scratch.join(format!("{transport}-{dtype}.txt"));
            let mut program: Vec<OsString> = vec![exe.clone().into_os_string()];
            program.extend(task.forwarded.iter().map(OsString::from));
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

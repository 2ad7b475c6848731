//! `bench-collectives` and `bench-train`: benchmarks that print figures (they do not pass or
//! fail). Both build in the release profile unless given `--debug` (the smoke test's way to run
//! them quickly).

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};
use burn_ddp::launch::{LaunchConfig, launch};
use clap::Args;

use crate::build::build_cpu_program;

/// The all-reduce benchmark on N rank processes: time, algbw and busbw against memcpy.
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
    /// Transport of the collectives [default: auto, shared memory on one host]
    #[arg(long, value_parser = ["tcp", "shm", "auto"])]
    transport: Option<String>,
    /// Element type: f32, or bf16 standing for f32 gradients sent compressed (a size S is an
    /// all-reduce of S/2 bytes of bf16, its algbw that of S bytes) [default: f32; with
    /// --hosts: both]
    #[arg(long, value_parser = ["f32", "bf16"])]
    pub(crate) dtype: Option<String>,
    /// Also time PyTorch gloo's all-reduce in the same run, with this Python (one with torch
    /// installed), and print the ratios
    #[arg(long, value_name = "PYTHON")]
    gloo: Option<PathBuf>,
    /// Run on this many hosts made of network namespaces (root; see `cargo xtask cluster`),
    /// comparing the flat TCP ring with the hierarchical all-reduce
    #[arg(long, value_name = "N")]
    pub(crate) hosts: Option<usize>,
    /// With --hosts: ranks per host
    #[arg(long, value_name = "N", default_value_t = 2, requires = "hosts")]
    pub(crate) nproc_per_host: usize,
    /// With --hosts: rate of each host's link in tc syntax (`1gbit`) [default: unlimited]
    #[arg(long, value_name = "RATE", requires = "hosts")]
    pub(crate) link_rate: Option<String>,
    /// Build in the dev profile (quick to build, not for figures)
    #[arg(long)]
    pub(crate) debug: bool,
}

impl BenchCollectives {
    /// The flags of the rank program that this task forwards (not the transport nor the
    /// element type).
    pub fn forwarded(&self) -> Vec<String> {
        let mut out = Vec::new();
        let spin = self.spin_us.map(|us| us.to_string());
        for (name, value) in [
            ("--sizes", &self.sizes),
            ("--chunk", &self.chunk),
            ("--spin-us", &spin),
            ("--op", &self.op),
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
    if task.hosts.is_some() {
        return crate::cluster::bench_across_hosts(&task);
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

/// One size's figures: bytes, median time in microseconds, bus bandwidth in GB/s.
pub type Row = (u64, f64, f64);

/// Reads a `bench_collectives --report` file.
pub fn read_report(path: &Path) -> Result<Vec<Row>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading the report {}", path.display()))?;
    text.lines()
        .map(|line| {
            let parse = |line: &str| -> Option<Row> {
                let mut f = line.split_whitespace().map(str::trim);
                let row = (
                    f.next()?.parse().ok()?,
                    f.next()?.parse().ok()?,
                    f.next()?.parse().ok()?,
                );
                f.next().is_none().then_some(row)
            };
            parse(line).with_context(|| format!("a bad line {line:?} in {}", path.display()))
        })
        .collect()
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

/// `bytes` in K/M/G (binary) units.
pub fn human(bytes: u64) -> String {
    match bytes {
        b if b >= 1 << 30 && b % (1 << 30) == 0 => format!("{} GiB", b >> 30),
        b if b >= 1 << 20 && b % (1 << 20) == 0 => format!("{} MiB", b >> 20),
        b if b >= 1 << 10 && b % (1 << 10) == 0 => format!("{} KiB", b >> 10),
        b => format!("{b} B"),
    }
}

/// Quickstart step time of DdpLearner at world size 1 against burn's Learner, and samples/s at
/// world size 2 against 1; with `--hosts`, step time and scaling across hosts of network
/// namespaces on a slow link, against the same world on one host, with and without bf16
/// gradients.
#[derive(Debug, Args)]
pub struct BenchTrain {
    /// Epochs per run
    #[arg(long, value_name = "N", default_value_t = 3)]
    epochs: usize,
    /// Runs of each kind (the median is reported)
    #[arg(long, value_name = "N", default_value_t = 3)]
    repeats: usize,
    /// Batch size per rank
    #[arg(long, value_name = "B", default_value_t = 32)]
    batch_size: usize,
    /// Training samples per epoch [default: the quickstart's]
    #[arg(long, value_name = "N")]
    samples: Option<usize>,
    /// The quickstart's network (`mlp`, or `mlp-large`: 784-1024-1024-10) [default: mlp;
    /// with --hosts: mlp-large]
    #[arg(long, value_name = "KIND")]
    model: Option<String>,
    /// Train across this many hosts made of network namespaces (root; see `cargo xtask
    /// cluster`): world 1, the same world on one host, and across the hosts, each with and
    /// without bf16 gradients
    #[arg(long, value_name = "N")]
    hosts: Option<usize>,
    /// With --hosts: ranks per host
    #[arg(long, value_name = "N", default_value_t = 1, requires = "hosts")]
    nproc_per_host: usize,
    /// With --hosts: rate of each host's link in tc syntax (`1gbit`) [default: unlimited]
    #[arg(long, value_name = "RATE", requires = "hosts")]
    link_rate: Option<String>,
    /// Build in the dev profile (quick to build, not for figures)
    #[arg(long)]
    debug: bool,
}

/// One quickstart run's figures, read from its `--report` file.
struct Timing {
    seconds: f64,
    steps: f64,
    samples: f64,
    /// Bytes each rank sends into the gradient all-reduces per step.
    bytes: f64,
}

impl Timing {
    fn per_step_ms(&self) -> f64 {
        self.seconds * 1e3 / self.steps
    }
    fn samples_per_sec(&self) -> f64 {
        self.samples / self.seconds
    }
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

/// One kind of quickstart run in `bench-train`.
struct TrainRun {
    label: String,
    /// Ranks (per host when `across_hosts`).
    nproc: usize,
    /// burn's own Learner instead of DdpLearner.
    plain: bool,
    /// Extra quickstart flags.
    extra: &'static [&'static str],
    /// `BURN_DDP_TRANSPORT`.
    transport: &'static str,
    /// On every host of the cluster instead of on this host.
    across_hosts: bool,
}

impl TrainRun {
    fn here(label: impl Into<String>, nproc: usize, extra: &'static [&'static str]) -> Self {
        TrainRun {
            label: label.into(),
            nproc,
            plain: false,
            extra,
            transport: "tcp",
            across_hosts: false,
        }
    }
    fn transport(mut self, transport: &'static str) -> Self {
        self.transport = transport;
        self
    }
}

const BF16: &[&str] = &["--compression", "bf16"];
const FP16: &[&str] = &["--compression", "fp16"];

/// Runs `bench-train`.
pub fn bench_train(task: BenchTrain) -> Result<()> {
    let (epochs, batch) = (task.epochs, task.batch_size);
    let repeats = task.repeats.max(1);
    let default_model = if task.hosts.is_some() {
        "mlp-large"
    } else {
        "mlp"
    };
    let model = task.model.clone().unwrap_or(default_model.into());
    let exe = build_cpu_program("quickstart", !task.debug)?;
    // With --hosts: the cluster and its launcher, made once for every run.
    let cluster = match task.hosts {
        Some(hosts) => {
            let launcher = build_cpu_program("burn-ddp-run", !task.debug)?;
            Some((
                crate::cluster::create(hosts, task.link_rate.clone())?,
                launcher,
            ))
        }
        None => None,
    };
    let scratch = std::env::temp_dir().join(format!("burn-ddp-bench-train-{}", std::process::id()));
    std::fs::create_dir_all(&scratch)?;
    let run = |r: &TrainRun| -> Result<Timing> {
        let report = scratch.join("report.txt");
        let _ = std::fs::remove_file(&report);
        let mut args: Vec<String> = vec![
            "--quiet".into(),
            "--epochs".into(),
            epochs.to_string(),
            "--batch-size".into(),
            batch.to_string(),
            "--report".into(),
            report.display().to_string(),
            "--artifacts".into(),
            scratch.join("artifacts").display().to_string(),
            "--model".into(),
            model.clone(),
        ];
        if let Some(n) = task.samples {
            args.extend(["--samples".into(), n.to_string()]);
        }
        if r.plain {
            args.push("--plain".into());
        }
        args.extend(r.extra.iter().map(|s| s.to_string()));
        match (&cluster, r.across_hosts) {
            (Some((cluster, launcher)), true) => {
                let mut program = vec![exe.clone().into_os_string()];
                program.extend(args.into_iter().map(Into::into));
                let env = vec![("BURN_DDP_TRANSPORT".into(), r.transport.into())];
                let job = crate::cluster::job(launcher, r.nproc, program, env)?;
                crate::cluster::run_job(cluster, &job).context("quickstart run across hosts")?;
            }
            _ => {
                let cfg = LaunchConfig::new(exe.clone(), r.nproc)
                    .args(args)
                    .env("BURN_DDP_TRANSPORT", r.transport);
                launch(&cfg).context("quickstart run")?;
            }
        }
        let text = std::fs::read_to_string(&report)
            .with_context(|| format!("reading the report of {:?}", r.label))?;
        let field = |name: &str| -> Result<f64> {
            text.split_whitespace()
                .find_map(|kv| kv.strip_prefix(&format!("{name}=")))
                .with_context(|| format!("{name} missing from the report"))?
                .parse()
                .with_context(|| format!("bad {name} in the report"))
        };
        Ok(Timing {
            seconds: field("seconds")?,
            steps: field("steps")?,
            samples: field("samples")?,
            bytes: field("bytes_per_step")?,
        })
    };
    let runs = match task.hosts {
        Some(hosts) => across_hosts_runs(hosts, task.nproc_per_host, task.link_rate.as_deref()),
        None => this_host_runs(),
    };
    let mut timings: Vec<Vec<Timing>> = runs.iter().map(|_| Vec::new()).collect();
    for round in 0..repeats {
        eprintln!("bench-train: round {} of {repeats}", round + 1);
        for (r, t) in runs.iter().zip(&mut timings) {
            t.push(run(r)?);
        }
    }
    // Removes the hosts before printing.
    drop(cluster);
    let _ = std::fs::remove_dir_all(&scratch);
    println!(
        "bench-train: quickstart --model {model}, {epochs} epochs, batch {batch} per rank, median \
         of {repeats}"
    );
    println!(
        "{:<50} {:>10} {:>12} {:>12}",
        "run", "ms/step", "samples/s", "bytes/step"
    );
    for (r, t) in runs.iter().zip(&timings) {
        let bytes = t.first().map_or(0.0, |t| t.bytes);
        println!(
            "{:<50} {:>10.3} {:>12.0} {:>12.0}",
            r.label,
            step(t),
            rate(t),
            bytes
        );
    }
    match task.hosts {
        Some(hosts) => summarise_across_hosts(&timings, hosts * task.nproc_per_host),
        None => summarise_this_host(&timings),
    }
    Ok(())
}

/// Median milliseconds per step.
fn step(t: &[Timing]) -> f64 {
    median(t.iter().map(Timing::per_step_ms).collect())
}

/// Median samples per second.
fn rate(t: &[Timing]) -> f64 {
    median(t.iter().map(Timing::samples_per_sec).collect())
}

/// The runs of `bench-train` on this host.
fn this_host_runs() -> Vec<TrainRun> {
    let w2 = "DdpLearner, world 2 (tcp)";
    vec![
        TrainRun {
            plain: true,
            ..TrainRun::here("burn Learner, 1 process", 1, &[])
        },
        TrainRun::here("DdpLearner, world 1", 1, &[]),
        TrainRun::here(w2, 2, &[]),
        TrainRun::here(format!("{w2}, no desync check"), 2, &["--no-desync-check"]),
        TrainRun::here(format!("{w2}, bf16 gradients"), 2, BF16),
        TrainRun::here(format!("{w2}, fp16 gradients"), 2, FP16),
        TrainRun::here(format!("{w2}, shared memory"), 2, &[]).transport("shm"),
        TrainRun::here(format!("{w2}, shm, bf16"), 2, BF16).transport("shm"),
    ]
}

fn summarise_this_host(timings: &[Vec<Timing>]) {
    let [plain, ddp1, ddp2, unchecked, bf16, _fp16, shm, _shm_bf16] = timings else {
        unreachable!("one timing list per run")
    };
    println!(
        "cost of the desync check at world 2: {:+.1}% of step time (ratio {:.3})",
        (step(ddp2) / step(unchecked) - 1.0) * 100.0,
        step(ddp2) / step(unchecked)
    );
    println!(
        "overhead of DdpLearner at world 1: {:+.1}% (ratio {:.3})",
        (step(ddp1) / step(plain) - 1.0) * 100.0,
        step(ddp1) / step(plain)
    );
    println!(
        "scaling world 2 / world 1: {:.2}x samples/s ({:.0}% efficiency)",
        rate(ddp2) / rate(ddp1),
        rate(ddp2) / rate(ddp1) / 2.0 * 100.0
    );
    println!(
        "bf16 gradients at world 2: step time ratio {:.3}, bytes per step ratio {:.3}",
        step(bf16) / step(ddp2),
        bf16[0].bytes / ddp2[0].bytes.max(1.0)
    );
    println!(
        "shared memory at world 2: step time ratio {:.3} against TCP",
        step(shm) / step(ddp2)
    );
}

/// The runs of `bench-train --hosts`: world 1, then the world of `hosts` x `per_host` ranks on
/// one host and across the hosts, each without and with bf16 gradients. Every DdpLearner run
/// uses the default transport (`auto`: shared memory within a host, TCP between hosts).
fn across_hosts_runs(hosts: usize, per_host: usize, link: Option<&str>) -> Vec<TrainRun> {
    let world = hosts * per_host;
    let here = format!("world {world}, 1 host");
    let across = format!(
        "world {world}, {hosts} hosts x {per_host}, link {}",
        link.unwrap_or("unlimited")
    );
    let across_hosts = |label: String, extra| TrainRun {
        across_hosts: true,
        ..TrainRun::here(label, per_host, extra).transport("auto")
    };
    vec![
        TrainRun::here("world 1", 1, &[]).transport("auto"),
        TrainRun::here(here.clone(), world, &[]).transport("auto"),
        TrainRun::here(format!("{here}, bf16 gradients"), world, BF16).transport("auto"),
        across_hosts(across.clone(), &[]),
        across_hosts(format!("{across}, bf16 gradients"), BF16),
    ]
}

fn summarise_across_hosts(timings: &[Vec<Timing>], world: usize) {
    let [one, here, here_bf16, across, across_bf16] = timings else {
        unreachable!("one timing list per run")
    };
    let w = world as f64;
    for (what, t) in [
        ("1 host", here),
        ("1 host, bf16", here_bf16),
        ("across hosts", across),
        ("across hosts, bf16", across_bf16),
    ] {
        println!(
            "scaling world {world} / world 1, {what}: {:.2}x samples/s ({:.0}% efficiency)",
            rate(t) / rate(one),
            rate(t) / rate(one) / w * 100.0
        );
    }
    let cost = step(across) - step(here);
    println!(
        "the slow link costs {cost:+.1} ms per step ({:.2}x the step time on 1 host)",
        step(across) / step(here)
    );
    let saved = step(across) - step(across_bf16);
    let recovered = if cost > 0.0 {
        format!(", {:.0}% of what the link costs", saved / cost * 100.0)
    } else {
        String::new()
    };
    println!(
        "bf16 gradients across hosts: {saved:+.1} ms per step saved (step time ratio {:.3}, \
         bytes per step ratio {:.3}){recovered}",
        step(across_bf16) / step(across),
        across_bf16[0].bytes / across[0].bytes.max(1.0)
    );
}

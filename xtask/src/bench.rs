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
    /// The flags of the rank program that this task forwards (not the transport).
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
    if let Some(t) = &task.transport {
        forwarded.extend(["--transport".to_string(), t.clone()]);
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
/// world size 2 against 1.
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
    /// The quickstart's network (`mlp`, or `mlp-large`: 784-1024-1024-10)
    #[arg(long, value_name = "KIND", default_value = "mlp")]
    model: String,
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

/// Runs `bench-train`.
pub fn bench_train(task: BenchTrain) -> Result<()> {
    let (epochs, batch) = (task.epochs, task.batch_size);
    let repeats = task.repeats.max(1);
    let exe = build_cpu_program("quickstart", !task.debug)?;
    let scratch = std::env::temp_dir().join(format!("burn-ddp-bench-train-{}", std::process::id()));
    std::fs::create_dir_all(&scratch)?;
    let run = |nproc: usize, plain: bool, extra: &[&str], transport: &str| -> Result<Timing> {
        let report = scratch.join("report.txt");
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
            task.model.clone(),
        ];
        if let Some(n) = task.samples {
            args.extend(["--samples".into(), n.to_string()]);
        }
        if plain {
            args.push("--plain".into());
        }
        args.extend(extra.iter().map(|s| s.to_string()));
        let cfg = LaunchConfig::new(exe.clone(), nproc)
            .args(args)
            .env("BURN_DDP_TRANSPORT", transport);
        launch(&cfg).context("quickstart run")?;
        let text = std::fs::read_to_string(&report)?;
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
    // (label, ranks, burn's own Learner, extra quickstart flags, transport)
    let (bf16, fp16): (&[&str], &[&str]) = (&["--compression", "bf16"], &["--compression", "fp16"]);
    let w2 = "DdpLearner, world 2 (tcp)";
    let runs: [(String, usize, bool, &[&str], &str); 8] = [
        ("burn Learner, 1 process".into(), 1, true, &[], "tcp"),
        ("DdpLearner, world 1".into(), 1, false, &[], "tcp"),
        (w2.into(), 2, false, &[], "tcp"),
        (
            format!("{w2}, no desync check"),
            2,
            false,
            &["--no-desync-check"],
            "tcp",
        ),
        (format!("{w2}, bf16 gradients"), 2, false, bf16, "tcp"),
        (format!("{w2}, fp16 gradients"), 2, false, fp16, "tcp"),
        (format!("{w2}, shared memory"), 2, false, &[], "shm"),
        (format!("{w2}, shm, bf16"), 2, false, bf16, "shm"),
    ];
    let mut timings: Vec<Vec<Timing>> = runs.iter().map(|_| Vec::new()).collect();
    for r in 0..repeats {
        eprintln!("bench-train: round {} of {repeats}", r + 1);
        for ((_, nproc, plain, extra, transport), t) in runs.iter().zip(&mut timings) {
            t.push(run(*nproc, *plain, extra, transport)?);
        }
    }
    let _ = std::fs::remove_dir_all(&scratch);
    let step = |t: &[Timing]| median(t.iter().map(Timing::per_step_ms).collect());
    let rate = |t: &[Timing]| median(t.iter().map(Timing::samples_per_sec).collect());
    println!(
        "bench-train: quickstart --model {}, {epochs} epochs, batch {batch} per rank, median of \
         {repeats}",
        task.model
    );
    println!(
        "{:<38} {:>10} {:>12} {:>12}",
        "run", "ms/step", "samples/s", "bytes/step"
    );
    for ((label, ..), t) in runs.iter().zip(&timings) {
        let bytes = t.first().map_or(0.0, |t| t.bytes);
        println!(
            "{label:<38} {:>10.3} {:>12.0} {:>12.0}",
            step(t),
            rate(t),
            bytes
        );
    }
    let [plain, ddp1, ddp2, unchecked, bf16, _fp16, shm, _shm_bf16] = &timings[..] else {
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
    Ok(())
}

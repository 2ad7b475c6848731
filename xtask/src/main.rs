//! Project tasks, run as `cargo xtask <task>`: thin wrappers that build a program and start its
//! ranks through `burn_ddp::launch`.
//!
//! - `multi-cpu --nproc N [--example NAME] [--release] [--max-restarts K] [-- ARGS]`: N CPU
//!   ranks of an example binary (`quickstart`, the default; `digits`; `hello_ddp`); a failed job
//!   is restarted up to K times.
//! - `multi-gpu [--nproc-per-node N] [--nnodes M --node-rank R --master-addr A --master-port P]`:
//!   one rank per visible GPU (`CUDA_VISIBLE_DEVICES` respected), examples built with CUDA.
//! - `bench-collectives [--world N] [--sizes 4K,64M,...] [--chunk 512K] [--spin-us 20]`: the
//!   all-reduce benchmark on N rank processes (release build).
//! - `bench-train [--epochs 3] [--repeats 3]`: quickstart step time of `DdpLearner` at world
//!   size 1 against burn's `Learner`, and samples/s at world size 2 against 1.
//! - `gpu-bundle --out DIR`: stripped release binaries and `run.sh`, the one-command GPU check
//!   for a bare machine with a GPU, CUDA 13 and NCCL (no cargo, no network).
//! - `soak [--iters 5000]`: the long soak test (random all-reduces on 4 ranks, results checked,
//!   resident memory reported).

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::{Command, Stdio};

use anyhow::{Context, Result, bail};
use burn_ddp::launch::{LaunchConfig, launch};

const USAGE: &str = "usage:
  cargo xtask multi-cpu --nproc N [--example NAME] [--release] [--max-restarts K] [-- ARGS...]
  cargo xtask multi-gpu [--nproc-per-node N] [--nnodes M --node-rank R --master-addr A --master-port P] [--example NAME] [--release] [--max-restarts K] [-- ARGS...]
  cargo xtask bench-collectives [--world N] [--sizes 4K,64M,...] [--chunk 512K] [--spin-us 20] [--op sum|avg|max]
  cargo xtask bench-train [--epochs 3] [--repeats 3] [--batch-size 32]
  cargo xtask gpu-bundle --out DIR
  cargo xtask soak [--iters 5000]";

/// Builds targets (`target`: cargo's selection flags) and returns the executables cargo
/// reports, as (target name, path), read from its JSON messages.
fn build_all(target: &[&str], release: bool) -> Result<Vec<(String, PathBuf)>> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.args(["build", "--message-format=json-render-diagnostics"]);
    cmd.args(target);
    if release {
        cmd.arg("--release");
    }
    let out = cmd
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("running cargo build {target:?}"))?;
    if !out.status.success() {
        bail!("building {target:?} failed");
    }
    let mut exes = Vec::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let msg: serde_json::Value = serde_json::from_str(line).unwrap_or_default();
        if msg["reason"] == "compiler-artifact"
            && let Some(path) = msg["executable"].as_str()
        {
            let name = msg["target"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_string();
            exes.push((name, PathBuf::from(path)));
        }
    }
    Ok(exes)
}

/// Builds one target and returns the path of its executable.
fn build(target: &[&str], release: bool) -> Result<PathBuf> {
    build_all(target, release)?
        .pop()
        .map(|(_, path)| path)
        .with_context(|| format!("cargo built no executable for {target:?}"))
}

/// Splits `--flag value` options from the arguments after `--`.
struct Opts {
    flags: Vec<(String, Option<String>)>,
    rest: Vec<OsString>,
}

impl Opts {
    fn parse(args: &[String], switches: &[&str]) -> Result<Self> {
        let mut flags = Vec::new();
        let mut it = args.iter();
        while let Some(a) = it.next() {
            if a == "--" {
                return Ok(Opts {
                    flags,
                    rest: it.map(Into::into).collect(),
                });
            }
            if !a.starts_with("--") {
                bail!("unexpected argument {a:?}\n{USAGE}");
            }
            if switches.contains(&a.as_str()) {
                flags.push((a.clone(), None));
            } else {
                let v = it.next().with_context(|| format!("{a} needs a value"))?;
                flags.push((a.clone(), Some(v.clone())));
            }
        }
        Ok(Opts {
            flags,
            rest: Vec::new(),
        })
    }

    fn get(&self, names: &[&str]) -> Option<&str> {
        self.flags
            .iter()
            .rev()
            .find(|(k, _)| names.contains(&k.as_str()))
            .and_then(|(_, v)| v.as_deref())
    }

    fn has(&self, name: &str) -> bool {
        self.flags.iter().any(|(k, _)| k == name)
    }

    fn number(&self, names: &[&str], default: usize) -> Result<usize> {
        self.get(names).map_or(Ok(default), |v| {
            v.parse()
                .with_context(|| format!("{} expects a number, got {v:?}", names[0]))
        })
    }

    fn check(&self, known: &[&str]) -> Result<()> {
        for (k, _) in &self.flags {
            if !known.contains(&k.as_str()) {
                bail!("unknown option {k}\n{USAGE}");
            }
        }
        Ok(())
    }
}

fn multi_cpu(args: &[String]) -> Result<()> {
    let opts = Opts::parse(args, &["--release"])?;
    opts.check(&[
        "--nproc",
        "--nproc-per-node",
        "--example",
        "--release",
        "--max-restarts",
    ])?;
    let nproc = opts.number(&["--nproc", "--nproc-per-node"], 2)?;
    let example = opts.get(&["--example"]).unwrap_or("quickstart");
    let exe = build(&["--bin", example], opts.has("--release"))?;
    let mut cfg = LaunchConfig::new(exe, nproc).args(opts.rest.clone());
    cfg.max_restarts = opts.number(&["--max-restarts"], 0)?;
    launch(&cfg).context("multi-cpu run failed")
}

/// GPUs this process may use: `CUDA_VISIBLE_DEVICES` when set, else what `nvidia-smi -L` lists.
fn visible_gpus() -> usize {
    if let Ok(v) = std::env::var("CUDA_VISIBLE_DEVICES") {
        return v
            .split(',')
            .map(str::trim)
            .take_while(|d| !d.is_empty() && !d.starts_with('-'))
            .count();
    }
    Command::new("nvidia-smi")
        .arg("-L")
        .output()
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .filter(|l| l.starts_with("GPU "))
                .count()
        })
        .unwrap_or(0)
}

/// If NCCL is only installed as `libnccl.so.2` (the pip wheel), links it as `libnccl.so` in a
/// private directory and returns an `LD_LIBRARY_PATH` for the ranks that includes it.
fn nccl_library_path() -> Result<Option<String>> {
    let found = burn_ddp_nccl::library::Located::from_env();
    let (None, Some(soname)) = (&found.nccl, &found.nccl_soname) else {
        return Ok(None);
    };
    let dir = std::env::temp_dir().join(format!("burn-ddp-nccl-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let link = dir.join("libnccl.so");
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(soname, &link)
        .with_context(|| format!("linking {} as {}", soname.display(), link.display()))?;
    let old = std::env::var("LD_LIBRARY_PATH").unwrap_or_default();
    Ok(Some(format!("{}:{old}", dir.display())))
}

fn multi_gpu(args: &[String]) -> Result<()> {
    let opts = Opts::parse(args, &["--release"])?;
    opts.check(&[
        "--nproc",
        "--nproc-per-node",
        "--nnodes",
        "--node-rank",
        "--master-addr",
        "--master-port",
        "--example",
        "--release",
        "--max-restarts",
    ])?;
    let visible = visible_gpus();
    let nproc = opts.number(&["--nproc-per-node", "--nproc"], visible)?;
    if nproc == 0 || nproc > visible {
        bail!(
            "{nproc} processes asked for, {visible} GPU(s) visible (CUDA_VISIBLE_DEVICES or \
             nvidia-smi): one process per GPU; without GPUs use `cargo xtask multi-cpu`"
        );
    }
    let example = opts.get(&["--example"]).unwrap_or("quickstart");
    // The quickstart package's binaries train on GPUs with its `cuda` feature.
    let exe = match example {
        "quickstart" | "digits" => build(
            &["-p", "quickstart", "--bin", example, "--features", "cuda"],
            opts.has("--release"),
        )?,
        other => build(&["--bin", other], opts.has("--release"))?,
    };
    let mut rank_args = opts.rest.clone();
    if matches!(example, "quickstart" | "digits") && !rank_args.iter().any(|a| a == "--device") {
        rank_args.extend(["--device".into(), "cuda".into()]);
    }
    let mut cfg = LaunchConfig::new(exe, nproc).args(rank_args);
    cfg.nnodes = opts.number(&["--nnodes"], 1)?;
    cfg.max_restarts = opts.number(&["--max-restarts"], 0)?;
    cfg.node_rank = opts.number(&["--node-rank"], 0)?;
    if let Some(addr) = opts.get(&["--master-addr"]) {
        cfg.master_addr = addr.to_string();
    }
    if let Some(port) = opts.get(&["--master-port"]) {
        cfg.master_port = Some(port.parse().context("--master-port")?);
    }
    if let Some(path) = nccl_library_path()? {
        cfg = cfg.env("LD_LIBRARY_PATH", path);
    }
    launch(&cfg).context("multi-gpu run failed")
}

/// Largest bundle `gpu-bundle` may produce.
const BUNDLE_LIMIT: u64 = 60 << 20;

fn run_tool(cmd: &mut Command) -> Result<()> {
    let status = cmd.status().with_context(|| format!("running {cmd:?}"))?;
    if !status.success() {
        bail!("{cmd:?} failed ({status})");
    }
    Ok(())
}

fn dir_size(dir: &std::path::Path) -> Result<u64> {
    let mut total = 0;
    for e in std::fs::read_dir(dir)? {
        let e = e?;
        total += if e.file_type()?.is_dir() {
            dir_size(&e.path())?
        } else {
            e.metadata()?.len()
        };
    }
    Ok(total)
}

/// Stripped release binaries of the GPU checks plus `run.sh`, for a bare GPU machine.
fn gpu_bundle(args: &[String]) -> Result<()> {
    let opts = Opts::parse(args, &[])?;
    opts.check(&["--out"])?;
    let out = PathBuf::from(opts.get(&["--out"]).context("--out DIR is required")?);
    // One build for all three, so burn is compiled once with one feature set.
    let exes = build_all(
        &[
            "-p",
            "burn-ddp-nccl",
            "-p",
            "quickstart",
            "--features",
            "burn-ddp-nccl/cuda,quickstart/cuda",
            "--test",
            "nccl",
            "--bin",
            "quickstart",
            "--example",
            "bucket_bench",
        ],
        true,
    )?;
    let find = |name: &str| {
        exes.iter()
            .find(|(n, _)| n == name)
            .map(|(_, p)| p.clone())
            .with_context(|| format!("cargo built no {name}"))
    };
    let (tests, quickstart, bench) = (find("nccl")?, find("quickstart")?, find("bucket_bench")?);
    let bin = out.join("bin");
    let _ = std::fs::remove_dir_all(&bin);
    std::fs::create_dir_all(&bin)?;
    for (from, name) in [
        (&tests, "nccl-tests"),
        (&quickstart, "quickstart"),
        (&bench, "bucket-bench"),
    ] {
        let to = bin.join(name);
        std::fs::copy(from, &to).with_context(|| format!("copying {}", from.display()))?;
        run_tool(Command::new("strip").arg(&to))?;
    }
    if dir_size(&bin)? > BUNDLE_LIMIT {
        for e in std::fs::read_dir(&bin)? {
            run_tool(Command::new("xz").args(["-9", "-T0"]).arg(e?.path()))?;
        }
    }
    let script = out.join("run.sh");
    std::fs::write(&script, include_str!("../assets/gpu-check.sh"))?;
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755))?;
    let total = dir_size(&out)?;
    println!(
        "gpu-bundle: {} ({:.1} MiB); on the GPU machine run: bash {}/run.sh",
        out.display(),
        total as f64 / (1 << 20) as f64,
        out.display()
    );
    if total > BUNDLE_LIMIT {
        bail!("the bundle is {total} bytes, above the {BUNDLE_LIMIT}-byte limit");
    }
    Ok(())
}

fn bench_collectives(args: &[String]) -> Result<()> {
    let opts = Opts::parse(args, &[])?;
    opts.check(&["--world", "--sizes", "--chunk", "--spin-us", "--op"])?;
    let world = opts.number(&["--world"], 2)?;
    let exe = build(&["-p", "burn-ddp", "--example", "bench_collectives"], true)?;
    let mut forwarded = Vec::new();
    for name in ["--sizes", "--chunk", "--spin-us", "--op"] {
        if let Some(v) = opts.get(&[name]) {
            forwarded.extend([name.to_string(), v.to_string()]);
        }
    }
    launch(&LaunchConfig::new(exe, world).args(forwarded)).context("benchmark failed")
}

/// One quickstart run's figures, read from its `--report` file.
struct Timing {
    seconds: f64,
    steps: f64,
    samples: f64,
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

fn bench_train(args: &[String]) -> Result<()> {
    let opts = Opts::parse(args, &[])?;
    opts.check(&["--epochs", "--repeats", "--batch-size"])?;
    let epochs = opts.number(&["--epochs"], 3)?;
    let repeats = opts.number(&["--repeats"], 3)?.max(1);
    let batch = opts.number(&["--batch-size"], 32)?;
    let exe = build(&["--bin", "quickstart"], true)?;
    let scratch = std::env::temp_dir().join(format!("burn-ddp-bench-train-{}", std::process::id()));
    std::fs::create_dir_all(&scratch)?;
    let run = |nproc: usize, plain: bool, extra: &[&str]| -> Result<Timing> {
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
        ];
        if plain {
            args.push("--plain".into());
        }
        args.extend(extra.iter().map(|s| s.to_string()));
        launch(&LaunchConfig::new(exe.clone(), nproc).args(args)).context("quickstart run")?;
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
        })
    };
    let (mut plain, mut ddp1, mut ddp2, mut unchecked) = (vec![], vec![], vec![], vec![]);
    for r in 0..repeats {
        eprintln!("bench-train: round {} of {repeats}", r + 1);
        plain.push(run(1, true, &[])?);
        ddp1.push(run(1, false, &[])?);
        ddp2.push(run(2, false, &[])?);
        unchecked.push(run(2, false, &["--no-desync-check"])?);
    }
    let _ = std::fs::remove_dir_all(&scratch);
    let step = |t: &[Timing]| median(t.iter().map(Timing::per_step_ms).collect());
    let rate = |t: &[Timing]| median(t.iter().map(Timing::samples_per_sec).collect());
    println!(
        "bench-train: quickstart MLP, {epochs} epochs, batch {batch} per rank, median of {repeats}"
    );
    println!("{:<34} {:>12} {:>12}", "run", "ms/step", "samples/s");
    println!(
        "{:<34} {:>12.3} {:>12.0}",
        "burn Learner, 1 process",
        step(&plain),
        rate(&plain)
    );
    println!(
        "{:<34} {:>12.3} {:>12.0}",
        "DdpLearner, world 1",
        step(&ddp1),
        rate(&ddp1)
    );
    println!(
        "{:<34} {:>12.3} {:>12.0}",
        "DdpLearner, world 2",
        step(&ddp2),
        rate(&ddp2)
    );
    println!(
        "{:<34} {:>12.3} {:>12.0}",
        "DdpLearner, world 2, no desync check",
        step(&unchecked),
        rate(&unchecked)
    );
    println!(
        "cost of the desync check at world 2: {:+.1}% of step time (ratio {:.3})",
        (step(&ddp2) / step(&unchecked) - 1.0) * 100.0,
        step(&ddp2) / step(&unchecked)
    );
    println!(
        "overhead of DdpLearner at world 1: {:+.1}% (ratio {:.3})",
        (step(&ddp1) / step(&plain) - 1.0) * 100.0,
        step(&ddp1) / step(&plain)
    );
    println!(
        "scaling world 2 / world 1: {:.2}x samples/s ({:.0}% efficiency)",
        rate(&ddp2) / rate(&ddp1),
        rate(&ddp2) / rate(&ddp1) / 2.0 * 100.0
    );
    Ok(())
}

/// Runs the ignored long soak test of burn-ddp's integration tests.
fn soak(args: &[String]) -> Result<()> {
    let opts = Opts::parse(args, &[])?;
    opts.check(&["--iters"])?;
    let iters = opts.number(&["--iters"], 5000)?;
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let status = Command::new(cargo)
        .args(["test", "-p", "burn-ddp", "--test", "integration", "--"])
        .args(["--ignored", "--exact", "soak::soak_long", "--nocapture"])
        .env("BDDP_SOAK_ITERS", iters.to_string())
        .status()
        .context("running cargo test")?;
    if !status.success() {
        bail!("the soak test failed ({status})");
    }
    Ok(())
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some((task, rest)) = args.split_first() else {
        bail!("no task given\n{USAGE}");
    };
    match task.as_str() {
        "multi-cpu" => multi_cpu(rest),
        "multi-gpu" => multi_gpu(rest),
        "bench-collectives" => bench_collectives(rest),
        "bench-train" => bench_train(rest),
        "gpu-bundle" => gpu_bundle(rest),
        "soak" => soak(rest),
        "-h" | "--help" | "help" => {
            println!("{USAGE}");
            Ok(())
        }
        other => bail!("unknown task {other:?}\n{USAGE}"),
    }
}

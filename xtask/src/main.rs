//! Project tasks, run as `cargo xtask <task>`: thin wrappers that build a program and start its
//! ranks through `burn_ddp::launch`.
//!
//! - `multi-cpu --nproc N [--example NAME] [-- ARGS]`: N CPU ranks of an example (default
//!   `quickstart`).
//! - `multi-gpu ...`: one rank per GPU (needs the NCCL backend, not in this build).
//! - `bench-collectives [--world N] [--sizes 4K,64M,...] [--chunk 512K] [--spin-us 20]`: the
//!   all-reduce benchmark on N rank processes (release build).

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::{Command, Stdio};

use anyhow::{Context, Result, bail};
use burn_ddp::launch::{LaunchConfig, launch};

const USAGE: &str = "usage:
  cargo xtask multi-cpu --nproc N [--example NAME] [--release] [-- ARGS...]
  cargo xtask multi-gpu [--nproc-per-node N] [--example NAME] [-- ARGS...]
  cargo xtask bench-collectives [--world N] [--sizes 4K,64M,...] [--chunk 512K] [--spin-us 20] [--op sum|avg|max]";

/// Builds one target and returns the path of its executable, read from cargo's JSON messages.
fn build(package: &str, target: &[&str], release: bool) -> Result<PathBuf> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.args([
        "build",
        "--message-format=json-render-diagnostics",
        "-p",
        package,
    ]);
    cmd.args(target);
    if release {
        cmd.arg("--release");
    }
    let out = cmd
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("running cargo build -p {package}"))?;
    if !out.status.success() {
        bail!("building {package} failed");
    }
    let mut exe = None;
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let msg: serde_json::Value = serde_json::from_str(line).unwrap_or_default();
        if msg["reason"] == "compiler-artifact"
            && let Some(path) = msg["executable"].as_str()
        {
            exe = Some(PathBuf::from(path));
        }
    }
    exe.with_context(|| format!("cargo built no executable for {package} {target:?}"))
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
    opts.check(&["--nproc", "--nproc-per-node", "--example", "--release"])?;
    let nproc = opts.number(&["--nproc", "--nproc-per-node"], 2)?;
    let example = opts.get(&["--example"]).unwrap_or("quickstart");
    let exe = build(example, &[], opts.has("--release"))?;
    let cfg = LaunchConfig::new(exe, nproc).args(opts.rest.clone());
    launch(&cfg).context("multi-cpu run failed")
}

fn bench_collectives(args: &[String]) -> Result<()> {
    let opts = Opts::parse(args, &[])?;
    opts.check(&["--world", "--sizes", "--chunk", "--spin-us", "--op"])?;
    let world = opts.number(&["--world"], 2)?;
    let exe = build("burn-ddp", &["--example", "bench_collectives"], true)?;
    let mut forwarded = Vec::new();
    for name in ["--sizes", "--chunk", "--spin-us", "--op"] {
        if let Some(v) = opts.get(&[name]) {
            forwarded.extend([name.to_string(), v.to_string()]);
        }
    }
    launch(&LaunchConfig::new(exe, world).args(forwarded)).context("benchmark failed")
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some((task, rest)) = args.split_first() else {
        bail!("no task given\n{USAGE}");
    };
    match task.as_str() {
        "multi-cpu" => multi_cpu(rest),
        "multi-gpu" => bail!(
            "this build has no GPU support: the NCCL backend (burn-ddp-nccl) is not implemented \
             yet; use `cargo xtask multi-cpu`"
        ),
        "bench-collectives" => bench_collectives(rest),
        "-h" | "--help" | "help" => {
            println!("{USAGE}");
            Ok(())
        }
        other => bail!("unknown task {other:?}\n{USAGE}"),
    }
}

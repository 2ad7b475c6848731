//! The quickstart runs of `bench-train`: building the programs (and with `--hosts` the cluster)
//! once, running each kind of run here or across the hosts, and reading its figures.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use burn_ddp::launch::{LaunchConfig, launch};
use burn_ddp::testing::cluster::Cluster;

use super::run::{Timing, TrainRun};
use crate::build::build_cpu_program;

/// What every run of one `bench-train` is given, from its flags.
pub(super) struct Shared<'a> {
    /// Epochs per run.
    pub epochs: usize,
    /// Batch size per rank.
    pub batch_size: usize,
    /// Training samples per epoch (the quickstart's).
    pub samples: Option<usize>,
    /// `--model`, if given (the transformer with `--shard`).
    pub model: Option<&'a str>,
    /// Hosts of network namespaces to run across.
    pub hosts: Option<usize>,
    /// Rate of each host's link in tc syntax.
    pub link_rate: Option<&'a str>,
    /// Build in the dev profile.
    pub debug: bool,
}

/// What every quickstart run of one `bench-train` shares: the flags, the program, the cluster
/// and the scratch directory.
pub(super) struct Runner<'a> {
    flags: Shared<'a>,
    /// The quickstart's `--model`, or `transformer` (the `charlm` program).
    model: String,
    /// The quickstart, or `charlm`.
    exe: PathBuf,
    /// With --hosts: the cluster and its launcher, made once for every run.
    cluster: Option<(Cluster, PathBuf)>,
    /// Reports and artifacts of the runs.
    scratch: PathBuf,
}

impl<'a> Runner<'a> {
    /// Builds the quickstart (and with --hosts the launcher, and creates the cluster).
    pub(super) fn new(flags: Shared<'a>) -> Result<Self> {
        let default_model = if flags.hosts.is_some() {
            "mlp-large"
        } else {
            "mlp"
        };
        let model = flags.model.unwrap_or(default_model).to_string();
        if model == TRANSFORMER && flags.samples.is_some() {
            anyhow::bail!("--samples is the quickstart's: the transformer trains on its text");
        }
        let exe = build_cpu_program(program_of(&model), !flags.debug)?;
        let cluster = match flags.hosts {
            Some(hosts) => {
                let launcher = build_cpu_program("burn-ddp-run", !flags.debug)?;
                Some((
                    crate::cluster::create(hosts, flags.link_rate.map(str::to_string))?,
                    launcher,
                ))
            }
            None => None,
        };
        let scratch =
            std::env::temp_dir().join(format!("burn-ddp-bench-train-{}", std::process::id()));
        std::fs::create_dir_all(&scratch)?;
        Ok(Runner {
            flags,
            model,
            exe,
            cluster,
            scratch,
        })
    }

    /// The program's flags for run `r`, writing its report to `report`: those every run gets,
    /// then the run's own ([`TrainRun::args`]).
    fn args(&self, r: &TrainRun, report: &Path) -> Vec<String> {
        let mut args: Vec<String> = vec![
            "--quiet".into(),
            "--epochs".into(),
            self.flags.epochs.to_string(),
            "--batch-size".into(),
            self.flags.batch_size.to_string(),
            "--report".into(),
            report.display().to_string(),
        ];
        if self.model != TRANSFORMER {
            let artifacts = self.scratch.join("artifacts").display().to_string();
            args.extend(["--artifacts".into(), artifacts, "--model".into()]);
            args.push(self.model.clone());
        }
        if let Some(n) = self.flags.samples {
            args.extend(["--samples".into(), n.to_string()]);
        }
        args.extend(r.args.iter().map(|s| s.to_string()));
        args
    }

    /// Runs `r` once, here or across the hosts, and reads its figures.
    pub(super) fn run(&self, r: &TrainRun) -> Result<Timing> {
        let report = self.scratch.join("report.txt");
        let _ = std::fs::remove_file(&report);
        for rank in 0..r.nproc {
            let _ = std::fs::remove_file(report.with_extension(format!("rank{rank}")));
        }
        let args = self.args(r, &report);
        match (&self.cluster, r.across_hosts) {
            (Some((cluster, launcher)), true) => {
                let mut program: Vec<std::ffi::OsString> = match r.pinned {
                    true => ["sh", "-c", PIN, "sh"].map(Into::into).to_vec(),
                    false => Vec::new(),
                };
                program.push(self.exe.clone().into_os_string());
                program.extend(args.into_iter().map(Into::into));
                let env = vec![("BURN_DDP_TRANSPORT".into(), r.transport.into())];
                let job = crate::cluster::job(launcher, r.nproc, program, env)?;
                crate::cluster::run_job(cluster, &job).context("quickstart run across hosts")?;
            }
            _ => {
                let cfg = LaunchConfig::new(self.exe.clone(), r.nproc)
                    .args(args)
                    .env("BURN_DDP_TRANSPORT", r.transport);
                launch(&cfg).context("quickstart run")?;
            }
        }
        read_timing(&report, &r.label, r.nproc)
    }

    /// Removes the hosts and the scratch directory; returns the model's name for the table.
    pub(super) fn finish(self) -> String {
        drop(self.cluster);
        let _ = std::fs::remove_dir_all(&self.scratch);
        self.model
    }
}

/// A program run through `sh -c PIN sh PROGRAM ARGS..` runs bound to core `RANK` modulo the
/// cores ([`TrainRun::pinned`]).
const PIN: &str = r#"exec taskset -c "$((RANK % $(nproc --all)))" "$@""#;

/// The `--model` that runs the `charlm` program's decoder-only transformer.
pub(super) const TRANSFORMER: &str = "transformer";

/// The program that trains `model`.
fn program_of(model: &str) -> &'static str {
    if model == TRANSFORMER {
        "charlm"
    } else {
        "quickstart"
    }
}

/// Reads the program's `--report` file of the run labelled `label`, and the memory figures of
/// its `nproc` ranks (`report.rank<r>`, on this host; none for runs across hosts).
fn read_timing(report: &Path, label: &str, nproc: usize) -> Result<Timing> {
    let read = |path: &Path| {
        std::fs::read_to_string(path)
            .with_context(|| format!("reading {} of {label:?}", path.display()))
    };
    let field = |text: &str, name: &str| -> Result<f64> {
        text.split_whitespace()
            .find_map(|kv| kv.strip_prefix(&format!("{name}=")))
            .with_context(|| format!("{name} missing from the report of {label:?}"))?
            .parse()
            .with_context(|| format!("bad {name} in the report of {label:?}"))
    };
    let text = read(report)?;
    let ranks = (0..nproc)
        .map(|r| report.with_extension(format!("rank{r}")))
        .filter(|path| path.exists())
        .map(|path| {
            let text = read(&path)?;
            Ok((field(&text, "optimizer_state")?, field(&text, "peak_rss")?))
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(Timing {
        seconds: field(&text, "seconds")?,
        steps: field(&text, "steps")?,
        samples: field(&text, "samples")?,
        bytes: field(&text, "bytes_per_step")?,
        sent: field(&text, "sent_per_step")?,
        exposed_ms: field(&text, "exposed_ms")?,
        ranks,
    })
}

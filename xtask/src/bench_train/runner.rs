//! The quickstart runs of `bench-train`: building the programs (and with `--hosts` the cluster)
//! once, running each kind of run here or across the hosts, and reading its figures.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use burn_ddp::launch::{LaunchConfig, launch};
use burn_ddp::testing::cluster::Cluster;

use super::{BenchTrain, Timing, TrainRun};
use crate::build::build_cpu_program;

/// What every quickstart run of one `bench-train` shares: the program, the cluster and the
/// scratch directory.
pub(super) struct Runner<'a> {
    task: &'a BenchTrain,
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
    pub(super) fn new(task: &'a BenchTrain) -> Result<Self> {
        let default_model = if task.hosts.is_some() {
            "mlp-large"
        } else {
            "mlp"
        };
        let model = task.model().unwrap_or(default_model).to_string();
        if model == TRANSFORMER && task.samples.is_some() {
            anyhow::bail!("--samples is the quickstart's: the transformer trains on its text");
        }
        let exe = build_cpu_program(program_of(&model), !task.debug)?;
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
        let scratch =
            std::env::temp_dir().join(format!("burn-ddp-bench-train-{}", std::process::id()));
        std::fs::create_dir_all(&scratch)?;
        Ok(Runner {
            task,
            model,
            exe,
            cluster,
            scratch,
        })
    }

    /// The program's flags for run `r`, writing its report to `report`.
    fn args(&self, r: &TrainRun, report: &Path) -> Vec<String> {
        let mut args: Vec<String> = vec![
            "--quiet".into(),
            "--epochs".into(),
            self.task.epochs().to_string(),
            "--batch-size".into(),
            self.task.batch_size().to_string(),
            "--report".into(),
            report.display().to_string(),
        ];
        if self.model != TRANSFORMER {
            let artifacts = self.scratch.join("artifacts").display().to_string();
            args.extend(["--artifacts".into(), artifacts, "--model".into()]);
            args.push(self.model.clone());
        }
        if let Some(n) = self.task.samples {
            args.extend(["--samples".into(), n.to_string()]);
        }
        if r.plain {
            args.push("--plain".into());
        }
        args.extend(r.extra.iter().map(|s| s.to_string()));
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
                let mut program = vec![self.exe.clone().into_os_string()];
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

//! `quickstart`: trains `MyModel` on `MyDataset`, alone or as one rank of many:
//!
//! ```text
//! cargo run -p quickstart -- --epochs 2
//! cargo xtask multi-cpu --nproc 2 --example quickstart -- --epochs 2
//! ```
//!
//! Flags: `--epochs N` `--batch-size B` (per rank) `--lr X` `--seed S` `--device cpu|cuda`
//! `--save-model PATH` `--samples N` `--artifacts DIR` `--plain` (burn's own `Learner`, one
//! process) `--quiet` (no progress) `--report PATH` (rank 0 writes timing as `key=value`).

use std::sync::Arc;

use anyhow::{Context, Result, bail};
use quickstart::{Config, run};

fn parse() -> Result<(Config, Option<std::path::PathBuf>)> {
    let mut cfg = Config::default();
    let mut report = None;
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let mut value = || args.next().with_context(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--epochs" => cfg.epochs = value()?.parse().context("--epochs")?,
            "--batch-size" => cfg.batch_size = value()?.parse().context("--batch-size")?,
            "--lr" => cfg.lr = value()?.parse().context("--lr")?,
            "--seed" => cfg.seed = value()?.parse().context("--seed")?,
            "--device" => cfg.device = value()?,
            "--save-model" => cfg.save_model = Some(value()?.into()),
            "--samples" => cfg.samples = value()?.parse().context("--samples")?,
            "--artifacts" => cfg.artifacts = value()?.into(),
            "--plain" => cfg.plain = true,
            "--quiet" => cfg.quiet = true,
            "--report" => report = Some(std::path::PathBuf::from(value()?)),
            other => bail!("unknown flag {other}"),
        }
    }
    Ok((cfg, report))
}

fn main() -> Result<()> {
    let (cfg, report_path) = parse()?;
    let group = Arc::new(burn_ddp::init_process_group().context("forming the process group")?);
    let report = run(group.clone(), &cfg)?;
    if group.rank() == 0 {
        println!(
            "quickstart: {} rank(s), {} epochs, batch {} per rank: validation accuracy {:.1}%",
            group.world_size(),
            cfg.epochs,
            cfg.batch_size,
            report.valid_accuracy
        );
        println!(
            "quickstart: {} optimizer steps in {:.2} s: {:.1} ms per step, {:.0} samples/s",
            report.steps,
            report.train_seconds,
            report.train_seconds * 1e3 / report.steps as f64,
            report.samples as f64 / report.train_seconds
        );
        if let Some(path) = report_path {
            let line = format!(
                "steps={} seconds={} samples={} accuracy={}\n",
                report.steps, report.train_seconds, report.samples, report.valid_accuracy
            );
            std::fs::write(&path, line).with_context(|| format!("writing {}", path.display()))?;
        }
    }
    Ok(())
}

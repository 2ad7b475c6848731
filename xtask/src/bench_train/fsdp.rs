//! `bench-train --fsdp`: what each rank holds and how fast it steps when a transformer too
//! large to replicate cheaply is trained under DDP, ZeRO-2 (the sharded optimizer and
//! gradients of `GradientReducer`) and fully sharded blocks (FSDP grad-op, FSDP full), at
//! worlds 2 and 4; then, where a cgroup memory controller is at hand (root), DDP and FSDP full
//! at world 4 with each rank capped between their peaks.
//!
//! Every run is the `shardlm` program (examples/quickstart/src/bin/shardlm), a hand-written
//! loop rather than `DdpLearner`: one code path per mode, nothing of burn-train's adding to the
//! memory measured, and the gradients each rank holds after the reduction are read where the
//! optimizer gets them. Each rank writes its figures (`shardlm`'s `measure` module says how it
//! counts); the table shows the largest rank's memory and rank 0's step time.

mod cgroup;
mod figures;
mod table;

use std::path::Path;

use anyhow::{Context, Result};
use burn_ddp::launch::{LaunchConfig, launch};

use crate::build::build_cpu_program;
use cgroup::Capped;
use figures::{Outcome, Rank};

/// What `bench-train --fsdp` was told.
pub(super) struct FsdpBench {
    /// Width of the transformer.
    pub width: usize,
    /// Attention heads.
    pub heads: usize,
    /// Transformer blocks.
    pub layers: usize,
    /// Sequences per batch, per rank.
    pub batch: usize,
    /// Measured steps per run.
    pub steps: usize,
    /// Runs of each kind (step time and peak memory: the median).
    pub repeats: usize,
    /// Whether to run the capped pair.
    pub cap: bool,
    /// Build in the dev profile.
    pub debug: bool,
}

/// Characters per sequence.
const SEQ_LEN: usize = 16;

/// How the ranks divide the model (`shardlm --mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Ddp,
    Zero2,
    GradOp,
    Full,
    /// `full` with `--no-backward-prefetch`: what backward prefetch saves, in the same run.
    FullNoPrefetch,
}

impl Mode {
    const ALL: [Mode; 5] = [
        Mode::Ddp,
        Mode::Zero2,
        Mode::GradOp,
        Mode::Full,
        Mode::FullNoPrefetch,
    ];

    /// `shardlm --mode`.
    fn flag(self) -> &'static str {
        match self {
            Mode::Ddp => "ddp",
            Mode::Zero2 => "zero2",
            Mode::GradOp => "grad-op",
            Mode::Full | Mode::FullNoPrefetch => "full",
        }
    }

    /// The run's `shardlm` flags besides the model's.
    fn args(self) -> Vec<&'static str> {
        let mut args = vec!["--mode", self.flag()];
        if self == Mode::FullNoPrefetch {
            args.push("--no-backward-prefetch");
        }
        args
    }

    /// The run's name in file names.
    fn key(self) -> &'static str {
        match self {
            Mode::FullNoPrefetch => "full-no-prefetch",
            _ => self.flag(),
        }
    }

    fn label(self) -> &'static str {
        match self {
            Mode::Ddp => "DDP",
            Mode::Zero2 => "ZeRO-2",
            Mode::GradOp => "FSDP grad-op",
            Mode::Full => "FSDP full",
            Mode::FullNoPrefetch => "FSDP full, no bwd prefetch",
        }
    }
}

/// One kind of run and what it came to.
struct Row {
    world: usize,
    mode: Mode,
    /// With each rank capped at this many bytes.
    capped: Option<u64>,
    outcome: Outcome,
}

/// The worlds of the uncapped runs; the capped ones run at the last.
const WORLDS: [usize; 2] = [2, 4];

/// Runs `bench-train --fsdp`.
pub(super) fn bench(b: &FsdpBench) -> Result<()> {
    if b.heads == 0 || !b.width.is_multiple_of(b.heads) {
        anyhow::bail!("--heads {} does not divide --width {}", b.heads, b.width);
    }
    let exe = build_cpu_program("shardlm", !b.debug)?;
    let scratch = std::env::temp_dir().join(format!("burn-ddp-bench-fsdp-{}", std::process::id()));
    std::fs::create_dir_all(&scratch)?;
    let result = bench_in(b, &exe, &scratch);
    let _ = std::fs::remove_dir_all(&scratch);
    result
}

fn bench_in(b: &FsdpBench, exe: &Path, scratch: &Path) -> Result<()> {
    let mut rows = Vec::new();
    for world in WORLDS {
        for mode in Mode::ALL {
            eprintln!("bench-train --fsdp: world {world}, {}", mode.label());
            let runs = (0..b.repeats)
                .map(|_| run(b, (exe, scratch), (world, mode), None))
                .collect::<Result<Vec<_>>>()?;
            rows.push(Row {
                world,
                mode,
                capped: None,
                outcome: Outcome::median(runs),
            });
        }
    }
    let capping = match b.cap {
        true => run_capped(b, (exe, scratch), &rows),
        false => Err("--no-cap".to_string()),
    };
    let capping = capping.map(|(mut pair, how)| {
        rows.append(&mut pair);
        how
    });
    table::print(b, SEQ_LEN, &rows, capping);
    Ok(())
}

/// DDP and FSDP full at the largest world, each rank in a cgroup capped at the geometric mean
/// of their peaks in the uncapped runs, and how the cap was set; `Err` says why they were
/// skipped.
fn run_capped(
    b: &FsdpBench,
    (exe, scratch): (&Path, &Path),
    rows: &[Row],
) -> std::result::Result<(Vec<Row>, String), String> {
    let world = WORLDS[WORLDS.len() - 1];
    let peak = |mode| {
        rows.iter()
            .find(|r| r.world == world && r.mode == mode)
            .and_then(|r| r.outcome.measured())
            .map_or(0, |m| m.peak_rss())
    };
    let (ddp, full) = (peak(Mode::Ddp), peak(Mode::Full));
    // Well apart, or a cap between them proves nothing (and may catch both, or neither).
    if full == 0 || (ddp as f64) < 1.3 * full as f64 {
        return Err(format!(
            "at this size DDP's peak resident memory ({:.0} MB) is not well above FSDP full's \
             ({:.0} MB) at world {world}",
            ddp as f64 / 1e6,
            full as f64 / 1e6
        ));
    }
    let cap = ((ddp as f64 * full as f64).sqrt() as u64).next_multiple_of(1 << 20);
    let mut pair = Vec::new();
    let mut how = String::new();
    for mode in [Mode::Ddp, Mode::Full] {
        eprintln!(
            "bench-train --fsdp: world {world}, {}, each rank capped at {} MiB",
            mode.label(),
            cap >> 20
        );
        let group = Capped::create(world, cap)?;
        how = group.describe();
        let outcome = run(b, (exe, scratch), (world, mode), Some(&group));
        let outcome = outcome.map_err(|e| format!("{e:#}"))?;
        pair.push(Row {
            world,
            mode,
            capped: Some(cap),
            outcome,
        });
    }
    Ok((pair, how))
}

/// Runs `mode` on `world` ranks once (each in its cgroup of `capped`, if given) and reads what
/// its ranks measured. A capped run that fails is an outcome, not an error.
fn run(
    b: &FsdpBench,
    (exe, scratch): (&Path, &Path),
    (world, mode): (usize, Mode),
    capped: Option<&Capped>,
) -> Result<Outcome> {
    let report = scratch.join(format!("{}-{world}", mode.key()));
    let rank_file = |r: usize| report.with_extension(format!("rank{r}"));
    for r in 0..world {
        let _ = std::fs::remove_file(rank_file(r));
    }
    let mut args: Vec<String> = mode.args().into_iter().map(String::from).collect();
    args.extend(
        [
            "--width",
            &b.width.to_string(),
            "--heads",
            &b.heads.to_string(),
            "--layers",
            &b.layers.to_string(),
            "--seq-len",
            &SEQ_LEN.to_string(),
            "--batch-size",
            &b.batch.to_string(),
            "--steps",
            &b.steps.to_string(),
            "--report",
            &report.display().to_string(),
        ]
        .map(String::from),
    );
    let mut cfg = match capped {
        Some(group) => group.launch_config(exe, world),
        None => LaunchConfig::new(exe.to_path_buf(), world),
    };
    cfg = cfg.args(args).env("BURN_DDP_TRANSPORT", "auto");
    // Rank 0's progress only.
    cfg.local_ranks_filter = Some(vec![0]);
    match (launch(&cfg), capped) {
        (Ok(()), _) => {}
        (Err(e), Some(group)) => {
            return Ok(Outcome::Failed {
                reason: e.to_string(),
                oom_kills: group.oom_kills(),
            });
        }
        (Err(e), None) => {
            return Err(e)
                .with_context(|| format!("shardlm {} at world {world}", mode.args().join(" ")));
        }
    }
    let ranks = (0..world)
        .map(|r| Rank::read(&rank_file(r)))
        .collect::<Result<Vec<_>>>()?;
    Ok(Outcome::ran(ranks))
}

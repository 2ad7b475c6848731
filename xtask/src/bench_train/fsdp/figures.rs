//! What a `shardlm` run measured: each rank's report line ([`Rank`]), a run's figures as the
//! table shows them ([`Measured`]: the largest rank's memory, rank 0's step time), and how a
//! run ended ([`Outcome`]).

use std::path::Path;

use anyhow::{Context, Result};

/// One rank's report (`PATH.rank<r>`, see `shardlm`'s `measure` module).
#[derive(Debug, Clone)]
pub(super) struct Rank {
    pub steps: f64,
    pub seconds: f64,
    pub param_elems: f64,
    pub grad_elems: f64,
    pub optim_bytes: f64,
    pub peak_rss: f64,
    pub sent_per_step: f64,
    pub coll_bytes_per_step: f64,
    pub gathers_per_step: f64,
    /// Milliseconds per step the training thread waited inside the blocks (FSDP).
    pub exposed_ms: f64,
}

impl Rank {
    /// Reads the report at `path`.
    pub(super) fn read(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading {} (did the rank finish?)", path.display()))?;
        let field = |name: &str| -> Result<f64> {
            text.split_whitespace()
                .find_map(|kv| kv.strip_prefix(&format!("{name}=")))
                .with_context(|| format!("{name} missing from {}", path.display()))?
                .parse()
                .with_context(|| format!("bad {name} in {}", path.display()))
        };
        Ok(Rank {
            steps: field("steps")?,
            seconds: field("seconds")?,
            param_elems: field("param_elems")?,
            grad_elems: field("grad_elems")?,
            optim_bytes: field("optim_bytes")?,
            peak_rss: field("peak_rss")?,
            sent_per_step: field("sent_per_step")?,
            coll_bytes_per_step: field("coll_bytes_per_step")?,
            gathers_per_step: field("gathers_per_step")?,
            exposed_ms: field("exposed_ms")?,
        })
    }

    /// Bytes of parameters, gradients and optimizer state this rank holds (f32 elements).
    fn state(&self) -> [f64; 3] {
        [
            self.param_elems * 4.0,
            self.grad_elems * 4.0,
            self.optim_bytes,
        ]
    }
}

/// A finished run: every rank's report, with its step time and peak (medians over repeats).
#[derive(Debug, Clone)]
pub(super) struct Measured {
    ranks: Vec<Rank>,
    ms_per_step: f64,
    peak_rss: u64,
}

impl Measured {
    fn new(ranks: Vec<Rank>) -> Self {
        let ms_per_step = ranks
            .first()
            .map_or(0.0, |r| r.seconds * 1e3 / r.steps.max(1.0));
        let peak_rss = ranks.iter().map(|r| r.peak_rss).fold(0.0, f64::max) as u64;
        Measured {
            ranks,
            ms_per_step,
            peak_rss,
        }
    }

    /// Rank 0's milliseconds per measured step.
    pub(super) fn ms_per_step(&self) -> f64 {
        self.ms_per_step
    }

    /// The largest rank's peak resident memory, in bytes.
    pub(super) fn peak_rss(&self) -> u64 {
        self.peak_rss
    }

    /// The parameters, gradients and optimizer state of the rank holding the most, in bytes.
    pub(super) fn state(&self) -> [f64; 3] {
        (self.ranks.iter())
            .map(Rank::state)
            .max_by(|a, b| a.iter().sum::<f64>().total_cmp(&b.iter().sum()))
            .unwrap_or_default()
    }

    /// Bytes rank 0 sends per step on a ring.
    pub(super) fn sent_per_step(&self) -> f64 {
        self.ranks.first().map_or(0.0, |r| r.sent_per_step)
    }

    /// Bytes rank 0 handed to its collectives per step.
    pub(super) fn coll_bytes_per_step(&self) -> f64 {
        self.ranks.first().map_or(0.0, |r| r.coll_bytes_per_step)
    }

    /// Rank 0's milliseconds per step waiting inside the blocks (FSDP; 0 otherwise).
    pub(super) fn exposed_ms_per_step(&self) -> f64 {
        self.ranks.first().map_or(0.0, |r| r.exposed_ms)
    }

    /// Block gathers per step (FSDP; 0 otherwise).
    pub(super) fn gathers_per_step(&self) -> f64 {
        self.ranks.first().map_or(0.0, |r| r.gathers_per_step)
    }
}

/// How a run ended.
#[derive(Debug, Clone)]
pub(super) enum Outcome {
    /// Every rank finished.
    Ran(Measured),
    /// The launcher reported a failed rank (capped runs only).
    Failed {
        /// The launcher's error.
        reason: String,
        /// OOM kills the ranks' cgroups counted.
        oom_kills: u64,
    },
}

impl Outcome {
    /// A run whose ranks all reported.
    pub(super) fn ran(ranks: Vec<Rank>) -> Self {
        Outcome::Ran(Measured::new(ranks))
    }

    /// The repeats of one kind of run as one: the first's memory figures, the median step time
    /// and peak; the first failure if any failed.
    pub(super) fn median(runs: Vec<Outcome>) -> Self {
        let mut measured = Vec::new();
        for run in runs {
            match run {
                Outcome::Ran(m) => measured.push(m),
                failed => return failed,
            }
        }
        let median = |mut xs: Vec<f64>| {
            xs.sort_by(f64::total_cmp);
            xs.get(xs.len() / 2).copied().unwrap_or(0.0)
        };
        let ms = median(measured.iter().map(|m| m.ms_per_step).collect());
        let peak = median(measured.iter().map(|m| m.peak_rss as f64).collect());
        match measured.into_iter().next() {
            Some(first) => Outcome::Ran(Measured {
                ms_per_step: ms,
                peak_rss: peak as u64,
                ..first
            }),
            None => Outcome::Failed {
                reason: "no run".into(),
                oom_kills: 0,
            },
        }
    }

    /// The figures, if every rank finished.
    pub(super) fn measured(&self) -> Option<&Measured> {
        match self {
            Outcome::Ran(m) => Some(m),
            Outcome::Failed { .. } => None,
        }
    }
}

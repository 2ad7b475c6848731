//! What a run measured ([`Report`]): accuracy, the final parameters and their digest, step
//! times, bytes sent, memory; printed by rank 0 and written for `--report`.

use anyhow::{Context, Result};
use burn_ddp::train::GradientReducer;

use crate::config::Config;

/// What a run measured.
#[derive(Debug, Clone)]
pub struct Report {
    /// Accuracy of the final model over the whole validation split, in percent.
    pub valid_accuracy: f64,
    /// The final parameters, flattened in visit order.
    pub params: Vec<f32>,
    /// Wall time of training (all epochs, validation included), in seconds.
    pub train_seconds: f64,
    /// Optimizer steps taken.
    pub steps: usize,
    /// Training samples processed by all ranks together.
    pub samples: usize,
    /// Bytes each rank sends into the gradient all-reduces per optimizer step (0 alone).
    pub bytes_per_step: usize,
    /// Bytes each rank sends per optimizer step on a ring (0 alone; with sharding, the
    /// reduce-scatter and the parameters' all-gather).
    pub sent_per_step: f64,
    /// Mean milliseconds per step rank 0 waited for gradient communication (0 alone).
    pub exposed_ms: f64,
    /// Bytes of this rank's optimizer state at the end (DdpLearner runs; what sharding cuts).
    pub optimizer_state: Option<usize>,
}

/// This process's peak resident memory (`VmHWM` of `/proc/self/status`), in bytes.
pub fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Mean milliseconds per step the job's rank 0 waited for communication, from a learner's
/// telemetry (0 without figures: alone, or burn's own Learner).
pub fn mean_exposed_ms(telemetry: &burn_ddp::train::Telemetry) -> f64 {
    let steps = telemetry.steps();
    let total: f64 = steps.iter().map(|s| s.rank0.exposed).sum();
    total * 1e3 / steps.len().max(1) as f64
}

impl Report {
    /// FNV-1a of the final parameters' bytes: equal digests, bit-identical models.
    pub fn digest(&self) -> u64 {
        self.params
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .fold(0xcbf2_9ce4_8422_2325, |h, b| {
                (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
            })
    }

    /// Prints this rank's memory figures (its optimizer state, when counted, and its peak
    /// resident memory) and, with `--report PATH`, writes them to `PATH.rank<r>` as key=value
    /// (every rank calls it).
    pub fn publish_rank(&self, report: Option<&std::path::Path>, rank: usize) -> Result<()> {
        let peak = peak_rss_bytes();
        if let Some(bytes) = self.optimizer_state {
            println!("optimizer state {bytes} bytes");
        }
        if let Some(path) = report {
            let path = path.with_extension(format!("rank{rank}"));
            let line = format!(
                "optimizer_state={} peak_rss={}\n",
                self.optimizer_state.unwrap_or(0),
                peak.unwrap_or(0)
            );
            std::fs::write(&path, line).with_context(|| format!("writing {}", path.display()))?;
        }
        Ok(())
    }

    /// Prints the summary and writes `--report` (rank 0 calls it).
    pub fn publish(&self, cfg: &Config, world: usize) -> Result<()> {
        println!(
            "{} rank(s), {} epochs, batch {} per rank: validation accuracy {:.1}%",
            world, cfg.epochs, cfg.batch_size, self.valid_accuracy
        );
        println!(
            "{} optimizer steps in {:.2} s: {:.2} ms per step, {:.0} samples/s",
            self.steps,
            self.train_seconds,
            self.train_seconds * 1e3 / self.steps as f64,
            self.samples as f64 / self.train_seconds
        );
        if let Some(path) = &cfg.params_out {
            let bytes: Vec<u8> = self.params.iter().flat_map(|x| x.to_le_bytes()).collect();
            std::fs::write(path, bytes).with_context(|| format!("writing {}", path.display()))?;
        }
        if let Some(path) = &cfg.report {
            let line = format!(
                "steps={} seconds={} samples={} bytes_per_step={} sent_per_step={} exposed_ms={} \
                 accuracy={} digest={:016x}\n",
                self.steps,
                self.train_seconds,
                self.samples,
                self.bytes_per_step,
                self.sent_per_step,
                self.exposed_ms,
                self.valid_accuracy,
                self.digest()
            );
            std::fs::write(path, line).with_context(|| format!("writing {}", path.display()))?;
        }
        Ok(())
    }
}

/// A step's communication as planned: bytes handed to the collectives, and bytes each rank
/// sends on a ring (`GradientReducer::sent_per_step`: with sharding, the reduce-scatter and
/// the parameters' all-gather).
#[derive(Debug, Clone, Copy, Default)]
pub struct Sent {
    /// Bytes handed to the gradient collectives.
    pub buffers: usize,
    /// Bytes each rank sends.
    pub wire: f64,
}

impl Sent {
    /// What `reducer` plans.
    pub fn of(reducer: &GradientReducer) -> Self {
        Sent {
            buffers: reducer.bytes_per_step(),
            wire: reducer.sent_per_step(),
        }
    }
}

//! What a rank of `shardlm` measured ([`Figures`]) and how: the elements of the parameters it
//! stores and of the gradients it holds after the reduction ([`Held`]), its optimizer state
//! (the tensors of the optimizer's record), its peak resident memory (`VmHWM`), its step time
//! and what its collectives moved per step.
//!
//! The report line (`PATH.rank<r>`), key=value: `steps`, `seconds` (the measured steps),
//! `param_elems`, `grad_elems`, `optim_bytes`, `peak_rss` (bytes), `sent_per_step` (bytes this
//! rank sends on a ring: `GradientReducer::sent_per_step` for DDP and ZeRO-2; for FSDP the
//! gathered and reduced elements of `fsdp::stats` x 4 x (N - 1) / N), `coll_bytes_per_step`
//! (bytes handed to the collectives: the reducer's buckets; for FSDP those elements x 4),
//! `gathers_per_step`, `exposed_ms` (FSDP: waiting for gathers and reductions) and `loss`.

use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result};
use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::{GradientsParams, ModuleOptimizer};
use burn::tensor::Tensor;
use burn_ddp::fsdp::FsdpStats;
use burn_ddp::train::GradientReducer;

/// Elements of the parameters a rank stores and of the gradients it holds for its optimizer.
#[derive(Debug, Clone, Copy, Default)]
pub struct Held {
    /// Parameter elements (an FSDP rank's shards, padding included).
    pub params: usize,
    /// Gradient elements handed to the optimizer (after the reduction).
    pub grads: usize,
}

impl Held {
    /// What `model` stores and `grads` holds for it.
    pub fn of<M: Module>(model: &M, grads: &GradientsParams) -> Self {
        let mut count = Count {
            grads,
            held: Held::default(),
        };
        model.visit(&mut count);
        count.held
    }
}

struct Count<'a> {
    grads: &'a GradientsParams,
    held: Held,
}

impl ModuleVisitor for Count<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        self.held.params += param.val().shape().num_elements();
        if let Some(g) = self.grads.get::<D>(param.id) {
            self.held.grads += g.shape().num_elements();
        }
    }
}

/// This process's peak resident memory (`VmHWM` of `/proc/self/status`), in bytes (0 where
/// the kernel does not say).
pub fn peak_rss_bytes() -> u64 {
    rss_now_and_peak().1
}

/// This process's resident memory now and its peak so far (`VmRSS`, `VmHWM`), in bytes.
pub fn rss_now_and_peak() -> (u64, u64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        (status.lines())
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
            * 1024
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// Bytes of the state tensors the optimizer keeps (its record's tensors: AdamW's two moments
/// per parameter it stepped; scalars such as the step count left out).
pub fn optimizer_state_bytes(optim: &ModuleOptimizer) -> Result<usize> {
    let bytes = optim
        .into_bytes()
        .map_err(|e| anyhow::anyhow!("writing the optimizer's record: {e:?}"))?;
    let reader = burn_store::burn_pack::Reader::from_bytes(bytes)
        .map_err(|e| anyhow::anyhow!("reading the optimizer's record: {e:?}"))?;
    let tensors = reader
        .into_tensors()
        .map_err(|e| anyhow::anyhow!("reading the optimizer's record: {e:?}"))?;
    Ok(tensors.iter().map(|t| t.byte_len()).sum())
}

/// One rank's figures.
#[derive(Debug, Clone)]
pub struct Figures {
    steps: usize,
    seconds: f64,
    held: Held,
    optim_bytes: usize,
    peak_rss: u64,
    sent_per_step: f64,
    coll_bytes_per_step: f64,
    gathers_per_step: f64,
    exposed_ms: f64,
    loss: f32,
}

impl Figures {
    /// The figures of `steps` measured steps that took `measured`, with what the rank held and
    /// its peak, the reducer's plan (DDP, ZeRO-2) or the wrapped blocks' counters over those
    /// steps (FSDP), in a world of `world` ranks, ending at `loss`.
    pub fn new(
        (steps, measured): (usize, Duration),
        (held, optim_bytes, peak_rss): (Held, usize, u64),
        reducer: Option<&GradientReducer>,
        fsdp: FsdpStats,
        (world, loss): (usize, f32),
    ) -> Self {
        let per_step = |x: u64| x as f64 / steps.max(1) as f64;
        let elements = per_step(fsdp.elements_gathered + fsdp.elements_reduced);
        let ring = (world as f64 - 1.0) / world as f64;
        let (sent_per_step, coll_bytes_per_step) = match reducer {
            Some(r) if world > 1 => (r.sent_per_step(), r.bytes_per_step() as f64),
            Some(_) => (0.0, 0.0),
            None => (elements * 4.0 * ring, elements * 4.0),
        };
        Figures {
            steps,
            seconds: measured.as_secs_f64(),
            held,
            optim_bytes,
            peak_rss,
            sent_per_step,
            coll_bytes_per_step,
            gathers_per_step: per_step(fsdp.gathers),
            exposed_ms: fsdp.exposed.as_secs_f64() * 1e3 / steps.max(1) as f64,
            loss,
        }
    }

    /// Prints the figures and, with `report`, writes them to `report.rank<rank>`.
    pub fn publish(&self, rank: usize, report: Option<&Path>) -> Result<()> {
        let state = (self.held.params + self.held.grads) * 4 + self.optim_bytes;
        println!(
            "{:.1} ms per step; holds {} parameter and {} gradient elements and {} bytes of \
             optimizer state ({:.1} MB in all); peak RSS {:.1} MB; final loss {:.4}",
            self.seconds * 1e3 / self.steps.max(1) as f64,
            self.held.params,
            self.held.grads,
            self.optim_bytes,
            state as f64 / 1e6,
            self.peak_rss as f64 / 1e6,
            self.loss
        );
        let Some(path) = report else {
            return Ok(());
        };
        let path = path.with_extension(format!("rank{rank}"));
        let line = format!(
            "steps={} seconds={} param_elems={} grad_elems={} optim_bytes={} peak_rss={} \
             sent_per_step={} coll_bytes_per_step={} gathers_per_step={} exposed_ms={} loss={}\n",
            self.steps,
            self.seconds,
            self.held.params,
            self.held.grads,
            self.optim_bytes,
            self.peak_rss,
            self.sent_per_step,
            self.coll_bytes_per_step,
            self.gathers_per_step,
            self.exposed_ms,
            self.loss
        );
        std::fs::write(&path, line).with_context(|| format!("writing {}", path.display()))
    }
}

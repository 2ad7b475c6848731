//! DdpLearner and GradientReducer training with real ranks (threads over loopback TCP), on
//! burn's `flex` CPU backend; `crate::wgpu` runs the same bodies on a wgpu device.
//!
//! - `model`: the data, the network and the die-in-forward hook of the process tests;
//! - `equivalence`: data-parallel training against one process with the global batch,
//!   gradient accumulation, a parameter without gradient in some steps;
//! - `lockstep`: a hand-written loop whose ranks stay bit identical after every step;
//! - `disagreement`: ranks with another model, setting or step stop naming the difference;
//! - `job`, `checkpoints`: the checkpointed job (also what rank processes run) and resuming it;
//! - `buffers`: BatchNorm's running statistics kept identical (or not) across ranks;
//! - `evaluation`: validation metrics that do not depend on the world size;
//! - `join`: ranks with different numbers of batches training together;
//! - `compression`: gradients reduced in bf16 and fp16;
//! - `sharding`: loaders without a sampler sharded by the learner; misuse caught at start;
//! - `telemetry`: per-step figures as metrics, the straggler, Chrome traces;
//! - `zero`: the sharded optimizer (ZeRO-1 and 2) against plain DDP and one process;
//! - `zero_edges`: ZeRO with a rank that owns nothing, buffers, frozen parameters, resumes;
//! - `zero_telemetry`: a sharded step's parameter all-gather in the figures and traces;
//! - `param_groups`: optimizer and learning-rate groups built by `ParamId` on each rank;
//! - `threads`: ranks as threads of this process, training one job each (shared by the above).

mod buffers;
mod checkpoints;
pub(crate) mod compression;
mod disagreement;
pub(crate) mod equivalence;
pub(crate) mod evaluation;
mod fsdp;
mod job;
mod join;
pub(crate) mod lockstep;
mod model;
mod non_finite;
mod param_groups;
mod sharding;
mod telemetry;
mod threads;
mod zero;
mod zero_edges;
mod zero_telemetry;

pub(crate) use job::{Job, train_rank, uninterrupted_digest};
pub(crate) use model::{EXIT_CODE, flex, new_net};

use burn::data::dataloader::DataLoaderBuilder;
use burn::train::SupervisedTraining;
use burn_ddp::train::{BucketConfig, DdpLearner, DdpTraining, QuietRenderer};

use crate::common::digest;
pub(crate) use crate::common::relative_error;
use model::{Net, Points, ToBatch};

/// Small buckets, so that several are in flight per step.
fn small_buckets() -> BucketConfig {
    BucketConfig {
        cap_bytes: 256,
        first_cap_bytes: 64,
    }
}

/// A directory for burn-train's files of one rank thread of one test (named by `what`, the
/// process and the thread).
fn thread_dir(what: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!(
        "burn-ddp-{what}-{}-{:?}",
        std::process::id(),
        std::thread::current().id()
    ))
}

/// Every rank's parameters have rank 0's bytes.
fn assert_identical(params: &[&[f32]]) {
    for (r, p) in params.iter().enumerate() {
        assert_eq!(
            digest(bytemuck::cast_slice(p)),
            digest(bytemuck::cast_slice(params[0])),
            "rank {r} differs from rank 0"
        );
    }
}

/// Trains `learner` for one epoch of 8 samples in batches of `batch`, expecting an error; returns
/// it in words.
fn launch_to_error(learner: DdpLearner<Net>, batch: usize) -> String {
    // Without a sampler: the learner shards the loaders.
    let loader = || {
        DataLoaderBuilder::new(ToBatch)
            .batch_size(batch)
            .build(Points(8))
    };
    SupervisedTraining::new(std::env::temp_dir(), loader(), loader())
        .renderer(Box::new(QuietRenderer))
        .with_application_logger(None)
        .launch_ddp(learner)
        .map(|_| ())
        .unwrap_err()
        .to_string()
}

//! Data-parallel training with burn-train (feature `train`), in three layers:
//! - `learner/`, the training loop: [`DdpLearner`] (burn-train's `Learner`, data-parallel), its
//!   strategy, epochs and steps, the loaders' shards and [`DistributedSampler`], buffer
//!   synchronisation, checkpoints, the settings every rank must share, and the stop vote;
//! - `reducer/`, the gradients of a step: [`GradientReducer`] takes them out of burn's
//!   `GradientsParams`, packs them into buckets ([`BucketConfig`]), all-reduces them (optionally
//!   [`Compression`]), checks fingerprints and non-finite values ([`NonFinite`]), and with
//!   ZeRO ([`Sharding`]) gives each parameter one owner;
//! - `report/`, what rank 0 shows: progress, metrics gathered from every rank
//!   ([`GlobalItem`]) and each step's [`Telemetry`].

pub(crate) mod learner;
mod reducer;
mod report;

pub use learner::checkpoint::{CHECKPOINT_FILE, CheckpointConfig, Position, inspect_checkpoint};
pub use learner::{BufferSync, DdpLearner, DdpTraining, DistributedDataset, DistributedSampler};
pub use reducer::GradientReducer;
pub use reducer::bucket::BucketConfig;
pub use reducer::compression::Compression;
pub use reducer::non_finite::NonFinite;
pub use reducer::ownership::Sharding;
pub use reducer::params::{broadcast_module, parameters_to_vector};
pub use report::{
    DdpMetric, GlobalItem, JobStats, LineRenderer, ProgressOutput, QuietRenderer, StepInput,
    StepStats, Telemetry,
};

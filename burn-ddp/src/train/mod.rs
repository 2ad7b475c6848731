//! Data-parallel training with burn-train (feature `train`): bucketing, gradient reduction, the
//! start-up agreement, buffer synchronisation, `DistributedSampler`, checkpoints, and the
//! `DdpLearner` strategy.

mod bucket;
mod buffers;
mod checkpoint;
mod compression;
mod fingerprint;
mod gather;
mod learner;
mod non_finite;
mod params;
mod progress;
mod quiet;
mod reducer;
mod sampler;
mod settings;
mod sharding;
mod stop;
mod strategy;
mod telemetry;

pub use bucket::{Bucket, BucketConfig, BucketPlan};
pub use buffers::BufferSync;
pub use checkpoint::{CHECKPOINT_FILE, CheckpointConfig, Position, inspect_checkpoint};
#[cfg(feature = "test-support")]
#[doc(hidden)]
pub use checkpoint::{GatherStats, last_gather as last_checkpoint_gather};
pub use compression::Compression;
pub use gather::GlobalItem;
pub use learner::{DdpLearner, DdpTraining};
pub use non_finite::NonFinite;
pub use params::{ParamInfo, broadcast_module, check_agreement, flat_parameters, layout};
pub use progress::{LineRenderer, ProgressOutput};
pub use quiet::QuietRenderer;
pub use reducer::GradientReducer;
pub use sampler::{DistributedDataset, DistributedSampler};
pub use sharding::Sharding;
pub use telemetry::{DdpMetric, JobStats, StepInput, StepStats, Telemetry};

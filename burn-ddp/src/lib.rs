//! # burn-ddp
//!
//! Distributed data-parallel training for [burn](https://burn.dev), as PyTorch's
//! `DistributedDataParallel` and `torchrun` give it to PyTorch users: one process per device,
//! gradients averaged across processes and nodes each step, every replica identical.
//!
//! This crate holds the pieces that do not depend on a device:
//! - [`env`](mod@env): who-am-I from torchrun, Slurm or Open MPI variables;
//! - [`store`]: the rendezvous key-value store rank 0 serves, or torchrun's c10d store;
//! - [`elastic`]: torchrun's variables and its error file;
//! - [`ProcessGroup`]: rendezvous plus collectives (`all_reduce`, `broadcast`, `all_gather`,
//!   `barrier`), each started now and waited for later through [`Work`];
//! - [`collectives`]: element types, reduction operators, and the transports that serve CPU
//!   training and every test: TCP (a pipelined ring, gloo-like) and, for ranks on one host,
//!   shared memory ([`Transport`], `BURN_DDP_TRANSPORT`);
//! - [`launch`]: starting N rank processes of a program, as torchrun does (serving the store
//!   and generating the job [`secret`]); `cli` (feature `cli`): the launcher's flags;
//! - [`status`]: where each rank is, published so that failures say where every rank was;
//! - [`signals`]: SIGTERM, SIGINT and SIGUSR1 stop training at a step boundary (preemption);
//! - `train` (feature `train`): `DdpLearner`, bucketing, `DistributedSampler`, checkpoints,
//!   buffer synchronisation, uneven inputs;
//! - `nn` (feature `train`): `SyncBatchNorm`, batch statistics over every rank's batch.
//!
//! ## Training with burn-train
//!
//! A burn-train program becomes data-parallel by two changes: `Learner::new` becomes
//! `DdpLearner::new` and `training.launch` becomes `training.launch_ddp` (trait `DdpTraining`).
//! The learner shards the training and validation loaders across the ranks (or takes a
//! `DistributedSampler` for PyTorch's exact sampling), averages the gradients every step, and
//! rank 0 alone reports metrics, counting every validation item once. The whole program, which
//! trains alone or started once per device (`burn-ddp-run --nproc 2 ./my-trainer`, torchrun,
//! srun, mpirun):
//!
#![cfg_attr(
    feature = "train",
    doc = concat!("```rust\n", include_str!("../doc/whole_program.rs"), "```\n")
)]
//!
//! It needs `burn = { version = "0.22", default-features = false, features = ["std", "flex",
//! "autodiff", "optim", "train", "dataset"] }` and `burn-ddp` (feature `train`, on by default).
//!
//! ## Collectives
//!
//! ```no_run
//! use burn_ddp::{init_process_group, ReduceOp};
//! let group = init_process_group()?; // world of one when no launcher variables are set
//! let grads = vec![1.0f32; 1024];
//! let pending = group.all_reduce(grads, ReduceOp::Avg); // runs in the background
//! let averaged = pending.wait()?;
//! # Ok::<(), burn_ddp::DdpError>(())
//! ```

// All unsafe code is in one module (`sys`: the shared-memory mapping and a raw signal handler),
// which allows it for itself.
// docs.rs marks each item with the feature it needs (`--cfg docsrs`, see Cargo.toml).
#![cfg_attr(docsrs, feature(doc_cfg))]
#![deny(unsafe_code)]
#![warn(missing_docs)]

#[cfg(feature = "cli")]
pub mod cli;
pub mod collectives;
pub mod elastic;
pub mod env;
mod error;
mod failure;
#[cfg(feature = "train")]
pub mod fsdp;
mod group;
pub mod launch;
mod limits;
mod liveness;
#[cfg(feature = "train")]
pub mod nn;
#[cfg(feature = "train")]
mod records;
pub mod secret;
pub mod signals;
pub mod status;
pub mod store;
mod sync;
mod sys;
#[cfg(feature = "test-support")]
#[doc(hidden)]
pub mod testing;
#[cfg(feature = "train")]
pub mod train;
mod wire;

// `DType` and `Element` stay in `collectives`: at the root they would shadow burn's own names.
pub use collectives::{Broadcastable, Gatherable, Reduce, ReduceOp, Reducible, Work};
pub use env::{TRANSPORT_VAR, Transport};
pub use error::{DdpError, Result};
pub use group::{
    GroupOptions, ProcessGroup, ProcessGroupBuilder, init_process_group, init_process_group_with,
};

// README.md's Rust code blocks run as doc tests (`cargo test --doc`).
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
struct ReadmeDoctests;
#[cfg(doctest)]
mod guide;

//! # burn-ddp-nccl
//!
//! The NCCL backend of burn-ddp: gradients all-reduced across GPUs and nodes on
//! burn-cuda's CubeCL buffers, with no host round trip.
//!
//! - [`library`]: finds libcuda and libnccl before anything loads them (cudarc's loader panics
//!   on a missing library); a missing library is an [`NcclError`] saying what was looked for and
//!   how to fix it. Always compiled.
//! - With the `cuda` feature: `NcclComm`, one non-blocking communicator per process group on
//!   the GPU of the rank's tensors (`cuda_ordinal`), joined with the 128-byte id rank 0
//!   creates (`unique_id`) and passes to the others (burn-ddp sends it over the group's own
//!   transport). All-reduce, broadcast and all-gather start on the calling thread and finish in
//!   `Pending::wait` on any thread, bounded by a timeout, an abort from another thread, NCCL's
//!   asynchronous errors and a watch the caller gives; a communicator enqueues its collectives
//!   in the order they were started, whichever threads wait for them. NCCL older than 2.14 is
//!   refused with an [`NcclError`]. The `cuda` feature turns on burn's kernel fusion, so that
//!   the CUDA backend is one type in every user's build (see `comm.rs`).
//!
//! Every `unsafe` call lives in one module (`ffi.rs`) with its safety argument; the crate
//! denies `unsafe_code` everywhere else.
//!
//! burn-ddp's `nccl` feature makes its process group use it for tensors on CUDA devices (so
//! `DdpLearner`'s buckets travel by NCCL). Status: built and tested without a GPU (library
//! finder, NCCL id, device and type tables, waits); it has not yet run on a GPU.

// docs.rs marks each item with the feature it needs (`--cfg docsrs`, see Cargo.toml).
#![cfg_attr(docsrs, feature(doc_cfg))]
#![deny(unsafe_code)]

mod error;
pub mod library;

#[cfg(feature = "cuda")]
mod buffer;
#[cfg(feature = "cuda")]
mod comm;
#[cfg(feature = "cuda")]
#[allow(unsafe_code)]
mod ffi;
#[cfg(feature = "cuda")]
#[cfg(feature = "cuda")]
mod tables;
#[cfg(feature = "cuda")]
mod turns;
#[cfg(feature = "cuda")]
mod waiting;

#[cfg(feature = "cuda")]
pub use buffer::POISON_VAR;
#[cfg(feature = "cuda")]
pub use comm::pending::Pending;
#[cfg(feature = "cuda")]
pub use comm::{NcclComm, check_libraries, unique_id};
pub use error::NcclError;
#[cfg(feature = "cuda")]
pub use tables::{ReduceOp, cuda_ordinal};
#[cfg(feature = "cuda")]
pub use waiting::{GRACE, WATCH_INTERVAL};

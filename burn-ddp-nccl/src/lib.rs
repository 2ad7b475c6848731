//! # burn-ddp-nccl
//!
//! The NCCL backend of burn-ddp: gradients all-reduced across GPUs and nodes in place on
//! burn-cuda's CubeCL buffers, with no host round trip.
//!
//! - [`library`]: finds libcuda and libnccl before anything loads them (cudarc's loader panics
//!   on a missing library); a missing library is an [`NcclError`] saying what was looked for and
//!   how to fix it. Always compiled.
//! - With the `cuda` feature: [`NcclComm`], one communicator per process group on the rank's
//!   GPU, joined with the 128-byte id rank 0 creates ([`unique_id`]) and passes through
//!   burn-ddp's store; its `unsafe` calls live in one module with their safety argument.
//!
//! burn-ddp's `nccl` feature makes `DdpLearner` use it for models on CUDA devices. Status: built
//! and tested without a GPU (library finder, NCCL id); it has not yet run on a GPU.

mod error;
pub mod library;

#[cfg(feature = "cuda")]
mod comm;
#[cfg(feature = "cuda")]
mod ffi;

#[cfg(feature = "cuda")]
pub use comm::{NcclComm, ReduceOp, check_libraries, is_cuda, unique_id};
pub use error::NcclError;

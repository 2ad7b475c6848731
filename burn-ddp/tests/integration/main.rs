//! burn-ddp's integration tests: real ranks over loopback TCP, as threads and as processes.

mod bins;
mod c10d;
mod cluster;
mod collectives;
mod common;
mod env;
mod faults;
mod flood;
mod fsdp;
mod mpi;
mod nccl_plans;
mod netif;
mod output;
mod preemption;
mod processes;
mod reduce_scatter;
mod security;
mod shm;
mod shm_forged;
mod soak;
mod store;
mod syncbn;
mod tensors;
mod torchrun;
mod train;
mod user_crate;
// Training on burn's wgpu backend: builds the wgpu stack, so only with the `wgpu` feature.
#[cfg(feature = "wgpu")]
mod wgpu;

//! # burn-ddp-nccl
//!
//! The NCCL backend of burn-ddp (not implemented yet; see the NCCL issue). It will implement the
//! collectives of [`burn_ddp::ProcessGroup`] with NCCL on burn-cuda buffers: one communicator
//! per process group, device = local rank, the NCCL unique id created on rank 0 and passed to
//! the other ranks through the group's [`burn_ddp::store::Store`]. Until then, CUDA devices are
//! not supported and burn-ddp's TCP transport serves CPU training.

//! The error type of the NCCL backend.

use std::path::PathBuf;

/// What can go wrong with CUDA and NCCL.
#[derive(Debug, thiserror::Error)]
pub enum NcclError {
    /// A shared library is not loadable; says what was looked for and how to fix it.
    #[error(
        "{library} not found (looked for {looked_for:?} in {searched:?} and the system's library \
         path): {fix}"
    )]
    MissingLibrary {
        /// `libcuda` or `libnccl`.
        library: &'static str,
        /// File names tried.
        looked_for: Vec<&'static str>,
        /// Directories searched.
        searched: Vec<PathBuf>,
        /// How to fix it.
        fix: String,
    },
    /// NCCL returned an error; carries NCCL's own message.
    #[error("rank {rank}: NCCL {call} failed: {message}")]
    Nccl {
        /// Rank reporting.
        rank: usize,
        /// The NCCL call.
        call: &'static str,
        /// `ncclGetErrorString` / `ncclGetLastError`.
        message: String,
    },
    /// The CUDA driver returned an error.
    #[error("rank {rank}: CUDA {call} failed: {message}")]
    Cuda {
        /// Rank reporting.
        rank: usize,
        /// The driver call.
        call: &'static str,
        /// The driver's message.
        message: String,
    },
    /// A collective did not finish in time; the communicator was aborted.
    #[error("rank {rank}: NCCL {op} did not finish within {timeout:?}; communicator aborted")]
    Timeout {
        /// Rank reporting.
        rank: usize,
        /// The operation.
        op: String,
        /// The limit.
        timeout: std::time::Duration,
    },
    /// A tensor cannot be reduced by NCCL (type, device, layout).
    #[error("rank {rank}: cannot all-reduce this tensor: {reason}")]
    Tensor {
        /// Rank reporting.
        rank: usize,
        /// Why.
        reason: String,
    },
}

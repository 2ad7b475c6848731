//! The error type of the NCCL backend.

use std::path::PathBuf;

/// What can go wrong with CUDA and NCCL. `Debug` shows the same sentence as `Display`, so any
/// `main` that returns the error prints the message, not a struct.
#[derive(thiserror::Error)]
#[non_exhaustive]
pub enum NcclError {
    /// A shared library is not loadable; says what was looked for and how to fix it.
    #[error(
        "{library} not found (looked for {looked_for:?} in {searched:?} and the system's library \
         path): {fix}"
    )]
    MissingLibrary {
        /// `libcuda`, `libnccl` or `libnvrtc`.
        library: &'static str,
        /// File names tried.
        looked_for: Vec<&'static str>,
        /// Directories searched.
        searched: Vec<PathBuf>,
        /// How to fix it.
        fix: String,
    },
    /// The libnccl that loads is older than this crate needs (`ncclCommInitRankConfig` and
    /// `ncclCommFinalize` came with NCCL 2.14; cudarc panics on a missing symbol, so the
    /// version is checked before any other NCCL call).
    #[error(
        "libnccl {found} (ncclGetVersion says {code}) is too old: burn-ddp-nccl needs NCCL \
         {needed} or newer; {fix}"
    )]
    UnsupportedNccl {
        /// The version found, `major.minor.patch` (or why it could not be read).
        found: String,
        /// `ncclGetVersion`'s code (`major * 10000 + minor * 100 + patch` since 2.9); 0 when
        /// it could not be read.
        code: i32,
        /// The oldest version this crate takes.
        needed: &'static str,
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
    /// A wait was stopped before NCCL finished, by a failure found elsewhere in the group (a
    /// dead peer, the group's failure record) or an abort; the communicator was aborted.
    #[error("rank {rank}: NCCL {op} stopped: {reason}; communicator aborted")]
    Stopped {
        /// Rank reporting.
        rank: usize,
        /// The operation.
        op: String,
        /// What stopped it.
        reason: String,
    },
    /// A tensor cannot be reduced by NCCL (type, device, layout).
    #[error("rank {rank}: NCCL cannot take this tensor: {reason}")]
    Tensor {
        /// Rank reporting.
        rank: usize,
        /// Why.
        reason: String,
    },
}

impl std::fmt::Debug for NcclError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // No variant has a source: the message is the whole story.
        std::fmt::Display::fmt(self, f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_is_the_message() {
        let e = NcclError::Tensor {
            rank: 1,
            reason: "not on a CUDA device".into(),
        };
        assert_eq!(
            format!("{e:?}"),
            "rank 1: NCCL cannot take this tensor: not on a CUDA device"
        );
    }
}

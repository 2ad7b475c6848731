//! The error type of burn-ddp: every failure a user, an environment or a peer can cause.

use std::fmt;
use std::io;
use std::time::Duration;

pub(crate) mod admission;

/// Result alias used throughout burn-ddp.
pub type Result<T, E = DdpError> = std::result::Result<T, E>;

/// Everything that can go wrong while forming a process group or running a collective.
///
/// Messages name the rank that saw the failure, the rank that caused it where known, and the
/// operation, so that a log line from any rank says what happened to the whole job.
///
/// `Debug` shows the same sentence as `Display` (with the causes it does not already name), so
/// `fn main() -> Result<(), Box<dyn Error>>` prints the message, not a struct.
#[derive(thiserror::Error)]
#[non_exhaustive]
pub enum DdpError {
    /// An environment variable is set but its value cannot be used.
    #[error("environment variable {var}={value:?} is invalid: {expected}")]
    InvalidEnv {
        /// Name of the variable.
        var: &'static str,
        /// The value found.
        value: String,
        /// What was expected instead.
        expected: String,
    },
    /// A required environment variable is missing.
    #[error("environment variable {var} is not set: {why}")]
    MissingEnv {
        /// Name of the variable.
        var: &'static str,
        /// Why it is required.
        why: String,
    },
    /// Options given to a builder or a launcher are inconsistent.
    #[error("invalid configuration: {0}")]
    InvalidConfig(String),
    /// A listening socket could not be opened (for example the port is in use).
    #[error("cannot listen on {addr} for the {what}: {source}{hint}")]
    Bind {
        /// The address asked for.
        addr: String,
        /// What the socket was for.
        what: &'static str,
        /// Extra advice (for example which variable chose the port).
        hint: String,
        /// The operating system's error.
        #[source]
        source: io::Error,
    },
    /// The rendezvous (store connection, address exchange, mesh connection) failed.
    #[error("rank {rank}: rendezvous failed: {reason}")]
    Rendezvous {
        /// Rank that failed.
        rank: usize,
        /// What went wrong.
        reason: String,
    },
    /// A request to the key-value store failed.
    #[error("store at {addr}: {reason}")]
    Store {
        /// Address of the store.
        addr: String,
        /// What went wrong.
        reason: String,
    },
    /// A connection to the store or between ranks was not admitted: this process or its peer
    /// cannot prove it holds the job secret (`BURN_DDP_SECRET`), or the peer is not burn-ddp's.
    #[error("{connection}: {source}")]
    Admission {
        /// Which connection, for example `store at 10.0.0.1:29500` or
        /// `rank 3: data plane of rank 1 at 10.0.0.2:41234`.
        connection: String,
        /// What went wrong.
        #[source]
        source: admission::AdmissionError,
    },
    /// Waiting for store keys did not finish in time.
    #[error("store at {addr}: timed out after {timeout:?} waiting for {what}")]
    StoreTimeout {
        /// Address of the store.
        addr: String,
        /// How long was waited.
        timeout: Duration,
        /// What was waited for.
        what: String,
    },
    /// A collective failed: a peer died, left, timed out or sent something unexpected.
    #[error("rank {rank}: {op} failed: {cause}; where the ranks were: {ranks}")]
    Collective {
        /// Rank reporting the failure.
        rank: usize,
        /// The operation, for example `all_reduce #12 of 4096 x f32`.
        op: String,
        /// The root cause as agreed through the store (names the failing rank).
        cause: String,
        /// Every rank's last published status (a dead rank's says what it was doing last),
        /// for example `rank 3: validation, epoch 2, step 118; ranks 0-2: training, ...`.
        ranks: String,
    },
    /// The group failed earlier; it cannot be used any more.
    #[error("rank {rank}: {op} refused: the process group failed earlier: {cause}")]
    Aborted {
        /// Rank reporting.
        rank: usize,
        /// The refused operation.
        op: String,
        /// The first failure of this group.
        cause: String,
    },
    /// A collective was called with arguments that cannot work.
    #[error("rank {rank}: invalid {op}: {reason}")]
    InvalidArgument {
        /// Rank reporting.
        rank: usize,
        /// The operation.
        op: String,
        /// What is wrong.
        reason: String,
    },
    /// A block wrapped for fully sharded training ([`crate::fsdp`]) cannot be wrapped or run.
    #[cfg(feature = "train")]
    #[error("rank {rank}: fsdp {block}: {reason}")]
    Fsdp {
        /// Rank reporting.
        rank: usize,
        /// The block's name (`block <n>` unless named).
        block: String,
        /// What is wrong.
        reason: String,
    },
    /// The background thread that runs collectives is gone (it panicked).
    #[error("rank {rank}: the collective worker thread stopped unexpectedly")]
    WorkerGone {
        /// Rank reporting.
        rank: usize,
    },
    /// Ranks disagree on something that must be the same everywhere (model layout, settings).
    #[error("ranks disagree: {0}")]
    Disagreement(String),
    /// Some rank's gradients held a NaN or an infinity (see `train::NonFinite`); every rank
    /// stops alike, before the optimizer step.
    #[error("rank {rank}: {detail}")]
    NonFiniteGradients {
        /// Rank reporting.
        rank: usize,
        /// The ranks whose gradients were not finite.
        culprits: Vec<usize>,
        /// The epoch.
        epoch: usize,
        /// The step within the epoch.
        step: usize,
        /// The whole sentence.
        detail: String,
    },
    /// A rank's data loader failed; training stops on every rank.
    #[error("rank {rank}: loading a batch failed: {reason}")]
    Data {
        /// Rank whose loader failed.
        rank: usize,
        /// The loader's error.
        reason: String,
    },
    /// Writing, agreeing on or reading a checkpoint failed.
    #[error("rank {rank}: checkpoint: {reason}")]
    Checkpoint {
        /// Rank reporting.
        rank: usize,
        /// What went wrong.
        reason: String,
    },
    /// A tensor could not be converted (for example a gradient of an unexpected type).
    #[error("tensor conversion failed: {0}")]
    Tensor(String),
    /// A rank process started by the launcher failed.
    #[error("rank {rank} failed first: {status}")]
    RankFailed {
        /// The first rank that failed.
        rank: usize,
        /// Its exit status in words.
        status: String,
    },
    /// Training stopped on every rank because a rank received a stop signal (preemption,
    /// Ctrl-C): not a failure; exit with [`DdpError::exit_code`] (128 + the signal's number).
    #[error(
        "rank {rank}: stopped by {} at epoch {epoch}, step {step}{}",
        crate::signals::signal_name(*signal),
        match checkpoint {
            Some(p) => format!("; checkpoint written to {}: run the job again to resume", p.display()),
            None => "; no checkpoint configured".to_string(),
        }
    )]
    Stopped {
        /// Rank reporting.
        rank: usize,
        /// The signal (the highest number, if ranks received different ones).
        signal: i32,
        /// Epoch the ranks stopped in.
        epoch: usize,
        /// Batches of that epoch done.
        step: usize,
        /// The checkpoint written at that point, if checkpoints are configured.
        checkpoint: Option<std::path::PathBuf>,
    },
    /// The launcher's ranks stopped after the launcher received a stop signal.
    #[error("stopped by {}: the ranks exited with {status}", crate::signals::signal_name(*signal))]
    LaunchStopped {
        /// The signal the launcher received and forwarded.
        signal: i32,
        /// How the ranks ended, in words.
        status: String,
        /// The exit code for the launcher (the ranks' own, or 128 + the signal).
        code: i32,
    },
    /// Any other I/O failure, with what was being done.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The operating system's error.
        #[source]
        source: io::Error,
    },
}

impl DdpError {
    /// The exit code a program should end with for this error: 128 + the signal's number for
    /// a stop by signal ([`DdpError::Stopped`], [`DdpError::LaunchStopped`]), 1 otherwise.
    pub fn exit_code(&self) -> i32 {
        match self {
            DdpError::Stopped { signal, .. } => crate::signals::exit_code(*signal),
            DdpError::LaunchStopped { code, .. } => *code,
            _ => 1,
        }
    }

    /// Wraps an I/O error with what was being done.
    pub(crate) fn io(context: impl Into<String>, source: io::Error) -> Self {
        DdpError::Io {
            context: context.into(),
            source,
        }
    }
}

/// Writes `error`'s message, then the messages of its causes that the text does not already
/// hold: the `Debug` form of burn-ddp's public errors.
pub(crate) fn fmt_chain(error: &dyn std::error::Error, f: &mut fmt::Formatter<'_>) -> fmt::Result {
    let mut text = error.to_string();
    let mut source = error.source();
    let mut caused = false;
    while let Some(cause) = source {
        let message = cause.to_string();
        if !text.contains(&message) {
            if !caused {
                text.push_str("\n\nCaused by:");
                caused = true;
            }
            text.push_str("\n    ");
            text.push_str(&message);
        }
        source = cause.source();
    }
    f.write_str(&text)
}

/// `Debug` as `Display` with the cause chain ([`fmt_chain`]), for public error types.
macro_rules! debug_as_display {
    ($($error:ty),* $(,)?) => {$(
        impl std::fmt::Debug for $error {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                $crate::error::fmt_chain(self, f)
            }
        }
    )*};
}
pub(crate) use debug_as_display;

debug_as_display!(DdpError);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_is_the_message_with_its_causes() {
        let e = DdpError::Disagreement("rank 0 has setting lr = 0.05 but rank 1 has 0.1".into());
        assert_eq!(format!("{e:?}"), format!("{e}"));
        assert!(!format!("{e:?}").contains("Disagreement("));
        // A cause already in the message is not repeated.
        let io = DdpError::io("reading x", io::Error::other("disk on fire"));
        assert_eq!(format!("{io:?}"), "reading x: disk on fire");
        // One that is not is listed.
        let admission = DdpError::Admission {
            connection: "store at 10.0.0.1:29500".into(),
            source: admission::AdmissionError::Io {
                step: "reading the challenge",
                source: io::Error::other("reset"),
            },
        };
        let debug = format!("{admission:?}");
        assert!(debug.starts_with(&admission.to_string()), "{debug}");
    }
}

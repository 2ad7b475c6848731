//! torchrun (`torch.distributed.elastic`) integration on the rank's side: the restart count,
//! the error file from which torchrun prints a failed job's root cause, and a rank's tie to the
//! `burn-ddp-run` that started it. (The variables themselves are read in [`crate::env`].)
//!
//! Under torchrun every rank gets `TORCHELASTIC_ERROR_FILE`, a per-rank path. When a rank fails,
//! torchrun reads that file and shows its message in the "Root Cause" section of its report
//! (the earliest failure by timestamp). [`record_error`] writes it in the JSON form PyTorch's
//! `ErrorHandler` uses:
//!
//! ```json
//! {"message": {"message": "...", "extraInfo": {"py_callstack": "...", "timestamp": "1733212800"}}}
//! ```
//!
//! The process group records its first failed collective there (the message names the rank,
//! the operation and where every rank was); programs call [`record_error`] from `main` for
//! any other error. The first error recorded in a process is kept.

use std::fmt::Display;
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

/// Path of this rank's error file, read by torchrun when the rank fails.
pub const ERROR_FILE_VAR: &str = "TORCHELASTIC_ERROR_FILE";

/// Which start of the job this process belongs to (0: the first), from the process
/// environment as [`crate::env::restart_count_from`] reads it; 0 when the value is not a
/// number. Programs use it, for example, to act differently after a restart.
pub fn restart_count() -> usize {
    crate::env::process_restart_count()
}

/// Makes this rank die with the `burn-ddp-run` that started it (`PR_SET_PDEATHSIG`), so a
/// launcher killed outright (SIGKILL, a lost node) takes its ranks along and their peers see
/// them gone, as torchrun's agent takes its workers. Does nothing when this process was not
/// started by our launcher, or when the launcher is already gone.
pub fn die_with_launcher() {
    #[cfg(target_os = "linux")]
    {
        use rustix::process::{Signal, getppid, set_parent_process_death_signal};
        let launcher = crate::env::launcher_pid();
        let parent = getppid().map(|p| p.as_raw_nonzero().get());
        if launcher.is_some() && launcher == parent {
            if let Err(e) = set_parent_process_death_signal(Some(Signal::KILL)) {
                log::warn!("could not tie this rank's life to its launcher's: {e}");
            }
            // The launcher may have died between the check and the call.
            if getppid().map(|p| p.as_raw_nonzero().get()) != launcher {
                std::process::exit(1);
            }
        }
    }
}

/// Whether this process already wrote its error file.
static RECORDED: Mutex<bool> = Mutex::new(false);

/// Writes `error` to the file named by `TORCHELASTIC_ERROR_FILE`, when set, for torchrun's
/// failure report. Only the first call of a process writes (the first error is the cause);
/// an I/O failure is logged, never raised. Call it from `main` when it fails:
///
/// ```no_run
/// fn main() -> Result<(), burn_ddp::DdpError> {
///     run().inspect_err(|e| burn_ddp::elastic::record_error(e))
/// }
/// # fn run() -> Result<(), burn_ddp::DdpError> { Ok(()) }
/// ```
///
/// (with `anyhow`: `record_error(&format_args!("{e:#}"))` to include the error's causes).
pub fn record_error(error: &dyn Display) {
    record_error_with(|| error.to_string());
}

/// As [`record_error`], building the message only when it will be written.
pub(crate) fn record_error_with(message: impl FnOnce() -> String) {
    let Some(path) = std::env::var_os(ERROR_FILE_VAR).filter(|p| !p.is_empty()) else {
        return;
    };
    let mut recorded = crate::sync::lock(&RECORDED);
    if *recorded {
        return;
    }
    *recorded = true;
    let timestamp = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let json = error_file_json(&message(), timestamp);
    if let Err(e) = std::fs::write(&path, json) {
        log::error!(
            "cannot write the torchrun error file {}: {e}",
            std::path::Path::new(&path).display()
        );
    }
}

/// The error file's content for `message` at `timestamp` (seconds since the epoch). torchrun
/// prints `py_callstack` when present, so it holds the message too.
pub(crate) fn error_file_json(message: &str, timestamp: u64) -> String {
    let m = crate::wire::json_string(message);
    format!(
        "{{\"message\": {{\"message\": {m}, \"extraInfo\": {{\"py_callstack\": {m}, \
         \"timestamp\": \"{timestamp}\"}}}}}}"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_file_has_torchruns_layout_and_escapes() {
        let json = error_file_json("rank 1: \"x\"\\ failed\n\tnext\u{1}", 1733212800);
        assert_eq!(
            json,
            "{\"message\": {\"message\": \"rank 1: \\\"x\\\"\\\\ failed\\n\\tnext\\u0001\", \
             \"extraInfo\": {\"py_callstack\": \"rank 1: \\\"x\\\"\\\\ failed\\n\\tnext\\u0001\", \
             \"timestamp\": \"1733212800\"}}}"
        );
    }
}

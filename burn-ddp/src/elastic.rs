//! torchrun (`torch.distributed.elastic`) integration: the variables its agent sets, the
//! restart count, and the error file from which torchrun prints a failed job's root cause.
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

use std::fmt::{Display, Write as _};
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use crate::error::{DdpError, Result};
use crate::launch::RESTART_COUNT_VAR;

/// `True` when torchrun's agent serves a c10d `TCPStore` at `MASTER_ADDR:MASTER_PORT`, which
/// the ranks then join as clients instead of rank 0 serving one.
pub const USE_AGENT_STORE_VAR: &str = "TORCHELASTIC_USE_AGENT_STORE";
/// How many times torchrun restarted the workers (0 on the first start).
pub const TORCHELASTIC_RESTART_COUNT_VAR: &str = "TORCHELASTIC_RESTART_COUNT";
/// Path of this rank's error file, read by torchrun when the rank fails.
pub const ERROR_FILE_VAR: &str = "TORCHELASTIC_ERROR_FILE";

/// The restart count from `get`: `BURN_DDP_RESTART_COUNT` (burn-ddp-run) if set, else
/// `TORCHELASTIC_RESTART_COUNT` (torchrun), else 0.
pub fn restart_count_from(get: impl Fn(&str) -> Option<String>) -> Result<usize> {
    for var in [RESTART_COUNT_VAR, TORCHELASTIC_RESTART_COUNT_VAR] {
        if let Some(v) = get(var).filter(|v| !v.trim().is_empty()) {
            return v.trim().parse().map_err(|_| DdpError::InvalidEnv {
                var,
                value: v.clone(),
                expected: "a non-negative integer".into(),
            });
        }
    }
    Ok(0)
}

/// Which start of the job this process belongs to (0: the first), from the process
/// environment as [`restart_count_from`] reads it; 0 when the value is not a number. Programs
/// use it, for example, to act differently after a restart.
pub fn restart_count() -> usize {
    restart_count_from(|name| std::env::var(name).ok()).unwrap_or(0)
}

/// Whether `get` says torchrun's agent serves the store (`TORCHELASTIC_USE_AGENT_STORE`, which
/// PyTorch compares with `"True"`; `true` and `1` are accepted too).
pub fn uses_agent_store(get: impl Fn(&str) -> Option<String>) -> Result<bool> {
    match get(USE_AGENT_STORE_VAR).as_deref().map(str::trim) {
        None | Some("" | "False" | "false" | "0") => Ok(false),
        Some("True" | "true" | "1") => Ok(true),
        Some(v) => Err(DdpError::InvalidEnv {
            var: USE_AGENT_STORE_VAR,
            value: v.to_string(),
            expected: "True or False".into(),
        }),
    }
}

/// The key prefix of one attempt of a job in torchrun's store, which outlives restarts: keys
/// of earlier attempts are never seen by later ones. PyTorch itself uses
/// `/worker/attempt_{n}` for its own keys.
pub fn store_namespace(restart_count: usize) -> String {
    format!("burn_ddp/attempt_{restart_count}/")
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
pub fn error_file_json(message: &str, timestamp: u64) -> String {
    let m = json_string(message);
    format!(
        "{{\"message\": {{\"message\": {m}, \"extraInfo\": {{\"py_callstack\": {m}, \
         \"timestamp\": \"{timestamp}\"}}}}}}"
    )
}

/// `s` as a JSON string literal.
pub(crate) fn json_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lookup<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |k| {
            vars.iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        }
    }

    #[test]
    fn ours_takes_precedence_over_torchrun_restart_count() {
        assert_eq!(restart_count_from(lookup(&[])).unwrap(), 0);
        let torchrun = [(TORCHELASTIC_RESTART_COUNT_VAR, "2")];
        assert_eq!(restart_count_from(lookup(&torchrun)).unwrap(), 2);
        let both = [
            (TORCHELASTIC_RESTART_COUNT_VAR, "2"),
            (RESTART_COUNT_VAR, "5"),
        ];
        assert_eq!(restart_count_from(lookup(&both)).unwrap(), 5);
        let bad = [(TORCHELASTIC_RESTART_COUNT_VAR, "two")];
        let e = restart_count_from(lookup(&bad)).unwrap_err().to_string();
        assert!(e.contains(TORCHELASTIC_RESTART_COUNT_VAR), "{e}");
    }

    #[test]
    fn agent_store_flag_reads_pythons_spelling() {
        for (v, on) in [("True", true), ("1", true), ("False", false), ("", false)] {
            let vars = [(USE_AGENT_STORE_VAR, v)];
            assert_eq!(uses_agent_store(lookup(&vars)).unwrap(), on, "{v:?}");
        }
        assert!(!uses_agent_store(lookup(&[])).unwrap());
        assert!(uses_agent_store(lookup(&[(USE_AGENT_STORE_VAR, "yes")])).is_err());
    }

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

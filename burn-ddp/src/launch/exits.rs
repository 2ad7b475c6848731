//! How the ranks of one start ended, as the launcher's waiter threads report it: who failed and
//! how (for the failure report), and the outcome of a start that a stop signal ended.

use std::process::ExitStatus;

use crate::error::{DdpError, Result};

/// A rank's exit status in words: `exited with code 3`, `killed by signal 9`.
pub(super) fn describe(status: ExitStatus) -> String {
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        if let Some(sig) = status.signal() {
            return format!("killed by signal {sig}");
        }
    }
    match status.code() {
        Some(c) => format!("exited with code {c}"),
        None => status.to_string(),
    }
}

/// A waiter thread's report: the local rank and how it ended.
pub(super) type Exit = (usize, std::io::Result<ExitStatus>);

/// The ranks' exits as the waiter threads report them.
pub(super) struct Exits {
    pub running: Vec<bool>,
    /// How each rank that failed ended, in words.
    pub failures: Vec<Option<String>>,
    /// How each rank ended.
    pub statuses: Vec<Option<ExitStatus>>,
}

impl Exits {
    /// `n` ranks, all running.
    pub(super) fn new(n: usize) -> Self {
        Exits {
            running: vec![true; n],
            failures: vec![None; n],
            statuses: vec![None; n],
        }
    }

    /// Notes rank `i`'s exit; true if it failed.
    pub(super) fn record(&mut self, (i, status): Exit) -> bool {
        self.running[i] = false;
        self.statuses[i] = status.as_ref().ok().copied();
        self.failures[i] = match status {
            Ok(s) if s.success() => None,
            Ok(s) => Some(describe(s)),
            Err(e) => Some(format!("cannot be waited for ({e})")),
        };
        self.failures[i].is_some()
    }
}

impl Exits {
    /// The outcome of a start that a stop signal ended: `Ok` if every rank exited with 0 (they
    /// finished anyway), else the ranks' exit code (the first rank's that has one; 128 + the
    /// signal for ranks killed by a signal).
    pub(super) fn stopped(&self, signal: i32, first: usize) -> Result<()> {
        if self.statuses.iter().all(|s| s.is_some_and(|s| s.success())) {
            return Ok(());
        }
        let code = self
            .statuses
            .iter()
            .flatten()
            .find_map(|s| s.code().filter(|c| *c != 0))
            .unwrap_or(crate::signals::exit_code(signal));
        let status = self
            .statuses
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let how = s.map_or("cannot be waited for".into(), describe);
                format!("rank {}: {how}", first + i)
            })
            .collect::<Vec<_>>()
            .join(", ");
        Err(DdpError::LaunchStopped {
            signal,
            status,
            code,
        })
    }
}

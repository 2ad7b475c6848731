//! Where the ranks' output goes, as torchrun's `--log-dir`, `--tee` and `--local-ranks-filter`
//! decide it there:
//! - in a terminal, rank 0 gets the terminal itself (stdin, stdout, stderr, no prefix), so
//!   burn-train's TUI works; the other ranks' lines are prefixed `[rank N] `;
//! - not in a terminal, every line is prefixed;
//! - with a log directory, each rank's output goes to `DIR/rank-N.log` instead, and also to
//!   the screen (prefixed) with `tee`;
//! - with a filter, only the listed local ranks are shown (log files are written for all).

use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, IsTerminal, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use super::LaunchConfig;
use crate::error::{DdpError, Result};

/// The output plan of one launch.
#[derive(Debug, Clone)]
pub(crate) struct OutputPlan {
    terminal: bool,
    log_dir: Option<PathBuf>,
    tee: bool,
    filter: Option<Vec<usize>>,
}

/// What to do with one rank's pipes once it runs.
pub(crate) struct RankOutput {
    prefix: String,
    shown: bool,
    log: Option<Arc<Mutex<File>>>,
}

/// The path of `rank`'s log file in `dir`.
pub fn log_path(dir: &Path, rank: usize) -> PathBuf {
    dir.join(format!("rank-{rank}.log"))
}

impl OutputPlan {
    pub(crate) fn new(cfg: &LaunchConfig) -> Result<Self> {
        if let Some(dir) = &cfg.log_dir {
            std::fs::create_dir_all(dir).map_err(|e| {
                DdpError::io(format!("creating the log directory {}", dir.display()), e)
            })?;
        }
        if let Some(bad) = cfg
            .local_ranks_filter
            .iter()
            .flatten()
            .find(|r| **r >= cfg.nproc_per_node)
        {
            return Err(DdpError::InvalidConfig(format!(
                "--local-ranks-filter names local rank {bad}, but this node runs local ranks \
                 0..{}",
                cfg.nproc_per_node
            )));
        }
        Ok(OutputPlan {
            terminal: std::io::stdout().is_terminal(),
            log_dir: cfg.log_dir.clone(),
            tee: cfg.tee,
            filter: cfg.local_ranks_filter.clone(),
        })
    }

    /// Sets up `cmd`'s standard streams for `rank` (local rank `local`) of start `attempt`,
    /// and returns what to do with its pipes. Rank 0 gets the terminal itself when the
    /// launcher runs in one, is shown and writes no log file.
    pub(crate) fn attach(
        &self,
        cmd: &mut Command,
        rank: usize,
        local: usize,
        attempt: usize,
    ) -> Result<Option<RankOutput>> {
        let shown = self.filter.as_ref().is_none_or(|f| f.contains(&local));
        let log = match &self.log_dir {
            Some(dir) => Some(Arc::new(Mutex::new(open_log(dir, rank, attempt)?))),
            None => None,
        };
        if log.is_none() && shown && self.terminal && rank == 0 {
            cmd.stdin(Stdio::inherit())
                .stdout(Stdio::inherit())
                .stderr(Stdio::inherit());
            return Ok(None);
        }
        cmd.stdin(Stdio::null());
        if log.is_none() && !shown {
            cmd.stdout(Stdio::null()).stderr(Stdio::null());
            return Ok(None);
        }
        cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
        Ok(Some(RankOutput {
            prefix: format!("[rank {rank}] "),
            shown: shown && (log.is_none() || self.tee),
            log,
        }))
    }
}

/// Opens `rank`'s log file: new for the first start, appended to (after a header) for a restart.
fn open_log(dir: &Path, rank: usize, attempt: usize) -> Result<File> {
    let path = log_path(dir, rank);
    let opened = if attempt == 0 {
        File::create(&path)
    } else {
        OpenOptions::new().append(true).create(true).open(&path)
    };
    let mut file = opened.map_err(|e| DdpError::io(format!("opening {}", path.display()), e))?;
    if attempt > 0 {
        let _ = writeln!(file, "--- restart {attempt} ---");
    }
    Ok(file)
}

impl RankOutput {
    /// Copies a rank's stream, line by line, to its log file and (prefixed) to the launcher's
    /// stdout or stderr.
    pub(crate) fn pump(&self, from: impl Read + Send + 'static, stderr: bool) -> JoinHandle<()> {
        let prefix = self.prefix.clone();
        let shown = self.shown;
        let log = self.log.clone();
        std::thread::spawn(move || {
            let mut reader = BufReader::new(from);
            let mut line = Vec::new();
            while matches!(reader.read_until(b'\n', &mut line), Ok(n) if n > 0) {
                if !line.ends_with(b"\n") {
                    line.push(b'\n');
                }
                if let Some(file) = &log {
                    let mut file = crate::sync::lock(file);
                    let _ = file.write_all(&line);
                }
                if shown {
                    let mut out: Box<dyn Write> = if stderr {
                        Box::new(std::io::stderr().lock())
                    } else {
                        Box::new(std::io::stdout().lock())
                    };
                    let _ = out.write_all(prefix.as_bytes());
                    let _ = out.write_all(&line);
                }
                line.clear();
            }
        })
    }
}

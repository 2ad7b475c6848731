//! Starts the rank processes of a program, as torchrun does: sets the launcher variables
//! (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `GROUP_RANK`, `MASTER_ADDR`,
//! `MASTER_PORT`), prefixes each output line with its rank, and when one rank fails stops the
//! others and reports the rank that failed first and what it last reported doing.
//!
//! Output: see [`output`] (rank 0 gets a terminal, `--log-dir`, `--tee`,
//! `--local-ranks-filter`). Stop signals sent to the launcher are forwarded to the ranks, which
//! stop together at a step boundary (see [`crate::signals`]); the launcher then exits with their
//! exit code.
//!
//! The launcher of node 0 serves the store itself (as torchrun's agent store), so the store and
//! the ranks' status reports outlive any rank, including rank 0. It generates a job secret
//! (`BURN_DDP_SECRET`) that the store and the data plane require from every connection.

/// Writes a launcher message to stderr, ignoring a closed stderr (a pipe whose reader is
/// gone must not make the launcher panic while it still has ranks to stop).
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($arg)*);
    }};
}

mod exits;
mod forward;
mod libraries;
pub mod output;
mod supervise;

use std::ffi::OsString;
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command};
use std::time::Duration;

use forward::Forwarder;
use libraries::LibraryLinks;
use output::OutputPlan;
use supervise::Supervisor;

use crate::env::{AGENT_STORE_VAR, LAUNCHER_PID_VAR, RESTART_COUNT_VAR};
use crate::error::{DdpError, Result};
use crate::secret::{JobSecret, SECRET_VAR};
use crate::store::StoreServer;

/// What to launch and how.
#[derive(Debug, Clone)]
pub struct LaunchConfig {
    /// The program each rank runs.
    pub program: PathBuf,
    /// Its arguments.
    pub args: Vec<OsString>,
    /// Processes on this node.
    pub nproc_per_node: usize,
    /// Number of nodes (each runs the launcher once).
    pub nnodes: usize,
    /// This node's index, `0..nnodes`.
    pub node_rank: usize,
    /// Host of rank 0 (default `127.0.0.1`).
    pub master_addr: String,
    /// Port of the store; `None` picks a free one (single node only).
    pub master_port: Option<u16>,
    /// The job secret; `None`: `BURN_DDP_SECRET` of the launcher's environment if set, else a
    /// fresh one (single node; every node of a multi-node job must be given the same).
    pub secret: Option<JobSecret>,
    /// Extra environment for every rank.
    pub env: Vec<(OsString, OsString)>,
    /// How often to restart all ranks after a failure (single node; default 0). Ranks see the
    /// attempt in `BURN_DDP_RESTART_COUNT`; with checkpoints they resume where they stopped.
    pub max_restarts: usize,
    /// Writes each rank's output to `DIR/rank-N.log` (torchrun's `--log-dir` with
    /// `--redirects 3`) instead of the terminal, unless [`LaunchConfig::tee`] is set.
    pub log_dir: Option<PathBuf>,
    /// With [`LaunchConfig::log_dir`]: also show each rank's output (torchrun's `--tee 3`).
    pub tee: bool,
    /// Show the output of these local ranks only (torchrun's `--local-ranks-filter`); `None`:
    /// every rank. Log files are written for every rank either way.
    pub local_ranks_filter: Option<Vec<usize>>,
    /// How long the ranks may take to stop after a stop signal reached the launcher before
    /// they are killed (default 120 s: a step, a checkpoint and the collectives' way out).
    pub stop_grace: Duration,
}

impl LaunchConfig {
    /// `nproc` ranks of `program` on this machine.
    pub fn new(program: impl Into<PathBuf>, nproc: usize) -> Self {
        LaunchConfig {
            program: program.into(),
            args: Vec::new(),
            nproc_per_node: nproc,
            nnodes: 1,
            node_rank: 0,
            master_addr: "127.0.0.1".into(),
            master_port: None,
            secret: None,
            env: Vec::new(),
            max_restarts: 0,
            log_dir: None,
            tee: false,
            local_ranks_filter: None,
            stop_grace: Duration::from_secs(120),
        }
    }

    /// Adds arguments.
    pub fn args<I: IntoIterator<Item = S>, S: Into<OsString>>(mut self, args: I) -> Self {
        self.args.extend(args.into_iter().map(Into::into));
        self
    }

    /// Adds an environment variable for every rank.
    pub fn env(mut self, key: impl Into<OsString>, value: impl Into<OsString>) -> Self {
        self.env.push((key.into(), value.into()));
        self
    }
}

/// Asks the OS for a free TCP port on `host` (as torchrun's `--standalone`).
pub fn free_port(host: &str) -> Result<u16> {
    let l = TcpListener::bind((host, 0)).map_err(|source| DdpError::Bind {
        addr: format!("{host}:0"),
        what: "free-port probe",
        hint: String::new(),
        source,
    })?;
    l.local_addr()
        .map(|a| a.port())
        .map_err(|e| DdpError::io("reading a probed port", e))
}

/// Runs the ranks of this node to completion. `Ok` when all exit with 0; otherwise the others
/// are killed and the error names the rank that failed first and how. With
/// [`LaunchConfig::max_restarts`], a failed job is started again (all ranks) that many times.
pub fn launch(cfg: &LaunchConfig) -> Result<()> {
    if cfg.nproc_per_node == 0 || cfg.nnodes == 0 || cfg.node_rank >= cfg.nnodes {
        return Err(DdpError::InvalidConfig(format!(
            "nproc_per_node={} nnodes={} node_rank={}: need at least one process and node, and \
             node_rank below nnodes",
            cfg.nproc_per_node, cfg.nnodes, cfg.node_rank
        )));
    }
    // Only as far as this job needs: the ranks inherit it (see `crate::limits`).
    let world = cfg.nproc_per_node * cfg.nnodes;
    let needs = crate::limits::launcher_needs(world, cfg.nproc_per_node, cfg.node_rank == 0);
    crate::limits::raise_open_files_to(needs);
    let several_nodes_without_port = cfg.nnodes > 1 && cfg.master_port.is_none();
    if several_nodes_without_port {
        return Err(DdpError::InvalidConfig(
            "with several nodes, give the same master port to every node".into(),
        ));
    }
    let secret = match (&cfg.secret, crate::env::launcher_secret()) {
        (Some(s), _) => s.clone(),
        (None, Some(v)) => JobSecret::new(v)?,
        (None, None) if cfg.nnodes == 1 => JobSecret::generate()?,
        (None, None) => {
            return Err(DdpError::MissingEnv {
                var: SECRET_VAR,
                why: "with several nodes, every node's launcher needs the same job secret \
                      (for example `export BURN_DDP_SECRET=$(openssl rand -hex 32)`)"
                    .into(),
            });
        }
    };
    if cfg.max_restarts > 0 && cfg.nnodes > 1 {
        return Err(DdpError::InvalidConfig(
            "restarts are for single-node jobs: across nodes, let the cluster manager restart \
             the job (for example Slurm's --requeue); checkpoints resume it either way"
                .into(),
        ));
    }
    let forwarder = Forwarder::start()?;
    let links = LibraryLinks::prepare()?;
    let mut attempt = 0;
    loop {
        match run_attempt(cfg, &secret, attempt, &forwarder, links.as_ref()) {
            Err(DdpError::RankFailed { rank, status })
                if attempt < cfg.max_restarts && forwarder.received().is_none() =>
            {
                attempt += 1;
                log::warn!(
                    "rank {rank} failed ({status}); restarting every rank (restart {attempt} of {})",
                    cfg.max_restarts
                );
                say!(
                    "[burn-ddp] rank {rank} failed ({status}); restarting every rank (restart \
                     {attempt} of {})",
                    cfg.max_restarts
                );
            }
            outcome => return outcome,
        }
    }
}

/// One start of every rank of this node, to completion or to the first failure.
fn run_attempt(
    cfg: &LaunchConfig,
    secret: &JobSecret,
    attempt: usize,
    forwarder: &Forwarder,
    links: Option<&LibraryLinks>,
) -> Result<()> {
    let output = OutputPlan::new(cfg)?;
    let (server, port) = serve_store(cfg, secret)?;
    let mut children: Vec<Child> = Vec::new();
    let mut pumps = Vec::new();
    for local in 0..cfg.nproc_per_node {
        let rank = cfg.node_rank * cfg.nproc_per_node + local;
        let mut cmd = rank_command(cfg, (rank, local), (secret, attempt), port, links);
        let spawned = output
            .attach(&mut cmd, rank, local, attempt)
            .and_then(|pipes| {
                let child = cmd.spawn().map_err(|e| {
                    let what = format!("starting rank {rank} ({})", cfg.program.display());
                    DdpError::io(what, e)
                })?;
                Ok((child, pipes))
            });
        let (mut child, pipes) = match spawned {
            Ok(spawned) => spawned,
            Err(e) => {
                kill_all(&mut children);
                return Err(e);
            }
        };
        if let Some(pipes) = &pipes {
            if let Some(out) = child.stdout.take() {
                pumps.push(pipes.pump(out, false));
            }
            if let Some(err) = child.stderr.take() {
                pumps.push(pipes.pump(err, true));
            }
        }
        children.push(child);
    }
    log::info!(
        "launched {} ranks of {}, store port {port}",
        children.len(),
        cfg.program.display()
    );
    let result = Supervisor::new(cfg, forwarder, server.as_ref()).watch(children);
    for p in pumps {
        let _ = p.join();
    }
    result
}

/// Node 0 serves the store, bound to the master address only; the store's port (given, or
/// picked by the OS on node 0).
fn serve_store(cfg: &LaunchConfig, secret: &JobSecret) -> Result<(Option<StoreServer>, u16)> {
    let server = if cfg.node_rank == 0 {
        let addr = (cfg.master_addr.as_str(), cfg.master_port.unwrap_or(0));
        Some(StoreServer::bind_with_secret(addr, Some(secret.clone()))?)
    } else {
        None
    };
    let port = match (&server, cfg.master_port) {
        (Some(s), _) => s.local_addr().port(),
        (None, Some(p)) => p,
        (None, None) => {
            return Err(DdpError::InvalidConfig(
                "a node other than node 0 needs the master port".into(),
            ));
        }
    };
    Ok((server, port))
}

/// The command of rank `rank` (local rank `local`) in start `attempt`, with the launcher
/// variables set.
fn rank_command(
    cfg: &LaunchConfig,
    (rank, local): (usize, usize),
    (secret, attempt): (&JobSecret, usize),
    port: u16,
    links: Option<&LibraryLinks>,
) -> Command {
    let world = cfg.nproc_per_node * cfg.nnodes;
    let mut cmd = Command::new(&cfg.program);
    cmd.args(&cfg.args)
        .envs(cfg.env.iter().map(|(k, v)| (k, v)))
        .env("RANK", rank.to_string())
        .env("WORLD_SIZE", world.to_string())
        .env("LOCAL_RANK", local.to_string())
        .env("LOCAL_WORLD_SIZE", cfg.nproc_per_node.to_string())
        .env("GROUP_RANK", cfg.node_rank.to_string())
        .env("MASTER_ADDR", &cfg.master_addr)
        .env("MASTER_PORT", port.to_string())
        .env(SECRET_VAR, secret.to_env_value())
        .env(AGENT_STORE_VAR, "1")
        .env(LAUNCHER_PID_VAR, std::process::id().to_string())
        .env(RESTART_COUNT_VAR, attempt.to_string());
    if let Some(links) = links {
        cmd.env("LD_LIBRARY_PATH", links.library_path());
    }
    cmd
}

/// Sends `signal` (SIGKILL if `None`) to a rank that is still running.
pub(super) fn kill_pid(pid: u32, signal: Option<i32>) {
    #[cfg(unix)]
    if let Some(pid) = rustix::process::Pid::from_raw(pid as i32) {
        use rustix::process::Signal;
        let signal = match signal {
            None => Signal::KILL,
            Some(s) if s == signal_hook::consts::SIGINT => Signal::INT,
            Some(s) if s == signal_hook::consts::SIGUSR1 => Signal::USR1,
            Some(_) => Signal::TERM,
        };
        let _ = rustix::process::kill_process(pid, signal);
    }
}

fn kill_all(children: &mut [Child]) {
    for c in children.iter_mut() {
        let _ = c.kill();
    }
    for c in children.iter_mut() {
        let _ = c.wait();
    }
}

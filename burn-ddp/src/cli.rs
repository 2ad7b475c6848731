//! The launcher's command-line flags (feature `cli`): one definition for `burn-ddp-run` and
//! `cargo xtask multi-cpu|multi-gpu`, parsed by [clap](https://docs.rs/clap), converted into a
//! [`LaunchConfig`].
//!
//! A program of its own flattens [`LaunchArgs`] into its parser and adds what it launches:
//!
//! ```
//! use std::ffi::OsString;
//! use burn_ddp::cli::LaunchArgs;
//! use clap::Parser;
//!
//! #[derive(Parser)]
//! struct Cli {
//!     #[command(flatten)]
//!     launch: LaunchArgs,
//!     /// The program, then its arguments.
//!     #[arg(required = true, trailing_var_arg = true)]
//!     command: Vec<OsString>,
//! }
//!
//! let cli = Cli::parse_from(["run", "--nproc", "2", "./train", "--epochs", "3"]);
//! let cfg = cli.launch.config(&cli.command[0], &cli.command[1..]);
//! assert_eq!((cfg.nproc_per_node, cfg.args.len()), (2, 2));
//! ```

use std::ffi::OsString;
use std::path::PathBuf;

use clap::builder::RangedU64ValueParser;

use crate::launch::LaunchConfig;

/// How many ranks to start and where the job's store is: torchrun's flags, under the same
/// names (`--nproc-per-node`, `--nnodes`, `--node-rank`, `--master-addr`, `--master-port`,
/// `--max-restarts`, `--log-dir`, `--tee`, `--local-ranks-filter`).
#[derive(Debug, Clone, PartialEq, Eq, clap::Args)]
pub struct LaunchArgs {
    /// Ranks (processes) on this node, one per device; `None` (no flag, and no default set by
    /// the program with clap's `mut_arg`): 1.
    #[arg(
        help = "Ranks (processes) on this node, one per device",
        long = "nproc-per-node",
        visible_alias = "nproc",
        value_name = "N",
        value_parser = RangedU64ValueParser::<usize>::new().range(1..),
    )]
    pub nproc_per_node: Option<usize>,
    /// Nodes in the job (run the launcher once on each)
    #[arg(
        long,
        value_name = "M",
        default_value_t = 1,
        value_parser = RangedU64ValueParser::<usize>::new().range(1..),
    )]
    pub nnodes: usize,
    /// This node's index, 0..M
    #[arg(long, value_name = "R", default_value_t = 0)]
    pub node_rank: usize,
    /// Host of the job's store (node 0's address; its interface is the one the store listens on)
    #[arg(long, value_name = "HOST", default_value = "127.0.0.1")]
    pub master_addr: String,
    /// Port of the job's store [default: a free port; required with several nodes]
    #[arg(long, value_name = "PORT")]
    pub master_port: Option<u16>,
    /// Start every rank again after a failure, up to K times (single node)
    #[arg(long, value_name = "K", default_value_t = 0)]
    pub max_restarts: usize,
    /// Write each rank's output to DIR/rank-N.log instead of the terminal
    #[arg(long, value_name = "DIR")]
    pub log_dir: Option<PathBuf>,
    /// With --log-dir: show each rank's output as well
    #[arg(long, requires = "log_dir")]
    pub tee: bool,
    /// Show the output of these local ranks only, e.g. 0,3 [default: every rank]
    #[arg(long, value_name = "RANKS", value_delimiter = ',')]
    pub local_ranks_filter: Option<Vec<usize>>,
    /// After a stop signal (SIGTERM, SIGINT, SIGUSR1), seconds the ranks have to stop at a step
    /// and write their checkpoint before they are killed
    #[arg(long, value_name = "SECS", default_value_t = 120)]
    pub stop_grace: u64,
}

impl LaunchArgs {
    /// The launch these flags describe, of `program` with `args` (1 rank per node unless
    /// `--nproc-per-node` says otherwise).
    pub fn config<I, S>(&self, program: impl Into<PathBuf>, args: I) -> LaunchConfig
    where
        I: IntoIterator<Item = S>,
        S: Into<OsString>,
    {
        let mut cfg = LaunchConfig::new(program, self.nproc_per_node.unwrap_or(1)).args(args);
        cfg.nnodes = self.nnodes;
        cfg.node_rank = self.node_rank;
        cfg.master_addr = self.master_addr.clone();
        cfg.master_port = self.master_port;
        cfg.max_restarts = self.max_restarts;
        cfg.log_dir = self.log_dir.clone();
        cfg.tee = self.tee;
        cfg.local_ranks_filter = self.local_ranks_filter.clone();
        cfg.stop_grace = std::time::Duration::from_secs(self.stop_grace);
        cfg
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        launch: LaunchArgs,
        #[arg(required = true, trailing_var_arg = true)]
        command: Vec<OsString>,
    }

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("run").chain(args.iter().copied()))
    }

    #[test]
    fn every_flag_reaches_the_launch_config() {
        let cli = parse(&[
            "--nproc-per-node=3",
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--master-addr",
            "node0",
            "--master-port",
            "29501",
            "--max-restarts",
            "4",
            "--log-dir",
            "logs",
            "--tee",
            "--local-ranks-filter",
            "0,2",
            "./train",
            "--nproc",
            "9",
        ])
        .unwrap();
        let cfg = cli.launch.config(&cli.command[0], &cli.command[1..]);
        assert_eq!(cfg.program, PathBuf::from("./train"));
        assert_eq!(cfg.args, ["--nproc", "9"].map(OsString::from));
        assert_eq!((cfg.nproc_per_node, cfg.nnodes, cfg.node_rank), (3, 2, 1));
        assert_eq!(
            (cfg.master_addr.as_str(), cfg.master_port),
            ("node0", Some(29501))
        );
        assert_eq!(cfg.max_restarts, 4);
        assert_eq!(cfg.log_dir, Some(PathBuf::from("logs")));
        assert!(cfg.tee);
        assert_eq!(cfg.local_ranks_filter, Some(vec![0, 2]));
    }

    #[test]
    fn defaults_are_one_local_rank_on_one_node() {
        let cli = parse(&["./train"]).unwrap();
        let cfg = cli.launch.config(&cli.command[0], &cli.command[1..]);
        let defaults = LaunchConfig::new("./train", 1);
        assert_eq!((cfg.nproc_per_node, cfg.nnodes, cfg.node_rank), (1, 1, 0));
        assert_eq!(cfg.master_addr, defaults.master_addr);
        assert_eq!((cfg.master_port, cfg.max_restarts), (None, 0));
        assert_eq!(
            (cfg.log_dir, cfg.tee, cfg.local_ranks_filter),
            (None, false, None)
        );
    }

    #[test]
    fn bad_values_and_misspelled_flags_are_refused() {
        let message = |args: &[&str]| parse(args).err().map(|e| e.to_string());
        assert!(message(&["--nproc", "0", "./t"]).is_some());
        assert!(message(&["--master-port", "70000", "./t"]).is_some());
        assert!(message(&["--tee", "./t"]).is_some_and(|m| m.contains("--log-dir")));
        assert!(message(&["--nprc", "2", "./t"]).is_some_and(|m| m.contains("'--nproc'")));
        assert!(
            message(&["--nproc", "2"]).is_some(),
            "a program is required"
        );
    }
}

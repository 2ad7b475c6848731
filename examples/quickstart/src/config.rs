//! Options of a quickstart run and the binaries' command line: [`Config`] holds the defaults
//! (each binary its own), [`Flags`] what the command line gives; each flag given replaces its
//! default, and `--help` shows the binary's defaults.

use std::ffi::OsString;
use std::path::PathBuf;

use clap::{CommandFactory, FromArgMatches, Parser};

/// The network the quickstart trains.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum ModelKind {
    /// A two-layer perceptron.
    #[default]
    Mlp,
    /// The perceptron with burn's BatchNorm after the hidden layer (each rank's batch
    /// statistics; running statistics kept identical across ranks by DdpLearner).
    MlpBn,
    /// The perceptron with burn-ddp's SyncBatchNorm after the hidden layer (statistics over
    /// every rank's batch).
    MlpSyncbn,
    /// A larger perceptron for benchmarks, 784-1024-1024-10 (MNIST-sized inputs; 1.9 million
    /// parameters), on synthetic data of that shape.
    MlpLarge,
}

impl std::fmt::Display for ModelKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        use clap::ValueEnum;
        let value = self.to_possible_value().expect("no variant is skipped");
        f.write_str(value.get_name())
    }
}

/// How buffers (BatchNorm's running statistics) are kept identical across ranks: burn-ddp's
/// `BufferSync`, as a flag.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum BufferSyncFlag {
    /// Rank 0's at every step.
    #[default]
    Broadcast,
    /// Averaged at each epoch's end and before checkpoints.
    Average,
    /// Not synchronised.
    Off,
}

impl From<BufferSyncFlag> for burn_ddp::train::BufferSync {
    fn from(flag: BufferSyncFlag) -> Self {
        match flag {
            BufferSyncFlag::Broadcast => Self::Broadcast,
            BufferSyncFlag::Average => Self::Average,
            BufferSyncFlag::Off => Self::Off,
        }
    }
}

/// The format gradients travel in: burn-ddp's `Compression`, as a flag.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum CompressionFlag {
    /// f32.
    #[default]
    None,
    /// bfloat16.
    Bf16,
    /// IEEE half precision.
    Fp16,
}

impl From<CompressionFlag> for burn_ddp::train::Compression {
    fn from(flag: CompressionFlag) -> Self {
        match flag {
            CompressionFlag::None => Self::None,
            CompressionFlag::Bf16 => Self::Bf16,
            CompressionFlag::Fp16 => Self::Fp16,
        }
    }
}

/// How the optimizer's work is sharded across the ranks: burn-ddp's `Sharding`, as a flag.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum ShardFlag {
    /// Not sharded: every rank keeps the whole optimizer state.
    #[default]
    None,
    /// ZeRO-1: each rank keeps and updates the optimizer state of its part of the parameters.
    Optimizer,
    /// ZeRO-2: also receives only its part's averaged gradients (reduce-scatter).
    Gradients,
}

impl From<ShardFlag> for burn_ddp::train::Sharding {
    fn from(flag: ShardFlag) -> Self {
        match flag {
            ShardFlag::None => Self::None,
            ShardFlag::Optimizer => Self::Optimizer,
            ShardFlag::Gradients => Self::OptimizerAndGradients,
        }
    }
}

/// The optimizer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum OptimizerFlag {
    /// Plain SGD (no state).
    #[default]
    Sgd,
    /// Adam (two moments per parameter: what sharding saves).
    Adam,
}

/// Options of a quickstart run (the binaries' flags).
#[derive(Debug, Clone)]
pub struct Config {
    /// The network.
    pub model: ModelKind,
    /// How buffers are synchronised across ranks.
    pub buffer_sync: BufferSyncFlag,
    /// The format gradients travel in.
    pub compression: CompressionFlag,
    /// How the optimizer's work is sharded.
    pub shard: ShardFlag,
    /// The optimizer.
    pub optimizer: OptimizerFlag,
    /// Every rank writes a Chrome trace of its steps into this directory.
    pub profile: Option<PathBuf>,
    /// Epochs.
    pub epochs: usize,
    /// Batch size per rank.
    pub batch_size: usize,
    /// Learning rate.
    pub lr: f64,
    /// Seed of initialisation and shuffling.
    pub seed: u64,
    /// `cpu` or `cuda`.
    pub device: String,
    /// Where rank 0 writes the final parameters (safetensors).
    pub save_model: Option<PathBuf>,
    /// Where rank 0 writes the final parameters as raw little-endian f32 in visit order (for
    /// comparing runs numerically, as the GPU check does).
    pub params_out: Option<PathBuf>,
    /// Training samples of the synthetic set.
    pub samples: usize,
    /// Train on the handwritten digits at this path instead of the synthetic set.
    pub digits: Option<PathBuf>,
    /// Directory of burn-train's logs and checkpoints.
    pub artifacts: PathBuf,
    /// Train with plain burn `Learner` instead of `DdpLearner` (world of one only; for
    /// measuring DdpLearner's overhead).
    pub plain: bool,
    /// Render no progress (benchmarks).
    pub quiet: bool,
    /// Where rank 0 writes timing and accuracy as `key=value` (benchmarks).
    pub report: Option<PathBuf>,
    /// Directory of burn-ddp checkpoints (written every epoch; resumed from when present).
    pub checkpoint_dir: Option<PathBuf>,
    /// Also checkpoint every this many optimizer steps (with `--checkpoint-dir`).
    pub checkpoint_every: usize,
    /// Switch off the per-bucket desync check (only to measure its cost).
    pub no_desync_check: bool,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            model: ModelKind::Mlp,
            buffer_sync: BufferSyncFlag::Broadcast,
            compression: CompressionFlag::None,
            shard: ShardFlag::None,
            optimizer: OptimizerFlag::Sgd,
            profile: None,
            epochs: 10,
            batch_size: 32,
            lr: 0.001,
            seed: 42,
            device: "cpu".into(),
            save_model: None,
            params_out: None,
            samples: 4096,
            digits: None,
            artifacts: std::env::temp_dir().join("burn-ddp-quickstart"),
            plain: false,
            quiet: false,
            report: None,
            checkpoint_dir: None,
            checkpoint_every: 0,
            no_desync_check: false,
        }
    }
}

/// The flags of the quickstart binaries. A flag not given leaves the binary's default (its
/// [`Config`]) in place.
#[derive(Debug, Default, Parser)]
#[command(
    name = "quickstart",
    about = "Trains an MLP with DdpLearner: alone, or as one rank of many under a launcher \
             (burn-ddp-run, cargo xtask multi-cpu, torchrun, srun, mpirun)"
)]
pub struct Flags {
    /// The network: an MLP, with BatchNorm, with SyncBatchNorm, or 784-1024-1024-10
    #[arg(long, value_name = "KIND")]
    pub model: Option<ModelKind>,
    /// Buffers (running statistics) across ranks: rank 0's every step, averaged per epoch, or
    /// not synchronised [default: broadcast]
    #[arg(long, value_name = "MODE")]
    pub buffer_sync: Option<BufferSyncFlag>,
    /// The format gradients travel in (halves the bytes sent) [default: none]
    #[arg(long, value_name = "FORMAT")]
    pub compression: Option<CompressionFlag>,
    /// Shard the optimizer's work across the ranks (ZeRO): each rank keeps the optimizer state
    /// of its part of the parameters (optimizer), and receives only its part's gradients
    /// (gradients) [default: none]
    #[arg(long, value_name = "WHAT", conflicts_with = "plain")]
    pub shard: Option<ShardFlag>,
    /// The optimizer [default: sgd]
    #[arg(long, value_name = "NAME")]
    pub optimizer: Option<OptimizerFlag>,
    /// Every rank writes a Chrome trace of its training steps there (rank-<r>.json; open it in
    /// Perfetto or chrome://tracing)
    #[arg(long, value_name = "DIR")]
    pub profile: Option<PathBuf>,
    /// Epochs (at least 1)
    #[arg(long, value_name = "N", value_parser = at_least(1))]
    pub epochs: Option<usize>,
    /// Batch size per rank (at least 1)
    #[arg(long, value_name = "B", value_parser = at_least(1))]
    pub batch_size: Option<usize>,
    /// Learning rate (a finite number above 0)
    #[arg(long, value_name = "X", value_parser = positive_finite)]
    pub lr: Option<f64>,
    /// Seed of initialisation and shuffling
    #[arg(long, value_name = "S")]
    pub seed: Option<u64>,
    /// Device: cpu, or cuda (a build with the `cuda` feature)
    #[arg(long, value_name = "cpu|cuda")]
    pub device: Option<String>,
    /// Rank 0 writes the final parameters there (safetensors)
    #[arg(long, value_name = "PATH")]
    pub save_model: Option<PathBuf>,
    /// Rank 0 writes the final parameters there as raw little-endian f32 (for comparing runs)
    #[arg(long, value_name = "PATH")]
    pub params_out: Option<PathBuf>,
    /// Training samples of the synthetic set (validation: a quarter as many; at least 4)
    #[arg(long, value_name = "N", value_parser = at_least(4))]
    pub samples: Option<usize>,
    /// Train on scikit-learn's digits.csv.gz at PATH instead of the synthetic set
    #[arg(long, value_name = "PATH")]
    pub digits: Option<PathBuf>,
    /// Directory of burn-train's logs
    #[arg(long, value_name = "DIR")]
    pub artifacts: Option<PathBuf>,
    /// Train with burn's own Learner (one process; to measure DdpLearner's overhead)
    #[arg(long)]
    pub plain: bool,
    /// Render no progress
    #[arg(long)]
    pub quiet: bool,
    /// Rank 0 writes timing and accuracy there as key=value (benchmarks)
    #[arg(long, value_name = "PATH")]
    pub report: Option<PathBuf>,
    /// Checkpoint into DIR every epoch; a run started again with the same DIR resumes
    #[arg(long, value_name = "DIR")]
    pub checkpoint_dir: Option<PathBuf>,
    /// With --checkpoint-dir: also checkpoint every N optimizer steps (0: epoch ends only)
    #[arg(long, value_name = "N")]
    pub checkpoint_every: Option<usize>,
    /// Switch off the per-bucket desync check (to measure its cost)
    #[arg(long)]
    pub no_desync_check: bool,
}

/// A parser of counts of at least `min`.
fn at_least(min: u64) -> clap::builder::RangedU64ValueParser<usize> {
    clap::builder::RangedU64ValueParser::<usize>::new().range(min..)
}

/// A parser of finite numbers above 0 (a learning rate of 0, below 0, NaN or infinite trains
/// nothing or everything into NaN).
fn positive_finite(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(x) if x.is_finite() && x > 0.0 => Ok(x),
        Ok(_) => Err("expected a finite number above 0".into()),
        Err(e) => Err(e.to_string()),
    }
}

impl Config {
    /// The command line of a binary whose defaults are `self`: `--help` shows them.
    pub fn command(&self) -> clap::Command {
        let shown = |v: &dyn ToString| v.to_string();
        let mut cmd = Flags::command()
            .mut_arg("model", |a| a.default_value(shown(&self.model)))
            .mut_arg("epochs", |a| a.default_value(shown(&self.epochs)))
            .mut_arg("batch_size", |a| a.default_value(shown(&self.batch_size)))
            .mut_arg("lr", |a| a.default_value(shown(&self.lr)))
            .mut_arg("seed", |a| a.default_value(shown(&self.seed)))
            .mut_arg("device", |a| a.default_value(self.device.clone()))
            .mut_arg("samples", |a| a.default_value(shown(&self.samples)))
            .mut_arg("checkpoint_every", |a| {
                a.default_value(shown(&self.checkpoint_every))
            })
            .mut_arg("artifacts", |a| {
                a.default_value(self.artifacts.clone().into_os_string())
            });
        if let Some(path) = &self.digits {
            cmd = cmd.mut_arg("digits", |a| a.default_value(path.clone().into_os_string()));
        }
        cmd
    }

    /// Applies command-line flags (`args`: without the program name) on top of `self`.
    pub fn parse_args<I, T>(self, args: I) -> Result<Self, clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<OsString>,
    {
        let program = OsString::from("quickstart");
        self.parse_command_line(std::iter::once(program).chain(args.into_iter().map(Into::into)))
    }

    /// Applies a whole command line (`argv[0]` first, which names the binary in messages).
    pub fn parse_command_line<I, T>(self, argv: I) -> Result<Self, clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<OsString> + Clone,
    {
        let matches = self.command().try_get_matches_from(argv)?;
        Ok(self.with(Flags::from_arg_matches(&matches)?))
    }

    /// `self` with every flag that is set in `flags`.
    pub fn with(mut self, flags: Flags) -> Self {
        let Flags {
            model,
            buffer_sync,
            compression,
            shard,
            optimizer,
            profile,
            epochs,
            batch_size,
            lr,
            seed,
            device,
            save_model,
            params_out,
            samples,
            digits,
            artifacts,
            plain,
            quiet,
            report,
            checkpoint_dir,
            checkpoint_every,
            no_desync_check,
        } = flags;
        self.model = model.unwrap_or(self.model);
        self.buffer_sync = buffer_sync.unwrap_or(self.buffer_sync);
        self.compression = compression.unwrap_or(self.compression);
        self.shard = shard.unwrap_or(self.shard);
        self.optimizer = optimizer.unwrap_or(self.optimizer);
        self.profile = profile.or(self.profile);
        self.epochs = epochs.unwrap_or(self.epochs);
        self.batch_size = batch_size.unwrap_or(self.batch_size);
        self.lr = lr.unwrap_or(self.lr);
        self.seed = seed.unwrap_or(self.seed);
        self.device = device.unwrap_or(self.device);
        self.save_model = save_model.or(self.save_model);
        self.params_out = params_out.or(self.params_out);
        self.samples = samples.unwrap_or(self.samples);
        self.digits = digits.or(self.digits);
        self.artifacts = artifacts.unwrap_or(self.artifacts);
        self.plain |= plain;
        self.quiet |= quiet;
        self.report = report.or(self.report);
        self.checkpoint_dir = checkpoint_dir.or(self.checkpoint_dir);
        self.checkpoint_every = checkpoint_every.unwrap_or(self.checkpoint_every);
        self.no_desync_check |= no_desync_check;
        self
    }
}

#[cfg(test)]
mod tests;

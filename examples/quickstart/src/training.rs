//! A quickstart run: the device, the data and the model, and the quickstart's own learner
//! settings; the run itself (data-parallel in a process group, or burn's own `Learner` with
//! `--plain`) is the package's timed run (`crate::timed`), what it measured a
//! [`Report`](crate::report::Report).

use std::sync::Arc;

use anyhow::{Context, Result, bail};
use burn::module::Module;
use burn::optim::{AdamConfig, ModuleOptimizer, SgdConfig};
use burn::tensor::Device;
use burn::train::SupervisedTraining;
use burn_ddp::ProcessGroup;
use burn_ddp::train::{CheckpointConfig, DdpLearner};

use crate::config::{Config, ModelKind, OptimizerFlag};
use crate::data::{CLASSES, DIGIT_PIXELS, Data, Digits, FEATURES, MyBatcher, MyDataset};
use crate::model::{LARGE_SHAPE, MyModel, accuracy};
use crate::report::Report;
use crate::timed::{DdpRun, Learning, Reduction, Settings, timed_run};

/// Selects the device for `name` and this process's local rank.
pub fn device(name: &str, local_rank: usize) -> Result<Device> {
    match name {
        "cpu" => Ok(Device::flex().autodiff()),
        "cuda" => cuda_device(local_rank),
        other => bail!("unknown device {other:?}: expected cpu or cuda"),
    }
}

/// This rank's GPU: the local rank's, or GPU 0 when each rank sees only its own GPU
/// (`CUDA_VISIBLE_DEVICES` naming one, as Slurm's `--gpu-bind` and per-rank launches set it).
#[cfg(feature = "cuda")]
fn cuda_device(local_rank: usize) -> Result<Device> {
    // Fails with what was looked for and how to fix it, instead of a loader panic.
    burn_ddp_nccl::check_libraries().context("--device cuda")?;
    let visible = std::env::var("CUDA_VISIBLE_DEVICES").ok();
    Ok(Device::cuda(gpu_of(local_rank, visible.as_deref())).autodiff())
}

/// The CUDA ordinal of local rank `local_rank` given `CUDA_VISIBLE_DEVICES`.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn gpu_of(local_rank: usize, visible: Option<&str>) -> usize {
    match visible.map(|v| v.split(',').filter(|s| !s.trim().is_empty()).count()) {
        Some(1) => 0,
        _ => local_rank,
    }
}

#[cfg(not(feature = "cuda"))]
fn cuda_device(local_rank: usize) -> Result<Device> {
    bail!(
        "--device cuda (GPU {local_rank}): this build has no CUDA support; rebuild with \
         `--features cuda` (cargo build -p quickstart --features cuda)"
    )
}

/// Trains in `group` (a world of one or many ranks) on the configured data.
pub fn run(group: Arc<ProcessGroup>, cfg: &Config) -> Result<Report> {
    let device = device(&cfg.device, group.local_rank())?;
    let (train_data, valid_data, features, classes) = load_data(cfg)?;
    device.seed(cfg.seed);
    // Parameters are initialised lazily; materialise them while the seed still decides.
    let model = MyModel::init(&device, cfg.model, features, classes).materialize();
    let learning = Learning {
        model,
        optim: optimizer(cfg),
        lr: cfg.lr.into(),
        device: &device,
    };
    let splits = (train_data, valid_data.clone());
    timed_run(
        &group,
        &settings(cfg),
        (MyBatcher, splits),
        learning,
        |training, learner| configure(training, learner, cfg),
        |model| {
            if group.rank() == 0 {
                save_model(model, cfg)?;
            }
            accuracy(model, &device.clone().inner(), &valid_data)
        },
    )
}

/// The flags every program of the package shares, from the quickstart's.
fn settings(cfg: &Config) -> Settings<'_> {
    Settings {
        epochs: cfg.epochs,
        batch_size: cfg.batch_size,
        seed: cfg.seed,
        artifacts: &cfg.artifacts,
        quiet: cfg.quiet,
        plain: cfg.plain,
        reduction: Reduction {
            desync_check: !cfg.no_desync_check,
            compression: cfg.compression.into(),
            sharding: cfg.shard.into(),
        },
    }
}

/// The training and validation splits of the configured data (synthetic, or the digits at
/// `--digits`), with the model's input features and classes.
fn load_data(cfg: &Config) -> Result<(Data, Data, usize, usize)> {
    Ok(match &cfg.digits {
        None => {
            let (features, classes) = match cfg.model {
                ModelKind::MlpLarge => LARGE_SHAPE,
                _ => (FEATURES, CLASSES),
            };
            (
                Data::Synthetic(MyDataset::train(cfg.samples).shape(features, classes)),
                Data::Synthetic(MyDataset::valid(cfg.samples / 4).shape(features, classes)),
                features,
                classes,
            )
        }
        Some(path) => {
            let (train, valid) = Digits::load(path)?.split();
            (train, valid, DIGIT_PIXELS, 10)
        }
    })
}

/// The quickstart's own learner settings, its telemetry as metrics, and profiling and
/// checkpoints as configured.
fn configure(
    training: SupervisedTraining<MyModel>,
    learner: DdpLearner<MyModel>,
    cfg: &Config,
) -> DdpRun<MyModel> {
    let mut learner = learner
        .setting("batch_size", cfg.batch_size)
        .setting("lr", cfg.lr)
        .setting("seed", cfg.seed)
        .setting("epochs", cfg.epochs)
        .setting("data", format!("{:?}", cfg.digits))
        .setting("model", cfg.model)
        .buffer_sync(cfg.buffer_sync.into())
        .setting("optimizer", format!("{:?}", cfg.optimizer));
    // Where each step's time goes, as metrics on rank 0.
    let figures = learner.telemetry();
    let training = training
        .metric_train_numeric(figures.communication())
        .metric_train_numeric(figures.exposed_communication())
        .metric_train_numeric(figures.busbw())
        .metric_train_numeric(figures.straggler_lag());
    if let Some(dir) = &cfg.profile {
        learner = learner.profile(dir);
    }
    if let Some(dir) = &cfg.checkpoint_dir {
        learner = learner.checkpoints(CheckpointConfig::new(dir).every(cfg.checkpoint_every));
    }
    (training, learner)
}

/// The configured optimizer.
fn optimizer(cfg: &Config) -> ModuleOptimizer {
    match cfg.optimizer {
        OptimizerFlag::Sgd => SgdConfig::new().init(),
        OptimizerFlag::Adam => AdamConfig::new().init(),
    }
}

/// Saves the final model to `--save-model` as safetensors, if given (rank 0 calls it).
fn save_model(model: &MyModel, cfg: &Config) -> Result<()> {
    if let Some(path) = &cfg.save_model {
        use burn_store::{ModuleSnapshot, SafetensorsStore};
        let mut store = SafetensorsStore::from_file(path);
        model
            .save_into(&mut store)
            .with_context(|| format!("saving the model to {}", path.display()))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn one_visible_gpu_is_gpu_0_whatever_the_local_rank() {
        assert_eq!(super::gpu_of(3, Some("5")), 0);
        assert_eq!(super::gpu_of(3, None), 3);
        assert_eq!(super::gpu_of(1, Some("0,1,2,3")), 1);
        assert_eq!(super::gpu_of(1, Some("")), 1);
    }
}

//! A quickstart run: the device, data-parallel training in a process group (or burn's own
//! `Learner` with `--plain`); what it measured is a [`Report`](crate::report::Report).

use std::sync::Arc;

use anyhow::{Context, Result, bail};
use burn::data::dataloader::batcher::Batcher;
use burn::data::dataloader::{DataLoader, DataLoaderBuilder};
use burn::data::dataset::Dataset;
use burn::module::Module;
use burn::optim::{AdamConfig, ModuleOptimizer, SgdConfig};
use burn::tensor::Device;
use burn::train::metric::{AccuracyInput, AccuracyMetric, Adaptor, LossInput, LossMetric};
use burn::train::{
    InferenceStep, Learner, LearnerModel, LearningResult, SupervisedTraining, TrainStep,
};
use burn_ddp::ProcessGroup;
use burn_ddp::train::{
    CheckpointConfig, DdpLearner, DdpTraining, DistributedSampler, GradientReducer, ProgressOutput,
    QuietRenderer,
};

use crate::config::{Config, ModelKind, OptimizerFlag};
use crate::data::{CLASSES, DIGIT_PIXELS, Data, Digits, FEATURES, MyBatcher, MyDataset};
use crate::model::{LARGE_SHAPE, MyModel, accuracy};
use crate::report::{Report, Sent, mean_exposed_ms};

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

    let splits = (train_data, valid_data.clone());
    let loaders = Loaders::new(&group, (cfg.seed, cfg.batch_size), MyBatcher, splits);
    let steps = cfg.epochs * loaders.train.num_items().div_ceil(cfg.batch_size);
    let display = Display {
        quiet: cfg.quiet,
        plain: cfg.plain,
    };
    let (training, progress) = supervised_training(
        (&cfg.artifacts, cfg.epochs),
        display,
        loaders.train,
        loaders.valid,
    );
    let sent = planned_bytes_per_step(&group, cfg, &model, &device)?;
    let start = std::time::Instant::now();
    let mut exposed_ms = 0.0;
    let mut optimizer_state = None;
    let result = if cfg.plain {
        if group.world_size() != 1 {
            bail!("--plain trains with burn's own Learner, on one process only");
        }
        training.launch(Learner::new(model, optimizer(cfg), cfg.lr))
    } else {
        let learner = ddp_learner(group.clone(), cfg, model, &loaders.samplers, progress);
        let figures = learner.telemetry().clone();
        figures.count_optimizer_state();
        let result = train_ddp(training, learner, cfg)?;
        exposed_ms = mean_exposed_ms(&figures);
        optimizer_state = figures.optimizer_state_bytes();
        result
    };
    let train_seconds = start.elapsed().as_secs_f64();
    if let Some(e) = &result.error {
        bail!("training failed: {e}");
    }
    let model = result.model;
    if group.rank() == 0 {
        save_model(&model, cfg)?;
    }
    Ok(Report {
        valid_accuracy: accuracy(&model, &device.clone().inner(), &valid_data)?,
        params: burn_ddp::train::flat_parameters(&model),
        train_seconds,
        steps,
        samples: steps * cfg.batch_size * group.world_size(),
        bytes_per_step: sent.buffers,
        sent_per_step: sent.wire,
        exposed_ms,
        optimizer_state,
    })
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

/// The training and validation samplers of this rank.
pub(crate) struct Samplers {
    pub train: DistributedSampler,
    pub valid: DistributedSampler,
}

/// This rank's loaders of both splits, and the samplers that shard them.
pub(crate) struct Loaders<O> {
    pub samplers: Samplers,
    pub train: Arc<dyn DataLoader<O>>,
    pub valid: Arc<dyn DataLoader<O>>,
}

impl<O: Send + Clone + std::fmt::Debug + 'static> Loaders<O> {
    /// Samples each split for this rank of `group` (training shuffled by `seed`, validation
    /// in order and unpadded) and batches it with `batcher`, `batch_size` items per batch.
    pub(crate) fn new<I, D, B>(
        group: &ProcessGroup,
        (seed, batch_size): (u64, usize),
        batcher: B,
        (train_data, valid_data): (D, D),
    ) -> Self
    where
        I: Send + Sync + Clone + std::fmt::Debug + 'static,
        D: Dataset<I> + 'static,
        B: Batcher<I, O> + Clone + 'static,
    {
        let sampler = DistributedSampler::for_group(group).seed(seed);
        // Validation counts every sample once, whatever the world size: no padding.
        let valid_sampler = DistributedSampler::for_group(group)
            .shuffle(false)
            .pad(false);
        let train = DataLoaderBuilder::new(batcher.clone())
            .batch_size(batch_size)
            .build(sampler.dataset(train_data));
        let valid = DataLoaderBuilder::new(batcher)
            .batch_size(batch_size)
            .build(valid_sampler.dataset(valid_data));
        Loaders {
            samplers: Samplers {
                train: sampler,
                valid: valid_sampler,
            },
            train,
            valid,
        }
    }
}

/// How a run shows its progress, from its flags.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Display {
    /// `--quiet`: nothing.
    pub quiet: bool,
    /// `--plain`: burn's own Learner, given the renderer DdpLearner would choose.
    pub plain: bool,
}

/// burn's training loop with the loss and accuracy metrics, for `epochs` epochs with its files
/// in `artifacts`, and how DdpLearner is to show progress. Rank 0's progress: burn's TUI in a
/// terminal, readable lines otherwise (DdpLearner chooses; burn's own Learner is told here),
/// nothing when quiet.
pub(crate) fn supervised_training<M>(
    (artifacts, epochs): (&std::path::Path, usize),
    display: Display,
    train: Arc<dyn DataLoader<<M as TrainStep>::Input>>,
    valid: Arc<dyn DataLoader<<M as InferenceStep>::Input>>,
) -> (SupervisedTraining<M>, ProgressOutput)
where
    M: LearnerModel,
    <M as TrainStep>::Output: Adaptor<LossInput> + Adaptor<AccuracyInput>,
    <M as InferenceStep>::Output: Adaptor<LossInput> + Adaptor<AccuracyInput>,
{
    let mut training = SupervisedTraining::new(artifacts, train, valid)
        .metric_train_numeric(LossMetric::new())
        .metric_valid_numeric(LossMetric::new())
        .metric_train_numeric(AccuracyMetric::new())
        .metric_valid_numeric(AccuracyMetric::new())
        .num_epochs(epochs);
    let progress = if display.quiet {
        training = training.renderer(Box::new(QuietRenderer));
        ProgressOutput::Keep
    } else {
        ProgressOutput::Auto
    };
    if display.plain
        && let Some(renderer) = progress.renderer()
    {
        training = training.renderer(renderer);
    }
    (training, progress)
}

/// What the learner's reducer will send per step (planning only, nothing is sent here): the
/// bytes it hands the collectives and the bytes each rank sends on a ring ([`Sent`]); zeros
/// alone or with `--plain`.
fn planned_bytes_per_step(
    group: &Arc<ProcessGroup>,
    cfg: &Config,
    model: &MyModel,
    device: &Device,
) -> Result<Sent> {
    if group.world_size() > 1 && !cfg.plain {
        let reducer = GradientReducer::new(
            &model.clone().fork(device),
            group.clone(),
            Default::default(),
        )?
        .desync_check(!cfg.no_desync_check)
        .compression(cfg.compression.into())
        .sharding(cfg.shard.into());
        Ok(Sent::of(&reducer))
    } else {
        Ok(Sent::default())
    }
}

/// The data-parallel learner of `model`, with the run's settings and samplers.
fn ddp_learner(
    group: Arc<ProcessGroup>,
    cfg: &Config,
    model: MyModel,
    samplers: &Samplers,
    progress: ProgressOutput,
) -> DdpLearner<MyModel> {
    DdpLearner::with_group(group, model, optimizer(cfg), cfg.lr)
        .sampler(&samplers.train)
        .valid_sampler(&samplers.valid)
        .setting("batch_size", cfg.batch_size)
        .setting("lr", cfg.lr)
        .setting("seed", cfg.seed)
        .setting("epochs", cfg.epochs)
        .setting("data", format!("{:?}", cfg.digits))
        .setting("model", cfg.model)
        .desync_check(!cfg.no_desync_check)
        .buffer_sync(cfg.buffer_sync.into())
        .compression(cfg.compression.into())
        .shard_optimizer(cfg.shard.into())
        .setting("optimizer", format!("{:?}", cfg.optimizer))
        .progress(progress)
}

/// The configured optimizer.
fn optimizer(cfg: &Config) -> ModuleOptimizer {
    match cfg.optimizer {
        OptimizerFlag::Sgd => SgdConfig::new().init(),
        OptimizerFlag::Adam => AdamConfig::new().init(),
    }
}

/// Registers the learner's telemetry as metrics, adds profiling and checkpoints as
/// configured, and trains data-parallel.
fn train_ddp(
    training: SupervisedTraining<MyModel>,
    mut learner: DdpLearner<MyModel>,
    cfg: &Config,
) -> Result<LearningResult<MyModel>> {
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
    training
        .launch_ddp(learner)
        .context("data-parallel training")
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

//! One timed run, the skeleton every program of this package shares whatever it trains (the
//! quickstart's MLP, charlm's transformer): this rank's loaders ([`Loaders`]), burn's training
//! loop with its metrics and progress ([`supervised_training`]), the plan of what a step sends,
//! then training under burn's own `Learner` (`--plain`) or `DdpLearner`, timed, and what it
//! measured as a [`Report`] ([`timed_run`]). The programs give the data, the model, its
//! optimizer and learning rate, their own learner settings and their accuracy.

use std::path::Path;
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use burn::data::dataloader::batcher::Batcher;
use burn::data::dataloader::{DataLoader, DataLoaderBuilder};
use burn::data::dataset::Dataset;
use burn::module::Module;
use burn::optim::ModuleOptimizer;
use burn::optim::lr_scheduler::module_lr_scheduler::ModuleLrScheduler;
use burn::tensor::Device;
use burn::train::metric::{AccuracyInput, AccuracyMetric, Adaptor, LossInput, LossMetric};
use burn::train::{
    ClassificationOutput, InferenceStep, Learner, LearnerModel, SupervisedTraining, TrainStep,
};
use burn_ddp::ProcessGroup;
use burn_ddp::train::{
    Compression, DdpLearner, DdpTraining, DistributedSampler, GradientReducer, ProgressOutput,
    QuietRenderer, Sharding,
};

use crate::report::{Report, Sent, mean_exposed_ms};

/// What every run of this package is told, whatever it trains: the flags the programs share.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Settings<'a> {
    /// Epochs.
    pub epochs: usize,
    /// Items per batch, per rank.
    pub batch_size: usize,
    /// Job seed of the training split's shuffle.
    pub seed: u64,
    /// Directory of burn-train's files.
    pub artifacts: &'a Path,
    /// `--quiet`: no progress.
    pub quiet: bool,
    /// `--plain`: burn's own Learner (one process), given the renderer DdpLearner would choose.
    pub plain: bool,
    /// How gradients are reduced: the learner's settings and the plan's.
    pub reduction: Reduction,
}

/// How a step's gradients are reduced, as both the learner and the plan of what a step sends
/// ([`Sent`]) are told.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Reduction {
    /// The per-bucket desync check (DdpLearner's default: on).
    pub desync_check: bool,
    /// The format gradients travel in.
    pub compression: Compression,
    /// How the optimizer's work is sharded.
    pub sharding: Sharding,
}

/// What a run trains: the model (every rank's is replaced by rank 0's at the start), on
/// `device`, with its optimizer and learning rate.
pub(crate) struct Learning<'a, M> {
    /// The model, on `device`.
    pub model: M,
    /// Its optimizer.
    pub optim: ModuleOptimizer,
    /// Its learning rate (constant or scheduled).
    pub lr: ModuleLrScheduler,
    /// The device the model trains on.
    pub device: &'a Device,
}

/// burn's training loop and the DdpLearner it is to launch.
pub(crate) type DdpRun<M> = (SupervisedTraining<M>, DdpLearner<M>);

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

/// burn's training loop with the loss and accuracy metrics, for the run's epochs with its files
/// in its artifacts directory, and how DdpLearner is to show progress. Rank 0's progress:
/// burn's TUI in a terminal, readable lines otherwise (DdpLearner chooses; burn's own Learner
/// is told here), nothing when quiet.
pub(crate) fn supervised_training<M>(
    settings: &Settings,
    train: Arc<dyn DataLoader<<M as TrainStep>::Input>>,
    valid: Arc<dyn DataLoader<<M as InferenceStep>::Input>>,
) -> (SupervisedTraining<M>, ProgressOutput)
where
    M: LearnerModel,
    <M as TrainStep>::Output: Adaptor<LossInput> + Adaptor<AccuracyInput>,
    <M as InferenceStep>::Output: Adaptor<LossInput> + Adaptor<AccuracyInput>,
{
    let mut training = SupervisedTraining::new(settings.artifacts, train, valid)
        .metric_train_numeric(LossMetric::new())
        .metric_valid_numeric(LossMetric::new())
        .metric_train_numeric(AccuracyMetric::new())
        .metric_valid_numeric(AccuracyMetric::new())
        .num_epochs(settings.epochs);
    let progress = if settings.quiet {
        training = training.renderer(Box::new(QuietRenderer));
        ProgressOutput::Keep
    } else {
        ProgressOutput::Auto
    };
    if settings.plain
        && let Some(renderer) = progress.renderer()
    {
        training = training.renderer(renderer);
    }
    (training, progress)
}

/// Trains `learning` in `group` (a world of one or many ranks) on `splits` batched by
/// `batcher`, and measures it: under burn's own Learner with `--plain` (one process only), else
/// under DdpLearner with the run's samplers, reduction and progress, which `ddp` completes with
/// the program's own settings (and may add metrics to the training loop). `accuracy` gives the
/// trained model's validation accuracy (and may save it first).
pub(crate) fn timed_run<M, O, I, D, B>(
    group: &Arc<ProcessGroup>,
    settings: &Settings,
    (batcher, splits): (B, (D, D)),
    learning: Learning<M>,
    ddp: impl FnOnce(SupervisedTraining<M>, DdpLearner<M>) -> DdpRun<M>,
    accuracy: impl FnOnce(&M) -> Result<f64>,
) -> Result<Report>
where
    M: LearnerModel
        + TrainStep<Input = O, Output = ClassificationOutput>
        + InferenceStep<Input = O, Output = ClassificationOutput>,
    O: Send + Clone + std::fmt::Debug + 'static,
    I: Send + Sync + Clone + std::fmt::Debug + 'static,
    D: Dataset<I> + 'static,
    B: Batcher<I, O> + Clone + 'static,
{
    if settings.plain && group.world_size() != 1 {
        bail!("--plain trains with burn's own Learner, on one process only");
    }
    let Learning {
        model,
        optim,
        lr,
        device,
    } = learning;
    let loaders = Loaders::new(group, (settings.seed, settings.batch_size), batcher, splits);
    let steps = settings.epochs * loaders.train.num_items().div_ceil(settings.batch_size);
    let (training, progress) = supervised_training(settings, loaders.train, loaders.valid);
    let sent = planned(group, settings, &model, device)?;
    let start = std::time::Instant::now();
    let mut exposed_ms = 0.0;
    let mut optimizer_state = None;
    let result = if settings.plain {
        training.launch(Learner::new(model, optim, lr))
    } else {
        let r = settings.reduction;
        let learner = DdpLearner::with_group(group.clone(), model, optim, lr)
            .sampler(&loaders.samplers.train)
            .valid_sampler(&loaders.samplers.valid)
            .desync_check(r.desync_check)
            .compression(r.compression)
            .shard_optimizer(r.sharding)
            .progress(progress);
        let (training, learner) = ddp(training, learner);
        let figures = learner.telemetry().clone();
        figures.count_optimizer_state();
        let result = training
            .launch_ddp(learner)
            .context("data-parallel training")?;
        exposed_ms = mean_exposed_ms(&figures);
        optimizer_state = figures.optimizer_state_bytes();
        result
    };
    let train_seconds = start.elapsed().as_secs_f64();
    if let Some(e) = &result.error {
        bail!("training failed: {e}");
    }
    let model = result.model;
    Ok(Report {
        valid_accuracy: accuracy(&model)?,
        params: burn_ddp::train::parameters_to_vector(&model),
        train_seconds,
        steps,
        samples: steps * settings.batch_size * group.world_size(),
        bytes_per_step: sent.buffers,
        sent_per_step: sent.wire,
        exposed_ms,
        optimizer_state,
    })
}

/// What the learner's reducer will send per step (planning only, nothing is sent here): the
/// bytes it hands the collectives and the bytes each rank sends on a ring ([`Sent`]); zeros
/// alone or with `--plain`.
fn planned<M: Module>(
    group: &Arc<ProcessGroup>,
    settings: &Settings,
    model: &M,
    device: &Device,
) -> Result<Sent> {
    if group.world_size() == 1 || settings.plain {
        return Ok(Sent::default());
    }
    let r = settings.reduction;
    let reducer = GradientReducer::new(
        &model.clone().fork(device),
        group.clone(),
        Default::default(),
    )?
    .desync_check(r.desync_check)
    .compression(r.compression)
    .sharding(r.sharding);
    Ok(Sent::of(&reducer))
}

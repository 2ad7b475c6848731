//! A quickstart run: the device, data-parallel training in a process group (or burn's own
//! `Learner` with `--plain`), and the [`Report`] of what it measured.

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

/// What a run measured.
#[derive(Debug, Clone)]
pub struct Report {
    /// Accuracy of the final model over the whole validation split, in percent.
    pub valid_accuracy: f64,
    /// The final parameters, flattened in visit order.
    pub params: Vec<f32>,
    /// Wall time of training (all epochs, validation included), in seconds.
    pub train_seconds: f64,
    /// Optimizer steps taken.
    pub steps: usize,
    /// Training samples processed by all ranks together.
    pub samples: usize,
    /// Bytes each rank sends into the gradient all-reduces per optimizer step (0 alone).
    pub bytes_per_step: usize,
    /// Bytes each rank sends per optimizer step on a ring (0 alone; with sharding, the
    /// reduce-scatter and the parameters' all-gather).
    pub sent_per_step: f64,
    /// Mean milliseconds per step rank 0 waited for gradient communication (0 alone).
    pub exposed_ms: f64,
    /// Bytes of this rank's optimizer state at the end (DdpLearner runs; what sharding cuts).
    pub optimizer_state: Option<usize>,
}

/// This process's peak resident memory (`VmHWM` of `/proc/self/status`), in bytes.
pub fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Mean milliseconds per step the job's rank 0 waited for communication, from a learner's
/// telemetry (0 without figures: alone, or burn's own Learner).
pub fn mean_exposed_ms(telemetry: &burn_ddp::train::Telemetry) -> f64 {
    let steps = telemetry.steps();
    let total: f64 = steps.iter().map(|s| s.rank0.exposed).sum();
    total * 1e3 / steps.len().max(1) as f64
}

impl Report {
    /// FNV-1a of the final parameters' bytes: equal digests, bit-identical models.
    pub fn digest(&self) -> u64 {
        self.params
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .fold(0xcbf2_9ce4_8422_2325, |h, b| {
                (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
            })
    }

    /// Prints this rank's memory figures (its optimizer state, when counted, and its peak
    /// resident memory) and, with `--report PATH`, writes them to `PATH.rank<r>` as key=value
    /// (every rank calls it).
    pub fn publish_rank(&self, report: Option<&std::path::Path>, rank: usize) -> Result<()> {
        let peak = peak_rss_bytes();
        if let Some(bytes) = self.optimizer_state {
            println!("optimizer state {bytes} bytes");
        }
        if let Some(path) = report {
            let path = path.with_extension(format!("rank{rank}"));
            let line = format!(
                "optimizer_state={} peak_rss={}\n",
                self.optimizer_state.unwrap_or(0),
                peak.unwrap_or(0)
            );
            std::fs::write(&path, line).with_context(|| format!("writing {}", path.display()))?;
        }
        Ok(())
    }

    /// Prints the summary and writes `--report` (rank 0 calls it).
    pub fn publish(&self, cfg: &Config, world: usize) -> Result<()> {
        println!(
            "{} rank(s), {} epochs, batch {} per rank: validation accuracy {:.1}%",
            world, cfg.epochs, cfg.batch_size, self.valid_accuracy
        );
        println!(
            "{} optimizer steps in {:.2} s: {:.2} ms per step, {:.0} samples/s",
            self.steps,
            self.train_seconds,
            self.train_seconds * 1e3 / self.steps as f64,
            self.samples as f64 / self.train_seconds
        );
        if let Some(path) = &cfg.params_out {
            let bytes: Vec<u8> = self.params.iter().flat_map(|x| x.to_le_bytes()).collect();
            std::fs::write(path, bytes).with_context(|| format!("writing {}", path.display()))?;
        }
        if let Some(path) = &cfg.report {
            let line = format!(
                "steps={} seconds={} samples={} bytes_per_step={} sent_per_step={} exposed_ms={} \
                 accuracy={} digest={:016x}\n",
                self.steps,
                self.train_seconds,
                self.samples,
                self.bytes_per_step,
                self.sent_per_step,
                self.exposed_ms,
                self.valid_accuracy,
                self.digest()
            );
            std::fs::write(path, line).with_context(|| format!("writing {}", path.display()))?;
        }
        Ok(())
    }
}

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

/// A step's communication as planned: bytes handed to the collectives, and bytes each rank
/// sends on a ring (`GradientReducer::sent_per_step`: with sharding, the reduce-scatter and
/// the parameters' all-gather).
#[derive(Debug, Clone, Copy, Default)]
pub struct Sent {
    /// Bytes handed to the gradient collectives.
    pub buffers: usize,
    /// Bytes each rank sends.
    pub wire: f64,
}

impl Sent {
    /// What `reducer` plans.
    pub fn of(reducer: &GradientReducer) -> Self {
        Sent {
            buffers: reducer.bytes_per_step(),
            wire: reducer.sent_per_step(),
        }
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

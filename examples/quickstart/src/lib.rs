//! The quickstart of burn-ddp, the Rust counterpart of PyTorch's DDP tutorial: a synthetic,
//! deterministic dataset (`MyDataset`), an MLP (`MyModel`), cross-entropy, SGD. The binary is a
//! thin wrapper around [`run`].

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use burn::data::dataloader::DataLoaderBuilder;
use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::{Dataset, DatasetError};
use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::SgdConfig;
use burn::tensor::{Device, Int, Tensor, TensorData};
use burn::train::metric::{AccuracyMetric, LossMetric};
use burn::train::{
    ClassificationOutput, InferenceStep, Learner, SupervisedTraining, TrainOutput, TrainStep,
};
use burn_ddp::ProcessGroup;
use burn_ddp::train::{DdpLearner, DdpTraining, DistributedSampler, QuietRenderer};

/// Input features per sample.
pub const FEATURES: usize = 16;
/// Number of classes.
pub const CLASSES: usize = 4;

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

fn unit(seed: u64) -> f32 {
    (splitmix(seed) >> 40) as f32 / (1u64 << 24) as f32
}

/// One sample: features and class.
#[derive(Debug, Clone)]
pub struct MyItem {
    /// Input features.
    pub x: [f32; FEATURES],
    /// Class in `0..CLASSES`.
    pub y: usize,
}

/// A synthetic classification set: each class is a Gaussian-ish blob around its own centre.
/// Sample `i` is a pure function of `(split, i)`, so every process sees the same data.
#[derive(Debug, Clone)]
pub struct MyDataset {
    len: usize,
    split: u64,
}

impl MyDataset {
    /// The training split.
    pub fn train(len: usize) -> Self {
        MyDataset { len, split: 1 }
    }
    /// The validation split.
    pub fn valid(len: usize) -> Self {
        MyDataset { len, split: 2 }
    }
}

impl Dataset<MyItem> for MyDataset {
    fn get(&self, index: usize) -> Result<MyItem, DatasetError> {
        let key = (self.split << 32) ^ index as u64;
        let y = (splitmix(key) % CLASSES as u64) as usize;
        let mut x = [0f32; FEATURES];
        for (f, v) in x.iter_mut().enumerate() {
            let centre = unit(((y as u64) << 8) ^ f as u64 ^ 0xc0ffee) * 4.0 - 2.0;
            let noise = unit(key.wrapping_mul(31) ^ ((f as u64) << 48)) * 2.0 - 1.0;
            *v = centre + 1.5 * noise;
        }
        Ok(MyItem { x, y })
    }

    fn len(&self) -> usize {
        self.len
    }
}

/// A batch of inputs and targets.
#[derive(Debug, Clone)]
pub struct MyBatch {
    /// `[batch, FEATURES]`.
    pub inputs: Tensor<2>,
    /// `[batch]`.
    pub targets: Tensor<1, Int>,
}

/// Stacks items into a [`MyBatch`].
#[derive(Debug, Clone, Default)]
pub struct MyBatcher;

impl Batcher<MyItem, MyBatch> for MyBatcher {
    fn batch(&self, items: Vec<MyItem>, device: &Device) -> MyBatch {
        let n = items.len();
        let x: Vec<f32> = items.iter().flat_map(|i| i.x).collect();
        let y: Vec<i64> = items.iter().map(|i| i.y as i64).collect();
        MyBatch {
            inputs: Tensor::from_data(TensorData::new(x, [n, FEATURES]), device),
            targets: Tensor::from_data(TensorData::new(y, [n]), device),
        }
    }
}

/// A two-layer perceptron.
#[derive(Module, Debug)]
pub struct MyModel {
    hidden: Linear,
    out: Linear,
    act: Relu,
}

impl MyModel {
    /// A freshly initialised model.
    pub fn init(device: &Device) -> Self {
        MyModel {
            hidden: LinearConfig::new(FEATURES, 64).init(device),
            out: LinearConfig::new(64, CLASSES).init(device),
            act: Relu::new(),
        }
    }

    fn forward_classification(&self, batch: MyBatch) -> ClassificationOutput {
        let logits = self
            .out
            .forward(self.act.forward(self.hidden.forward(batch.inputs)));
        let loss = CrossEntropyLossConfig::new()
            .init(&logits.device())
            .forward(logits.clone(), batch.targets.clone());
        ClassificationOutput::new(loss, logits, batch.targets)
    }
}

impl TrainStep for MyModel {
    type Input = MyBatch;
    type Output = ClassificationOutput;

    fn step(&self, batch: MyBatch) -> TrainOutput<ClassificationOutput> {
        let item = self.forward_classification(batch);
        let grads = item.loss.backward();
        TrainOutput::new(self, grads, item)
    }
}

impl InferenceStep for MyModel {
    type Input = MyBatch;
    type Output = ClassificationOutput;

    fn step(&self, batch: MyBatch) -> ClassificationOutput {
        self.forward_classification(batch)
    }
}

/// Options of a quickstart run (the binary's flags).
#[derive(Debug, Clone)]
pub struct Config {
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
    /// Training samples.
    pub samples: usize,
    /// Directory of burn-train's logs and checkpoints.
    pub artifacts: PathBuf,
    /// Train with plain burn `Learner` instead of `DdpLearner` (world of one only; for
    /// measuring DdpLearner's overhead).
    pub plain: bool,
    /// Render no progress (benchmarks).
    pub quiet: bool,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            epochs: 10,
            batch_size: 32,
            lr: 0.001,
            seed: 42,
            device: "cpu".into(),
            save_model: None,
            samples: 4096,
            artifacts: std::env::temp_dir().join("burn-ddp-quickstart"),
            plain: false,
            quiet: false,
        }
    }
}

/// What a run measured.
#[derive(Debug, Clone)]
pub struct Report {
    /// Validation accuracy of the final model over the whole validation split, in percent.
    pub valid_accuracy: f64,
    /// The final parameters, flattened in visit order.
    pub params: Vec<f32>,
    /// Wall time of training (all epochs, validation included), in seconds.
    pub train_seconds: f64,
    /// Optimizer steps taken.
    pub steps: usize,
    /// Training samples processed by all ranks together.
    pub samples: usize,
}

/// Selects the device for `name` and this process's local rank.
pub fn device(name: &str, local_rank: usize) -> Result<Device> {
    match name {
        "cpu" => Ok(Device::flex().autodiff()),
        "cuda" => bail!(
            "--device cuda (GPU {local_rank}): this build has no CUDA/NCCL support yet; use \
             --device cpu"
        ),
        other => bail!("unknown device {other:?}: expected cpu or cuda"),
    }
}

/// Accuracy of `model` on the whole validation split (on every rank; used for the report).
pub fn accuracy(model: &MyModel, device: &Device, samples: usize) -> Result<f64> {
    let data = MyDataset::valid(samples);
    let items: Vec<MyItem> = (0..data.len())
        .map(|i| data.get(i))
        .collect::<Result<_, _>>()?;
    let batch = MyBatcher.batch(items, device);
    let out = InferenceStep::step(model, batch);
    let predicted = out.output.argmax(1).reshape([samples]);
    let correct: i64 = predicted
        .equal(out.targets)
        .int()
        .sum()
        .into_scalar::<i64>();
    Ok(correct as f64 * 100.0 / samples as f64)
}

/// Trains the quickstart in `group` (a world of one or many ranks).
pub fn run(group: Arc<ProcessGroup>, cfg: &Config) -> Result<Report> {
    let device = device(&cfg.device, group.local_rank())?;
    device.seed(cfg.seed);
    // Parameters are initialised lazily; materialise them while the seed still decides.
    let model = MyModel::init(&device).materialize();

    let sampler = DistributedSampler::for_group(&group).seed(cfg.seed);
    let valid_sampler = DistributedSampler::for_group(&group).shuffle(false);
    let train = DataLoaderBuilder::new(MyBatcher)
        .batch_size(cfg.batch_size)
        .build(sampler.dataset(MyDataset::train(cfg.samples)));
    let valid = DataLoaderBuilder::new(MyBatcher)
        .batch_size(cfg.batch_size)
        .build(valid_sampler.dataset(MyDataset::valid(cfg.samples / 4)));

    let steps = cfg.epochs * train.num_items().div_ceil(cfg.batch_size);
    let mut training = SupervisedTraining::new(&cfg.artifacts, train, valid)
        .metric_train_numeric(LossMetric::new())
        .metric_valid_numeric(LossMetric::new())
        .metric_train_numeric(AccuracyMetric::new())
        .metric_valid_numeric(AccuracyMetric::new())
        .num_epochs(cfg.epochs);
    if cfg.quiet {
        training = training.renderer(Box::new(QuietRenderer));
    }
    let start = std::time::Instant::now();
    let result = if cfg.plain {
        if group.world_size() != 1 {
            bail!("--plain trains with burn's own Learner, on one process only");
        }
        training.launch(Learner::new(model, SgdConfig::new().init(), cfg.lr))
    } else {
        let learner = DdpLearner::with_group(group.clone(), model, SgdConfig::new().init(), cfg.lr)
            .sampler(&sampler)
            .setting("batch_size", cfg.batch_size)
            .setting("lr", cfg.lr)
            .setting("seed", cfg.seed)
            .setting("epochs", cfg.epochs);
        training
            .launch_ddp(learner)
            .context("data-parallel training")?
    };
    let train_seconds = start.elapsed().as_secs_f64();
    if let Some(e) = &result.error {
        bail!("training failed: {e}");
    }
    let model = result.model;
    if group.rank() == 0
        && let Some(path) = &cfg.save_model
    {
        use burn_store::{ModuleSnapshot, SafetensorsStore};
        let mut store = SafetensorsStore::from_file(path);
        model
            .save_into(&mut store)
            .with_context(|| format!("saving the model to {}", path.display()))?;
    }
    Ok(Report {
        valid_accuracy: accuracy(&model, &device, cfg.samples / 4)?,
        params: burn_ddp::train::flat_parameters(&model),
        train_seconds,
        steps,
        samples: steps * cfg.batch_size * group.world_size(),
    })
}

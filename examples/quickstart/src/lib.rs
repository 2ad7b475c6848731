//! The quickstart of burn-ddp, the Rust counterpart of PyTorch's DDP tutorial: a synthetic,
//! deterministic dataset (`MyDataset`), an MLP (`MyModel`), cross-entropy, SGD. The binary is a
//! thin wrapper around [`run`].

#![warn(missing_docs)]

use std::path::PathBuf;
use std::sync::Arc;

mod config;
pub use config::{Config, Flags};

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
use burn_ddp::train::{
    CheckpointConfig, DdpLearner, DdpTraining, DistributedSampler, ProgressOutput, QuietRenderer,
};

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
    pub x: Vec<f32>,
    /// Class.
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
        let mut x = vec![0f32; FEATURES];
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

/// The UCI handwritten digits (1797 images of 8x8 pixels, CC BY 4.0; see `data/README.md`),
/// read from scikit-learn's `digits.csv.gz`. Pixels are scaled to `0..=1`.
#[derive(Debug, Clone)]
pub struct Digits {
    items: Arc<Vec<MyItem>>,
}

/// Pixels per digit image.
pub const DIGIT_PIXELS: usize = 64;

impl Digits {
    /// The copy shipped with this example.
    pub fn bundled_path() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("data/digits.csv.gz")
    }

    /// Reads `digits.csv.gz` (64 pixel columns, then the digit).
    pub fn load(path: &std::path::Path) -> Result<Self> {
        use std::io::Read;
        let file =
            std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
        let mut text = String::new();
        flate2::read::GzDecoder::new(file)
            .read_to_string(&mut text)
            .with_context(|| format!("decompressing {}", path.display()))?;
        let items = text
            .lines()
            .filter(|l| !l.trim().is_empty())
            .enumerate()
            .map(|(n, line)| {
                let values: Vec<f32> = line
                    .split(',')
                    .map(|v| v.trim().parse::<f32>())
                    .collect::<Result<_, _>>()
                    .with_context(|| format!("{} line {}", path.display(), n + 1))?;
                if values.len() != DIGIT_PIXELS + 1 {
                    bail!(
                        "{} line {}: {} columns, expected 65",
                        path.display(),
                        n + 1,
                        values.len()
                    );
                }
                Ok(MyItem {
                    x: values[..DIGIT_PIXELS].iter().map(|p| p / 16.0).collect(),
                    y: values[DIGIT_PIXELS] as usize,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Digits {
            items: Arc::new(items),
        })
    }

    /// Every fifth image for validation, the rest for training.
    pub fn split(&self) -> (Data, Data) {
        let pick = |valid: bool| Data::Table {
            items: self.items.clone(),
            indices: (0..self.items.len())
                .filter(|i| (i % 5 == 0) == valid)
                .collect(),
        };
        (pick(false), pick(true))
    }
}

/// A training or validation split of either data source.
#[derive(Debug, Clone)]
pub enum Data {
    /// The synthetic [`MyDataset`].
    Synthetic(MyDataset),
    /// Rows of a table (the digits).
    Table {
        /// All rows.
        items: Arc<Vec<MyItem>>,
        /// The rows of this split.
        indices: Vec<usize>,
    },
}

impl Dataset<MyItem> for Data {
    fn get(&self, index: usize) -> Result<MyItem, DatasetError> {
        match self {
            Data::Synthetic(d) => d.get(index),
            Data::Table { items, indices } => indices
                .get(index)
                .and_then(|i| items.get(*i))
                .cloned()
                .ok_or_else(|| {
                    DatasetError::new(std::io::Error::new(
                        std::io::ErrorKind::InvalidInput,
                        format!("index {index} out of range"),
                    ))
                }),
        }
    }

    fn len(&self) -> usize {
        match self {
            Data::Synthetic(d) => d.len(),
            Data::Table { indices, .. } => indices.len(),
        }
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
        let (n, features) = (items.len(), items.first().map_or(0, |i| i.x.len()));
        let x: Vec<f32> = items.iter().flat_map(|i| i.x.iter().copied()).collect();
        let y: Vec<i64> = items.iter().map(|i| i.y as i64).collect();
        MyBatch {
            inputs: Tensor::from_data(TensorData::new(x, [n, features]), device),
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
    /// A freshly initialised model for `features` inputs and `classes` outputs.
    pub fn init(device: &Device, features: usize, classes: usize) -> Self {
        MyModel {
            hidden: LinearConfig::new(features, 64).init(device),
            out: LinearConfig::new(64, classes).init(device),
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
        if let Some(path) = &cfg.report {
            let line = format!(
                "steps={} seconds={} samples={} accuracy={} digest={:016x}\n",
                self.steps,
                self.train_seconds,
                self.samples,
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

#[cfg(feature = "cuda")]
fn cuda_device(local_rank: usize) -> Result<Device> {
    // Fails with what was looked for and how to fix it, instead of a loader panic.
    burn_ddp_nccl::check_libraries().context("--device cuda")?;
    Ok(Device::cuda(local_rank).autodiff())
}

#[cfg(not(feature = "cuda"))]
fn cuda_device(local_rank: usize) -> Result<Device> {
    bail!(
        "--device cuda (GPU {local_rank}): this build has no CUDA support; rebuild with \
         `--features cuda` (cargo build -p quickstart --features cuda)"
    )
}

/// Accuracy of `model` on all of `data`, in percent.
pub fn accuracy(model: &MyModel, device: &Device, data: &Data) -> Result<f64> {
    let items: Vec<MyItem> = (0..data.len())
        .map(|i| data.get(i))
        .collect::<Result<_, _>>()?;
    let n = items.len();
    let out = InferenceStep::step(model, MyBatcher.batch(items, device));
    let predicted = out.output.argmax(1).reshape([n]);
    let correct = predicted
        .equal(out.targets)
        .int()
        .sum()
        .into_scalar::<i64>();
    Ok(correct as f64 * 100.0 / n.max(1) as f64)
}

/// Trains in `group` (a world of one or many ranks) on the configured data.
pub fn run(group: Arc<ProcessGroup>, cfg: &Config) -> Result<Report> {
    let device = device(&cfg.device, group.local_rank())?;
    let (train_data, valid_data, features, classes) = match &cfg.digits {
        None => (
            Data::Synthetic(MyDataset::train(cfg.samples)),
            Data::Synthetic(MyDataset::valid(cfg.samples / 4)),
            FEATURES,
            CLASSES,
        ),
        Some(path) => {
            let (train, valid) = Digits::load(path)?.split();
            (train, valid, DIGIT_PIXELS, 10)
        }
    };
    device.seed(cfg.seed);
    // Parameters are initialised lazily; materialise them while the seed still decides.
    let model = MyModel::init(&device, features, classes).materialize();

    let sampler = DistributedSampler::for_group(&group).seed(cfg.seed);
    let valid_sampler = DistributedSampler::for_group(&group).shuffle(false);
    let train = DataLoaderBuilder::new(MyBatcher)
        .batch_size(cfg.batch_size)
        .build(sampler.dataset(train_data));
    let valid = DataLoaderBuilder::new(MyBatcher)
        .batch_size(cfg.batch_size)
        .build(valid_sampler.dataset(valid_data.clone()));

    let steps = cfg.epochs * train.num_items().div_ceil(cfg.batch_size);
    let mut training = SupervisedTraining::new(&cfg.artifacts, train, valid)
        .metric_train_numeric(LossMetric::new())
        .metric_valid_numeric(LossMetric::new())
        .metric_train_numeric(AccuracyMetric::new())
        .metric_valid_numeric(AccuracyMetric::new())
        .num_epochs(cfg.epochs);
    // Rank 0's progress: burn's TUI in a terminal, readable lines otherwise (DdpLearner
    // chooses; burn's own Learner is told here), nothing with --quiet.
    let progress = if cfg.quiet {
        training = training.renderer(Box::new(QuietRenderer));
        ProgressOutput::Keep
    } else {
        ProgressOutput::Auto
    };
    if cfg.plain
        && let Some(renderer) = progress.renderer()
    {
        training = training.renderer(renderer);
    }
    let start = std::time::Instant::now();
    let result = if cfg.plain {
        if group.world_size() != 1 {
            bail!("--plain trains with burn's own Learner, on one process only");
        }
        training.launch(Learner::new(model, SgdConfig::new().init(), cfg.lr))
    } else {
        let mut learner =
            DdpLearner::with_group(group.clone(), model, SgdConfig::new().init(), cfg.lr)
                .sampler(&sampler)
                .setting("batch_size", cfg.batch_size)
                .setting("lr", cfg.lr)
                .setting("seed", cfg.seed)
                .setting("epochs", cfg.epochs)
                .setting("data", format!("{:?}", cfg.digits))
                .desync_check(!cfg.no_desync_check)
                .progress(progress);
        if let Some(dir) = &cfg.checkpoint_dir {
            learner = learner.checkpoints(CheckpointConfig::new(dir).every(cfg.checkpoint_every));
        }
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
        valid_accuracy: accuracy(&model, &device.clone().inner(), &valid_data)?,
        params: burn_ddp::train::flat_parameters(&model),
        train_seconds,
        steps,
        samples: steps * cfg.batch_size * group.world_size(),
    })
}

/// Ends a binary: prints the error with its causes (also into torchrun's error file) and exits
/// with its code (128 + the signal for a stop by signal, see `burn_ddp::signals`; 1 for other
/// errors).
pub fn exit(result: Result<()>) -> std::process::ExitCode {
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            let code = e
                .chain()
                .find_map(|c| c.downcast_ref::<burn_ddp::DdpError>())
                .map_or(1, burn_ddp::DdpError::exit_code);
            // Under torchrun, the error goes to its error file too (its "Root Cause" report).
            burn_ddp::elastic::record_error(&format_args!("{e:#}"));
            if code == 1 {
                eprintln!("Error: {e:#}");
            } else {
                eprintln!("{e:#}");
            }
            std::process::ExitCode::from(u8::try_from(code).unwrap_or(1))
        }
    }
}

/// Entry point of the binaries: forms the group from the environment, trains, and has rank 0
/// print the summary.
pub fn main_with(defaults: Config) -> Result<()> {
    // Wrong flags and `--help` end here, as clap does (exit codes 2 and 0).
    let cfg = defaults
        .parse_command_line(std::env::args_os())
        .unwrap_or_else(|e| e.exit());
    let group = Arc::new(burn_ddp::init_process_group().context("forming the process group")?);
    let report = run(group.clone(), &cfg)?;
    // Every rank's digest: equal digests show the replicas ended identical.
    println!("parameters digest {:016x}", report.digest());
    if group.rank() == 0 {
        report.publish(&cfg, group.world_size())?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bundled_digits_load_and_split() {
        let digits = Digits::load(&Digits::bundled_path()).unwrap();
        let (train, valid) = digits.split();
        assert_eq!((train.len(), valid.len()), (1437, 360));
        let item = valid.get(0).unwrap();
        assert_eq!(item.x.len(), DIGIT_PIXELS);
        assert_eq!(item.y, 0, "the first image of the file is a zero");
        let classes: std::collections::BTreeSet<usize> =
            (0..train.len()).map(|i| train.get(i).unwrap().y).collect();
        assert_eq!(classes.len(), 10);
        assert!(item.x.iter().all(|p| (0.0..=1.0).contains(p)));
    }
}

//! A single-device burn-train program made data-parallel: `Learner` became `DdpLearner` and
//! `launch` became `launch_ddp`, nothing else. Alone it trains as before; started once per
//! device (`burn-ddp-run --nproc 2 ./my-trainer`, torchrun, srun, mpirun) each rank trains on
//! its share of the data and every replica ends identical.

use burn::data::dataloader::DataLoaderBuilder;
use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::InMemDataset;
use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::SgdConfig;
use burn::tensor::{Device, Int, Tensor, TensorData};
use burn::train::metric::{AccuracyMetric, LossMetric};
use burn::train::{
    ClassificationOutput, InferenceStep, SupervisedTraining, TrainOutput, TrainStep,
};
use burn_ddp::train::{DdpLearner, DdpTraining};

/// A point of 8 features and its class (0 to 3).
type Item = (Vec<f32>, i64);

#[derive(Clone, Debug)]
struct Batch {
    x: Tensor<2>,
    y: Tensor<1, Int>,
}

#[derive(Clone)]
struct ToBatch;

impl Batcher<Item, Batch> for ToBatch {
    fn batch(&self, items: Vec<Item>, device: &Device) -> Batch {
        let n = items.len();
        let x: Vec<f32> = items.iter().flat_map(|(x, _)| x.clone()).collect();
        let y: Vec<i64> = items.iter().map(|(_, y)| *y).collect();
        Batch {
            x: Tensor::from_data(TensorData::new(x, [n, 8]), device),
            y: Tensor::from_data(TensorData::new(y, [n]), device),
        }
    }
}

#[derive(Module, Debug)]
struct Mlp {
    hidden: Linear,
    out: Linear,
    act: Relu,
}

impl Mlp {
    fn new(device: &Device) -> Self {
        Mlp {
            hidden: LinearConfig::new(8, 32).init(device),
            out: LinearConfig::new(32, 4).init(device),
            act: Relu::new(),
        }
    }

    fn forward(&self, batch: Batch) -> ClassificationOutput {
        let hidden = self.act.forward(self.hidden.forward(batch.x));
        let logits = self.out.forward(hidden);
        let loss = CrossEntropyLossConfig::new()
            .init(&logits.device())
            .forward(logits.clone(), batch.y.clone());
        ClassificationOutput::new(loss, logits, batch.y)
    }
}

impl TrainStep for Mlp {
    type Input = Batch;
    type Output = ClassificationOutput;
    fn step(&self, batch: Batch) -> TrainOutput<ClassificationOutput> {
        let item = self.forward(batch);
        TrainOutput::new(self, item.loss.backward(), item)
    }
}

impl InferenceStep for Mlp {
    type Input = Batch;
    type Output = ClassificationOutput;
    fn step(&self, batch: Batch) -> ClassificationOutput {
        self.forward(batch)
    }
}

/// `n` points in 4 classes: class `c` is centred on feature `c`.
fn points(n: usize, seed: u64) -> InMemDataset<Item> {
    let noise = |i: usize, f: usize| {
        let h = (seed ^ (i * 8 + f) as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        (h >> 40) as f32 / (1u64 << 24) as f32 - 0.5
    };
    let item = |i: usize| {
        let class = i % 4;
        let x = (0..8)
            .map(|f| noise(i, f) + 2.0 * (f == class) as u8 as f32)
            .collect();
        (x, class as i64)
    };
    InMemDataset::new((0..n).map(item).collect())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // This process's device (on a GPU: `Device::cuda(local_rank)`); the learner moves the
    // loaders' batches to it.
    let device = Device::flex().autodiff();
    let model = Mlp::new(&device);
    let train = DataLoaderBuilder::new(ToBatch)
        .batch_size(32)
        .shuffle(42)
        .build(points(1024, 1));
    let valid = DataLoaderBuilder::new(ToBatch)
        .batch_size(32)
        .build(points(512, 2));
    let artifacts = std::env::temp_dir().join("burn-ddp-user-crate");
    let training = SupervisedTraining::new(artifacts, train, valid)
        .metric_train_numeric(LossMetric::new())
        .metric_valid_numeric(LossMetric::new())
        .metric_valid_numeric(AccuracyMetric::new())
        .num_epochs(3);

    // Was: `let learner = Learner::new(model, SgdConfig::new().init(), 0.1);`
    let learner = DdpLearner::new(model, SgdConfig::new().init(), 0.1)?;
    let rank = learner.group().rank();
    // Was: `let result = training.launch(learner);`
    let result = training.launch_ddp(learner)?;

    // Every replica ends identical: each rank prints the same checksum.
    let checksum = burn_ddp::train::parameters_to_vector(&result.model)
        .iter()
        .fold(0xcbf2_9ce4_8422_2325_u64, |h, v| {
            (h ^ u64::from(v.to_bits())).wrapping_mul(0x0100_0000_01b3)
        });
    println!("rank {rank}: trained, parameter checksum {checksum:016x}");
    Ok(())
}

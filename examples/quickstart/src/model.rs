//! The quickstart's model: a two-layer perceptron trained with cross-entropy, optionally with
//! batch normalisation after the hidden layer (burn's `BatchNorm`, or burn-ddp's
//! `SyncBatchNorm`), and its accuracy on a data split.

use anyhow::Result;
use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::Dataset;
use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{BatchNorm, BatchNormConfig, Linear, LinearConfig, Relu};
use burn::tensor::Device;
use burn::train::{ClassificationOutput, InferenceStep, TrainOutput, TrainStep};
use burn_ddp::nn::{BatchNormSyncExt, SyncBatchNorm};

use crate::config::ModelKind;
use crate::data::{Data, MyBatch, MyBatcher, MyItem};

/// Units of the hidden layer.
const HIDDEN: usize = 64;

/// Batch normalisation of the hidden layer.
#[derive(Module, Debug)]
pub enum Norm {
    /// burn's: statistics of this rank's batch.
    Batch(BatchNorm),
    /// burn-ddp's: statistics of every rank's batch.
    Sync(SyncBatchNorm),
}

impl Norm {
    fn forward(&self, x: burn::tensor::Tensor<2>) -> burn::tensor::Tensor<2> {
        match self {
            Norm::Batch(n) => n.forward(x),
            Norm::Sync(n) => n.forward(x),
        }
    }
}

/// A two-layer perceptron, optionally with batch normalisation after the hidden layer, or the
/// three-layer 784-1024-1024-10 one.
#[derive(Module, Debug)]
pub struct MyModel {
    hidden: Linear,
    norm: Option<Norm>,
    /// The second hidden layer of the large perceptron.
    hidden2: Option<Linear>,
    out: Linear,
    act: Relu,
}

/// Units of the large perceptron's hidden layers.
const LARGE_HIDDEN: usize = 1024;

/// Inputs and classes of the large perceptron's data.
pub const LARGE_SHAPE: (usize, usize) = (784, 10);

impl MyModel {
    /// A freshly initialised model of `kind` for `features` inputs and `classes` outputs.
    pub fn init(device: &Device, kind: ModelKind, features: usize, classes: usize) -> Self {
        let config = BatchNormConfig::new(HIDDEN);
        let norm = match kind {
            ModelKind::Mlp | ModelKind::MlpLarge => None,
            ModelKind::MlpBn => Some(Norm::Batch(config.init(device))),
            ModelKind::MlpSyncbn => Some(Norm::Sync(config.init_sync(device))),
        };
        let (hidden, hidden2) = match kind {
            ModelKind::MlpLarge => (
                LinearConfig::new(features, LARGE_HIDDEN).init(device),
                Some(LinearConfig::new(LARGE_HIDDEN, LARGE_HIDDEN).init(device)),
            ),
            _ => (LinearConfig::new(features, HIDDEN).init(device), None),
        };
        let width = if hidden2.is_some() {
            LARGE_HIDDEN
        } else {
            HIDDEN
        };
        MyModel {
            hidden,
            norm,
            hidden2,
            out: LinearConfig::new(width, classes).init(device),
            act: Relu::new(),
        }
    }

    fn forward_classification(&self, batch: MyBatch) -> ClassificationOutput {
        let mut hidden = self.hidden.forward(batch.inputs);
        if let Some(norm) = &self.norm {
            hidden = norm.forward(hidden);
        }
        let mut hidden = self.act.forward(hidden);
        if let Some(layer) = &self.hidden2 {
            hidden = self.act.forward(layer.forward(hidden));
        }
        let logits = self.out.forward(hidden);
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

/// Accuracy of `model` on all of `data`, in percent.
pub fn accuracy(model: &MyModel, device: &Device, data: &Data) -> Result<f64> {
    let items: Vec<MyItem> = (0..data.len())
        .map(|i| data.get(i))
        .collect::<Result<_, _>>()?;
    Ok(percent_correct(InferenceStep::step(
        model,
        MyBatcher.batch(items, device),
    )))
}

/// The share of a classification's items whose highest-scored class is the target, in percent.
pub fn percent_correct(out: ClassificationOutput) -> f64 {
    let n = out.targets.dims()[0];
    let predicted = out.output.argmax(1).reshape([n]);
    let correct = predicted
        .equal(out.targets)
        .int()
        .sum()
        .into_scalar::<i64>();
    correct as f64 * 100.0 / n.max(1) as f64
}

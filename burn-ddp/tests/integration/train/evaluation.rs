//! Exact evaluation: the learner's validation metrics count every sample once, whatever the
//! world size. The same model (learning rate 0: training leaves it as it starts) over a
//! validation split of 25 samples, which 2 and 3 do not divide (the ranks then hold different
//! numbers of batches), with the same global batch of 12, gives the accuracy of one process
//! exactly and its loss to rounding (burn-train's loss metric averages batch means, so the
//! global batch must match; accuracy counts samples).

use std::sync::{Arc, Mutex};

use burn::data::dataloader::DataLoaderBuilder;
use burn::optim::SgdConfig;
use burn::tensor::TensorReadError;
use burn::train::SupervisedTraining;
use burn::train::metric::{
    AccuracyMetric, LossMetric, Metric, MetricMetadata, MetricName, SerializedEntry,
};
use burn_ddp::ProcessGroup;
use burn_ddp::train::{DdpLearner, DdpTraining, DistributedSampler, ProgressOutput, QuietRenderer};

use super::model::{DATA, Points, ToBatch, flex, new_net};
use crate::common::{options, run_world};

/// A burn-train metric that also records the epoch values it computes.
#[derive(Clone)]
pub(crate) struct Recorded<Mx> {
    pub(crate) inner: Mx,
    pub(crate) epochs: Arc<Mutex<Vec<String>>>,
}

impl<Mx: Metric> Metric for Recorded<Mx> {
    type Input = Mx::Input;
    fn name(&self) -> MetricName {
        self.inner.name()
    }
    fn update(
        &mut self,
        item: &Self::Input,
        metadata: &MetricMetadata,
    ) -> Result<SerializedEntry, TensorReadError> {
        self.inner.update(item, metadata)
    }
    fn compute(&mut self) -> Result<SerializedEntry, TensorReadError> {
        let entry = self.inner.compute()?;
        self.epochs.lock().unwrap().push(entry.serialized.clone());
        Ok(entry)
    }
    fn clear(&mut self) {
        self.inner.clear()
    }
}

/// Rank 0's validation (accuracy, loss) of epoch 1, as recorded by burn-train's metrics.
fn validate(world: usize, batch: usize, valid_items: usize) -> (String, String) {
    let device = flex();
    let model = new_net(&device, Some(11), false);
    let recorded = |_| Arc::new(Mutex::new(Vec::new()));
    let (accuracy, loss) = (recorded(0), recorded(1));
    run_world(world, options(60), |group: ProcessGroup| {
        let group = Arc::new(group);
        let sampler = DistributedSampler::for_group(&group);
        let valid = DistributedSampler::for_group(&group)
            .shuffle(false)
            .pad(false);
        let dir = super::thread_dir("eval");
        let training = SupervisedTraining::new(
            &dir,
            DataLoaderBuilder::new(ToBatch)
                .batch_size(batch)
                .build(sampler.dataset(Points(DATA))),
            DataLoaderBuilder::new(ToBatch)
                .batch_size(batch)
                .build(valid.dataset(Points(valid_items))),
        )
        .metric_valid(Recorded {
            inner: AccuracyMetric::new(),
            epochs: accuracy.clone(),
        })
        .metric_valid(Recorded {
            inner: LossMetric::new(),
            epochs: loss.clone(),
        })
        .renderer(Box::new(QuietRenderer))
        .with_application_logger(None)
        .num_epochs(1);
        let learner = DdpLearner::with_group(group, model.clone(), SgdConfig::new().init(), 0.0)
            .sampler(&sampler)
            .valid_sampler(&valid)
            .progress(ProgressOutput::Keep);
        let result = training.launch_ddp(learner).expect("training");
        assert!(result.error.is_none(), "{:?}", result.error);
        let _ = std::fs::remove_dir_all(&dir);
    });
    let only = |v: &Arc<Mutex<Vec<String>>>| {
        let v = v.lock().unwrap();
        assert_eq!(
            v.len(),
            1,
            "one epoch value recorded (by rank 0 only): {v:?}"
        );
        v[0].clone()
    };
    (only(&accuracy), only(&loss))
}

/// The first number of a serialized metric value.
pub(crate) fn number(serialized: &str) -> f64 {
    serialized
        .split(|c: char| !(c.is_ascii_digit() || c == '.' || c == '-' || c == 'e'))
        .find_map(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no number in {serialized:?}"))
}

#[test]
fn validation_metrics_do_not_depend_on_the_world_size() {
    let (accuracy, loss) = validate(1, 12, 25);
    eprintln!("world 1: accuracy {accuracy}, loss {loss}");
    for world in [2, 3] {
        let (a, l) = validate(world, 12 / world, 25);
        eprintln!("world {world}: accuracy {a}, loss {l}");
        assert_eq!(a, accuracy, "world {world}: accuracy");
        let (x, y) = (number(&l), number(&loss));
        assert!(
            (x - y).abs() <= 1e-6 * y.abs(),
            "world {world}: loss {x} against {y}"
        );
    }
}

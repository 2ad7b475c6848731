//! Data-parallel training on thread ranks as the equivalence and ZeRO tests run it
//! (`equivalence`, `zero`, `zero_edges`): each rank starts from a model of its own (which the
//! start-up broadcast replaces with rank 0's), samples the training points shuffled and the
//! validation points in order, trains quietly in a scratch folder of its own, and hands the
//! trained model to what the test reads off it.

use std::sync::{Arc, Mutex};

use burn::data::dataloader::DataLoaderBuilder;
use burn::data::dataloader::batcher::Batcher;
use burn::train::metric::LossMetric;
use burn::train::{
    ClassificationOutput, InferenceStep, LearnerModel, SupervisedTraining, TrainStep,
};
use burn_ddp::ProcessGroup;
use burn_ddp::train::{DdpLearner, DdpTraining, DistributedSampler, ProgressOutput, QuietRenderer};

use super::model::{DATA, Points};
use crate::common::{options, run_world};

/// How the ranks train, besides their learner: batches, epochs, the shuffle, accumulation.
pub(crate) struct Threads<B> {
    /// Ranks (threads).
    pub world: usize,
    /// Points per batch, per rank.
    pub batch: usize,
    /// Epochs.
    pub epochs: usize,
    /// Seed of the training sampler's shuffle.
    pub seed: u64,
    /// Micro-steps per optimizer step (`None`: one).
    pub accumulation: Option<usize>,
    /// The loss as a training metric (every rank's, gathered).
    pub loss_metric: bool,
    /// Names the ranks' scratch folders (`super::thread_dir`).
    pub scratch: &'static str,
    /// Batches the points.
    pub batcher: B,
}

/// Trains on `threads.world` thread ranks, rank `r` starting from `models[r]`. Each rank's
/// `learner` builds its DdpLearner from the group and the model (the samplers and
/// `ProgressOutput::Keep` are added here) and says what to read off the trained model; the
/// results in rank order.
pub(crate) fn train_on_threads<M, O, B, F, T>(
    threads: &Threads<B>,
    models: Vec<M>,
    learner: impl Fn(&Arc<ProcessGroup>, M) -> (DdpLearner<M>, F) + Sync,
) -> Vec<T>
where
    M: LearnerModel
        + TrainStep<Input = O, Output = ClassificationOutput>
        + InferenceStep<Input = O, Output = ClassificationOutput>
        + Send,
    O: Send + Clone + std::fmt::Debug + 'static,
    B: Batcher<(Vec<f32>, usize), O> + Clone + Sync + 'static,
    F: FnOnce(M) -> T,
    T: Send,
{
    assert_eq!(models.len(), threads.world, "one model per rank");
    let models = Mutex::new(models.into_iter().map(Some).collect::<Vec<_>>());
    run_world(threads.world, options(60), |group: ProcessGroup| {
        let rank = group.rank();
        let model = models.lock().unwrap()[rank].take().unwrap();
        let group = Arc::new(group);
        let sampler = DistributedSampler::for_group(&group).seed(threads.seed);
        let valid_sampler = DistributedSampler::for_group(&group).shuffle(false);
        let loader = |data: Points, s: &DistributedSampler| {
            DataLoaderBuilder::new(threads.batcher.clone())
                .batch_size(threads.batch)
                .build(s.dataset(data))
        };
        let dir = super::thread_dir(threads.scratch);
        let mut training = SupervisedTraining::new(
            &dir,
            loader(Points(DATA), &sampler),
            loader(Points(DATA / 2), &valid_sampler),
        );
        if threads.loss_metric {
            training = training.metric_train_numeric(LossMetric::new());
        }
        let mut training = training
            .renderer(Box::new(QuietRenderer))
            .with_application_logger(None)
            .num_epochs(threads.epochs);
        if let Some(k) = threads.accumulation {
            training = training.grads_accumulation(k);
        }
        let (learner, read) = learner(&group, model);
        let learner = learner
            .sampler(&sampler)
            .valid_sampler(&valid_sampler)
            .progress(ProgressOutput::Keep);
        let result = training.launch_ddp(learner).expect("training");
        assert!(result.error.is_none(), "{:?}", result.error);
        let _ = std::fs::remove_dir_all(&dir);
        read(result.model)
    })
}

//! Uneven inputs (`DdpLearner::uneven_inputs`, PyTorch's `Join`): ranks with different numbers
//! of batches train together; a rank that ran out takes part with zero gradients until every
//! rank is done. The result is what the documented rule predicts: in a step where `k` of `n`
//! ranks have a batch, the update is the sum of their gradients divided by `n`, computed here
//! in one process as the gradient of (sum of those ranks' batch losses) / `n`; with the
//! optimizer sharded too.

use std::sync::Arc;

use burn::data::dataloader::DataLoaderBuilder;
use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::{Dataset, DatasetError};
use burn::optim::{GradientsParams, SgdConfig};
use burn::tensor::Tensor;
use burn::train::{InferenceStep, SupervisedTraining};
use burn_ddp::ProcessGroup;
use burn_ddp::train::{
    DdpLearner, DdpTraining, ProgressOutput, QuietRenderer, Sharding, parameters_to_vector,
};

use super::model::{Points, ToBatch, flex, new_net};
use super::{assert_identical, relative_error, small_buckets};
use crate::common::{options, run_world};

/// Each rank's samples: rank 0 has 3 batches of 4, rank 1 has 5.
const SHARDS: [std::ops::Range<usize>; 2] = [0..12, 12..32];
const BATCH: usize = 4;
const LR: f64 = 0.3;

/// Consecutive samples of the test set.
#[derive(Clone)]
struct Shard(std::ops::Range<usize>);

impl Dataset<(Vec<f32>, usize)> for Shard {
    fn get(&self, i: usize) -> Result<(Vec<f32>, usize), DatasetError> {
        Points(self.0.end).get(self.0.start + i)
    }
    fn len(&self) -> usize {
        self.0.len()
    }
}

/// Every rank's final parameters after one epoch over its own shard.
fn train(accumulation: Option<usize>, sharding: Sharding) -> Vec<Vec<f32>> {
    let device = flex();
    let model = new_net(&device, Some(7), false);
    run_world(2, options(60), |group: ProcessGroup| {
        let rank = group.rank();
        let loader = |shard: Shard| {
            DataLoaderBuilder::new(ToBatch)
                .batch_size(BATCH)
                .build(shard)
        };
        let dir = super::thread_dir("join");
        let mut training = SupervisedTraining::new(
            &dir,
            loader(Shard(SHARDS[rank].clone())),
            loader(Shard(SHARDS[rank].start..SHARDS[rank].start + 2 + 3 * rank)),
        )
        .renderer(Box::new(QuietRenderer))
        .with_application_logger(None)
        .num_epochs(1);
        if let Some(k) = accumulation {
            training = training.grads_accumulation(k);
        }
        let learner =
            DdpLearner::with_group(Arc::new(group), model.clone(), SgdConfig::new().init(), LR)
                .buckets(small_buckets())
                .uneven_inputs(true)
                .shard_optimizer(sharding)
                // Each rank's loaders are its own shard already.
                .shard_loaders(false)
                .progress(ProgressOutput::Keep);
        let result = training.launch_ddp(learner).expect("training");
        assert!(result.error.is_none(), "{:?}", result.error);
        let _ = std::fs::remove_dir_all(&dir);
        parameters_to_vector(&result.model)
    })
}

/// The rule, in one process: each optimizer step takes the gradient of the sum of the losses
/// of the batches the ranks have in its rounds, divided by the world size.
fn predicted(accumulation: Option<usize>) -> Vec<f32> {
    let device = flex();
    let mut model = new_net(&device, Some(7), false);
    let mut optim = SgdConfig::new().init();
    let batches: Vec<Vec<_>> = SHARDS
        .iter()
        .map(|s| {
            let items: Vec<_> = s.clone().map(|i| Points(s.end).get(i).unwrap()).collect();
            items
                .chunks(BATCH)
                .map(|c| ToBatch.batch(c.to_vec(), &device))
                .collect()
        })
        .collect();
    let rounds = batches.iter().map(Vec::len).max().unwrap();
    let k = accumulation.unwrap_or(1);
    for first in (0..rounds).step_by(k) {
        let mut loss: Option<Tensor<1>> = None;
        for round in first..(first + k).min(rounds) {
            for rank_batches in &batches {
                if let Some(b) = rank_batches.get(round) {
                    let l = InferenceStep::step(&model, b.clone()).loss.div_scalar(2.0);
                    loss = Some(match loss {
                        Some(sum) => sum + l,
                        None => l,
                    });
                }
            }
        }
        let grads = GradientsParams::from_grads(loss.unwrap().backward(), &model);
        model = optim.step(LR, model, grads);
    }
    parameters_to_vector(&model)
}

#[test]
fn uneven_inputs_train_together_as_the_rule_predicts() {
    for (accumulation, sharding) in [
        (None, Sharding::None),
        (Some(2), Sharding::None),
        (None, Sharding::OptimizerAndGradients),
        (Some(2), Sharding::Optimizer),
    ] {
        let ranks = train(accumulation, sharding);
        assert_identical(&ranks.iter().map(Vec::as_slice).collect::<Vec<_>>());
        let want = predicted(accumulation);
        let err = relative_error(&ranks[0], &want);
        eprintln!("accumulation {accumulation:?}, sharding {sharding}: relative error {err:e}");
        assert!(
            err <= 1e-5,
            "accumulation {accumulation:?}, {sharding}: {err:e}"
        );
        let start = parameters_to_vector(&new_net(&flex(), Some(7), false));
        assert!(
            relative_error(&ranks[0], &start) > 1e-3,
            "training changed nothing"
        );
    }
}

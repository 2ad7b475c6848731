//! Buffers (BatchNorm's running statistics) across ranks: `BufferSync::Broadcast` keeps every
//! replica bit-identical after every step, `Average` makes them agree at epoch ends, and `Off`
//! leaves them apart (which shows that the checks can fail).

use std::sync::{Arc, Mutex};

use burn::data::dataloader::DataLoaderBuilder;
use burn::optim::SgdConfig;
use burn::train::SupervisedTraining;
use burn_ddp::ProcessGroup;
use burn_ddp::train::{
    BufferSync, DdpLearner, DdpTraining, DistributedSampler, ProgressOutput, QuietRenderer,
    parameters_to_vector,
};

use super::model::{DATA, Net, Points, ToBatch, flex, new_net, record_steps};
use super::{assert_identical, relative_error, small_buckets};
use crate::common::{options, run_world};

/// Where the running mean and variance are in the flattened network: after the hidden layer
/// (6 x 16 weights, 16 biases), the norm's gamma and beta (16 each).
const RUNNING: std::ops::Range<usize> = 144..176;

/// What a rank ends with: the digest of its model at the start of every step (so after every
/// previous step), and its final parameters and buffers.
struct Outcome {
    steps: Vec<u64>,
    params: Vec<f32>,
}

/// Trains the BatchNorm network for 2 epochs on `world` thread ranks (other ranks start from
/// other weights and buffers, which the start-up broadcast replaces).
fn train(world: usize, mode: BufferSync) -> Vec<Outcome> {
    let device = flex();
    let models: Vec<Option<Net>> = (0..world)
        .map(|r| Some(new_net(&device, Some(7 + r as u64), false).with_norm(&device)))
        .collect();
    let models = Mutex::new(models);
    run_world(world, options(60), |group: ProcessGroup| {
        let rank = group.rank();
        let model = models.lock().unwrap()[rank].take().unwrap();
        let group = Arc::new(group);
        let sampler = DistributedSampler::for_group(&group).seed(3);
        let valid = DistributedSampler::for_group(&group).pad(false);
        let loader = |data: Points, s: &DistributedSampler| {
            DataLoaderBuilder::new(ToBatch)
                .batch_size(4)
                .build(s.dataset(data))
        };
        let dir = super::thread_dir("buffers");
        let training = SupervisedTraining::new(
            &dir,
            loader(Points(DATA), &sampler),
            loader(Points(DATA / 4), &valid),
        )
        .renderer(Box::new(QuietRenderer))
        .with_application_logger(None)
        .num_epochs(2);
        let learner = DdpLearner::with_group(group, model, SgdConfig::new().init(), 0.2)
            .sampler(&sampler)
            .valid_sampler(&valid)
            .buckets(small_buckets())
            .buffer_sync(mode)
            .progress(ProgressOutput::Keep);
        record_steps(true);
        let result = training.launch_ddp(learner).expect("training");
        let steps = record_steps(false);
        assert!(result.error.is_none(), "{:?}", result.error);
        let _ = std::fs::remove_dir_all(&dir);
        Outcome {
            steps,
            params: parameters_to_vector(&result.model),
        }
    })
}

#[test]
fn broadcast_buffers_keep_every_replica_identical_after_every_step() {
    for world in [2, 3] {
        let out = train(world, BufferSync::Broadcast);
        let steps = DATA.div_ceil(world * 4) * 2;
        for (r, o) in out.iter().enumerate() {
            assert_eq!(o.steps.len(), steps, "rank {r}: steps");
            assert_eq!(
                o.steps, out[0].steps,
                "world {world}: rank {r} differs from rank 0"
            );
        }
        assert_identical(&out.iter().map(|o| o.params.as_slice()).collect::<Vec<_>>());
        // The running statistics moved: they are not just their initial zeros and ones.
        let initial = parameters_to_vector(&new_net(&flex(), Some(7), false).with_norm(&flex()));
        assert!(
            relative_error(&out[0].params[RUNNING], &initial[RUNNING]) > 1e-2,
            "the running statistics did not change"
        );
    }
}

#[test]
fn averaged_buffers_agree_after_each_epoch_and_unsynchronised_ones_drift() {
    let averaged = train(2, BufferSync::Average);
    assert_identical(
        &averaged
            .iter()
            .map(|o| o.params.as_slice())
            .collect::<Vec<_>>(),
    );
    // Within an epoch the replicas' buffers differ (each rank's own batches).
    assert_ne!(averaged[0].steps[2], averaged[1].steps[2]);

    let off = train(2, BufferSync::Off);
    assert_ne!(
        off[0].params, off[1].params,
        "without synchronisation each rank keeps its own running statistics"
    );
}

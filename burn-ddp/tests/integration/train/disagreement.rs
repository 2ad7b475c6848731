//! Ranks that do not train the same thing (another model, another setting, a skipped step)
//! stop, every one of them, with an error that names the difference.

use std::sync::Arc;

use burn::optim::SgdConfig;
use burn::train::TrainStep;
use burn_ddp::train::{BucketConfig, BufferSync, DdpLearner, ProgressOutput, Sharding};

use super::launch_to_error;
use super::lockstep::ManualRank;
use super::model::{flex, new_net};
use crate::common::{options, run_world};

#[test]
fn ranks_with_different_models_or_settings_stop_naming_the_difference() {
    let device = flex();
    let errors = run_world(2, options(30), |group| {
        let group = Arc::new(group);
        let rank = group.rank();
        let learner = |model, batch: usize| {
            DdpLearner::with_group(group.clone(), model, SgdConfig::new().init(), 0.1)
                .setting("batch_size", batch)
                .progress(ProgressOutput::Keep)
        };
        // Rank 1 has an extra layer, then a different batch size.
        let model_error = launch_to_error(learner(new_net(&device, None, rank == 1), 4), 4);
        let setting_error =
            launch_to_error(learner(new_net(&device, None, false), 4 + rank), 4 + rank);
        // Buffers take part: rank 1 synchronises them otherwise, then has none.
        let mode = [BufferSync::Broadcast, BufferSync::Average][rank];
        let normed = || new_net(&device, None, false).with_norm(&device);
        let buffer_error = launch_to_error(learner(normed(), 4).buffer_sync(mode), 4);
        let model = if rank == 0 {
            normed()
        } else {
            new_net(&device, None, false)
        };
        let missing_error = launch_to_error(learner(model, 4), 4);
        (model_error, setting_error, buffer_error, missing_error)
    });
    for (model_error, setting_error, buffer_error, missing_error) in errors {
        assert!(
            buffer_error.contains("setting buffer_sync = broadcast")
                && buffer_error.contains("setting buffer_sync = average"),
            "{buffer_error}"
        );
        assert!(
            missing_error.contains("`norm.gamma`") && missing_error.contains("rank 1 has"),
            "{missing_error}"
        );
        assert!(model_error.contains("ranks disagree"), "{model_error}");
        assert!(model_error.contains("rank 1 has"), "{model_error}");
        assert!(
            model_error.contains("parameter 4 `extra.weight`"),
            "{model_error}"
        );
        assert!(
            setting_error.contains("setting batch_size = 4")
                && setting_error.contains("setting batch_size = 5"),
            "{setting_error}"
        );
    }
}

/// The bucket sizes decide the buckets and, sharded, which rank owns which parameter: a rank
/// with another bucket cap stops every rank before training, naming the setting and the rank.
#[test]
fn ranks_with_different_bucket_sizes_stop_naming_the_setting() {
    let device = flex();
    let errors = run_world(2, options(30), |group| {
        let rank = group.rank();
        let buckets = BucketConfig {
            cap_bytes: [256, 1 << 20][rank],
            first_cap_bytes: 64,
        };
        let model = new_net(&device, None, false);
        let learner = DdpLearner::with_group(Arc::new(group), model, SgdConfig::new().init(), 0.1)
            .buckets(buckets)
            .shard_optimizer(Sharding::Optimizer)
            .progress(ProgressOutput::Keep);
        launch_to_error(learner, 4)
    });
    for (rank, e) in errors.iter().enumerate() {
        assert!(
            e.contains("rank 0 has setting bucket_cap_bytes = 256")
                && e.contains("rank 1 has setting bucket_cap_bytes = 1048576"),
            "rank {rank}: {e}"
        );
    }
}

#[test]
fn a_rank_that_skips_a_step_stops_every_rank_with_a_desync_error() {
    let device = flex();
    let errors = run_world(2, options(20), |group| {
        let rank = group.rank();
        let ManualRank {
            mut model,
            reducer,
            loader,
            ..
        } = ManualRank::new(group, new_net(&device, None, false), &device);
        let mut optim = SgdConfig::new().init();
        for (step, batch) in loader.iter().enumerate() {
            // Same shapes, same number of collectives so far: only the fingerprint tells.
            if rank == 1 && step == 2 {
                continue;
            }
            let out = TrainStep::step(&model, batch.unwrap());
            match reducer.reduce_at(&model, out.grads, 1, step) {
                Ok(grads) => model = optim.step(0.5, model, grads),
                Err(e) => return e.to_string(),
            }
        }
        panic!("rank {rank}: the skipped step went unnoticed");
    });
    for e in errors {
        assert!(e.contains("desync"), "{e}");
        // Whichever rank noticed first wrote the cause both report.
        assert!(
            e.contains("epoch 1 step 2") && e.contains("epoch 1 step 3"),
            "{e}"
        );
    }
}

//! What a sharded step's parameter all-gather costs, as telemetry and traces show it: each
//! step's figures carry its bytes (every trainable value, as each rank receives them) and its
//! time, and each rank's trace has one span per bucket gathered.

use std::sync::Arc;

use burn::data::dataloader::DataLoaderBuilder;
use burn::optim::SgdConfig;
use burn::train::SupervisedTraining;
use burn_ddp::ProcessGroup;
use burn_ddp::train::{
    DdpLearner, DdpTraining, DistributedSampler, JobStats, ProgressOutput, QuietRenderer, Sharding,
    parameters_to_vector,
};

use super::model::{DATA, Points, ToBatch, flex, new_net};
use super::small_buckets;
use crate::common::{options, run_world};

/// Trains one epoch at `world` with `sharding`, a trace per rank in `dir`; rank 0's figures of
/// every step.
fn train(world: usize, sharding: Sharding, dir: &std::path::Path) -> Vec<JobStats> {
    let model = new_net(&flex(), Some(3), false);
    let ranks = run_world(world, options(60), |group: ProcessGroup| {
        let group = Arc::new(group);
        let sampler = DistributedSampler::for_group(&group);
        let loader = || {
            DataLoaderBuilder::new(ToBatch)
                .batch_size(4)
                .build(sampler.dataset(Points(DATA)))
        };
        let artifacts = super::thread_dir("zero-telemetry");
        let learner = DdpLearner::with_group(group, model.clone(), SgdConfig::new().init(), 0.1)
            .sampler(&sampler)
            .valid_sampler(&sampler)
            .buckets(small_buckets())
            .shard_optimizer(sharding)
            .profile(dir)
            .progress(ProgressOutput::Keep);
        let figures = learner.telemetry().clone();
        let training = SupervisedTraining::new(&artifacts, loader(), loader())
            .renderer(Box::new(QuietRenderer))
            .with_application_logger(None)
            .num_epochs(1);
        let result = training.launch_ddp(learner).expect("training");
        assert!(result.error.is_none(), "{:?}", result.error);
        let _ = std::fs::remove_dir_all(&artifacts);
        figures.steps()
    });
    ranks.into_iter().next().expect("rank 0")
}

/// How many complete spans of `rank`'s trace in `dir` have names starting with `prefix`.
fn spans(dir: &std::path::Path, rank: usize, prefix: &str) -> usize {
    (crate::common::trace_spans(dir, rank).iter())
        .filter(|(n, _)| n.starts_with(prefix))
        .count()
}

#[test]
fn a_sharded_step_reports_its_parameter_all_gather_in_figures_and_traces() {
    // Every trainable value of the network (it has no buffer), in f32.
    let values = parameters_to_vector(&new_net(&flex(), Some(3), false)).len();
    let runs = [
        (2, Sharding::Optimizer),
        (3, Sharding::OptimizerAndGradients),
        (2, Sharding::None),
    ];
    for (world, sharding) in runs {
        let dir = std::env::temp_dir().join(format!(
            "burn-ddp-zero-trace-{}-{world}-{sharding:?}",
            std::process::id()
        ));
        let steps = train(world, sharding, &dir);
        let what = format!("world {world}, sharding {sharding}");
        assert_eq!(steps.len(), DATA / world / 4, "{what}: a figure per step");
        let sharded = sharding != Sharding::None;
        for (i, s) in steps.iter().enumerate() {
            let expected = if sharded { 4.0 * values as f64 } else { 0.0 };
            assert_eq!(s.rank0.gather_bytes, expected, "{what}, step {i}: bytes");
            assert_eq!(s.rank0.gather > 0.0, sharded, "{what}, step {i}: time");
            assert!(
                s.rank0.gather < 60.0,
                "{what}, step {i}: {} s",
                s.rank0.gather
            );
        }
        for rank in 0..world {
            let buckets = spans(&dir, rank, "pack bucket");
            assert!(
                buckets > steps.len(),
                "{what}, rank {rank}: several buckets"
            );
            let gathered = if sharded { buckets } else { 0 };
            assert_eq!(
                spans(&dir, rank, "all-gather bucket"),
                gathered,
                "{what}, rank {rank}: a span per bucket gathered"
            );
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}

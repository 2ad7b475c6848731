//! The sharded optimizer (ZeRO-1 and ZeRO-2) against plain DdpLearner and against one process
//! with the global batch: SGD with momentum, Adam and AdamW (weight decay on), a learning-rate
//! schedule and gradient clipping, worlds 2 and 3, several epochs; with gradient accumulation;
//! with a parameter some steps leave without gradient.

use std::sync::{Arc, Mutex};

use burn::data::dataloader::DataLoaderBuilder;
use burn::optim::grad_clipping::GradientClippingConfig;
use burn::optim::lr_scheduler::linear::LinearLrSchedulerConfig;
use burn::optim::momentum::MomentumConfig;
use burn::optim::{AdamConfig, AdamWConfig, ModuleOptimizer, SgdConfig};
use burn::train::SupervisedTraining;
use burn_ddp::ProcessGroup;
use burn_ddp::train::{
    DdpLearner, DdpTraining, DistributedSampler, ProgressOutput, QuietRenderer, Sharding,
    flat_parameters,
};

use super::model::{DATA, Points, ToBatch, flex, new_net};
use super::{assert_identical, relative_error, small_buckets};
use crate::common::{options, run_world};

#[derive(Debug, Clone, Copy)]
enum Optim {
    SgdMomentum,
    Adam,
    AdamW,
}

fn optimizer(optim: Optim) -> ModuleOptimizer {
    let clip = Some(GradientClippingConfig::Norm(0.5));
    match optim {
        Optim::SgdMomentum => SgdConfig::new()
            .with_momentum(Some(MomentumConfig::new().with_momentum(0.9)))
            .with_gradient_clipping(clip)
            .init(),
        Optim::Adam => AdamConfig::new().with_grad_clipping(clip).init(),
        Optim::AdamW => AdamWConfig::new()
            .with_weight_decay(0.05)
            .with_grad_clipping(clip)
            .init(),
    }
}

/// One run: `world` ranks of per-rank batch `batch`.
#[derive(Debug, Clone, Copy)]
struct Run {
    optim: Optim,
    world: usize,
    batch: usize,
    sharding: Sharding,
    accumulation: Option<usize>,
    extra: bool,
}

/// Every rank's final parameters after 3 epochs. Ranks start from different weights, which
/// the start-up broadcast replaces with rank 0's (seed 7).
fn train(run: Run) -> Vec<Vec<f32>> {
    let device = flex();
    let models: Vec<_> = (0..run.world)
        .map(|r| {
            Some(new_net(
                &device,
                Some(if r == 0 { 7 } else { 100 + r as u64 }),
                run.extra,
            ))
        })
        .collect();
    let models = Mutex::new(models);
    run_world(run.world, options(60), |group: ProcessGroup| {
        let rank = group.rank();
        let model = models.lock().unwrap()[rank].take().unwrap();
        let group = Arc::new(group);
        let sampler = DistributedSampler::for_group(&group).seed(5);
        let valid_sampler = DistributedSampler::for_group(&group).shuffle(false);
        let loader = |data: Points, s: &DistributedSampler| {
            DataLoaderBuilder::new(ToBatch)
                .batch_size(run.batch)
                .build(s.dataset(data))
        };
        let dir = super::thread_dir("zero");
        let mut training = SupervisedTraining::new(
            &dir,
            loader(Points(DATA), &sampler),
            loader(Points(DATA / 2), &valid_sampler),
        )
        .renderer(Box::new(QuietRenderer))
        .with_application_logger(None)
        .num_epochs(3);
        if let Some(k) = run.accumulation {
            training = training.grads_accumulation(k);
        }
        let lr = LinearLrSchedulerConfig::new(0.05, 0.005, 12)
            .init()
            .expect("schedule");
        let learner = DdpLearner::with_group(group.clone(), model, optimizer(run.optim), lr)
            .sampler(&sampler)
            .valid_sampler(&valid_sampler)
            .buckets(small_buckets())
            .shard_optimizer(run.sharding)
            .progress(ProgressOutput::Keep);
        let result = training.launch_ddp(learner).expect("training");
        assert!(result.error.is_none(), "{:?}", result.error);
        let _ = std::fs::remove_dir_all(&dir);
        flat_parameters(&result.model)
    })
}

/// Sharded runs of `base` (both stages) against the same run unsharded and against one process
/// with the global batch: every rank identical, within `1e-6` relative of both. (With the
/// `extra` layer, which a batch uses depending on its first sample, one process with the
/// global batch trains another model: then plain DDP alone is the reference.)
fn check(base: Run) {
    let global = Run {
        world: 1,
        batch: base.batch * base.world,
        sharding: Sharding::None,
        ..base
    };
    let reference = train(global);
    let plain = train(Run {
        sharding: Sharding::None,
        ..base
    });
    let start = flat_parameters(&new_net(&flex(), Some(7), base.extra));
    assert!(
        relative_error(&plain[0], &start) > 1e-3,
        "training changed nothing"
    );
    for sharding in [Sharding::Optimizer, Sharding::OptimizerAndGradients] {
        let sharded = train(Run { sharding, ..base });
        let all: Vec<&[f32]> = sharded.iter().map(Vec::as_slice).collect();
        assert_identical(&all);
        let to_plain = relative_error(&sharded[0], &plain[0]);
        let to_one = relative_error(&sharded[0], &reference[0]);
        eprintln!("{base:?} {sharding}: {to_plain:e} from plain DDP, {to_one:e} from one process");
        assert!(
            to_plain <= 1e-6,
            "{base:?} {sharding}: {to_plain:e} from plain DDP"
        );
        assert!(
            base.extra || to_one <= 1e-6,
            "{base:?} {sharding}: {to_one:e} from one process"
        );
    }
}

fn base(optim: Optim, world: usize) -> Run {
    Run {
        optim,
        world,
        batch: 4,
        sharding: Sharding::None,
        accumulation: None,
        extra: false,
    }
}

#[test]
fn sharded_sgd_with_momentum_equals_plain_ddp_and_one_process() {
    check(base(Optim::SgdMomentum, 2));
    check(base(Optim::SgdMomentum, 3));
}

#[test]
fn sharded_adam_equals_plain_ddp_and_one_process() {
    check(base(Optim::Adam, 2));
    check(base(Optim::Adam, 3));
}

#[test]
fn sharded_adamw_equals_plain_ddp_and_one_process() {
    check(base(Optim::AdamW, 2));
    check(base(Optim::AdamW, 3));
}

#[test]
fn sharded_training_with_accumulation_and_a_parameter_without_gradient() {
    check(Run {
        accumulation: Some(2),
        ..base(Optim::AdamW, 2)
    });
    check(Run {
        extra: true,
        ..base(Optim::Adam, 3)
    });
}

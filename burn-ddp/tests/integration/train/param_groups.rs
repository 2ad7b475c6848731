//! Optimizer and learning-rate groups a user builds by `ParamId` on each rank, before handing
//! the model to `DdpLearner` (burn's `ModuleOptimizer::with_group` and
//! `ModuleLrScheduler::with_group` with `ParamGroup::from_ids`): every rank's groups keep
//! matching its own parameters, plain and sharded, so the replicas stay identical and train as
//! one process with the same groups does.

use std::sync::{Arc, Mutex};

use burn::data::dataloader::DataLoaderBuilder;
use burn::module::{Module, ModuleVisitor, Param, ParamGroup, ParamId};
use burn::optim::lr_scheduler::module_lr_scheduler::ModuleLrScheduler;
use burn::optim::{AdamConfig, ModuleOptimizer, SgdConfig};
use burn::tensor::Tensor;
use burn::train::SupervisedTraining;
use burn_ddp::ProcessGroup;
use burn_ddp::train::{
    DdpLearner, DdpTraining, DistributedSampler, ProgressOutput, QuietRenderer, Sharding,
    parameters_to_vector,
};

use super::model::{DATA, Net, Points, ToBatch, flex, new_net};
use super::{assert_identical, relative_error, small_buckets};
use crate::common::{options, run_world};

/// The `ParamId`s of the trainable parameters whose module path starts with `prefix`.
struct IdsUnder {
    prefix: &'static str,
    path: Vec<String>,
    ids: Vec<ParamId>,
}

impl ModuleVisitor for IdsUnder {
    fn enter_module(&mut self, name: &str, _container: &str) {
        self.path.push(name.to_string());
    }
    fn exit_module(&mut self, _name: &str, _container: &str) {
        self.path.pop();
    }
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if self.path.first().is_some_and(|p| p == self.prefix) {
            self.ids.push(param.id);
        }
    }
}

fn ids_under(model: &Net, prefix: &'static str) -> Vec<ParamId> {
    let mut v = IdsUnder {
        prefix,
        path: Vec::new(),
        ids: Vec::new(),
    };
    model.visit(&mut v);
    assert_eq!(v.ids.len(), 2, "`{prefix}` has a weight and a bias");
    v.ids
}

/// The groups, built from this rank's own `ParamId`s: the hidden layer learns at 0.2, the rest
/// at 0.02; the output layer is stepped by Adam, the rest by SGD.
fn groups(model: &Net) -> (ModuleOptimizer, ModuleLrScheduler) {
    let hidden = ParamGroup::from_ids(ids_under(model, "hidden"));
    let out = ParamGroup::from_ids(ids_under(model, "out"));
    let optim = SgdConfig::new()
        .init()
        .with_group(out, AdamConfig::new().build(), None);
    let lr = ModuleLrScheduler::new(0.02).with_group(hidden, 0.2);
    (optim, lr)
}

/// Every rank's final parameters after 2 epochs of `world` ranks of per-rank batch `batch`.
/// Ranks start from different weights, and each has its own `ParamId`s.
fn train(world: usize, batch: usize, sharding: Sharding) -> Vec<Vec<f32>> {
    let device = flex();
    let models: Vec<_> = (0..world)
        .map(|r| {
            Some(new_net(
                &device,
                Some(if r == 0 { 7 } else { 300 + r as u64 }),
                false,
            ))
        })
        .collect();
    let models = Mutex::new(models);
    run_world(world, options(60), |group: ProcessGroup| {
        let rank = group.rank();
        let model = models.lock().unwrap()[rank].take().unwrap();
        let (optim, lr) = groups(&model);
        let group = Arc::new(group);
        let sampler = DistributedSampler::for_group(&group).seed(5);
        let valid_sampler = DistributedSampler::for_group(&group).shuffle(false);
        let loader = |data: Points, s: &DistributedSampler| {
            DataLoaderBuilder::new(ToBatch)
                .batch_size(batch)
                .build(s.dataset(data))
        };
        let dir = super::thread_dir("groups");
        let training = SupervisedTraining::new(
            &dir,
            loader(Points(DATA), &sampler),
            loader(Points(DATA / 2), &valid_sampler),
        )
        .renderer(Box::new(QuietRenderer))
        .with_application_logger(None)
        .num_epochs(2);
        let learner = DdpLearner::with_group(group.clone(), model, optim, lr)
            .sampler(&sampler)
            .valid_sampler(&valid_sampler)
            .buckets(small_buckets())
            .shard_optimizer(sharding)
            .progress(ProgressOutput::Keep);
        let result = training.launch_ddp(learner);
        let _ = std::fs::remove_dir_all(&dir);
        let result = result.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        assert!(result.error.is_none(), "rank {rank}: {:?}", result.error);
        parameters_to_vector(&result.model)
    })
}

/// At worlds 2 and 3, plain and sharded (both stages): replicas identical and within 1e-6 of
/// one process with the global batch and the same groups.
#[test]
fn groups_built_by_param_id_on_each_rank_train_as_one_process() {
    let start = parameters_to_vector(&new_net(&flex(), Some(7), false));
    for world in [2, 3] {
        let reference = train(1, 4 * world, Sharding::None);
        assert!(
            relative_error(&reference[0], &start) > 1e-3,
            "training changed nothing"
        );
        for sharding in [
            Sharding::None,
            Sharding::Optimizer,
            Sharding::OptimizerAndGradients,
        ] {
            let got = train(world, 4, sharding);
            let all: Vec<&[f32]> = got.iter().map(Vec::as_slice).collect();
            assert_identical(&all);
            let err = relative_error(&got[0], &reference[0]);
            eprintln!("world {world}, sharding {sharding}: {err:e} from one process");
            assert!(err <= 1e-6, "world {world}, sharding {sharding}: {err:e}");
        }
    }
}

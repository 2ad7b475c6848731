//! A hand-written training loop around [`GradientReducer`]: the ranks' parameters stay bit
//! identical after every optimizer step.

use std::sync::{Arc, Mutex};

use burn::data::dataloader::{DataLoader, DataLoaderBuilder};
use burn::optim::SgdConfig;
use burn::tensor::Device;
use burn::train::TrainStep;
use burn_ddp::ProcessGroup;
use burn_ddp::train::{
    DistributedSampler, GradientReducer, broadcast_module, parameters_to_vector,
};

use super::model::{Batch, DATA, Net, Points, ToBatch, flex, new_net};
use super::small_buckets;
use crate::common::{digest, options, run_world};

/// A rank of a hand-written training loop: rank 0's model, small buckets, its shard of the data
/// in batches of 4 on `device`.
pub(super) struct ManualRank {
    pub group: Arc<ProcessGroup>,
    pub model: Net,
    pub reducer: GradientReducer,
    pub sampler: DistributedSampler,
    pub loader: Arc<dyn DataLoader<Batch>>,
}

impl ManualRank {
    pub fn new(group: ProcessGroup, model: Net, device: &Device) -> Self {
        let group = Arc::new(group);
        let model = broadcast_module(model, &group).unwrap();
        let reducer = GradientReducer::new(&model, group.clone(), small_buckets()).unwrap();
        let sampler = DistributedSampler::for_group(&group).seed(11);
        let loader = DataLoaderBuilder::new(ToBatch)
            .batch_size(4)
            .build(sampler.dataset(Points(DATA)))
            .to_device(device);
        ManualRank {
            group,
            model,
            reducer,
            sampler,
            loader,
        }
    }
}

/// Three ranks, each starting from other weights and a model with a layer only some batches
/// use, train two epochs; after every step all ranks hold the same parameter bytes.
pub(crate) fn identical_after_every_step(device: &Device) {
    let world = 3;
    let models: Vec<Option<Net>> = (0..world)
        .map(|r| Some(new_net(device, Some(50 + r as u64), true)))
        .collect();
    let models = Mutex::new(models);
    let steps = run_world(world, options(60), |group| {
        let model = models.lock().unwrap()[group.rank()].take().unwrap();
        let ManualRank {
            group,
            mut model,
            reducer,
            sampler,
            loader,
        } = ManualRank::new(group, model, device);
        let mut optim = SgdConfig::new().init();
        let mut steps = 0;
        for epoch in 0..2 {
            sampler.set_epoch(epoch);
            for batch in loader.iter() {
                let out = TrainStep::step(&model, batch.unwrap());
                let grads = reducer.reduce(&model, out.grads).unwrap();
                model = optim.step(0.5, model, grads);
                let params = parameters_to_vector(&model);
                let all = group
                    .all_gather(digest(bytemuck::cast_slice(&params)).to_le_bytes().to_vec())
                    .wait()
                    .unwrap();
                assert!(
                    all.iter().all(|d| *d == all[0]),
                    "step {steps}: ranks differ"
                );
                steps += 1;
            }
        }
        steps
    });
    assert_eq!(steps, vec![8; world]);
}

#[test]
fn ranks_hold_identical_parameters_after_every_step() {
    identical_after_every_step(&flex());
}

/// A module of f64 parameters.
#[derive(burn::module::Module, Debug)]
struct F64Params {
    w: burn::module::Param<burn::tensor::Tensor<1>>,
}

/// `broadcast_module` gives every rank rank 0's f64 parameters exactly (they travel as f64: as
/// f32, 1 + 1e-12 would arrive as 1).
#[test]
fn broadcast_keeps_f64_parameters_exact() {
    use burn::tensor::{DType, Tensor, TensorData};
    let values = |rank: usize| vec![1.0 + 1e-12 * (rank + 1) as f64, 1.0 / 3.0, -2.5e-300];
    let got = run_world(3, options(30), |group| {
        let rank = group.rank();
        let w = Tensor::<1>::from_data(TensorData::new(values(rank), [3]), (&flex(), DType::F64));
        assert_eq!(w.dtype(), DType::F64);
        let module = F64Params {
            w: burn::module::Param::from_tensor(w),
        };
        let module = broadcast_module(module, &group).unwrap();
        let w = module.w.val();
        (w.dtype(), w.into_data().try_to_vec::<f64>().unwrap())
    });
    for (rank, (dtype, w)) in got.into_iter().enumerate() {
        assert_eq!(dtype, DType::F64, "rank {rank}");
        assert_eq!(w, values(0), "rank {rank}");
    }
}

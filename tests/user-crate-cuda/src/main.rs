//! One rank of a data-parallel job on CUDA, as a user with burn's default features writes it
//! (kernel fusion on): start it with `burn-ddp-run --nproc <GPUs> user-crate-cuda`, or under
//! torchrun, srun or mpirun. Each rank all-reduces a tensor on its GPU through NCCL and trains
//! a linear layer one step with `DdpLearner`'s gradient reducer; every rank prints the same sums.

use std::sync::Arc;

use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::tensor::{Device, Tensor};
use burn_ddp::train::{BucketConfig, GradientReducer};
use burn_ddp::{ProcessGroup, ReduceOp};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let group = Arc::new(ProcessGroup::from_env()?);
    // One GPU per rank: the local rank's, or GPU 0 where each rank sees only its own.
    let device = Device::cuda(group.local_rank());

    let ones = Tensor::<1>::ones([1024], &device);
    let summed = group.all_reduce(ones, ReduceOp::Sum).wait()?;
    println!(
        "rank {}: all-reduced sum {}",
        group.rank(),
        summed.sum().into_scalar::<f32>()
    );

    let autodiff = device.clone().autodiff();
    let layer: Linear = LinearConfig::new(16, 4).init(&autodiff);
    let layer = burn_ddp::train::broadcast_module(layer, &group)?;
    let input = Tensor::<2>::ones([8, 16], &autodiff);
    let loss = layer.forward(input).sum();
    let grads = burn::optim::GradientsParams::from_grads(loss.backward(), &layer);
    let reducer = GradientReducer::new(&layer, group.clone(), BucketConfig::default())?;
    let grads = reducer.reduce(&layer, grads)?;
    println!(
        "rank {}: {} parameters, {} gradients reduced",
        group.rank(),
        layer.num_params(),
        grads.len()
    );
    Ok(())
}

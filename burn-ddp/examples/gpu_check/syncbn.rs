//! `gpu_check syncbn`: `SyncBatchNorm` forward and backward on each rank's rows of a batch
//! against burn's `BatchNorm` on the whole batch, on one process (relative error at most 1e-5).

use std::sync::Arc;

use anyhow::Result;
use burn::module::Param;
use burn::nn::{BatchNorm, BatchNormConfig};
use burn::tensor::{Device, Tensor, TensorData};
use burn_ddp::ProcessGroup;
use burn_ddp::nn::{BatchNormSyncExt, SyncBatchNorm};

use crate::verdict::relative_error;
use crate::{host, report};

const BATCH: usize = 8;
const CHANNELS: usize = 4;
const LENGTH: usize = 5;

/// Forward and backward of a batch norm on `x` (rows `rows` of the whole batch); returns the
/// output, d(loss)/d(input), d/d(gamma), d/d(beta).
fn run_norm(
    forward: impl Fn(Tensor<3>) -> Tensor<3>,
    gamma: &Param<Tensor<1>>,
    beta: &Param<Tensor<1>>,
    rows: std::ops::Range<usize>,
    device: &Device,
) -> [Vec<f64>; 4] {
    let data =
        |seed: usize| {
            let values: Vec<f32> = (0..BATCH * CHANNELS * LENGTH)
                .map(|i| ((i * 31 + seed * 17) % 23) as f32 / 7.0 - 1.5)
                .collect();
            Tensor::<3>::from_data(TensorData::new(values, [BATCH, CHANNELS, LENGTH]), device)
                .narrow(0, rows.start, rows.len())
        };
    let x = data(1).require_grad();
    let weight = data(2);
    let y = forward(x.clone());
    let grads = (y.clone() * weight).sum().backward();
    let grad = |t: &Tensor<1>| t.grad(&grads).map(host).unwrap_or_default();
    [
        host(y),
        x.grad(&grads).map(host).unwrap_or_default(),
        grad(&gamma.val()),
        grad(&beta.val()),
    ]
}

pub(crate) fn syncbn(group: &Arc<ProcessGroup>, device: &Device) -> Result<usize> {
    let (rank, world) = (group.rank(), group.world_size());
    let device = device.clone().autodiff();
    let config = BatchNormConfig::new(CHANNELS);
    let rows = rank * BATCH / world..(rank + 1) * BATCH / world;
    let sync: SyncBatchNorm = config.init_sync(&device);
    let mine = {
        let _scope = burn_ddp::nn::scope(group.clone());
        run_norm(|x| sync.forward(x), &sync.gamma, &sync.beta, rows, &device)
    };
    // Every rank's parts on every rank (through the host), then the reference on the whole batch.
    let mut parts = Vec::new();
    for part in &mine {
        let bytes: Vec<u8> = part.iter().flat_map(|v| v.to_le_bytes()).collect();
        let all = group.all_gather(bytes).wait()?;
        parts.push(
            all.into_iter()
                .map(|b| {
                    b.chunks_exact(8)
                        .map(|c| f64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
                        .collect::<Vec<f64>>()
                })
                .collect::<Vec<_>>(),
        );
    }
    let plain: BatchNorm = config.init(&device);
    let want = run_norm(
        |x| plain.forward(x),
        &plain.gamma,
        &plain.beta,
        0..BATCH,
        &device,
    );
    let concat = |p: &[Vec<f64>]| p.concat();
    let sum = |p: &[Vec<f64>]| {
        (0..p[0].len())
            .map(|i| p.iter().map(|v| v[i]).sum())
            .collect::<Vec<f64>>()
    };
    let got = [
        concat(&parts[0]),
        concat(&parts[1]),
        sum(&parts[2]),
        sum(&parts[3]),
    ];
    let mut failed = 0;
    for (name, (got, want)) in [
        "output",
        "input gradient",
        "gamma gradient",
        "beta gradient",
    ]
    .iter()
    .zip(got.iter().zip(&want))
    {
        let err = relative_error(got, want);
        let outcome = if got.len() == want.len() && err <= 1e-5 {
            Ok(format!("relative error {err:.2e}"))
        } else {
            Err(format!(
                "relative error {err:.2e} ({} vs {} values)",
                got.len(),
                want.len()
            ))
        };
        failed += report(&format!("SyncBatchNorm world {world} {name}"), outcome);
    }
    Ok(failed)
}

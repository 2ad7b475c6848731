//! `gpu_check fsdp`: three linear layers wrapped in `Fsdp` (each strategy; `full` on a device
//! with gradient checkpointing, so its backward gathers again, the middle layer's gather started
//! ahead while the last layer's backward runs) take one SGD step on each rank's
//! rows of a batch; the layers gathered back must have moved as the unwrapped layers stepped on
//! the whole batch in this process move (relative error of the update at most 2e-2: the two
//! multiply different numbers of rows, so burn's TF32 matmul rounds them differently; a sum
//! instead of a mean, or a piece in the wrong place, is off by 50 % or more).

use std::sync::Arc;

use anyhow::Result;
use burn::module::{Module, Param};
use burn::nn::{Linear, LinearConfig};
use burn::optim::{GradientsParams, SgdConfig};
use burn::tensor::{Device, Tensor, TensorData};
use burn_ddp::ProcessGroup;
use burn_ddp::fsdp::{self, Fsdp, FsdpConfig, ShardingStrategy};
use burn_ddp::train::parameters_to_vector;

use crate::report;
use crate::verdict::relative_error;

const BATCH: usize = 8;
/// Odd widths, so that a block's elements do not divide evenly among the ranks (padding).
const WIDTHS: [usize; 4] = [13, 11, 9, 7];

/// The unwrapped network.
#[derive(Module, Debug)]
struct Plain {
    layers: Vec<Linear>,
}

/// The network with every layer wrapped.
#[derive(Module, Debug)]
struct Wrapped {
    layers: Vec<Fsdp<Linear>>,
}

/// Deterministic values, the same on every rank.
fn values(n: usize, seed: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((i * 37 + seed * 11) % 29) as f32 / 29.0 - 0.5)
        .collect()
}

fn layers(device: &Device) -> Vec<Linear> {
    (0..WIDTHS.len() - 1)
        .map(|i| {
            let (inp, out) = (WIDTHS[i], WIDTHS[i + 1]);
            let mut l = LinearConfig::new(inp, out).init(device);
            let w = TensorData::new(values(inp * out, i), [inp, out]);
            l.weight = Param::from_tensor(Tensor::from_data(w, device));
            let b = TensorData::new(values(out, 10 + i), [out]);
            l.bias = Some(Param::from_tensor(Tensor::from_data(b, device)));
            l
        })
        .collect()
}

/// Rows `rows` of the batch.
fn batch(rows: std::ops::Range<usize>, device: &Device) -> Tensor<2> {
    let data = TensorData::new(values(BATCH * WIDTHS[0], 20), [BATCH, WIDTHS[0]]);
    Tensor::from_data(data, device).narrow(0, rows.start, rows.len())
}

/// The loss of outputs `y`: the mean over rows, so the ranks' mean is the whole batch's.
fn loss(y: Tensor<2>) -> Tensor<1> {
    y.square().mean()
}

/// One SGD step (learning rate 1) of the unwrapped layers on the whole batch: the update.
fn reference(device: &Device) -> Vec<f64> {
    let plain = Plain {
        layers: layers(device),
    };
    let before = parameters_to_vector(&plain);
    let y = plain
        .layers
        .iter()
        .fold(batch(0..BATCH, device), |x, l| l.forward(x).tanh());
    let grads = GradientsParams::from_grads(loss(y).backward(), &plain);
    let after = parameters_to_vector(&SgdConfig::new().init().step(1.0, plain, grads));
    after
        .iter()
        .zip(&before)
        .map(|(a, b)| f64::from(a - b))
        .collect()
}

/// One SGD step of the wrapped layers on this rank's rows, gathered back: the update.
fn wrapped(
    group: &Arc<ProcessGroup>,
    strategy: ShardingStrategy,
    device: &Device,
) -> Result<Vec<f64>> {
    let (rank, world) = (group.rank(), group.world_size());
    let config = FsdpConfig::new().with_strategy(strategy);
    let wrap = |l| config.clone().init(l, group);
    let net = Wrapped {
        layers: layers(device)
            .into_iter()
            .map(wrap)
            .collect::<burn_ddp::Result<_>>()?,
    };
    let whole = |net: &Wrapped| -> Result<Vec<f32>> {
        let layers = net.layers.iter().map(Fsdp::gathered);
        let layers = layers.collect::<burn_ddp::Result<Vec<_>>>()?;
        Ok(parameters_to_vector(&Plain { layers }))
    };
    let before = whole(&net)?;
    let rows = rank * BATCH / world..(rank + 1) * BATCH / world;
    let counted = fsdp::stats();
    let y = fsdp::forward_chain(&net.layers, batch(rows, device), |l, x| l.forward(x).tanh());
    let grads = GradientsParams::from_grads(loss(y).backward(), &net);
    let ahead = (fsdp::stats() - counted).backward_prefetches;
    // `full` runs under checkpointing: the middle layer (its input has a gradient) is gathered
    // ahead while the last layer's backward runs.
    let want_ahead = u64::from(strategy == ShardingStrategy::FullShard);
    if ahead != want_ahead {
        anyhow::bail!("{ahead} gather(s) started ahead in backward, expected {want_ahead}");
    }
    let net = SgdConfig::new().init().step(1.0, net, grads);
    let after = whole(&net)?;
    Ok(after
        .iter()
        .zip(&before)
        .map(|(a, b)| f64::from(a - b))
        .collect())
}

pub(crate) fn fsdp(group: &Arc<ProcessGroup>, device: &Device) -> Result<usize> {
    let world = group.world_size();
    let plain = device.clone().autodiff();
    let want = reference(&plain);
    let mut failed = 0;
    for strategy in [
        ShardingStrategy::FullShard,
        ShardingStrategy::ShardGradOp,
        ShardingStrategy::NoShard,
    ] {
        let device = match strategy {
            ShardingStrategy::FullShard => plain.clone().gradient_checkpointing(),
            _ => plain.clone(),
        };
        let outcome = match wrapped(group, strategy, &device) {
            Ok(got) => {
                let err = relative_error(&got, &want);
                if got.len() == want.len() && err <= 2e-2 {
                    Ok(format!("update's relative error {err:.2e}"))
                } else {
                    Err(format!(
                        "update's relative error {err:.2e} ({} vs {} values)",
                        got.len(),
                        want.len()
                    ))
                }
            }
            Err(e) => Err(format!("{e:#}")),
        };
        let row = format!("fsdp {} world {world}, one SGD step", strategy.name());
        failed += report(&row, outcome);
    }
    Ok(failed)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The check itself, on the CPU at world 1 (what CI can run): every strategy passes.
    #[test]
    fn every_strategy_passes_at_world_1_on_the_cpu() {
        let group = Arc::new(burn_ddp::init_process_group().expect("a world of one"));
        assert_eq!(fsdp(&group, &Device::flex()).expect("the check ran"), 0);
    }

    /// And at world 2, ranks as threads over loopback (each evaluates half of the batch).
    #[test]
    fn every_strategy_passes_at_world_2_on_the_cpu() {
        let server = burn_ddp::store::StoreServer::bind("127.0.0.1:0").expect("a store");
        let port = server.local_addr().port();
        let failed: Vec<usize> = std::thread::scope(|s| {
            let ranks: Vec<_> = (0..2)
                .map(|rank| {
                    s.spawn(move || {
                        let group = ProcessGroup::builder(rank, 2)
                            .master_addr("127.0.0.1")
                            .master_port(port)
                            .host_store(false)
                            .timeout(std::time::Duration::from_secs(30))
                            .build()
                            .expect("the group");
                        fsdp(&Arc::new(group), &Device::flex()).expect("the check ran")
                    })
                })
                .collect();
            ranks
                .into_iter()
                .map(|r| r.join().expect("a rank"))
                .collect()
        });
        assert_eq!(failed, [0, 0]);
    }
}

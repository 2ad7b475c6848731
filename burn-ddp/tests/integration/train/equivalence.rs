//! DdpLearner against single-process training: same data, seed and SGD; world sizes 2 and 3
//! with per-rank batch b against one process with batch world * b; gradient accumulation; a
//! parameter some steps leave without gradient. The bodies take the device the ranks train on,
//! so that every backend runs the same checks (`flex` here, `wgpu` in `crate::wgpu`).

use burn::optim::SgdConfig;
use burn::tensor::Device;
use burn_ddp::train::{BucketConfig, Compression, DdpLearner, parameters_to_vector};

use super::model::{DATA, Net, ToBatch, flex, new_net};
use super::threads::{Threads, train_on_threads};
use super::{assert_identical, relative_error, small_buckets};

/// What one rank ends with.
struct Outcome {
    params: Vec<f32>,
    all_reduces: u64,
}

struct Run<'a> {
    device: &'a Device,
    world: usize,
    batch: usize,
    epochs: usize,
    accumulation: Option<usize>,
    extra: bool,
    buckets: BucketConfig,
    compression: Compression,
}

/// Trains on `world` thread ranks. Rank 0 starts from the seed-7 model; other ranks from
/// different weights, which the start-up broadcast must replace.
fn train(run: &Run) -> Vec<Outcome> {
    let models: Vec<Net> = (0..run.world)
        .map(|r| {
            let seed = if r == 0 { 7 } else { 1000 + r as u64 };
            new_net(run.device, Some(seed), run.extra)
        })
        .collect();
    let threads = Threads {
        world: run.world,
        batch: run.batch,
        epochs: run.epochs,
        seed: 5,
        accumulation: run.accumulation,
        loss_metric: true,
        scratch: "test",
        batcher: ToBatch,
    };
    train_on_threads(&threads, models, |group, model| {
        let learner = DdpLearner::with_group(group.clone(), model, SgdConfig::new().init(), 0.5)
            .buckets(run.buckets)
            .compression(run.compression)
            .setting("batch", run.batch);
        let group = group.clone();
        let read = move |model: Net| Outcome {
            params: parameters_to_vector(&model),
            all_reduces: group.all_reduce_count(),
        };
        (learner, read)
    })
}

fn params(outcomes: &[Outcome]) -> Vec<&[f32]> {
    outcomes.iter().map(|o| o.params.as_slice()).collect()
}

/// World `world` with per-rank batch 4 ends within relative error 1e-5 of one process with
/// batch `world * 4`, every rank bit-identical, and far from where it started.
pub(crate) fn equivalence(device: &Device, world: usize, accumulation: Option<usize>) {
    let b = 4;
    let run = |world, batch| Run {
        device,
        world,
        batch,
        epochs: 2,
        accumulation,
        extra: false,
        buckets: small_buckets(),
        compression: Compression::None,
    };
    let reference = train(&run(1, world * b));
    let ddp = train(&run(world, b));
    assert_identical(&params(&ddp));
    let err = relative_error(&ddp[0].params, &reference[0].params);
    eprintln!("world {world}, accumulation {accumulation:?}: relative error {err:e}");
    assert!(err <= 1e-5, "world {world}: relative error {err:e}");
    let start = parameters_to_vector(&new_net(device, Some(7), false));
    assert!(
        relative_error(&ddp[0].params, &start) > 1e-3,
        "training changed nothing"
    );
}

/// With accumulation over 2 micro-steps, training still matches one process, and the buckets
/// are all-reduced once per optimizer step, not once per micro-step.
pub(crate) fn accumulation(device: &Device) {
    equivalence(device, 2, Some(2));
    let (world, batch, epochs) = (2, 4, 2);
    let steps_per_epoch = (DATA / world).div_ceil(batch) as u64;
    let runs = |accumulation| Run {
        device,
        world,
        batch,
        epochs,
        accumulation,
        extra: false,
        buckets: small_buckets(),
        compression: Compression::None,
    };
    let plain = train(&runs(None));
    let accumulated = train(&runs(Some(2)));
    // Besides the buckets, the ranks vote on stopping (a 2-value all-reduce) after every 4th
    // optimizer step, after every 4th validation step and at each epoch's end. (The ranks hold
    // as many validation items, so validation needs no per-step join.)
    let valid_steps = (DATA / 2 / world).div_ceil(batch) as u64;
    let votes = |optimizer_steps: u64| epochs as u64 * (optimizer_steps / 4 + valid_steps / 4 + 1);
    let buckets =
        (plain[0].all_reduces - votes(steps_per_epoch)) / (epochs as u64 * steps_per_epoch);
    assert!(buckets > 1, "the small caps should give several buckets");
    assert_eq!(
        plain[0].all_reduces,
        epochs as u64 * steps_per_epoch * buckets + votes(steps_per_epoch)
    );
    let optimizer_steps = steps_per_epoch.div_ceil(2);
    assert_eq!(
        accumulated[0].all_reduces,
        epochs as u64 * optimizer_steps * buckets + votes(optimizer_steps),
        "with accumulation over 2, one reduction per 2 micro-steps"
    );
}

/// A layer only some batches use (so on some ranks, in some steps, its parameters get no
/// gradient): training neither hangs nor lets the ranks drift apart.
pub(crate) fn unused_parameter(device: &Device) {
    let outcomes = train(&Run {
        device,
        world: 3,
        batch: 4,
        epochs: 2,
        accumulation: None,
        extra: true,
        buckets: small_buckets(),
        compression: Compression::None,
    });
    assert_identical(&params(&outcomes));
    assert!(outcomes[0].params.iter().all(|x| x.is_finite()));
    let start = parameters_to_vector(&new_net(device, Some(7), true));
    assert!(
        relative_error(&outcomes[0].params, &start) > 1e-3,
        "training changed nothing"
    );
}

#[test]
fn world_2_matches_one_process_with_the_global_batch() {
    equivalence(&flex(), 2, None);
}

#[test]
fn world_3_matches_one_process_with_the_global_batch() {
    equivalence(&flex(), 3, None);
}

#[test]
fn accumulation_reduces_once_per_optimizer_step() {
    accumulation(&flex());
}

#[test]
fn a_parameter_without_gradient_in_some_steps_neither_hangs_nor_diverges() {
    unused_parameter(&flex());
}

/// World 2 (batch 4 per rank) with gradients reduced in `compression`, against one process with
/// batch 8: the relative error of the final parameters (every rank bit-identical, and trained).
pub(crate) fn compressed(device: &Device, compression: Compression) -> f64 {
    let run = |world, batch, compression| Run {
        device,
        world,
        batch,
        epochs: 2,
        accumulation: None,
        extra: false,
        buckets: small_buckets(),
        compression,
    };
    let reference = train(&run(1, 8, Compression::None));
    let ddp = train(&run(2, 4, compression));
    assert_identical(&params(&ddp));
    let start = parameters_to_vector(&new_net(device, Some(7), false));
    assert!(
        relative_error(&ddp[0].params, &start) > 1e-3,
        "training changed nothing"
    );
    relative_error(&ddp[0].params, &reference[0].params)
}

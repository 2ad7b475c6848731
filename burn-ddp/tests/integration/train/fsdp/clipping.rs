//! `DdpLearner::clip_grad_norm` with wrapped blocks: the norm is the whole model's, so the
//! wrapped network trains as the unwrapped one with the same limit, for every strategy and
//! under ZeRO-2, and the limit changes the training.

use super::*;

/// Every rank's whole network after 3 epochs at world 2 with SGD with momentum, the gradients
/// clipped at `clip`, the hidden layers wrapped as `wrap` says (unwrapped when `None`).
fn run(clip: Option<f32>, wrap: Option<(ShardingStrategy, Sharding)>) -> Vec<Vec<f32>> {
    let device = flex();
    // No limit: one that never binds.
    let max = clip.unwrap_or(f32::MAX);
    let results = match wrap {
        None => train_ranks(
            (2, 3, (DATA, DATA / 2)),
            |group| {
                let model = PlainNet::new(group.rank(), 1, &device);
                let optim = optimizer(Optim::SgdMomentum);
                DdpLearner::with_group(group.clone(), model, optim, LR).clip_grad_norm(max)
            },
            |_, model: PlainNet| parameters_to_vector(&model),
        ),
        Some((strategy, zero)) => train_ranks(
            (2, 3, (DATA, DATA / 2)),
            |group| {
                let model = FsdpNet::new(group, strategy, 1, &device);
                let optim = optimizer(Optim::SgdMomentum);
                DdpLearner::with_group(group.clone(), model, optim, LR)
                    .clip_grad_norm(max)
                    .shard_optimizer(zero)
            },
            |_, model: FsdpNet| model.whole(),
        ),
    };
    (results.into_iter())
        .map(|r| r.expect("training"))
        .collect()
}

#[test]
fn clipping_by_the_global_norm_is_the_same_wrapped_or_not() {
    let max = 0.05;
    let reference = run(Some(max), None);
    let unclipped = run(None, None);
    let changed = relative_error(&reference[0], &unclipped[0]);
    assert!(
        changed > 1e-3,
        "the limit changes the training ({changed:e})"
    );
    let wraps = [
        (ShardingStrategy::FullShard, Sharding::None),
        (ShardingStrategy::ShardGradOp, Sharding::None),
        (ShardingStrategy::NoShard, Sharding::None),
        (ShardingStrategy::FullShard, Sharding::OptimizerAndGradients),
    ];
    for wrap in wraps {
        let got = run(Some(max), Some(wrap));
        close(&format!("{wrap:?}, clipped at {max}"), &got, &reference[0]);
    }
}

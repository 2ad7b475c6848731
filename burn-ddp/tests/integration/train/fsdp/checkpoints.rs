//! DdpLearner's checkpoints of a network with wrapped blocks: rank 0 writes the whole model
//! and its optimizer state as the unwrapped network's run writes them, so a run stopped at
//! world 4 resumes at world 2, wrapped or unwrapped, and an unwrapped run's checkpoint resumes
//! wrapped, each within 1e-6 of plain DdpLearner resumed the same way (an epoch at world 4,
//! two at world 2), with SGD with momentum and AdamW; at the same world size the resumed run
//! is the uninterrupted one.

use burn_ddp::train::{CHECKPOINT_FILE, CheckpointConfig, inspect_checkpoint};

use super::*;

/// A checkpoint directory of its own for `name`, empty.
fn scratch(name: &str) -> CheckpointConfig {
    let dir = std::env::temp_dir().join(format!("burn-ddp-fsdp-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    CheckpointConfig::new(dir)
}

/// A copy of `from`'s checkpoint in a directory of its own (each resumed run writes its own).
fn copy(from: &CheckpointConfig, name: &str) -> CheckpointConfig {
    let to = scratch(name);
    std::fs::create_dir_all(&to.dir).expect("scratch directory");
    std::fs::copy(from.path(), to.dir.join(CHECKPOINT_FILE)).expect("copying the checkpoint");
    to
}

/// How a run's network is laid out and trained.
#[derive(Debug, Clone, Copy)]
enum Net {
    /// Unwrapped, plain DdpLearner.
    Plain,
    /// The hidden layers wrapped with this strategy, the optimizer sharded as ZeRO says.
    Wrapped(ShardingStrategy, Sharding),
}

/// Every rank's whole network (as [`PlainNet`] lays it out) after training `net` on `world`
/// ranks to the end of epoch `epochs` with `o`, checkpointing into (and resuming from)
/// `config`.
fn run(
    world: usize,
    epochs: usize,
    o: Optim,
    net: Net,
    config: &CheckpointConfig,
) -> Vec<Vec<f32>> {
    let results = match net {
        Net::Plain => train_ranks(
            (world, epochs, (DATA, DATA / 2)),
            |group| {
                let model = PlainNet::new(group.rank(), 1, &flex());
                DdpLearner::with_group(group.clone(), model, optimizer(o), LR)
                    .checkpoints(config.clone())
            },
            |_, model: PlainNet| parameters_to_vector(&model),
        ),
        Net::Wrapped(strategy, zero) => {
            let device = match strategy {
                ShardingStrategy::FullShard => flex().gradient_checkpointing(),
                _ => flex(),
            };
            train_ranks(
                (world, epochs, (DATA, DATA / 2)),
                |group| {
                    let model = FsdpNet::new(group, strategy, 1, &device);
                    DdpLearner::with_group(group.clone(), model, optimizer(o), LR)
                        .shard_optimizer(zero)
                        .checkpoints(config.clone())
                },
                |_, model: FsdpNet| model.whole(),
            )
        }
    };
    let what = format!("world {world}, {epochs} epochs, {o:?}, {net:?}");
    (results.into_iter())
        .map(|r| r.unwrap_or_else(|e| panic!("{what}: {e}")))
        .collect()
}

#[test]
fn wrapped_checkpoints_resume_at_another_world_size_wrapped_or_not() {
    let full = Net::Wrapped(ShardingStrategy::FullShard, Sharding::None);
    for o in [Optim::AdamW, Optim::SgdMomentum] {
        // One epoch at world 4, wrapped and unwrapped, each leaving its checkpoint.
        let wrapped_4 = scratch("w4");
        let plain_4 = scratch("p4");
        let after_1 = run(4, 1, o, full, &wrapped_4);
        let plain_after_1 = run(4, 1, o, Net::Plain, &plain_4);
        close(
            &format!("{o:?}: epoch 1, wrapped against plain"),
            &after_1,
            &plain_after_1[0],
        );
        let at = inspect_checkpoint(&wrapped_4.path()).expect("the wrapped run's checkpoint");
        assert_eq!((at.epoch, at.batches, at.world_size), (2, 0, 4));

        // The reference: the unwrapped run resumed at world 2 for epochs 2 and 3.
        let config = copy(&plain_4, "p4p2");
        let reference = run(2, 3, o, Net::Plain, &config);
        let _ = std::fs::remove_dir_all(&config.dir);
        assert!(
            relative_error(&reference[0], &plain_after_1[0]) > 1e-3,
            "epochs 2 and 3 changed nothing"
        );
        let cases = [
            ("wrapped world 4 -> wrapped world 2", &wrapped_4, full),
            (
                "wrapped world 4 -> unwrapped world 2",
                &wrapped_4,
                Net::Plain,
            ),
            (
                "wrapped world 4 -> world 2 grad-op under ZeRO-2",
                &wrapped_4,
                Net::Wrapped(
                    ShardingStrategy::ShardGradOp,
                    Sharding::OptimizerAndGradients,
                ),
            ),
            ("unwrapped world 4 -> wrapped world 2", &plain_4, full),
        ];
        for (i, (what, from, net)) in cases.into_iter().enumerate() {
            let config = copy(from, &format!("case{i}"));
            let got = run(2, 3, o, net, &config);
            let _ = std::fs::remove_dir_all(&config.dir);
            close(&format!("{o:?}: {what}"), &got, &reference[0]);
        }
        let _ = std::fs::remove_dir_all(&wrapped_4.dir);
        let _ = std::fs::remove_dir_all(&plain_4.dir);
    }
}

/// At world 2, a wrapped run stopped after its first epoch and resumed ends where the
/// uninterrupted run does.
#[test]
fn a_resumed_wrapped_run_is_the_uninterrupted_one() {
    let full = Net::Wrapped(ShardingStrategy::FullShard, Sharding::None);
    let straight = scratch("straight");
    let uninterrupted = run(2, 3, Optim::AdamW, full, &straight);
    let config = scratch("stopped");
    run(2, 1, Optim::AdamW, full, &config);
    let resumed = run(2, 3, Optim::AdamW, full, &config);
    close(
        "AdamW, world 2, resumed after epoch 1",
        &resumed,
        &uninterrupted[0],
    );
    let _ = std::fs::remove_dir_all(&straight.dir);
    let _ = std::fs::remove_dir_all(&config.dir);
}

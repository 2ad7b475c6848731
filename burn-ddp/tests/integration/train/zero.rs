//! The sharded optimizer (ZeRO-1 and ZeRO-2) against plain DdpLearner and against one process
//! with the global batch: SGD with momentum, Adam and AdamW (weight decay on), a learning-rate
//! schedule and gradient clipping, worlds 2 and 3, several epochs; with gradient accumulation;
//! with a parameter some steps leave without gradient; with bf16 gradients. At world 2 both
//! stages are bit-identical to plain DDP, bf16 included. ZeRO-2 issues one
//! all-reduce per step (its buckets are reduce-scattered), ZeRO-1 as many as plain DDP. Each
//! rank keeps only its share of the optimizer state, and sharded checkpoints resume at any
//! world size, sharded or not (`zero_edges`: resumes with several buckets, a rank that owns
//! nothing, buffers and frozen parameters).

use burn::optim::grad_clipping::GradientClippingConfig;
use burn::optim::lr_scheduler::linear::LinearLrSchedulerConfig;
use burn::optim::momentum::MomentumConfig;
use burn::optim::{AdamConfig, AdamWConfig, ModuleOptimizer, SgdConfig};
use burn_ddp::testing::bucket_layout;
use burn_ddp::train::{
    CHECKPOINT_FILE, CheckpointConfig, Compression, DdpLearner, GradientReducer, Sharding,
    inspect_checkpoint, parameters_to_vector,
};

use super::job::{Job, run_job};
use super::model::{DATA, Net, ToBatch, flex, new_net};
use super::threads::{Threads, train_on_threads};
use super::{assert_identical, relative_error, small_buckets};

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
    compression: Compression,
}

/// What a rank ends with: its parameters, the bytes of its optimizer state, and what its steps
/// cost.
struct Trained {
    params: Vec<f32>,
    state: usize,
    /// All-reduces this rank issued in the whole run (measured by its group).
    all_reduces: u64,
    /// Optimizer steps the learner reported figures for (rank 0 gathers them; 0 elsewhere).
    steps: usize,
    /// The run's bucket plan: its buckets, and the bytes a rank sends per step on a ring
    /// (`GradientReducer::sent_per_step`).
    buckets: usize,
    sent: f64,
}

/// Every rank's final parameters after 3 epochs. Ranks start from different weights, which
/// the start-up broadcast replaces with rank 0's (seed 7).
fn train(run: Run) -> Vec<Trained> {
    let device = flex();
    let models: Vec<_> = (0..run.world)
        .map(|r| {
            let seed = if r == 0 { 7 } else { 100 + r as u64 };
            new_net(&device, Some(seed), run.extra)
        })
        .collect();
    let threads = Threads {
        world: run.world,
        batch: run.batch,
        epochs: 3,
        seed: 5,
        accumulation: run.accumulation,
        loss_metric: false,
        scratch: "zero",
        batcher: ToBatch,
    };
    train_on_threads(&threads, models, |group, model| {
        let lr = LinearLrSchedulerConfig::new(0.05, 0.005, 12)
            .init()
            .expect("schedule");
        let plan = GradientReducer::new(&model, group.clone(), small_buckets())
            .expect("a bucket plan")
            .sharding(run.sharding)
            .compression(run.compression);
        let learner = DdpLearner::with_group(group.clone(), model, optimizer(run.optim), lr)
            .buckets(small_buckets())
            .shard_optimizer(run.sharding)
            .compression(run.compression);
        let figures = learner.telemetry().clone();
        figures.count_optimizer_state();
        let group = group.clone();
        let read = move |model: Net| Trained {
            params: parameters_to_vector(&model),
            state: figures.optimizer_state_bytes().expect("counted"),
            all_reduces: group.all_reduce_count(),
            steps: figures.steps().len(),
            buckets: bucket_layout(&plan).len(),
            sent: plan.sent_per_step(),
        };
        (learner, read)
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
    let start = parameters_to_vector(&new_net(&flex(), Some(7), base.extra));
    assert!(
        relative_error(&plain[0].params, &start) > 1e-3,
        "training changed nothing"
    );
    let whole = plain[0].state;
    assert!(
        plain.iter().all(|t| t.state == whole),
        "unsharded: every rank holds it all"
    );
    for sharding in [Sharding::Optimizer, Sharding::OptimizerAndGradients] {
        let sharded = train(Run { sharding, ..base });
        let all: Vec<&[f32]> = sharded.iter().map(|t| t.params.as_slice()).collect();
        assert_identical(&all);
        if bit_identical(sharding, base.world) {
            assert!(
                same_bits(&plain[0].params, &sharded[0].params),
                "{base:?} {sharding}: not bit-identical to plain DDP"
            );
        }
        let to_plain = relative_error(&sharded[0].params, &plain[0].params);
        let to_one = relative_error(&sharded[0].params, &reference[0].params);
        eprintln!("{base:?} {sharding}: {to_plain:e} from plain DDP, {to_one:e} from one process");
        assert!(
            to_plain <= 1e-6,
            "{base:?} {sharding}: {to_plain:e} from plain DDP"
        );
        assert!(
            base.extra || to_one <= 1e-6,
            "{base:?} {sharding}: {to_one:e} from one process"
        );
        let states: Vec<usize> = sharded.iter().map(|t| t.state).collect();
        assert_partition(&states, whole, &format!("{sharding}"));
    }
}

/// The optimizer state is cut among the ranks: their `states` add up to `whole`, each holding
/// a part of it; `what` in the messages.
pub(super) fn assert_partition(states: &[usize], whole: usize, what: &str) {
    assert_eq!(
        states.iter().sum::<usize>(),
        whole,
        "{what}: {states:?} of {whole}"
    );
    assert!(
        states.iter().all(|&s| s < whole),
        "{what}: {states:?} of {whole}"
    );
}

/// Whether a sharded run must be bit-identical to plain DDP here: at world 2, both stages (a sum
/// of two values does not depend on its order, and burn's optimizers step each tensor alone).
/// At world 3 ZeRO-2's buckets, without their tails, are cut into other ring segments, so each
/// element is summed in another order; ZeRO-1 all-reduces plain DDP's layout, so it is
/// bit-identical at any world size (`zero_edges` checks it where ownership reorders a bucket).
fn bit_identical(sharding: Sharding, world: usize) -> bool {
    sharding == Sharding::Optimizer || world == 2
}

/// Whether `a` and `b` hold the same bits.
pub(super) fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

fn base(optim: Optim, world: usize) -> Run {
    Run {
        optim,
        world,
        batch: 4,
        sharding: Sharding::None,
        accumulation: None,
        extra: false,
        compression: Compression::None,
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

/// Gradients in bf16, all-reduced (ZeRO-1) or reduce-scattered (ZeRO-2): replicas identical;
/// bit-identical to plain DDP with bf16 gradients where [`bit_identical`] says so (the same
/// bf16 values summed in either order), else close to it (at world 3 each bucket is rounded to
/// 8 bits of mantissa at each hop of the ring, and a sharded bucket may be cut otherwise).
#[test]
fn sharded_training_with_bf16_gradients() {
    for world in [2, 3] {
        let run = Run {
            compression: Compression::Bf16,
            ..base(Optim::AdamW, world)
        };
        let plain = train(run);
        for sharding in [Sharding::Optimizer, Sharding::OptimizerAndGradients] {
            let sharded = train(Run { sharding, ..run });
            let all: Vec<&[f32]> = sharded.iter().map(|t| t.params.as_slice()).collect();
            assert_identical(&all);
            let err = relative_error(&sharded[0].params, &plain[0].params);
            let same = same_bits(&sharded[0].params, &plain[0].params);
            eprintln!(
                "bf16, world {world}, {sharding}: {err:e} from plain DDP with bf16 (bit-identical: {same})"
            );
            assert!(
                same || !bit_identical(sharding, world),
                "bf16, world {world}, {sharding}: {err:e}, not bit-identical"
            );
            assert!(err <= 1e-2, "bf16, world {world}, {sharding}: {err:e}");
        }
    }
}

/// What tells the stages apart, measured by each rank's group: ZeRO-1 issues exactly plain
/// DDP's all-reduces (its buckets all-reduced as in plain DDP); ZeRO-2 one per step instead of
/// one per bucket (its buckets reduce-scattered; only the tails of all buckets are
/// all-reduced), so a stage 2 that all-reduced its buckets fails here. By the reducer's
/// accounting (`sent_per_step`), ZeRO-2 sends what plain DDP sends, ZeRO-1 one all-gather of
/// the parameters more.
#[test]
fn zero_2_reduce_scatters_where_zero_1_all_reduces_as_plain_ddp() {
    let values = parameters_to_vector(&new_net(&flex(), Some(7), false)).len();
    for world in [2, 3] {
        let run = base(Optim::Adam, world);
        let plain = train(run);
        let zero1 = train(Run {
            sharding: Sharding::Optimizer,
            ..run
        });
        let zero2 = train(Run {
            sharding: Sharding::OptimizerAndGradients,
            ..run
        });
        let steps = 3 * DATA.div_ceil(world * run.batch);
        let buckets = plain[0].buckets;
        assert!(buckets >= 3, "small buckets: {buckets}");
        for (name, t) in [("plain", &plain), ("ZeRO-1", &zero1), ("ZeRO-2", &zero2)] {
            assert_eq!(t[0].steps, steps, "world {world}, {name}: steps reported");
            assert_eq!(t[0].buckets, buckets, "world {world}, {name}: buckets");
        }
        for r in 0..world {
            let (p, z1, z2) = (
                plain[r].all_reduces,
                zero1[r].all_reduces,
                zero2[r].all_reduces,
            );
            eprintln!("world {world}, rank {r}: all-reduces: plain {p}, ZeRO-1 {z1}, ZeRO-2 {z2}");
            assert_eq!(z1, p, "world {world}, rank {r}: ZeRO-1 against plain DDP");
            assert_eq!(
                p.checked_sub(z2),
                Some((steps * (buckets - 1)) as u64),
                "world {world}, rank {r}: ZeRO-2 ({z2}) against plain DDP ({p}), {steps} steps \
                 of {buckets} buckets"
            );
        }
        let share = (world - 1) as f64 / world as f64;
        let close = |a: f64, b: f64| (a - b).abs() <= 1e-9 * b;
        let (p, z1, z2) = (plain[0].sent, zero1[0].sent, zero2[0].sent);
        assert!(
            close(z2, p),
            "world {world}: ZeRO-2 sends {z2}, plain DDP {p}"
        );
        let gather = share * (values * 4) as f64;
        assert!(
            close(z1, p + gather),
            "world {world}: ZeRO-1 sends {z1}, plain DDP {p}"
        );
    }
}

/// A sharded run that stops after a checkpoint and resumes: at the same world size exactly as
/// if it had not stopped; at world 3, sharded or not, within 1e-6 of the unsharded job resumed
/// at world 3 from an unsharded checkpoint (and so from a sharded checkpoint to an unsharded
/// run, and from an unsharded checkpoint to a sharded run).
#[test]
fn sharded_checkpoints_resume_at_any_world_size_sharded_or_not() {
    let stage = Sharding::OptimizerAndGradients;
    let job = |world, sharding, checkpoints| Job {
        sharding,
        ..Job::plain(world, checkpoints)
    };
    let params = |results: Vec<Result<Vec<f32>, String>>| -> Vec<Vec<f32>> {
        results.into_iter().map(|r| r.expect("training")).collect()
    };
    let straight = params(run_job(&job(2, stage, None)));
    // Checkpoints every 2 optimizer steps; a crash in epoch 2 leaves epoch 2 after 4 batches.
    let crash = |sharding, name| {
        let dir = scratch(name);
        let config = CheckpointConfig::new(&dir).every(2);
        let crashed = run_job(&Job {
            fail_at: Some((2, 17)),
            ..job(2, sharding, Some(config.clone()))
        });
        assert!(
            crashed
                .iter()
                .all(|r| r.as_ref().is_err_and(|e| e.contains("simulated crash")))
        );
        assert_eq!(inspect_checkpoint(&config.path()).unwrap().batches, 4);
        config
    };
    let copy = |from: &CheckpointConfig, name| {
        let dir = scratch(name);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::copy(from.path(), dir.join(CHECKPOINT_FILE)).unwrap();
        CheckpointConfig::new(dir)
    };
    let sharded = crash(stage, "zero-sharded");
    let plain = crash(Sharding::None, "zero-plain");
    let to_3_sharded = copy(&sharded, "zero-s3s");
    let to_3_plain = copy(&sharded, "zero-s3p");
    let plain_to_3_sharded = copy(&plain, "zero-p3s");

    let resumed = params(run_job(&job(2, stage, Some(sharded.clone()))));
    for (r, p) in resumed.iter().enumerate() {
        let err = relative_error(p, &straight[0]);
        assert!(
            err <= 1e-6,
            "rank {r} resumed at world 2: {err:e} from the uninterrupted run"
        );
    }
    let reference = params(run_job(&job(3, Sharding::None, Some(plain))));
    for (what, sharding, config) in [
        ("sharded -> world 3 sharded", stage, to_3_sharded),
        ("sharded -> world 3 unsharded", Sharding::None, to_3_plain),
        (
            "unsharded -> world 3 sharded",
            Sharding::Optimizer,
            plain_to_3_sharded,
        ),
    ] {
        let got = params(run_job(&job(3, sharding, Some(config.clone()))));
        let all: Vec<&[f32]> = got.iter().map(Vec::as_slice).collect();
        assert_identical(&all);
        let err = relative_error(&got[0], &reference[0]);
        eprintln!("{what}: {err:e} from the unsharded job resumed at world 3");
        assert!(err <= 1e-6, "{what}: {err:e}");
        let _ = std::fs::remove_dir_all(&config.dir);
    }
    let _ = std::fs::remove_dir_all(&sharded.dir);
}

fn scratch(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("burn-ddp-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

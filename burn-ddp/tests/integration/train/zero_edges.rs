//! The sharded optimizer (ZeRO-1 and 2) where a model is not just trainable tensors, or has
//! fewer of them than ranks: a rank that owns nothing (2 tensors at world 3), BatchNorm's
//! running statistics and frozen parameters (the README: sharding "works with ... buffers";
//! "frozen parameters count as buffers"), each rank's share of the optimizer state after
//! resuming a checkpoint, at the same world size and another, with several buckets; and ZeRO-1
//! bit-identical to plain DDP where ownership reorders a bucket.

use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{BatchNorm, BatchNormConfig, Linear, LinearConfig, Relu};
use burn::optim::AdamConfig;
use burn::tensor::{Device, Tensor};
use burn::train::{ClassificationOutput, InferenceStep, TrainOutput, TrainStep};
use burn_ddp::testing::bucket_layout;
use burn_ddp::train::{
    BufferSync, CheckpointConfig, Compression, DdpLearner, GradientReducer, Sharding,
    parameters_to_vector,
};

use super::model::{Rows, ToRows, flex};
use super::threads::{Threads, train_on_threads};
use super::{assert_identical, relative_error, small_buckets};

const FEATURES: usize = 6;
const CLASSES: usize = 3;
const HIDDEN: usize = 8;

/// A classifier of [`Points`](super::model::Points): a frozen layer, a hidden layer (no bias)
/// with BatchNorm, the output layer; each but the output optional.
#[derive(Module, Debug)]
struct Small {
    /// Never trained (`no_grad`): a buffer to the learner.
    frozen: Option<Linear>,
    hidden: Option<Linear>,
    norm: Option<BatchNorm>,
    out: Linear,
    act: Relu,
}

impl Small {
    /// Only the output layer (2 trainable tensors), or every layer (5 trainable tensors, the
    /// running statistics and the frozen layer).
    fn new(device: &Device, full: bool) -> Self {
        let width = if full { HIDDEN } else { FEATURES };
        Small {
            frozen: full.then(|| LinearConfig::new(FEATURES, FEATURES).init(device).no_grad()),
            // Without a bias: BatchNorm cancels it, so its gradient is rounding noise, which Adam
            // turns into steps of the learning rate's size that differ with the order of sums.
            hidden: full.then(|| {
                LinearConfig::new(FEATURES, HIDDEN)
                    .with_bias(false)
                    .init(device)
            }),
            norm: full.then(|| BatchNormConfig::new(HIDDEN).init(device)),
            out: LinearConfig::new(width, CLASSES).init(device),
            act: Relu::new(),
        }
    }

    fn forward(&self, b: Rows) -> ClassificationOutput {
        let mut h = b.x;
        if let Some(frozen) = &self.frozen {
            h = frozen.forward(h);
        }
        if let Some(hidden) = &self.hidden {
            h = hidden.forward(h);
        }
        if let Some(norm) = &self.norm {
            h = self.act.forward(norm.forward(h));
        }
        let logits = self.out.forward(h);
        let loss = CrossEntropyLossConfig::new()
            .init(&logits.device())
            .forward(logits.clone(), b.y.clone());
        ClassificationOutput::new(loss, logits, b.y)
    }

    /// A copy with its own running statistics: a clone's `RunningState`s are shared with this
    /// model (the statistics one run's rank 0 updates would be the next run's start).
    fn copy(&self) -> Self {
        Small::new(&flex(), self.norm.is_some()).load_record(self.clone().into_record())
    }

    /// The running mean and variance, when the model has BatchNorm.
    fn running(&self) -> Vec<f32> {
        let Some(norm) = &self.norm else {
            return Vec::new();
        };
        let values = |t: Tensor<1>| t.into_data().try_to_vec::<f32>().expect("f32 statistics");
        let mut all = values(norm.running_mean.value());
        all.extend(values(norm.running_var.value()));
        all
    }
}

impl TrainStep for Small {
    type Input = Rows;
    type Output = ClassificationOutput;
    fn step(&self, b: Rows) -> TrainOutput<ClassificationOutput> {
        let item = self.forward(b);
        TrainOutput::new(self, item.loss.backward(), item)
    }
}

impl InferenceStep for Small {
    type Input = Rows;
    type Output = ClassificationOutput;
    fn step(&self, b: Rows) -> ClassificationOutput {
        self.forward(b)
    }
}

/// One run of [`Small`] with Adam, small buckets, batches of 4 per rank.
#[derive(Clone)]
struct Run {
    world: usize,
    sharding: Sharding,
    buffers: BufferSync,
    epochs: usize,
    checkpoints: Option<CheckpointConfig>,
    compression: Compression,
}

impl Run {
    fn new(world: usize, sharding: Sharding) -> Self {
        Run {
            world,
            sharding,
            buffers: BufferSync::Broadcast,
            epochs: 2,
            checkpoints: None,
            compression: Compression::None,
        }
    }
}

/// What a rank ends with.
struct Outcome {
    /// Every float tensor (parameters and buffers).
    params: Vec<f32>,
    /// The frozen layer's values.
    frozen: Vec<f32>,
    /// BatchNorm's running statistics.
    running: Vec<f32>,
    /// This rank's optimizer-state bytes at the end of training.
    state: usize,
    /// The run's bucket plan: each bucket's parameters, in packing order.
    layout: Vec<Vec<usize>>,
}

/// Trains `start` (rank 0's model; the others start from other weights, which the start-up
/// broadcast replaces) as `run` says.
fn train(start: &Small, run: &Run) -> Vec<Outcome> {
    let device = flex();
    let models: Vec<Small> = (0..run.world)
        .map(|r| match r {
            0 => start.copy(),
            _ => Small::new(&device, start.norm.is_some()),
        })
        .collect();
    let threads = Threads {
        world: run.world,
        batch: 4,
        epochs: run.epochs,
        seed: 11,
        accumulation: None,
        loss_metric: false,
        scratch: "zero-edges",
        batcher: ToRows,
    };
    train_on_threads(&threads, models, |group, model| {
        let plan = GradientReducer::new(&model, group.clone(), small_buckets())
            .expect("a bucket plan")
            .sharding(run.sharding);
        let mut learner =
            DdpLearner::with_group(group.clone(), model, AdamConfig::new().init(), 0.05)
                .buckets(small_buckets())
                .buffer_sync(run.buffers)
                .shard_optimizer(run.sharding)
                .compression(run.compression);
        if let Some(c) = &run.checkpoints {
            learner = learner.checkpoints(c.clone());
        }
        let figures = learner.telemetry().clone();
        figures.count_optimizer_state();
        let read = move |model: Small| Outcome {
            params: parameters_to_vector(&model),
            frozen: model
                .frozen
                .as_ref()
                .map_or(Vec::new(), parameters_to_vector),
            running: model.running(),
            state: figures.optimizer_state_bytes().expect("counted"),
            layout: bucket_layout(&plan),
        };
        (learner, read)
    })
}

/// Rank 0's model of every run of a test: the same weights each time.
fn start(full: bool) -> Small {
    Small::new(&flex(), full)
}

/// Every rank of `got` identical, and equal to `plain`: bit for bit when `bitwise`, else
/// within 1e-6. (Sharded runs are bit-identical to plain DDP at world 2, where a sum of two
/// values does not depend on its order; ZeRO-1 must be at any world size, see the last test.)
fn assert_like_plain(got: &[Outcome], plain: &[Outcome], bitwise: bool, what: &str) {
    assert_identical(&got.iter().map(|o| o.params.as_slice()).collect::<Vec<_>>());
    let err = relative_error(&got[0].params, &plain[0].params);
    eprintln!("{what}: {err:e} from plain DDP");
    if bitwise {
        let same = super::zero::same_bits(&got[0].params, &plain[0].params);
        assert!(same, "{what}: not bit-identical to plain DDP ({err:e})");
    }
    assert!(err <= 1e-6, "{what}: {err:e} from plain DDP");
}

/// The states of `got` add up to `whole`, each a part of it; `what` in the messages
/// ([`super::zero::assert_partition`]).
fn assert_partition(got: &[Outcome], whole: usize, what: &str) {
    let states: Vec<usize> = got.iter().map(|o| o.state).collect();
    super::zero::assert_partition(&states, whole, what);
}

/// Two trainable tensors at world 3, in a bucket each: one rank owns nothing at all (and two
/// own nothing of each bucket: empty parts in every reduce-scatter and all-gather). It holds
/// no optimizer state, still takes part in every collective, and ends with the same model.
#[test]
fn a_rank_that_owns_nothing_trains_with_the_others() {
    let start = start(false);
    let plain = train(&start, &Run::new(3, Sharding::None));
    assert!(
        relative_error(&plain[0].params, &parameters_to_vector(&start)) > 1e-3,
        "training changed nothing"
    );
    let whole = plain[0].state;
    assert_eq!(plain[0].layout, [[1], [0]], "a bucket per tensor");
    for sharding in [Sharding::Optimizer, Sharding::OptimizerAndGradients] {
        let got = train(&start, &Run::new(3, sharding));
        let what = format!("world 3, 2 tensors, {sharding}");
        assert_like_plain(&got, &plain, sharding == Sharding::Optimizer, &what);
        assert_partition(&got, whole, &format!("{sharding}"));
        let idle = got.iter().filter(|o| o.state == 0).count();
        assert_eq!(idle, 1, "{sharding}: ranks that own nothing");
    }
}

/// BatchNorm's running statistics (`BufferSync::Broadcast` and `Average`) and a frozen layer
/// under both stages at worlds 2 and 3: every replica's parameters and buffers identical and
/// equal to plain DDP's with the same buffer mode; the frozen layer never moves, the running
/// statistics do.
#[test]
fn batch_norm_buffers_and_frozen_parameters_with_sharding() {
    let start = start(true);
    let initial_frozen = parameters_to_vector(start.frozen.as_ref().unwrap());
    let initial_running = start.running();
    for (world, buffers) in [
        (2, BufferSync::Broadcast),
        (3, BufferSync::Broadcast),
        (2, BufferSync::Average),
    ] {
        let run = |sharding| Run {
            buffers,
            ..Run::new(world, sharding)
        };
        let plain = train(&start, &run(Sharding::None));
        let whole = plain[0].state;
        for sharding in [Sharding::Optimizer, Sharding::OptimizerAndGradients] {
            let what = format!("world {world}, {buffers:?}, {sharding}");
            let got = train(&start, &run(sharding));
            assert_like_plain(&got, &plain, world == 2, &what);
            assert_partition(&got, whole, &what);
            for (r, o) in got.iter().enumerate() {
                assert_eq!(
                    o.frozen, initial_frozen,
                    "{what}: rank {r}'s frozen layer moved"
                );
                assert!(
                    relative_error(&o.running, &initial_running) > 1e-2,
                    "{what}: rank {r}'s running statistics did not move"
                );
            }
        }
    }
}

/// A sharded job checkpointed after epoch 1 of 2 (world 2, ZeRO-2) and resumed, at world 2
/// (ZeRO-2) and at world 3 (ZeRO-1), with several buckets: it ends with the parameters of the
/// job resumed unsharded. Then it resumes once more from its own last checkpoint, with nothing
/// left to train, so that what each rank holds is what it kept of the checkpoint: exactly the
/// optimizer state it holds after the same run straight through (its own parameters' state,
/// not the whole checkpoint's).
#[test]
fn a_resumed_sharded_job_keeps_each_rank_to_its_share_of_the_state() {
    let start = start(true);
    let dir = std::env::temp_dir().join(format!("burn-ddp-zero-edges-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let stage2 = Sharding::OptimizerAndGradients;
    let checkpoint = CheckpointConfig::new(dir.join("first"));
    let first = Run {
        epochs: 1,
        checkpoints: Some(checkpoint.clone()),
        ..Run::new(2, stage2)
    };
    train(&start, &first);
    // A copy of the checkpoint for each run that resumes from it.
    let copy = |name: &str| {
        let config = CheckpointConfig::new(dir.join(name));
        std::fs::create_dir_all(&config.dir).unwrap();
        std::fs::copy(checkpoint.path(), config.path()).unwrap();
        config
    };
    let states = |got: &[Outcome]| got.iter().map(|o| o.state).collect::<Vec<_>>();
    for (world, sharding) in [(2, stage2), (3, Sharding::Optimizer)] {
        let what = format!("world {world}, {sharding}");
        let resume = |sharding, config| Run {
            checkpoints: Some(config),
            ..Run::new(world, sharding)
        };
        let plain = train(
            &start,
            &resume(Sharding::None, copy(&format!("plain{world}"))),
        );
        let config = copy(&format!("sharded{world}"));
        let resumed = train(&start, &resume(sharding, config.clone()));
        let straight = train(&start, &Run::new(world, sharding));
        let buckets = straight[0].layout.len();
        assert!(buckets >= 3, "{what}: {buckets} buckets");
        // The resumed job's checkpoint after its last epoch: loaded, and nothing trained.
        let loaded = train(&start, &resume(sharding, config));
        let (got, want) = (states(&loaded), states(&straight));
        eprintln!("{what}: state per rank after loading {got:?}, straight {want:?}");
        assert_partition(&loaded, plain[0].state, &format!("{what}, loaded"));
        assert_eq!(
            got, want,
            "{what}: each rank's optimizer state after loading"
        );
        assert_eq!(states(&resumed), want, "{what}: after the resumed epoch");
        assert_like_plain(&resumed, &plain, world == 2, &format!("{what}, resumed"));
        assert_eq!(loaded[0].params, resumed[0].params, "{what}: trained again");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// ZeRO-1 all-reduces the gradients as plain DDP does, so it must be bit-identical to it at any
/// world size, bf16 gradients included, also where ownership lays a bucket out otherwise (as
/// ZeRO-2's plan shows): at world 3 the bucket of the output weight and BatchNorm's gamma and
/// beta goes owner by owner, and a ring of 3 ranks sums each element in an order that depends
/// on its position.
#[test]
fn zero_1_is_bit_identical_to_plain_ddp_where_ownership_reorders_a_bucket() {
    let start = start(true);
    for compression in [Compression::None, Compression::Bf16] {
        let run = |sharding| Run {
            compression,
            ..Run::new(3, sharding)
        };
        let plain = train(&start, &run(Sharding::None));
        let zero2 = train(&start, &run(Sharding::OptimizerAndGradients));
        assert_ne!(
            zero2[0].layout, plain[0].layout,
            "ownership reorders no bucket here: the test would prove nothing"
        );
        let zero1 = train(&start, &run(Sharding::Optimizer));
        let what = format!("world 3, optimizer, {compression}");
        assert_like_plain(&zero1, &plain, true, &what);
    }
}

//! DdpLearner with fully sharded blocks (`Fsdp<Linear>`) on real ranks (threads over loopback
//! TCP): a small network whose hidden layers are wrapped and whose first layer is not trains
//! as the same network unwrapped does with plain DdpLearner, at worlds 2 and 4, for every
//! sharding strategy, with SGD with momentum and AdamW, and with the ZeRO optimizer on top;
//! the unwrapped layer stays identical on every rank while the shards differ. A NaN in one
//! rank's shard gradient stops every rank naming it; the time the step waits inside the blocks
//! is exposed communication in the telemetry; ranks with different numbers of batches are
//! refused before training.

use std::cell::Cell;
use std::sync::Arc;
use std::time::Duration;

use burn::data::dataloader::DataLoaderBuilder;
use burn::module::{Module, Param};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Linear, LinearConfig};
use burn::optim::momentum::MomentumConfig;
use burn::optim::{AdamWConfig, ModuleOptimizer, SgdConfig};
use burn::tensor::{Device, Int, Tensor, TensorData};
use burn::train::{
    ClassificationOutput, InferenceStep, LearnerModel, SupervisedTraining, TrainOutput, TrainStep,
};
use burn_ddp::ProcessGroup;
use burn_ddp::fsdp::{self, Fsdp, FsdpConfig, ShardingStrategy};
use burn_ddp::train::{
    DdpLearner, DdpTraining, DistributedSampler, JobStats, NonFinite, ProgressOutput,
    QuietRenderer, Sharding, Telemetry, parameters_to_vector,
};

mod checkpoints;
mod clipping;

use super::model::{DATA, Points, Rows, ToRows, flex};
use super::{assert_identical, relative_error};
use crate::common::{max_relative_error, options, run_world, trace_spans, value};

/// Layer widths: 6 features (the tests' `Points`), 3 classes.
const WIDTHS: [usize; 4] = [6, 8, 7, 3];
/// Points per batch, per rank.
const BATCH: usize = 4;

/// Layer `i` of rank `rank`'s initial model: deterministic values of its own (no generator
/// that other test threads seed), so that every rank but 0 starts elsewhere.
fn linear(i: usize, rank: usize, device: &Device) -> Linear {
    let (inp, out) = (WIDTHS[i], WIDTHS[i + 1]);
    let case = 500 + 10 * rank as u64 + i as u64;
    let w: Vec<f32> = (0..inp * out).map(|k| 0.6 * value(case, 0, k)).collect();
    let b: Vec<f32> = (0..out).map(|k| 0.2 * value(case, 1, k)).collect();
    let mut l = LinearConfig::new(inp, out).init(device);
    l.weight = Param::from_tensor(Tensor::from_data(TensorData::new(w, [inp, out]), device));
    l.bias = Some(Param::from_tensor(Tensor::from_data(
        TensorData::new(b, [out]),
        device,
    )));
    l
}

/// The loss and output of `logits` for `y`.
fn classify(logits: Tensor<2>, y: Tensor<1, Int>) -> ClassificationOutput {
    let loss = CrossEntropyLossConfig::new()
        .init(&logits.device())
        .forward(logits.clone(), y.clone());
    ClassificationOutput::new(loss, logits, y)
}

/// The network unwrapped, trained by plain DdpLearner: the same fields as [`FsdpNet`], so that
/// the records of either load into the other.
#[derive(Module, Debug)]
struct PlainNet {
    plain: Vec<Linear>,
    wrapped: Vec<Linear>,
}

impl PlainNet {
    /// Rank `rank`'s network, its first `unwrapped` layers in `plain`.
    fn new(rank: usize, unwrapped: usize, device: &Device) -> Self {
        let mut layers: Vec<Linear> = (0..WIDTHS.len() - 1)
            .map(|i| linear(i, rank, device))
            .collect();
        let wrapped = layers.split_off(unwrapped);
        PlainNet {
            plain: layers,
            wrapped,
        }
    }

    fn logits(&self, x: Tensor<2>) -> Tensor<2> {
        let layers: Vec<&Linear> = self.plain.iter().chain(&self.wrapped).collect();
        let last = layers.len() - 1;
        (layers.into_iter().enumerate()).fold(x, |x, (i, l)| {
            let y = l.forward(x);
            if i < last { y.tanh() } else { y }
        })
    }
}

/// The network with its last layers wrapped: `plain` (the first layers, on the DDP path), then
/// `wrapped`.
#[derive(Module, Debug)]
struct FsdpNet {
    plain: Vec<Linear>,
    wrapped: Vec<Fsdp<Linear>>,
}

thread_local! {
    /// This thread's training steps so far, and the one whose first shard gradient it turns
    /// into NaN (a rank whose gradients went wrong), if any.
    static POISON: Cell<(usize, Option<usize>)> = const { Cell::new((0, None)) };
    /// How long each forward pass on this thread sleeps first (a straggler).
    static SLOW: Cell<Duration> = const { Cell::new(Duration::ZERO) };
    /// Whether the training on this thread also has burn-train's own checkpointer.
    static BURN_CHECKPOINTER: Cell<bool> = const { Cell::new(false) };
}

impl FsdpNet {
    /// Rank `rank`'s network in `group`, its first `unwrapped` layers left unwrapped.
    fn new(
        group: &Arc<ProcessGroup>,
        strategy: ShardingStrategy,
        unwrapped: usize,
        device: &Device,
    ) -> Self {
        let rank = group.rank();
        let config = FsdpConfig::new().with_strategy(strategy);
        let n = WIDTHS.len() - 1;
        FsdpNet {
            plain: (0..unwrapped).map(|i| linear(i, rank, device)).collect(),
            wrapped: (unwrapped..n)
                .map(|i| config.init(linear(i, rank, device), group))
                .collect::<burn_ddp::Result<Vec<_>>>()
                .expect("wrapping"),
        }
    }

    fn logits(&self, x: Tensor<2>) -> Tensor<2> {
        let slow = SLOW.get();
        if !slow.is_zero() {
            std::thread::sleep(slow);
        }
        let x = self.plain.iter().fold(x, |x, l| l.forward(x).tanh());
        let last = self.wrapped.len();
        let mut i = 0;
        fsdp::forward_chain(&self.wrapped, x, |l, x| {
            let y = l.forward(x);
            i += 1;
            if i < last { y.tanh() } else { y }
        })
    }

    /// The whole network as the unwrapped one lays it out (a collective: the blocks are
    /// gathered), flattened.
    fn whole(&self) -> Vec<f32> {
        let wrapped = self.wrapped.iter().map(|b| b.gathered().expect("gather"));
        parameters_to_vector(&PlainNet {
            plain: self.plain.clone(),
            wrapped: wrapped.collect(),
        })
    }
}

impl TrainStep for PlainNet {
    type Input = Rows;
    type Output = ClassificationOutput;
    fn step(&self, b: Rows) -> TrainOutput<ClassificationOutput> {
        let item = classify(self.logits(b.x), b.y);
        TrainOutput::new(self, item.loss.backward(), item)
    }
}

impl InferenceStep for PlainNet {
    type Input = Rows;
    type Output = ClassificationOutput;
    fn step(&self, b: Rows) -> ClassificationOutput {
        classify(self.logits(b.x), b.y)
    }
}

impl TrainStep for FsdpNet {
    type Input = Rows;
    type Output = ClassificationOutput;
    fn step(&self, b: Rows) -> TrainOutput<ClassificationOutput> {
        let item = classify(self.logits(b.x), b.y);
        let mut out = TrainOutput::new(self, item.loss.backward(), item);
        let (step, poison) = POISON.get();
        POISON.set((step + 1, poison));
        if poison == Some(step) {
            let id = self.wrapped[0].shard().id;
            let g = out.grads.remove::<1>(id).expect("the shard's gradient");
            out.grads.register::<1>(id, g.mul_scalar(f32::NAN));
        }
        out
    }
}

impl InferenceStep for FsdpNet {
    type Input = Rows;
    type Output = ClassificationOutput;
    fn step(&self, b: Rows) -> ClassificationOutput {
        classify(self.logits(b.x), b.y)
    }
}

/// Trains `epochs` epochs on `world` thread ranks (`data` training and validation points of the
/// tests' set, batches of [`BATCH`] per rank, a shuffling sampler for training, each validation
/// item once), each rank's learner built by `learner` on its thread; `read`
/// reads the trained model (on every rank, so it may call collectives). Each rank's result, in
/// rank order: what `read` made of the model, or the training's error in words.
fn train_ranks<M, T>(
    (world, epochs, data): (usize, usize, (usize, usize)),
    learner: impl Fn(&Arc<ProcessGroup>) -> DdpLearner<M> + Sync,
    read: impl Fn(&Arc<ProcessGroup>, M) -> T + Sync,
) -> Vec<Result<T, String>>
where
    M: LearnerModel
        + TrainStep<Input = Rows, Output = ClassificationOutput>
        + InferenceStep<Input = Rows, Output = ClassificationOutput>,
    T: Send,
{
    run_world(world, options(30), |group: ProcessGroup| {
        let group = Arc::new(group);
        let sampler = DistributedSampler::for_group(&group).seed(5);
        let valid_sampler = DistributedSampler::for_group(&group)
            .shuffle(false)
            .pad(false);
        let loader = |points: Points, s: &DistributedSampler| {
            DataLoaderBuilder::new(ToRows)
                .batch_size(BATCH)
                .build(s.dataset(points))
        };
        let dir = super::thread_dir("fsdp");
        let training = SupervisedTraining::new(
            &dir,
            loader(Points(data.0), &sampler),
            loader(Points(data.1), &valid_sampler),
        )
        .renderer(Box::new(QuietRenderer))
        .with_application_logger(None)
        .num_epochs(epochs);
        let learner = learner(&group)
            .sampler(&sampler)
            .valid_sampler(&valid_sampler)
            .progress(ProgressOutput::Keep);
        // Read after the learner is built: its closure sets it.
        let training = match BURN_CHECKPOINTER.take() {
            true => training.with_default_checkpointers(),
            false => training,
        };
        let outcome = training.launch_ddp(learner);
        POISON.set((0, None));
        SLOW.set(Duration::ZERO);
        let _ = std::fs::remove_dir_all(&dir);
        match outcome {
            Ok(result) => match result.error {
                None => Ok(read(&group, result.model)),
                Some(e) => Err(format!("{e:?}")),
            },
            Err(e) => Err(e.to_string()),
        }
    })
}

#[derive(Debug, Clone, Copy)]
enum Optim {
    SgdMomentum,
    AdamW,
}

fn optimizer(o: Optim) -> ModuleOptimizer {
    match o {
        Optim::SgdMomentum => SgdConfig::new()
            .with_momentum(Some(MomentumConfig::new().with_momentum(0.9)))
            .init(),
        Optim::AdamW => AdamWConfig::new().with_weight_decay(0.05).init(),
    }
}

/// The learning rate of every run.
const LR: f64 = 0.05;

/// Every rank's whole network after 3 epochs of plain DdpLearner on the unwrapped network.
fn plain(world: usize, o: Optim) -> Vec<Vec<f32>> {
    let device = flex();
    let results = train_ranks(
        (world, 3, (DATA, DATA / 2)),
        |group| {
            let model = PlainNet::new(group.rank(), 1, &device);
            DdpLearner::with_group(group.clone(), model, optimizer(o), LR)
        },
        |_, model: PlainNet| parameters_to_vector(&model),
    );
    results.into_iter().map(|r| r.expect("training")).collect()
}

/// What a rank of a run with wrapped blocks ends with.
struct Wrapped {
    /// The whole network, gathered, as [`plain`] lays it out.
    whole: Vec<f32>,
    /// The unwrapped layer's parameters on this rank.
    replicated: Vec<f32>,
    /// This rank's shard of the first wrapped block.
    shard: Vec<f32>,
}

/// Every rank's network after 3 epochs of DdpLearner on the network with its hidden layers
/// wrapped with `strategy`, the optimizer sharded as `zero` says.
fn wrapped(world: usize, o: Optim, strategy: ShardingStrategy, zero: Sharding) -> Vec<Wrapped> {
    // FullShard as users run it: on a device with gradient checkpointing (the gathered blocks
    // dropped after forward), which the replicated layer, broadcast at start, must keep.
    let device = match strategy {
        ShardingStrategy::FullShard => flex().gradient_checkpointing(),
        _ => flex(),
    };
    let results = train_ranks(
        (world, 3, (DATA, DATA / 2)),
        |group| {
            let model = FsdpNet::new(group, strategy, 1, &device);
            DdpLearner::with_group(group.clone(), model, optimizer(o), LR).shard_optimizer(zero)
        },
        |_, model: FsdpNet| Wrapped {
            whole: model.whole(),
            replicated: parameters_to_vector(&model.plain[0]),
            shard: parameters_to_vector(model.wrapped[0].shard()),
        },
    );
    results.into_iter().map(|r| r.expect("training")).collect()
}

/// The runs with wrapped blocks of `o` at `world`, one per strategy (and with the optimizer
/// sharded as `zero` lists), against plain DdpLearner: within `1e-6` relative, the unwrapped
/// layer identical on every rank, the shards of a sharding strategy different.
fn check(world: usize, o: Optim, zero: &[Sharding]) {
    let reference = plain(world, o);
    let start = parameters_to_vector(&PlainNet::new(0, 1, &flex()));
    assert!(
        relative_error(&reference[0], &start) > 1e-3,
        "training changed nothing"
    );
    let strategies = [
        ShardingStrategy::FullShard,
        ShardingStrategy::ShardGradOp,
        ShardingStrategy::NoShard,
    ];
    let runs = (strategies.iter().map(|&s| (s, Sharding::None)))
        .chain(zero.iter().map(|&z| (ShardingStrategy::FullShard, z)));
    for (strategy, zero) in runs {
        let what = format!("world {world}, {o:?}, {strategy:?}, ZeRO {zero}");
        let ranks = wrapped(world, o, strategy, zero);
        let replicated: Vec<&[f32]> = ranks.iter().map(|r| r.replicated.as_slice()).collect();
        assert_identical(&replicated);
        for (rank, r) in ranks.iter().enumerate() {
            let err = relative_error(&r.whole, &reference[0]);
            let max = max_relative_error(&r.whole, &reference[0]);
            if rank == 0 {
                eprintln!("{what}: {err:e} from plain DDP (largest element {max:e})");
            }
            assert!(err <= 1e-6, "{what}: rank {rank} is {err:e} from plain DDP");
        }
        if strategy != ShardingStrategy::NoShard {
            assert_ne!(ranks[0].shard, ranks[1].shard, "{what}: shards differ");
        }
    }
}

#[test]
fn wrapped_blocks_train_as_plain_ddp_with_sgd_momentum() {
    check(2, Optim::SgdMomentum, &[]);
    check(4, Optim::SgdMomentum, &[]);
}

#[test]
fn wrapped_blocks_train_as_plain_ddp_with_adamw_and_under_zero() {
    check(
        2,
        Optim::AdamW,
        &[Sharding::Optimizer, Sharding::OptimizerAndGradients],
    );
    check(4, Optim::AdamW, &[]);
}

/// Rank 1's first shard gradient turns NaN in its third step: a network whose layers are all
/// wrapped (no gradient bucket carries the check) and one with an unwrapped layer both stop on
/// every rank, naming rank 1.
#[test]
fn a_nan_in_one_ranks_shard_gradient_stops_every_rank() {
    let device = flex();
    for unwrapped in [0, 1] {
        let results = train_ranks(
            (2, 1, (DATA, DATA / 2)),
            |group| {
                if group.rank() == 1 {
                    POISON.set((0, Some(2)));
                }
                let model = FsdpNet::new(group, ShardingStrategy::FullShard, unwrapped, &device);
                DdpLearner::with_group(group.clone(), model, optimizer(Optim::AdamW), LR)
                    .non_finite(NonFinite::Stop)
            },
            |_, _| (),
        );
        for (rank, r) in results.iter().enumerate() {
            let e = r.as_ref().expect_err("training should stop");
            assert!(
                e.contains("rank 1 produced gradients that are not finite"),
                "{unwrapped} unwrapped, rank {rank}: {e}"
            );
        }
    }
}

/// Rank 1 sleeps 60 ms before each forward pass. In a network whose layers are all wrapped
/// (so no gradient bucket), rank 0 waits for it inside the blocks (their reductions): that is its exposed
/// communication, and not its compute, so rank 1 is the straggler. Each rank's trace shows
/// every wait inside the blocks.
#[test]
fn the_wait_inside_wrapped_blocks_is_exposed_communication() {
    let device = flex();
    let slow = Duration::from_millis(60);
    let dir = std::env::temp_dir().join(format!("burn-ddp-fsdp-trace-{}", std::process::id()));
    let results = train_ranks(
        (2, 1, (DATA, DATA / 2)),
        |group| {
            if group.rank() == 1 {
                SLOW.set(slow);
            }
            let model = FsdpNet::new(group, ShardingStrategy::NoShard, 0, &device);
            let learner =
                DdpLearner::with_group(group.clone(), model, optimizer(Optim::SgdMomentum), LR)
                    .profile(&dir);
            TELEMETRY.set(Some(learner.telemetry().clone()));
            learner
        },
        |_, _| TELEMETRY.take().map(|t| t.steps()),
    );
    let steps: Vec<JobStats> = (results.into_iter().next())
        .and_then(|r| r.expect("training"))
        .expect("rank 0's telemetry");
    let n = steps.len();
    assert_eq!(n, DATA / (2 * BATCH), "every optimizer step reported");
    let exposed: Vec<f64> = steps.iter().map(|s| s.rank0.exposed * 1e3).collect();
    let compute: Vec<f64> = steps.iter().map(|s| s.rank0.compute * 1e3).collect();
    let slowest: Vec<usize> = steps.iter().map(|s| s.slowest).collect();
    eprintln!("rank 0: exposed {exposed:.1?} ms, compute {compute:.1?} ms; slowest {slowest:?}");
    let mut sorted = exposed.clone();
    sorted.sort_by(f64::total_cmp);
    assert!(
        sorted[n / 2] >= 30.0,
        "rank 0 waits about 60 ms per step for rank 1 inside the blocks: exposed {exposed:?} ms"
    );
    assert!(compute.iter().all(|c| *c >= 0.0), "compute {compute:?}");
    let by_1 = slowest.iter().filter(|&&r| r == 1).count();
    assert!(
        by_1 * 2 > n,
        "rank 1 is the straggler in most steps: {slowest:?}"
    );
    // Each step waits once for each block's gather (forward) and reduction (backward).
    let blocks = WIDTHS.len() - 1;
    for rank in 0..2 {
        let all = trace_spans(&dir, rank);
        let spans = |name: &str| -> Vec<f64> {
            (all.iter())
                .filter(|(n, _)| n == name)
                .map(|(_, dur)| *dur)
                .collect()
        };
        let gathers = spans("fsdp: waiting for a gather");
        let reductions = spans("fsdp: waiting for a reduction");
        assert_eq!(spans("forward+backward").len(), n, "rank {rank}");
        assert_eq!(gathers.len(), n * blocks, "rank {rank}: gather waits");
        assert_eq!(reductions.len(), n * blocks, "rank {rank}: reduction waits");
        if rank == 0 {
            // Rank 0 waits for the slow rank 1 in its first reduction of each step.
            let waited_ms = reductions.iter().sum::<f64>() / 1e3;
            assert!(
                waited_ms >= 30.0 * n as f64,
                "rank 0 waited {waited_ms} ms in {n} steps' reductions"
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

thread_local! {
    /// The telemetry of the learner built on this thread.
    static TELEMETRY: Cell<Option<Telemetry>> = const { Cell::new(None) };
}

/// 17 validation points over 4 ranks (each item evaluated once) make 2 batches on rank 0 and
/// 1 on the others: those without a batch in the last step would skip the blocks' gathers, so
/// every rank refuses before training, saying why.
#[test]
fn ranks_with_different_numbers_of_batches_are_refused() {
    let device = flex();
    let results = train_ranks(
        (4, 1, (DATA, 17)),
        |group| {
            let model = FsdpNet::new(group, ShardingStrategy::FullShard, 1, &device);
            DdpLearner::with_group(group.clone(), model, optimizer(Optim::AdamW), LR)
        },
        |_, _| (),
    );
    for (rank, r) in results.iter().enumerate() {
        let e = r.as_ref().expect_err("training should be refused");
        assert!(
            e.contains("fsdp") && e.contains("validation batches"),
            "rank {rank}: {e}"
        );
    }
}

/// burn-train's own checkpointer with a model with wrapped blocks is refused on every rank
/// before training, naming the rank and the block (it would save rank 0's shards only).
#[test]
fn burn_trains_checkpointer_with_wrapped_blocks_is_refused_naming_the_block() {
    let device = flex();
    let results = train_ranks(
        (2, 1, (DATA, DATA / 2)),
        |group| {
            BURN_CHECKPOINTER.set(true);
            let model = FsdpNet::new(group, ShardingStrategy::FullShard, 1, &device);
            DdpLearner::with_group(group.clone(), model, optimizer(Optim::AdamW), LR)
        },
        |_, _| (),
    );
    for (rank, r) in results.iter().enumerate() {
        let e = r
            .as_ref()
            .expect_err("burn-train's checkpointer should be refused");
        assert!(
            e.contains(&format!("rank {rank}: fsdp wrapped"))
                && e.contains("burn-train's own checkpointer")
                && e.contains("DdpLearner::checkpoints"),
            "rank {rank}: {e}"
        );
    }
}

/// Each rank of `got` within 1e-6 of `reference`.
fn close(what: &str, got: &[Vec<f32>], reference: &[f32]) {
    for (rank, g) in got.iter().enumerate() {
        let err = relative_error(g, reference);
        if rank == 0 {
            eprintln!("{what}: {err:e}");
        }
        assert!(
            err <= 1e-6,
            "{what}: rank {rank} is {err:e} from the reference"
        );
    }
}

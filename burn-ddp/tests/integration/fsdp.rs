//! Fully sharded blocks on real ranks (threads over loopback TCP): a model of wrapped layers,
//! each rank with its slice of every batch, trains as one process with the whole batch does,
//! for every sharding strategy and for SGD with momentum and AdamW; and bad use is refused
//! with the block and the rank named.

use std::sync::Arc;

use burn::module::{Module, Param};
use burn::nn::{Linear, LinearConfig};
use burn::optim::{AdamWConfig, GradientsParams, ModuleOptimizer, OptimizerRecord, SgdConfig};
use burn::store::ModuleRecord;
use burn::tensor::{Bytes, DType, Device, Tensor, TensorData};
use burn_ddp::ProcessGroup;
use burn_ddp::fsdp::{self, Fsdp, FsdpConfig, ShardingStrategy};
use burn_ddp::train::{BucketConfig, GradientReducer, NonFinite, Sharding};

use crate::common::{max_relative_error, options, run_world, value};

const WIDTHS: [usize; 4] = [5, 7, 6, 3];
const STEPS: usize = 3;
const GLOBAL: usize = 8;

#[derive(Module, Debug)]
struct RefNet {
    layers: Vec<Linear>,
}

#[derive(Module, Debug)]
struct ShardedNet {
    /// The first layer stays replicated (the DDP path), the others are wrapped.
    first: Linear,
    layers: Vec<Fsdp<Linear>>,
}

impl RefNet {
    fn new(device: &Device) -> Self {
        let layers = WIDTHS
            .windows(2)
            .map(|w| LinearConfig::new(w[0], w[1]).init(device))
            .collect();
        RefNet { layers }
    }

    fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        let mut x = x;
        for (i, l) in self.layers.iter().enumerate() {
            x = l.forward(x);
            if i + 1 < self.layers.len() {
                x = x.tanh();
            }
        }
        x
    }

    /// Every parameter, flat, in visit order.
    fn state(&self) -> Vec<Vec<f32>> {
        (self.layers.iter())
            .flat_map(|l| {
                let w = l.weight.val().flatten::<1>(0, 1);
                let b = l.bias.as_ref().expect("bias").val();
                [w, b]
            })
            .map(|t| t.into_data().try_to_vec::<f32>().expect("f32"))
            .collect()
    }
}

impl ShardedNet {
    fn new(
        reference: RefNet,
        group: &Arc<ProcessGroup>,
        strategy: ShardingStrategy,
    ) -> burn_ddp::Result<Self> {
        Self::configured(reference, group, FsdpConfig::new().with_strategy(strategy))
    }

    fn configured(
        reference: RefNet,
        group: &Arc<ProcessGroup>,
        config: FsdpConfig,
    ) -> burn_ddp::Result<Self> {
        let mut layers = reference.layers.into_iter();
        let first = layers.next().expect("a first layer");
        let layers = layers
            .map(|l| config.init(l, group))
            .collect::<burn_ddp::Result<Vec<_>>>()?;
        Ok(ShardedNet { first, layers })
    }

    fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        let last = self.layers.len() - 1;
        let x = self.first.forward(x).tanh();
        let mut i = 0;
        fsdp::forward_chain(&self.layers, x, |l, x| {
            let y = l.forward(x);
            i += 1;
            if i - 1 < last { y.tanh() } else { y }
        })
    }

    /// Every parameter, gathered, flat, in the reference's visit order.
    fn state(&self) -> Vec<Vec<f32>> {
        let mut layers = vec![self.first.clone()];
        layers.extend(self.layers.iter().map(|l| l.gathered().expect("gather")));
        RefNet {
            layers: layers.into_iter().map(|l| l.valid()).collect(),
        }
        .state()
    }
}

fn initial_record() -> ModuleRecord {
    let device = Device::flex();
    device.seed(11);
    RefNet::new(&device).into_record()
}

/// Rows `range` of step `step`'s global batch.
fn batch(step: usize, range: std::ops::Range<usize>, device: &Device) -> (Tensor<2>, Tensor<2>) {
    let n = range.len();
    let (inp, out) = (WIDTHS[0], WIDTHS[WIDTHS.len() - 1]);
    let (xs, ys): (Vec<Vec<f32>>, Vec<Vec<f32>>) = range
        .map(|i| {
            let x = (0..inp).map(|f| value(300 + step as u64, f, i)).collect();
            let y = (0..out).map(|o| value(400 + step as u64, o, i)).collect();
            (x, y)
        })
        .unzip();
    let x = TensorData::new(xs.concat(), [n, inp]);
    let y = TensorData::new(ys.concat(), [n, out]);
    (Tensor::from_data(x, device), Tensor::from_data(y, device))
}

#[derive(Clone, Copy, Debug)]
enum Optim {
    SgdMomentum,
    AdamW,
}

fn optimizer(o: Optim) -> ModuleOptimizer {
    match o {
        Optim::SgdMomentum => SgdConfig::new()
            .with_momentum(Some(burn::optim::momentum::MomentumConfig::new()))
            .init(),
        Optim::AdamW => AdamWConfig::new().init(),
    }
}

fn reference(o: Optim, init: &ModuleRecord) -> Vec<Vec<f32>> {
    let device = Device::flex().autodiff();
    let mut model = RefNet::new(&device).load_record(init.clone());
    let mut optim = optimizer(o);
    for step in 0..STEPS {
        let (x, y) = batch(step, 0..GLOBAL, &device);
        let loss = (model.forward(x) - y).square().mean();
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(0.05, model, grads);
    }
    model.state()
}

fn sharded(
    group: ProcessGroup,
    o: Optim,
    strategy: ShardingStrategy,
    init: &ModuleRecord,
) -> Vec<Vec<f32>> {
    let config = FsdpConfig::new().with_strategy(strategy);
    sharded_on(group, o, config, init, Device::flex().autodiff())
}

fn sharded_on(
    group: ProcessGroup,
    o: Optim,
    config: FsdpConfig,
    init: &ModuleRecord,
    device: Device,
) -> Vec<Vec<f32>> {
    let group = Arc::new(group);
    let (rank, world) = (group.rank(), group.world_size());
    let plain = RefNet::new(&device).load_record(init.clone());
    let mut model = ShardedNet::configured(plain, &group, config).expect("wrap");
    let mut optim = optimizer(o);
    let per = GLOBAL / world;
    for step in 0..STEPS {
        let (x, y) = batch(step, rank * per..(rank + 1) * per, &device);
        let loss = (model.forward(x) - y).square().mean();
        let mut grads = GradientsParams::from_grads(loss.backward(), &model);
        // The replicated layer's gradients, averaged as DDP does.
        average(&group, &mut grads, &model.first.weight);
        average(&group, &mut grads, model.first.bias.as_ref().expect("bias"));
        model = optim.step(0.05, model, grads);
    }
    model.state()
}

fn average<const D: usize>(
    group: &ProcessGroup,
    grads: &mut GradientsParams,
    p: &burn::module::Param<Tensor<D>>,
) {
    let g = grads.remove::<D>(p.id).expect("a gradient");
    let shape = g.shape();
    let flat = g.reshape([shape.num_elements()]);
    let avg = group
        .all_reduce(flat, burn_ddp::ReduceOp::Avg)
        .wait()
        .expect("all-reduce");
    grads.register::<D>(p.id, avg.reshape(shape));
}

fn check(world: usize, o: Optim, strategy: ShardingStrategy) {
    let init = initial_record();
    let want = reference(o, &init);
    let got = run_world(world, options(60), |g| sharded(g, o, strategy, &init));
    for (rank, state) in got.iter().enumerate() {
        for (i, (a, b)) in state.iter().zip(&want).enumerate() {
            let err = max_relative_error(a, b);
            assert!(
                err < 1e-5,
                "world {world}, {o:?}, {strategy:?}: rank {rank} tensor {i} differs by {err}"
            );
        }
    }
}

#[test]
fn every_strategy_trains_as_one_process_at_worlds_2_and_4() {
    for world in [2, 4] {
        for strategy in [
            ShardingStrategy::FullShard,
            ShardingStrategy::ShardGradOp,
            ShardingStrategy::NoShard,
        ] {
            for o in [Optim::SgdMomentum, Optim::AdamW] {
                check(world, o, strategy);
            }
        }
    }
}

/// burn's gradient checkpointing drops the gathered parameters of a `FullShard` block after
/// the forward pass and gathers them again in backward (the gather's retro-forward): the
/// training is the same.
#[test]
fn full_shard_under_gradient_checkpointing_trains_as_one_process() {
    let init = initial_record();
    for o in [Optim::SgdMomentum, Optim::AdamW] {
        let want = reference(o, &init);
        let got = run_world(2, options(60), |g| {
            let before = fsdp::stats();
            let config = FsdpConfig::new().with_strategy(ShardingStrategy::FullShard);
            let state = sharded_on(g, o, config, &init, checkpointed());
            (state, (fsdp::stats() - before).gathers)
        });
        for (rank, (state, gathers)) in got.iter().enumerate() {
            for (i, (a, b)) in state.iter().zip(&want).enumerate() {
                let err = max_relative_error(a, b);
                assert!(err < 1e-5, "{o:?}: rank {rank} tensor {i} differs by {err}");
            }
            // Each step: 2 blocks gathered in forward, again in backward; then the final
            // gather of the state (2 blocks).
            let want = STEPS as u64 * 2 * 2 + 2;
            assert_eq!(*gathers, want, "{o:?}: rank {rank}'s gathers");
        }
    }
}

/// Every strategy at world 2 on `device` (an autodiff device; `FullShard` on it with gradient
/// checkpointing, gathering each block again in backward), AdamW: each rank's model within
/// 1e-5 (relative) of one process trained on the whole batch on the host. `crate::wgpu` runs
/// it on burn's wgpu backend, so that the shards, gathers and reductions go through device
/// buffers.
#[cfg_attr(not(feature = "wgpu"), allow(dead_code))]
pub(crate) fn every_strategy_trains_as_one_process_on(device: &Device) {
    let init = initial_record();
    let want = reference(Optim::AdamW, &init);
    for strategy in [
        ShardingStrategy::FullShard,
        ShardingStrategy::ShardGradOp,
        ShardingStrategy::NoShard,
    ] {
        let device = match strategy {
            ShardingStrategy::FullShard => device.clone().gradient_checkpointing(),
            _ => device.clone(),
        };
        let got = run_world(2, options(60), |g| {
            let before = fsdp::stats();
            let config = FsdpConfig::new().with_strategy(strategy);
            let state = sharded_on(g, Optim::AdamW, config, &init, device.clone());
            (state, (fsdp::stats() - before).gathers)
        });
        for (rank, (state, gathers)) in got.iter().enumerate() {
            let errors = state
                .iter()
                .zip(&want)
                .map(|(a, b)| max_relative_error(a, b));
            let err = errors.fold(0.0, f64::max);
            eprintln!("{strategy:?}: rank {rank}: largest relative error {err:e}");
            assert!(err < 1e-5, "{strategy:?}: rank {rank} differs by {err}");
            // `full`: each step gathers the 2 blocks in forward and again in backward, then
            // the final gather of the state.
            if strategy == ShardingStrategy::FullShard {
                let want = STEPS as u64 * 2 * 2 + 2;
                assert_eq!(*gathers, want, "rank {rank}'s gathers");
            }
        }
    }
}

/// Blocks whose gradients are reduced in bf16 (`with_reduce_dtype`, gradient compression)
/// train close to one process, at bf16's precision, and not as exactly as in f32; ranks that
/// reduce in different types are refused, naming the block.
#[test]
fn blocks_reduced_in_bf16_train_close_to_one_process() {
    let init = initial_record();
    let want = reference(Optim::SgdMomentum, &init).concat();
    let error = |dtype: Option<DType>| {
        let got = run_world(2, options(60), |g| {
            let mut config = FsdpConfig::new();
            config.reduce_dtype = dtype;
            let device = Device::flex().autodiff();
            sharded_on(g, Optim::SgdMomentum, config, &init, device).concat()
        });
        (got.iter().map(|state| max_relative_error(state, &want))).fold(0.0, f64::max)
    };
    let (f32_err, bf16_err) = (error(None), error(Some(DType::BF16)));
    eprintln!("largest relative error: reduced in f32 {f32_err:e}, in bf16 {bf16_err:e}");
    assert!(bf16_err < 1e-2, "bf16: {bf16_err:e}");
    assert!(
        bf16_err > 10.0 * f32_err.max(1e-8),
        "bf16 ({bf16_err:e}) should be coarser than f32 ({f32_err:e})"
    );
    let refused = run_world(2, options(30), |g| {
        let group = Arc::new(g);
        let config = match group.rank() {
            1 => FsdpConfig::new().with_reduce_dtype(DType::BF16),
            _ => FsdpConfig::new(),
        };
        let block = LinearConfig::new(3, 2).init(&Device::flex());
        config
            .init(block, &group)
            .expect_err("different types")
            .to_string()
    });
    for (rank, e) in refused.iter().enumerate() {
        assert!(
            e.contains("rank 1 wraps block 0, full, reduced in BF16"),
            "rank {rank}: {e}"
        );
    }
}

/// `GradientReducer::clip_grad_norm` clips by the norm of the whole model, shards included
/// (under every strategy, and with the replicated layer's gradients owned under ZeRO-1): one SGD
/// step of the wrapped model at world 2 (each rank half the batch, the replicated layer
/// averaged by the reducer) is the one-process step on the whole batch whose gradients were
/// scaled by hand to the limit, a quarter of their norm.
#[test]
fn gradients_are_clipped_by_the_global_norm_of_the_whole_model() {
    let init = initial_record();
    let device = Device::flex().autodiff();
    let sgd = || SgdConfig::new().init();
    let model = RefNet::new(&device).load_record(init.clone());
    let (x, y) = batch(0, 0..GLOBAL, &device);
    let loss = (model.forward(x) - y).square().mean();
    let mut grads = GradientsParams::from_grads(loss.backward(), &model);
    let mut squares = 0.0f64;
    for l in &model.layers {
        let w = grads.get::<2>(l.weight.id).expect("a weight gradient");
        let bias = l.bias.as_ref().expect("bias");
        let b = grads.get::<1>(bias.id).expect("a bias gradient");
        let w = w.into_data().try_to_vec::<f32>().expect("f32");
        let b = b.into_data().try_to_vec::<f32>().expect("f32");
        squares += w
            .iter()
            .chain(&b)
            .map(|v| f64::from(*v).powi(2))
            .sum::<f64>();
    }
    let max = (squares.sqrt() / 4.0) as f32;
    let scale = max / (squares.sqrt() as f32 + 1e-6);
    for l in &model.layers {
        let w = grads.remove::<2>(l.weight.id).expect("a weight gradient");
        grads.register::<2>(l.weight.id, w.mul_scalar(scale));
        let bias = l.bias.as_ref().expect("bias");
        let b = grads.remove::<1>(bias.id).expect("a bias gradient");
        grads.register::<1>(bias.id, b.mul_scalar(scale));
    }
    let want = sgd().step(0.05, model.clone(), grads).state().concat();
    let unclipped = {
        let (x, y) = batch(0, 0..GLOBAL, &device);
        let loss = (model.forward(x) - y).square().mean();
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        sgd().step(0.05, model, grads).state().concat()
    };
    assert!(
        max_relative_error(&unclipped, &want) > 1e-3,
        "clipping changes the step"
    );

    let runs = [
        (ShardingStrategy::FullShard, Sharding::None),
        (ShardingStrategy::ShardGradOp, Sharding::None),
        (ShardingStrategy::NoShard, Sharding::None),
        (ShardingStrategy::FullShard, Sharding::Optimizer),
    ];
    for (strategy, zero) in runs {
        let got = run_world(2, options(60), |g| {
            let group = Arc::new(g);
            let device = Device::flex().autodiff();
            let plain = RefNet::new(&device).load_record(init.clone());
            let model = ShardedNet::new(plain, &group, strategy).expect("wrap");
            let reducer = GradientReducer::new(&model, group.clone(), BucketConfig::default())
                .expect("reducer")
                .sharding(zero)
                .clip_grad_norm(max);
            let half = GLOBAL / 2;
            let (x, y) = batch(0, group.rank() * half..(group.rank() + 1) * half, &device);
            let loss = (model.forward(x) - y).square().mean();
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            let grads = reducer.reduce(&model, grads).expect("reduce");
            let model = sgd().step(0.05, model, grads);
            let model = reducer.share_parameters(model).expect("share");
            model.state().concat()
        });
        for (rank, state) in got.iter().enumerate() {
            let err = max_relative_error(state, &want);
            assert!(
                err < 1e-5,
                "{strategy:?}, {zero}: rank {rank} is {err:e} from the clipped step"
            );
        }
    }
}

/// A NaN in rank 1's batch under `NonFinite::SkipStep`: every rank skips the step, the wrapped
/// blocks included (their shards' gradients, reduced in backward, are not handed to the
/// optimizer either), and the next clean step is applied as the one-process step.
#[test]
fn a_skipped_step_leaves_the_wrapped_blocks_alone() {
    let init = initial_record();
    let sgd = || SgdConfig::new().init();
    let device = Device::flex().autodiff();
    let start = RefNet::new(&device).load_record(init.clone());
    let want = {
        let (x, y) = batch(1, 0..GLOBAL, &device);
        let loss = (start.forward(x) - y).square().mean();
        let grads = GradientsParams::from_grads(loss.backward(), &start);
        sgd().step(0.05, start.clone(), grads).state().concat()
    };
    let start = start.state().concat();
    let got = run_world(2, options(60), |g| {
        let group = Arc::new(g);
        let device = Device::flex().autodiff();
        let plain = RefNet::new(&device).load_record(init.clone());
        let model = ShardedNet::new(plain, &group, ShardingStrategy::FullShard).expect("wrap");
        let reducer = GradientReducer::new(&model, group.clone(), BucketConfig::default())
            .expect("reducer")
            .non_finite(NonFinite::SkipStep);
        let half = GLOBAL / 2;
        let rows = group.rank() * half..(group.rank() + 1) * half;
        let step = |model: ShardedNet, at: usize, factor: f32| {
            let (x, y) = batch(at, rows.clone(), &device);
            let loss = (model.forward(x.mul_scalar(factor)) - y).square().mean();
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            let grads = reducer.reduce(&model, grads).expect("reduce");
            let handed = grads.len();
            (sgd().step(0.05, model, grads), handed)
        };
        let poison = if group.rank() == 1 { f32::NAN } else { 1.0 };
        let (model, handed) = step(model, 0, poison);
        let skipped = model.state().concat();
        let (model, _) = step(model, 1, 1.0);
        (handed, skipped, model.state().concat())
    });
    for (rank, (handed, skipped, after)) in got.into_iter().enumerate() {
        assert_eq!(
            handed, 0,
            "rank {rank}: gradients handed over for a skipped step"
        );
        assert_eq!(
            skipped, start,
            "rank {rank}: the skipped step changed the model"
        );
        let err = max_relative_error(&after, &want);
        assert!(err < 1e-5, "rank {rank}: the next step is {err:e} off");
    }
}

fn checkpointed() -> Device {
    Device::flex().autodiff().gradient_checkpointing()
}

/// Under gradient checkpointing, backward gathers each `FullShard` block again when it needs
/// it, not every block at once: one is held at a time, however deep the chain, whether
/// the blocks' outputs are compute-bound (`tanh`) or a residual stream of memory-bound
/// additions (a transformer's: burn would rebuild a block's input through every earlier block,
/// and gather them all again, were the input not kept: 5 held). The first block, whose input
/// has no gradient, is gathered again too.
#[test]
fn full_shard_backward_holds_one_gathered_block_at_a_time() {
    const DEPTH: usize = 6;
    for residual in [false, true] {
        let got = run_world(2, options(60), |g| {
            let group = Arc::new(g);
            let device = checkpointed();
            let layers = (0..DEPTH)
                .map(|_| FsdpConfig::new().init(LinearConfig::new(4, 4).init(&device), &group))
                .collect::<burn_ddp::Result<Vec<_>>>()
                .expect("wrap");
            let (stats, grads) = chain_step(&layers, &device, residual);
            (stats.gathers, stats.most_regathered, grads.len())
        });
        for (rank, (gathers, held, grads)) in got.into_iter().enumerate() {
            let what = format!("residual {residual}, rank {rank}");
            // Every block gathered again, but for one under a residual stream, whose gathered
            // parameters burn keeps (11 of 12).
            let regathered = gathers - DEPTH as u64;
            assert!(regathered + 1 >= DEPTH as u64, "{what}: {gathers} gathers");
            assert_eq!(held, 1, "{what}: {held} blocks held at once");
            assert_eq!(grads, DEPTH, "{what}: shards with a gradient");
        }
    }
}

/// Backward prefetch: under gradient checkpointing each `FullShard` block's gather in
/// backward starts while the block after it runs its backward (FSDP's `BACKWARD_PRE`), taking
/// the place of the gather backward would start later: no more gathers than without it, and
/// the same gradients, bit for bit. With `with_backward_prefetch(false)` none starts ahead.
#[test]
fn backward_gathers_the_next_block_ahead_and_changes_nothing_else() {
    const DEPTH: usize = 6;
    for residual in [false, true] {
        let got = run_world(2, options(60), |g| {
            let group = Arc::new(g);
            let device = checkpointed();
            let mut out = Vec::new();
            for prefetch in [true, false] {
                let config = FsdpConfig::new().with_backward_prefetch(prefetch);
                let layers = (0..DEPTH)
                    .map(|i| config.init(fixed_linear(i, &device), &group))
                    .collect::<burn_ddp::Result<Vec<_>>>()
                    .expect("wrap");
                let (stats, grads) = chain_step(&layers, &device, residual);
                let grads: Vec<Vec<f32>> = layers
                    .iter()
                    .map(|l| {
                        let g = grads.get::<1>(l.shard().id).expect("a shard's gradient");
                        g.into_data().try_to_vec::<f32>().expect("f32")
                    })
                    .collect();
                out.push((stats.gathers, stats.backward_prefetches, grads));
            }
            out
        });
        for (rank, runs) in got.into_iter().enumerate() {
            let what = format!("residual {residual}, rank {rank}");
            let [(gathers, ahead, grads), (gathers_off, ahead_off, grads_off)] =
                <[_; 2]>::try_from(runs).ok().unwrap();
            println!(
                "{what}: gathers {gathers} (off {gathers_off}), ahead {ahead} (off {ahead_off})"
            );
            assert!(ahead + 2 >= DEPTH as u64, "{what}: {ahead} gathers ahead");
            assert_eq!(ahead_off, 0, "{what}: gathers ahead with prefetch off");
            assert_eq!(
                gathers, gathers_off,
                "{what}: gathers with and without prefetch"
            );
            assert_eq!(grads, grads_off, "{what}: the gradients changed");
        }
    }
}

/// One forward and backward pass of `layers` (4 wide) as a chain on ones, with `tanh` between
/// the blocks or as a residual stream: the wrapped blocks' counters over it, and the gradients.
fn chain_step(
    layers: &[Fsdp<Linear>],
    device: &Device,
    residual: bool,
) -> (fsdp::FsdpStats, GradientsParams) {
    let x = Tensor::<2>::ones([2, 4], device);
    let before = fsdp::stats();
    let y = fsdp::forward_chain(layers, x, |l, x| match residual {
        true => x.clone() + l.forward(x),
        false => l.forward(x).tanh(),
    });
    // A `Vec` is the module (copies of the wrappers: the same parameters).
    let grads = GradientsParams::from_grads(y.sum().backward(), &layers.to_vec());
    (fsdp::stats() - before, grads)
}

/// A linear layer of 4 by 4 whose values depend on `i` (the same on every rank).
fn fixed_linear(i: usize, device: &Device) -> Linear {
    let values: Vec<f32> = (0..16)
        .map(|j| ((i * 16 + j) as f32 * 0.37).sin() * 0.5)
        .collect();
    let bias: Vec<f32> = (0..4)
        .map(|j| ((i * 4 + j) as f32 * 0.11).cos() * 0.1)
        .collect();
    let mut layer = LinearConfig::new(4, 4).init(device);
    layer.weight =
        Param::from_tensor(Tensor::<1>::from_floats(values.as_slice(), device).reshape([4, 4]));
    layer.bias = Some(Param::from_tensor(Tensor::<1>::from_floats(
        bias.as_slice(),
        device,
    )));
    layer
}

/// A block used twice in one forward pass is refused, naming the block and the rank.
#[test]
fn a_block_run_twice_in_one_forward_pass_is_refused() {
    let init = initial_record();
    let messages = run_world(2, options(30), |g| {
        let group = Arc::new(g);
        let device = Device::flex().autodiff();
        let plain = RefNet::new(&device).load_record(init.clone());
        let model = ShardedNet::new(plain, &group, ShardingStrategy::FullShard).expect("wrap");
        let (x, _) = batch(0, 0..2, &device);
        let once = model.layers[0].forward(model.first.forward(x), |l, x| l.forward(x));
        let twice = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            model.layers[0].forward(once.clone(), |l, x| l.forward(x))
        }));
        let Err(panic) = twice else {
            panic!("a second run of the block was not refused")
        };
        // Backward of the first run still works, and the block runs again after it.
        let _ = once.sum().backward();
        panic.downcast_ref::<String>().cloned().unwrap_or_default()
    });
    for (rank, m) in messages.iter().enumerate() {
        assert!(
            m.contains(&format!("rank {rank}: fsdp block 0:")) && m.contains("second time"),
            "{m}"
        );
    }
}

/// Ranks that wrap different blocks are told which ranks and what each wraps; a block without
/// parameters is refused.
#[test]
fn ranks_wrapping_differently_and_empty_blocks_are_refused() {
    let errors = run_world(2, options(30), |g| {
        let group = Arc::new(g);
        let device = Device::flex();
        let width = if group.rank() == 1 { 4 } else { 3 };
        let block = LinearConfig::new(2, width).init(&device);
        let differ = FsdpConfig::new()
            .with_name("proj")
            .init(block, &group)
            .map(|_| ());
        let empty = FsdpConfig::new()
            .init(burn::nn::Relu::new(), &group)
            .map(|_| ());
        (
            differ.expect_err("different blocks").to_string(),
            empty.expect_err("no parameters").to_string(),
        )
    });
    for (rank, (differ, empty)) in errors.iter().enumerate() {
        assert!(
            differ.contains("fsdp proj: the ranks wrap different blocks")
                && differ.contains("rank 1 wraps proj, full: 2 parameters of F32")
                && differ.contains("weight [2, 4], bias [4]"),
            "rank {rank}: {differ}"
        );
        assert!(
            empty.contains(&format!(
                "rank {rank}: fsdp block 1: the block has no float parameter"
            )),
            "rank {rank}: {empty}"
        );
    }
}

/// A model trained at world 4 gives rank 0 its whole record and its optimizer's, which load
/// into the unwrapped model and into the wrapped model at world 2 (each rank keeping its
/// piece): the same parameters everywhere, and a further AdamW step of the wrapped model at
/// world 2 (each rank half the batch) is the unwrapped model's on the whole batch.
#[test]
fn the_full_record_loads_unwrapped_and_at_another_world_size() {
    let init = initial_record();
    let saved = run_world(4, options(60), |g| {
        let group = Arc::new(g);
        let device = Device::flex().autodiff();
        let plain = RefNet::new(&device).load_record(init.clone());
        let model = ShardedNet::new(plain, &group, ShardingStrategy::FullShard).expect("wrap");
        let mut optim = optimizer(Optim::AdamW);
        let (x, y) = batch(0, group.rank() * 2..group.rank() * 2 + 2, &device);
        let loss = (model.forward(x) - y).square().mean();
        let mut grads = GradientsParams::from_grads(loss.backward(), &model);
        average(&group, &mut grads, &model.first.weight);
        average(&group, &mut grads, model.first.bias.as_ref().expect("bias"));
        let model = optim.step(0.05, model, grads);
        let record = fsdp::full_record(&model, &group).expect("full record");
        let optim = fsdp::full_optimizer_record(&model, optim.to_record(), &group)
            .expect("full optimizer record")
            .map(|o| o.into_bytes().expect("encoding").to_vec());
        assert_eq!(record.is_some(), group.rank() == 0);
        assert_eq!(optim.is_some(), group.rank() == 0);
        (model.state(), record.zip(optim))
    });
    let want = saved[0].0.clone();
    let (record, optim) = saved[0].1.clone().expect("rank 0's records");
    // (An optimizer record is not `Clone`: kept encoded.)
    let optim =
        || OptimizerRecord::from_bytes(Bytes::from_bytes_vec(optim.clone())).expect("decoding");
    assert_ne!(
        want,
        RefNet::new(&Device::flex())
            .load_record(init.clone())
            .state()
    );

    // The unwrapped twin of ShardedNet: the same fields, no wrapper.
    #[derive(Module, Debug)]
    struct Unwrapped {
        first: Linear,
        layers: Vec<Linear>,
    }
    let device = Device::flex().autodiff();
    let mut fresh = RefNet::new(&device).layers.into_iter();
    let first = fresh.next().expect("a first layer");
    let unwrapped = Unwrapped {
        first,
        layers: fresh.collect(),
    }
    .load_record(record.clone());
    let mut layers = vec![unwrapped.first];
    layers.extend(unwrapped.layers);
    let unwrapped = RefNet { layers };
    assert_eq!(unwrapped.state(), want, "the unwrapped model");
    // The next step, unwrapped, on the whole batch, from the full optimizer record.
    let (x, y) = batch(1, 0..GLOBAL, &device);
    let loss = (unwrapped.forward(x) - y).square().mean();
    let grads = GradientsParams::from_grads(loss.backward(), &unwrapped);
    let mut unwrapped_optim = optimizer(Optim::AdamW).load_record(optim());
    let next = unwrapped_optim.step(0.05, unwrapped, grads).state();

    let resumed = run_world(2, options(60), |g| {
        let group = Arc::new(g);
        let device = Device::flex().autodiff();
        device.seed(99 + group.rank() as u64);
        let fresh = ShardedNet::new(RefNet::new(&device), &group, ShardingStrategy::FullShard)
            .expect("wrap");
        // The optimizer record before the model's: refused, the blocks' ids are not the record's.
        let e = fsdp::load_full_optimizer_record(&fresh, optim(), &group)
            .expect_err("a model not loaded from the record")
            .to_string();
        assert!(
            e.contains("load the model from the record saved with this one"),
            "{e}"
        );
        let loaded = fsdp::load_full_record(fresh, record.clone(), &group).expect("load");
        let state = loaded.state();
        let mine = fsdp::load_full_optimizer_record(&loaded, optim(), &group)
            .expect("load the optimizer record");
        let mut optim = optimizer(Optim::AdamW).load_record(mine);
        let half = GLOBAL / 2;
        let (x, y) = batch(1, group.rank() * half..(group.rank() + 1) * half, &device);
        let loss = (loaded.forward(x) - y).square().mean();
        let mut grads = GradientsParams::from_grads(loss.backward(), &loaded);
        average(&group, &mut grads, &loaded.first.weight);
        average(
            &group,
            &mut grads,
            loaded.first.bias.as_ref().expect("bias"),
        );
        (state, optim.step(0.05, loaded, grads).state())
    });
    for (rank, (state, stepped)) in resumed.iter().enumerate() {
        assert_eq!(state, &want, "rank {rank} at world 2");
        let (got, reference) = (stepped.concat(), next.concat());
        let err = max_relative_error(&got, &reference);
        assert!(
            err <= 1e-5,
            "rank {rank}: the step after loading is {err:e} from the unwrapped one"
        );
    }
    // Without the optimizer's state (a fresh AdamW), that step goes elsewhere.
    let (x, y) = batch(1, 0..GLOBAL, &device);
    let unwrapped = Unwrapped {
        first: LinearConfig::new(WIDTHS[0], WIDTHS[1]).init(&device),
        layers: RefNet::new(&device).layers.split_off(1),
    }
    .load_record(record);
    let mut layers = vec![unwrapped.first];
    layers.extend(unwrapped.layers);
    let unwrapped = RefNet { layers };
    let loss = (unwrapped.forward(x) - y).square().mean();
    let grads = GradientsParams::from_grads(loss.backward(), &unwrapped);
    let fresh = optimizer(Optim::AdamW).step(0.05, unwrapped, grads).state();
    assert!(
        max_relative_error(&fresh.concat(), &next.concat()) > 1e-3,
        "the optimizer state makes a difference"
    );
}

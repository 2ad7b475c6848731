//! SyncBatchNorm on real ranks (threads): a world of n, each rank with its slice of a batch,
//! trains as one process with the whole batch and burn's BatchNorm does, running statistics
//! included; uneven and empty slices; evaluation communicates nothing; BatchNorm records load.

use std::sync::Arc;

use burn::module::{Module, Param};
use burn::nn::{BatchNorm, BatchNormConfig, Linear, LinearConfig};
use burn::optim::{GradientsParams, SgdConfig};
use burn::store::ModuleRecord;
use burn::tensor::activation::relu;
use burn::tensor::{Device, Tensor, TensorData};
use burn_ddp::nn::{self, BatchNormSyncExt, SyncBatchNorm};
use burn_ddp::{ProcessGroup, ReduceOp};

use crate::common::{flex, max_relative_error, options, run_world, value};

const FEATURES: usize = 5;
const HIDDEN: usize = 4;
const OUT: usize = 3;
const STEPS: usize = 3;
const LR: f64 = 0.1;

macro_rules! net {
    ($name:ident, $norm:ty) => {
        #[derive(Module, Debug)]
        struct $name {
            l1: Linear,
            bn: $norm,
            l2: Linear,
        }

        impl $name {
            fn new(device: &Device) -> Self {
                Self {
                    l1: LinearConfig::new(FEATURES, HIDDEN).init(device),
                    bn: BatchNormConfig::new(HIDDEN).init(device).into(),
                    l2: LinearConfig::new(HIDDEN, OUT).init(device),
                }
            }

            fn forward(&self, x: Tensor<2>) -> Tensor<2> {
                self.l2.forward(relu(self.bn.forward(self.l1.forward(x))))
            }

            /// Every parameter and running statistic, flat, in a fixed order.
            fn state(&self) -> Vec<(&'static str, Vec<f32>)> {
                let v = |t: Tensor<1>| t.into_data().try_to_vec::<f32>().expect("f32");
                let w = |t: Tensor<2>| v(t.flatten(0, 1));
                let b = |l: &Linear| v(l.bias.as_ref().expect("bias").val());
                vec![
                    ("l1.weight", w(self.l1.weight.val())),
                    ("l1.bias", b(&self.l1)),
                    ("bn.gamma", v(self.bn.gamma.val())),
                    ("bn.beta", v(self.bn.beta.val())),
                    ("l2.weight", w(self.l2.weight.val())),
                    ("l2.bias", b(&self.l2)),
                    ("bn.running_mean", v(self.bn.running_mean.value_sync())),
                    ("bn.running_var", v(self.bn.running_var.value_sync())),
                ]
            }
        }
    };
}

net!(RefNet, BatchNorm);
net!(SyncNet, SyncBatchNorm);

impl SyncNet {
    /// Sums every parameter's gradient over the group (missing ones count as zeros).
    fn sum_grads(&self, group: &ProcessGroup, grads: &mut GradientsParams) {
        sum_grad(group, grads, &self.l1.weight);
        sum_grad(group, grads, self.l1.bias.as_ref().expect("bias"));
        sum_grad(group, grads, &self.bn.gamma);
        sum_grad(group, grads, &self.bn.beta);
        sum_grad(group, grads, &self.l2.weight);
        sum_grad(group, grads, self.l2.bias.as_ref().expect("bias"));
    }
}

fn sum_grad<const D: usize>(
    group: &ProcessGroup,
    grads: &mut GradientsParams,
    p: &Param<Tensor<D>>,
) {
    let shape = p.val().shape();
    let local = grads
        .remove::<D>(p.id)
        .unwrap_or_else(|| Tensor::zeros(shape.clone(), &p.val().device().inner()));
    let flat = local.reshape([shape.num_elements()]);
    let summed = group
        .all_reduce(flat, ReduceOp::Sum)
        .wait()
        .expect("gradient all-reduce");
    grads.register::<D>(p.id, summed.reshape(shape));
}

/// The initial weights of a run (a BatchNorm model's record: the SyncBatchNorm model loads it,
/// which also checks that the records agree). Made once and given to every rank: burn's seeded
/// initialisation is not per thread.
fn initial_record() -> ModuleRecord {
    let device = Device::flex();
    device.seed(7);
    RefNet::new(&device).into_record()
}

/// Sample `i` of step `step`'s global batch: its input and target rows.
fn sample(step: usize, i: usize) -> (Vec<f32>, Vec<f32>) {
    let x = (0..FEATURES)
        .map(|f| 3.0 * value(100 + step as u64, f, i) + 2.0)
        .collect();
    let y = (0..OUT).map(|o| value(200 + step as u64, o, i)).collect();
    (x, y)
}

/// Rows `range` of step `step`'s global batch, as tensors.
fn batch(step: usize, range: std::ops::Range<usize>, device: &Device) -> (Tensor<2>, Tensor<2>) {
    let n = range.len();
    let (xs, ys): (Vec<_>, Vec<_>) = range.map(|i| sample(step, i)).unzip();
    let x = TensorData::new(xs.concat(), [n, FEATURES]);
    let y = TensorData::new(ys.concat(), [n, OUT]);
    (Tensor::from_data(x, device), Tensor::from_data(y, device))
}

/// `STEPS` SGD steps of the reference model (BatchNorm) on the whole batch of `global` samples.
fn train_reference(
    device: &Device,
    init: &ModuleRecord,
    global: usize,
) -> Vec<(&'static str, Vec<f32>)> {
    let device = device.clone();
    let mut model = RefNet::new(&device).load_record(init.clone());
    let mut optim = SgdConfig::new().init();
    for step in 0..STEPS {
        let (x, y) = batch(step, 0..global, &device);
        let loss = (model.forward(x) - y).square().sum() / global as f64;
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(LR, model, grads);
    }
    model.state()
}

/// The same steps on a world of `sizes.len()` ranks, rank r with the next `sizes[r]` samples.
/// The loss is the mean over the GLOBAL batch: each rank's loss is the sum over its samples
/// divided by the global batch size, and the gradients are summed over the ranks; the sum of
/// the ranks' losses is then the reference's loss, so the gradients are the reference's.
fn train_world(
    device: &Device,
    init: &ModuleRecord,
    sizes: &[usize],
) -> Vec<Vec<(&'static str, Vec<f32>)>> {
    let global: usize = sizes.iter().sum();
    run_world(sizes.len(), options(60), |group| {
        let group = Arc::new(group);
        let rank = group.rank();
        let start: usize = sizes[..rank].iter().sum();
        let device = device.clone();
        let mut model = SyncNet::new(&device).load_record(init.clone());
        let mut optim = SgdConfig::new().init();
        let _scope = nn::scope(group.clone());
        for step in 0..STEPS {
            let (x, y) = batch(step, start..start + sizes[rank], &device);
            let loss = (model.forward(x) - y).square().sum() / global as f64;
            let mut grads = GradientsParams::from_grads(loss.backward(), &model);
            model.sum_grads(&group, &mut grads);
            model = optim.step(LR, model, grads);
        }
        model.state()
    })
}

/// World `sizes.len()` with SyncBatchNorm, rank r with `sizes[r]` samples, on `device`, against
/// one process with BatchNorm and the whole batch (also what `crate::wgpu` runs).
pub(crate) fn matches_reference(device: &Device, sizes: &[usize]) {
    let init = initial_record();
    let reference = train_reference(device, &init, sizes.iter().sum());
    for (rank, state) in train_world(device, &init, sizes).iter().enumerate() {
        for ((name, got), (_, want)) in state.iter().zip(&reference) {
            let err = max_relative_error(got, want);
            eprintln!("sizes {sizes:?}, rank {rank}: {name}: relative error {err:.2e}");
            assert!(
                err <= 1e-5,
                "rank {rank}, {name}: {got:?} vs {want:?} ({err:.2e})"
            );
        }
    }
}

#[test]
fn world_2_matches_one_process_with_the_global_batch() {
    matches_reference(&flex(), &[4, 4]);
}

#[test]
fn world_3_matches_one_process_with_the_global_batch() {
    matches_reference(&flex(), &[3, 3, 3]);
}

#[test]
fn uneven_batches_are_count_weighted() {
    matches_reference(&flex(), &[3, 5]);
}

#[test]
fn an_empty_batch_contributes_nothing_and_does_not_hang() {
    matches_reference(&flex(), &[0, 6]);
    // With two non-empty ranks the backward's all-reduce matters, and the empty rank must
    // still take part in it (or the others wait for it until the group's timeout).
    matches_reference(&flex(), &[2, 0, 4]);
}

/// A BatchNorm with non-trivial parameters and running statistics (a few training forwards).
fn trained_batch_norm(device: &Device) -> BatchNorm {
    let mut bn = BatchNormConfig::new(HIDDEN).init(device);
    let values = |case: u64| {
        let v: Vec<f32> = (0..HIDDEN).map(|i| value(case, 0, i) + 1.5).collect();
        Tensor::<1>::from_data(TensorData::new(v, [HIDDEN]), device)
    };
    bn.gamma = Param::from_tensor(values(1));
    bn.beta = Param::from_tensor(values(2));
    for step in 0..3 {
        let x = Tensor::<3>::from_data(
            TensorData::new(
                (0..24).map(|i| 4.0 * value(3 + step, 0, i) + 1.0).collect(),
                [2, HIDDEN, 3],
            ),
            device,
        );
        let _ = bn.forward(x);
    }
    // A RunningState's record is its value before this thread's last update until it is synced.
    let _ = (bn.running_mean.value_sync(), bn.running_var.value_sync());
    bn
}

fn eval_input(device: &Device) -> Tensor<3> {
    let data: Vec<f32> = (0..5 * HIDDEN * 2).map(|i| 3.0 * value(9, 0, i)).collect();
    Tensor::from_data(TensorData::new(data, [5, HIDDEN, 2]), device)
}

fn floats<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.into_data().try_to_vec::<f32>().expect("f32")
}

#[test]
fn eval_uses_running_statistics_and_communicates_nothing() {
    let outcomes = run_world(2, options(20), |group| {
        let group = Arc::new(group);
        let _scope = nn::scope(group.clone());
        if group.rank() == 0 {
            let bn = trained_batch_norm(&flex());
            let want = floats(bn.valid().forward(eval_input(&Device::flex())));
            let sync = SyncBatchNorm::from(trained_batch_norm(&flex()));
            let before = group.all_reduce_count();
            // On a device without autodiff, and on the autodiff device with training off: were
            // either to communicate, it would wait for rank 1, which issues nothing until the
            // check below, and fail with the timeout or a wrong sum there.
            let plain = floats(sync.valid().forward(eval_input(&Device::flex())));
            let frozen = floats(sync.clone().freeze().forward(eval_input(&flex())));
            assert_eq!(group.all_reduce_count(), before, "eval issued a collective");
            for (name, got) in [("valid", &plain), ("frozen", &frozen)] {
                let err = max_relative_error(got, &want);
                eprintln!("eval ({name}): relative error {err:.2e}");
                assert!(err <= 1e-6, "{name}: {got:?} vs {want:?}");
            }
        }
        // The ranks still pair their collectives: the first all-reduce after the evaluation
        // is the same one on both.
        let check = group.all_reduce(vec![group.rank() as f32 + 1.0], ReduceOp::Sum);
        check.wait().expect("all-reduce after eval")
    });
    assert_eq!(outcomes, vec![vec![3.0], vec![3.0]]);
}

#[test]
fn a_batch_norm_record_loads_into_sync_batch_norm() {
    let device = flex();
    let bn = trained_batch_norm(&device);
    let dir = std::env::temp_dir().join(format!("burn-ddp-syncbn-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join("bn.bpk");
    bn.clone().save_file(&path).expect("save BatchNorm");

    let loaded = BatchNormConfig::new(HIDDEN)
        .init_sync(&device)
        .load_file(&path);
    // A conversion moves the layer (clones share their running statistics): convert an
    // identical one, so that `bn`'s training forward below leaves it alone.
    let converted = SyncBatchNorm::from(trained_batch_norm(&device));
    let from_record = BatchNormConfig::new(HIDDEN)
        .init_sync(&device)
        .load_record(bn.clone().into_record());

    let want_eval = floats(bn.valid().forward(eval_input(&Device::flex())));
    let want_train = floats(bn.forward(eval_input(&device)));
    for (name, sync) in [
        ("file", loaded),
        ("From", converted),
        ("record", from_record),
    ] {
        assert_eq!(
            floats(sync.valid().forward(eval_input(&Device::flex()))),
            want_eval,
            "{name}"
        );
        // Training outside a scope is BatchNorm's training forward.
        assert_eq!(
            floats(sync.forward(eval_input(&device))),
            want_train,
            "{name}"
        );
    }
    // After the loaded module read its (lazily loaded) tensors.
    std::fs::remove_dir_all(&dir).ok();
}

/// Timing, not a check: one forward and backward of SyncBatchNorm at world 2 against
/// BatchNorm's on a `[32, 64]` input (`cargo test ... syncbn::timing -- --ignored --nocapture`).
#[test]
#[ignore]
fn timing_forward_backward_32x64() {
    const ITERS: u32 = 50;
    let device = flex();
    let input = |device: &Device| {
        let data: Vec<f32> = (0..32 * 64).map(|i| value(11, 0, i)).collect();
        Tensor::<2>::from_data(TensorData::new(data, [32, 64]), device).require_grad()
    };
    let time = |f: &dyn Fn()| {
        f(); // warm-up
        let start = std::time::Instant::now();
        for _ in 0..ITERS {
            f();
        }
        start.elapsed() / ITERS
    };
    let bn = BatchNormConfig::new(64).init(&device);
    let local = time(&|| {
        let x = input(&device);
        let grads = bn.forward(x.clone()).sum().backward();
        let _ = x.grad(&grads).expect("grad").into_data();
    });
    let synced = run_world(2, options(60), |group| {
        let _scope = nn::scope(Arc::new(group));
        let bn = BatchNormConfig::new(64).init_sync(&device);
        time(&|| {
            let x = input(&device);
            let grads = bn.forward(x.clone()).sum().backward();
            let _ = x.grad(&grads).expect("grad").into_data();
        })
    });
    eprintln!(
        "[32, 64] forward + backward: BatchNorm {local:?}, SyncBatchNorm at world 2 {synced:?}"
    );
}

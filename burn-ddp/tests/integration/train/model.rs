//! The training tests' data and model: a small classification set, a two-layer network with an
//! optional layer some batches skip, and a hook that makes a rank process die in its n-th
//! forward pass.

use std::sync::Mutex;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicI32, AtomicUsize, Ordering};

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::{Dataset, DatasetError};
use burn::module::{Module, Param};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{BatchNorm, BatchNormConfig, Linear, LinearConfig, Relu};
use burn::tensor::{Device, Int, Tensor, TensorData};
use burn::train::{ClassificationOutput, InferenceStep, TrainOutput, TrainStep};
use burn_ddp::train::parameters_to_vector;

use crate::common::{digest, value};

const FEATURES: usize = 6;
const CLASSES: usize = 3;

/// Training samples of the tests' jobs.
pub(crate) const DATA: usize = 48;

#[derive(Clone)]
pub(crate) struct Points(pub usize);

impl Dataset<(Vec<f32>, usize)> for Points {
    fn get(&self, i: usize) -> Result<(Vec<f32>, usize), DatasetError> {
        let y = i % CLASSES;
        let x = (0..FEATURES)
            .map(|f| value(77, f, i) + (f % CLASSES == y) as u8 as f32)
            .collect();
        Ok((x, y))
    }
    fn len(&self) -> usize {
        self.0
    }
}

/// A batch of [`Points`], features and classes only (for models of their own).
#[derive(Clone, Debug)]
pub(crate) struct Rows {
    pub(crate) x: Tensor<2>,
    pub(crate) y: Tensor<1, Int>,
}

/// Batches [`Points`] into [`Rows`].
#[derive(Clone)]
pub(crate) struct ToRows;

impl Batcher<(Vec<f32>, usize), Rows> for ToRows {
    fn batch(&self, items: Vec<(Vec<f32>, usize)>, device: &Device) -> Rows {
        let n = items.len();
        let x: Vec<f32> = items.iter().flat_map(|(x, _)| x.clone()).collect();
        let y: Vec<i64> = items.iter().map(|(_, y)| *y as i64).collect();
        Rows {
            x: Tensor::from_data(TensorData::new(x, [n, FEATURES]), device),
            y: Tensor::from_data(TensorData::new(y, [n]), device),
        }
    }
}

#[derive(Clone, Debug)]
pub(crate) struct Batch {
    x: Tensor<2>,
    y: Tensor<1, Int>,
    /// Whether the `extra` layer takes part (data-dependent, differs across ranks).
    use_extra: bool,
}

impl Batch {
    /// The batch with every feature multiplied by `factor` (NaN or infinity: gradients that are
    /// not finite).
    pub(crate) fn scaled(self, factor: f32) -> Self {
        Batch {
            x: self.x.mul_scalar(factor),
            ..self
        }
    }
}

#[derive(Clone)]
pub(crate) struct ToBatch;

impl Batcher<(Vec<f32>, usize), Batch> for ToBatch {
    fn batch(&self, items: Vec<(Vec<f32>, usize)>, device: &Device) -> Batch {
        let n = items.len();
        let use_extra = items[0].1 == 0;
        let x: Vec<f32> = items.iter().flat_map(|(x, _)| x.clone()).collect();
        let y: Vec<i64> = items.iter().map(|(_, y)| *y as i64).collect();
        Batch {
            x: Tensor::from_data(TensorData::new(x, [n, FEATURES]), device),
            y: Tensor::from_data(TensorData::new(y, [n]), device),
            use_extra,
        }
    }
}

#[derive(Module, Debug)]
pub(crate) struct Net {
    hidden: Linear,
    /// Batch normalisation after the hidden layer: running statistics are buffers.
    norm: Option<BatchNorm>,
    out: Linear,
    /// Used only by some batches: its parameters get no gradient in some steps.
    extra: Option<Linear>,
    /// A large frozen tensor, to make checkpoints slow to write (process tests).
    ballast: Option<Param<Tensor<1>>>,
    act: Relu,
}

/// The exit code a rank process of [`train_rank`](super::train_rank) ends with when training
/// fails: 3, or the `DdpError::exit_code` of a stop by signal.
pub(crate) static EXIT_CODE: AtomicI32 = AtomicI32::new(3);

/// Forward passes so far in this process (for the die-in-forward hook of process tests).
static FORWARDS: AtomicUsize = AtomicUsize::new(0);
/// The forward pass this process dies in, if any (see [`die_at_forward`]).
static DIE_AT_FORWARD: OnceLock<Option<usize>> = OnceLock::new();

/// `BDDP_DIE_AT_FORWARD`, for the rank given it, or for rank `BDDP_DIE_RANK` only when that is
/// set, and only on the job's first start.
fn die_at_forward() -> Option<usize> {
    let var = |k: &str| std::env::var(k).ok();
    let this_rank = var("BDDP_DIE_RANK").is_none_or(|r| var("RANK") == Some(r));
    let first_start = burn_ddp::elastic::restart_count() == 0;
    (this_rank && first_start)
        .then(|| var("BDDP_DIE_AT_FORWARD")?.parse().ok())
        .flatten()
}

impl Net {
    pub(crate) fn new(device: &Device, with_extra: bool) -> Self {
        Net {
            hidden: LinearConfig::new(FEATURES, 16).init(device),
            norm: None,
            out: LinearConfig::new(16, CLASSES).init(device),
            extra: with_extra.then(|| LinearConfig::new(16, CLASSES).init(device)),
            ballast: None,
            act: Relu::new(),
        }
    }

    /// Adds batch normalisation after the hidden layer.
    pub(crate) fn with_norm(mut self, device: &Device) -> Self {
        self.norm = Some(BatchNormConfig::new(16).init(device));
        self
    }

    /// Adds `n` frozen values to the model.
    pub(crate) fn with_ballast(mut self, n: usize, device: &Device) -> Self {
        let t = Tensor::<1>::ones([n], device);
        self.ballast = Some(Param::from_tensor(t).set_require_grad(false));
        self
    }

    fn forward(&self, b: Batch) -> ClassificationOutput {
        // Process tests make a rank die in its n-th forward pass (after publishing where it
        // is). The environment is read once per process.
        let n = FORWARDS.fetch_add(1, Ordering::Relaxed) + 1;
        if DIE_AT_FORWARD.get_or_init(die_at_forward) == &Some(n) {
            std::thread::sleep(std::time::Duration::from_millis(400));
            if std::env::var_os("BDDP_DIE_BY_SIGNALLING_LAUNCHER").is_some() {
                // Not dying: the launcher (this process's parent) is told to stop the job, as
                // a cluster preempting it would; this rank then goes on, and the stop signal
                // it gets forwarded arrives while it still computes this step.
                let launcher = rustix::process::getppid().expect("a parent process");
                eprintln!("SIGNALLING the launcher in forward pass {n}");
                rustix::process::kill_process(launcher, rustix::process::Signal::TERM).unwrap();
                std::thread::sleep(std::time::Duration::from_millis(500));
                return self.compute(b);
            }
            if std::env::var_os("BDDP_DIE_BY_PANIC").is_some() {
                panic!("simulated panic in forward pass {n}");
            }
            eprintln!("DYING in forward pass {n}");
            std::process::exit(9);
        }
        self.compute(b)
    }

    fn compute(&self, b: Batch) -> ClassificationOutput {
        let slow = SLOW_FORWARD.get();
        if !slow.is_zero() {
            std::thread::sleep(slow);
        }
        let mut h = self.hidden.forward(b.x);
        if let Some(norm) = &self.norm {
            h = norm.forward(h);
        }
        let h = self.act.forward(h);
        let mut logits = self.out.forward(h.clone());
        if let (Some(extra), true) = (&self.extra, b.use_extra) {
            logits = logits + extra.forward(h);
        }
        let loss = CrossEntropyLossConfig::new()
            .init(&logits.device())
            .forward(logits.clone(), b.y.clone());
        ClassificationOutput::new(loss, logits, b.y)
    }
}

impl TrainStep for Net {
    type Input = Batch;
    type Output = ClassificationOutput;
    fn step(&self, b: Batch) -> TrainOutput<ClassificationOutput> {
        note_rows(&b, |seen| &mut seen.train);
        STEP_DIGESTS.with_borrow_mut(|d| {
            if let Some(d) = d {
                d.push(digest(bytemuck::cast_slice(&parameters_to_vector(self))));
            }
        });
        let item = self.forward(b);
        TrainOutput::new(self, item.loss.backward(), item)
    }
}

impl InferenceStep for Net {
    type Input = Batch;
    type Output = ClassificationOutput;
    fn step(&self, b: Batch) -> ClassificationOutput {
        note_rows(&b, |seen| &mut seen.valid);
        self.forward(b)
    }
}

thread_local! {
    /// When set, each training step of a `Net` on this thread records the digest of the model
    /// it starts from (parameters and buffers): the model after the previous step.
    static STEP_DIGESTS: std::cell::RefCell<Option<Vec<u64>>> = const { std::cell::RefCell::new(None) };
}

thread_local! {
    /// How long each forward pass of a `Net` on this thread sleeps (a straggler).
    pub(crate) static SLOW_FORWARD: std::cell::Cell<std::time::Duration> =
        const { std::cell::Cell::new(std::time::Duration::ZERO) };
}

/// Starts (`true`) or ends recording this thread's step digests; returns those recorded.
/// The samples a thread's steps saw, by the digest of their features (see [`sample_ids`]).
#[derive(Debug, Default)]
pub(crate) struct SeenRows {
    pub train: Vec<u64>,
    pub valid: Vec<u64>,
}

thread_local! {
    /// When set, each step of a `Net` on this thread notes the samples of its batch.
    static SEEN_ROWS: std::cell::RefCell<Option<SeenRows>> = const { std::cell::RefCell::new(None) };
}

fn note_rows(b: &Batch, split: impl Fn(&mut SeenRows) -> &mut Vec<u64>) {
    SEEN_ROWS.with_borrow_mut(|seen| {
        if let Some(seen) = seen {
            let x = b.x.to_data().try_to_vec::<f32>().expect("f32 features");
            (split(seen)).extend(x.chunks(FEATURES).map(|r| digest(bytemuck::cast_slice(r))));
        }
    });
}

/// Starts (`true`) or stops noting the samples this thread's steps see; returns those noted.
pub(crate) fn record_rows(on: bool) -> SeenRows {
    SEEN_ROWS
        .with_borrow_mut(|d| std::mem::replace(d, on.then(SeenRows::default)).unwrap_or_default())
}

/// Each sample of `data`, by the digest [`record_rows`] notes for it.
pub(crate) fn sample_ids(data: &Points) -> std::collections::HashMap<u64, usize> {
    (0..data.len())
        .map(|i| {
            let (x, _) = data.get(i).expect("a sample");
            (digest(bytemuck::cast_slice(&x)), i)
        })
        .collect()
}

pub(crate) fn record_steps(on: bool) -> Vec<u64> {
    STEP_DIGESTS.with_borrow_mut(|d| std::mem::replace(d, on.then(Vec::new)).unwrap_or_default())
}

pub(crate) use crate::common::flex;

/// Serialises seeding and initialisation across test threads.
static SEED_LOCK: Mutex<()> = Mutex::new(());

/// A model on `device` initialised now under the seed lock, from `seed` (or whatever the device
/// generator holds): burn initialises lazily, drawing from the generator other test threads
/// seed, so the values are read before the lock is released.
pub(crate) fn new_net(device: &Device, seed: Option<u64>, extra: bool) -> Net {
    let _guard = SEED_LOCK.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(seed) = seed {
        device.seed(seed);
    }
    let net = Net::new(device, extra);
    parameters_to_vector(&net);
    net
}

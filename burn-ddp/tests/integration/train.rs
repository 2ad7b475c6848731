//! Data-parallel training against single-process training: same data, seed and SGD; world
//! sizes 2 and 3 with per-rank batch b against one process with batch world * b.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataloader::{DataLoader, DataLoaderBuilder};
use burn::data::dataset::{Dataset, DatasetError};
use burn::module::{Module, Param};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::lr_scheduler::linear::LinearLrSchedulerConfig;
use burn::optim::{AdamConfig, SgdConfig};
use burn::tensor::{Device, Int, Tensor, TensorData};
use burn::train::metric::LossMetric;
use burn::train::{
    ClassificationOutput, InferenceStep, SupervisedTraining, TrainOutput, TrainStep,
};
use burn_ddp::ProcessGroup;
use burn_ddp::train::{
    BucketConfig, CHECKPOINT_FILE, CheckpointConfig, DdpLearner, DdpTraining, DistributedDataset,
    DistributedSampler, GradientReducer, ProgressOutput, QuietRenderer, broadcast_module,
    flat_parameters, inspect_checkpoint,
};

use crate::common::{digest, options, run_world, value};

const FEATURES: usize = 6;
const CLASSES: usize = 3;

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

#[derive(Clone, Debug)]
pub(crate) struct Batch {
    x: Tensor<2>,
    y: Tensor<1, Int>,
    /// Whether the `extra` layer takes part (data-dependent, differs across ranks).
    use_extra: bool,
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
    out: Linear,
    /// Used only by some batches: its parameters get no gradient in some steps.
    extra: Option<Linear>,
    /// A large frozen tensor, to make checkpoints slow to write (process tests).
    ballast: Option<Param<Tensor<1>>>,
    act: Relu,
}

/// The exit code a rank process of [`train_rank`] ends with when training fails: 3, or the
/// `DdpError::exit_code` of a stop by signal.
pub(crate) static EXIT_CODE: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(3);

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
            out: LinearConfig::new(16, CLASSES).init(device),
            extra: with_extra.then(|| LinearConfig::new(16, CLASSES).init(device)),
            ballast: None,
            act: Relu::new(),
        }
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
        let h = self.act.forward(self.hidden.forward(b.x));
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
        let item = self.forward(b);
        TrainOutput::new(self, item.loss.backward(), item)
    }
}

impl InferenceStep for Net {
    type Input = Batch;
    type Output = ClassificationOutput;
    fn step(&self, b: Batch) -> ClassificationOutput {
        self.forward(b)
    }
}

/// What one rank ends with.
struct Outcome {
    params: Vec<f32>,
    all_reduces: u64,
}

struct Run {
    world: usize,
    batch: usize,
    epochs: usize,
    accumulation: Option<usize>,
    extra: bool,
    buckets: BucketConfig,
}

const DATA: usize = 48;

/// Serialises seeding and initialisation across test threads.
static SEED_LOCK: Mutex<()> = Mutex::new(());

/// A model initialised now under the seed lock, from `seed` (or whatever the device generator
/// holds): burn initialises lazily, drawing from the generator other test threads seed, so the
/// values are read before the lock is released.
pub(crate) fn new_net(seed: Option<u64>, extra: bool) -> Net {
    let device = Device::flex().autodiff();
    let _guard = SEED_LOCK.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(seed) = seed {
        device.seed(seed);
    }
    let net = Net::new(&device, extra);
    flat_parameters(&net);
    net
}

/// Trains on `world` thread ranks. Rank 0 starts from the seed-7 model; other ranks from
/// different weights, which the start-up broadcast must replace.
fn train(run: &Run) -> Vec<Outcome> {
    let models: Vec<Option<Net>> = (0..run.world)
        .map(|r| {
            Some(new_net(
                Some(if r == 0 { 7 } else { 1000 + r as u64 }),
                run.extra,
            ))
        })
        .collect();
    let models = Mutex::new(models);
    run_world(run.world, options(60), |group: ProcessGroup| {
        let rank = group.rank();
        let model = models.lock().unwrap()[rank].take().unwrap();
        let group = Arc::new(group);
        let sampler = DistributedSampler::for_group(&group).seed(5);
        let loader = |data: Points, s: &DistributedSampler| {
            DataLoaderBuilder::new(ToBatch)
                .batch_size(run.batch)
                .build(s.dataset(data))
        };
        let valid_sampler = DistributedSampler::for_group(&group).shuffle(false);
        let dir = std::env::temp_dir().join(format!(
            "burn-ddp-test-{}-{:?}-{rank}",
            std::process::id(),
            std::thread::current().id()
        ));
        let mut training = SupervisedTraining::new(
            &dir,
            loader(Points(DATA), &sampler),
            loader(Points(DATA / 2), &valid_sampler),
        )
        .metric_train_numeric(LossMetric::new())
        .renderer(Box::new(QuietRenderer))
        .with_application_logger(None)
        .num_epochs(run.epochs);
        if let Some(k) = run.accumulation {
            training = training.grads_accumulation(k);
        }
        let learner = DdpLearner::with_group(group.clone(), model, SgdConfig::new().init(), 0.5)
            .sampler(&sampler)
            .buckets(run.buckets)
            .setting("batch", run.batch)
            .progress(ProgressOutput::Keep);
        let result = training.launch_ddp(learner).expect("training");
        assert!(result.error.is_none(), "{:?}", result.error);
        let _ = std::fs::remove_dir_all(&dir);
        Outcome {
            params: flat_parameters(&result.model),
            all_reduces: group.all_reduce_count(),
        }
    })
}

fn relative_error(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let diff: f64 = a
        .iter()
        .zip(b)
        .map(|(x, y)| (*x as f64 - *y as f64).powi(2))
        .sum();
    let norm: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (diff / norm).sqrt()
}

fn assert_identical(outcomes: &[Outcome]) {
    for (r, o) in outcomes.iter().enumerate() {
        assert_eq!(
            digest(bytemuck::cast_slice(&o.params)),
            digest(bytemuck::cast_slice(&outcomes[0].params)),
            "rank {r} differs from rank 0"
        );
    }
}

/// Small buckets, so that several are in flight per step.
fn small_buckets() -> BucketConfig {
    BucketConfig {
        cap_bytes: 256,
        first_cap_bytes: 64,
    }
}

fn equivalence(world: usize, accumulation: Option<usize>) {
    let b = 4;
    let run = |world, batch| Run {
        world,
        batch,
        epochs: 2,
        accumulation,
        extra: false,
        buckets: small_buckets(),
    };
    let reference = train(&run(1, world * b));
    let ddp = train(&run(world, b));
    assert_identical(&ddp);
    let err = relative_error(&ddp[0].params, &reference[0].params);
    eprintln!("world {world}, accumulation {accumulation:?}: relative error {err:e}");
    assert!(err <= 1e-5, "world {world}: relative error {err:e}");
    let start = flat_parameters(&new_net(Some(7), false));
    assert!(
        relative_error(&ddp[0].params, &start) > 1e-3,
        "training changed nothing"
    );
}

#[test]
fn world_2_matches_one_process_with_the_global_batch() {
    equivalence(2, None);
}

#[test]
fn world_3_matches_one_process_with_the_global_batch() {
    equivalence(3, None);
}

#[test]
fn accumulation_reduces_once_per_optimizer_step() {
    equivalence(2, Some(2));
    let (world, batch, epochs) = (2, 4, 2);
    let steps_per_epoch = (DATA / world).div_ceil(batch) as u64;
    let runs = |accumulation| Run {
        world,
        batch,
        epochs,
        accumulation,
        extra: false,
        buckets: small_buckets(),
    };
    let plain = train(&runs(None));
    let accumulated = train(&runs(Some(2)));
    // Besides the buckets, the ranks vote on stopping (a 2-value all-reduce) after every 4th
    // optimizer step, after every 4th validation step and at each epoch's end.
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

#[test]
fn a_parameter_without_gradient_in_some_steps_neither_hangs_nor_diverges() {
    let outcomes = train(&Run {
        world: 3,
        batch: 4,
        epochs: 2,
        accumulation: None,
        extra: true,
        buckets: small_buckets(),
    });
    assert_identical(&outcomes);
    assert!(outcomes[0].params.iter().all(|x| x.is_finite()));
}

/// A rank of a hand-written training loop: rank 0's model, small buckets, its shard of the data.
struct ManualRank {
    group: Arc<ProcessGroup>,
    model: Net,
    reducer: GradientReducer,
    sampler: DistributedSampler,
    loader: Arc<dyn DataLoader<Batch>>,
}

impl ManualRank {
    fn new(group: ProcessGroup, model: Net) -> Self {
        let group = Arc::new(group);
        let model = broadcast_module(model, &group).unwrap();
        let reducer = GradientReducer::new(&model, group.clone(), small_buckets()).unwrap();
        let sampler = DistributedSampler::for_group(&group).seed(11);
        let loader = DataLoaderBuilder::new(ToBatch)
            .batch_size(4)
            .build(sampler.dataset(Points(DATA)))
            .to_device(&Device::flex().autodiff());
        ManualRank {
            group,
            model,
            reducer,
            sampler,
            loader,
        }
    }
}

#[test]
fn ranks_hold_identical_parameters_after_every_step() {
    let world = 3;
    let models: Vec<Option<Net>> = (0..world)
        .map(|r| Some(new_net(Some(50 + r as u64), true)))
        .collect();
    let models = Mutex::new(models);
    let steps = run_world(world, options(60), |group| {
        let model = models.lock().unwrap()[group.rank()].take().unwrap();
        let ManualRank {
            group,
            mut model,
            reducer,
            sampler,
            loader,
        } = ManualRank::new(group, model);
        let mut optim = SgdConfig::new().init();
        let mut steps = 0;
        for epoch in 0..2 {
            sampler.set_epoch(epoch);
            for batch in loader.iter() {
                let out = TrainStep::step(&model, batch.unwrap());
                let grads = reducer.reduce(&model, out.grads).unwrap();
                model = optim.step(0.5, model, grads);
                let params = flat_parameters(&model);
                let all = group
                    .all_gather(digest(bytemuck::cast_slice(&params)).to_le_bytes().to_vec())
                    .wait()
                    .unwrap();
                assert!(
                    all.iter().all(|d| *d == all[0]),
                    "step {steps}: ranks differ"
                );
                steps += 1;
            }
        }
        steps
    });
    assert_eq!(steps, vec![8; world]);
}

#[test]
fn ranks_with_different_models_or_settings_stop_naming_the_difference() {
    let errors = run_world(2, options(30), |group| {
        let group = Arc::new(group);
        let rank = group.rank();
        let learner = |model, batch: usize| {
            DdpLearner::with_group(group.clone(), model, SgdConfig::new().init(), 0.1)
                .setting("batch_size", batch)
                .progress(ProgressOutput::Keep)
        };
        // Rank 1 has an extra layer, then a different batch size.
        let model_error = launch_to_error(learner(new_net(None, rank == 1), 4), 4);
        let setting_error = launch_to_error(learner(new_net(None, false), 4 + rank), 4 + rank);
        (model_error, setting_error)
    });
    for (model_error, setting_error) in errors {
        assert!(model_error.contains("ranks disagree"), "{model_error}");
        assert!(model_error.contains("rank 1 has"), "{model_error}");
        assert!(
            model_error.contains("parameter 4 `extra.weight`"),
            "{model_error}"
        );
        assert!(
            setting_error.contains("setting batch_size = 4")
                && setting_error.contains("setting batch_size = 5"),
            "{setting_error}"
        );
    }
}

/// Trains `learner` for one epoch of 8 samples in batches of `batch`, expecting an error; returns
/// it in words.
fn launch_to_error(learner: DdpLearner<Net>, batch: usize) -> String {
    let sampler = DistributedSampler::for_group(learner.group());
    let loader = || {
        DataLoaderBuilder::new(ToBatch)
            .batch_size(batch)
            .build(sampler.dataset(Points(8)))
    };
    SupervisedTraining::new(std::env::temp_dir(), loader(), loader())
        .renderer(Box::new(QuietRenderer))
        .with_application_logger(None)
        .launch_ddp(learner)
        .map(|_| ())
        .unwrap_err()
        .to_string()
}

/// A dataset that fails at one position of one epoch (a crash stand-in that hits every rank at
/// the same step) and counts the samples read in another epoch.
pub(crate) struct Probe {
    inner: DistributedDataset<Points, (Vec<f32>, usize)>,
    sampler: DistributedSampler,
    fail_at: Option<(usize, usize)>,
    count: Option<(usize, Arc<AtomicUsize>)>,
}

impl Dataset<(Vec<f32>, usize)> for Probe {
    fn get(&self, i: usize) -> Result<(Vec<f32>, usize), DatasetError> {
        let epoch = self.sampler.epoch();
        if self.fail_at == Some((epoch, i)) {
            return Err(DatasetError::new(std::io::Error::other("simulated crash")));
        }
        if let Some((e, n)) = &self.count
            && *e == epoch
        {
            n.fetch_add(1, Ordering::Relaxed);
        }
        self.inner.get(i)
    }
    fn len(&self) -> usize {
        self.inner.len()
    }
}

/// A training job for the checkpoint tests: Adam and a linear learning-rate schedule, so that
/// optimizer and schedule state matter on resume.
pub(crate) struct Job {
    pub world: usize,
    pub checkpoints: Option<CheckpointConfig>,
    pub fail_at: Option<(usize, usize)>,
    pub count: Option<(usize, Arc<AtomicUsize>)>,
}

const JOB_EPOCHS: usize = 3;

/// The digest of the checkpoint tests' job at world 2 run straight through, as threads: what a
/// stopped, killed or restarted job must end with.
pub(crate) fn uninterrupted_digest() -> String {
    let straight = run_job(&Job {
        world: 2,
        checkpoints: None,
        fail_at: None,
        count: None,
    });
    digest(bytemuck::cast_slice(straight[0].as_ref().unwrap())).to_string()
}

pub(crate) fn run_job(job: &Job) -> Vec<Result<Vec<f32>, String>> {
    let net = Mutex::new(Some(new_net(Some(7), false)));
    run_world(job.world, options(60), |group: ProcessGroup| {
        // Rank 0's model is broadcast to the others.
        let model = match group.rank() {
            0 => net.lock().unwrap().take().unwrap(),
            _ => new_net(None, false),
        };
        train_rank(Arc::new(group), model, job, 0)
    })
}

/// One rank of a [`Job`] (a thread of [`run_job`] or a process of the process tests); `ballast`
/// adds that many frozen values to the model.
pub(crate) fn train_rank(
    group: Arc<ProcessGroup>,
    model: Net,
    job: &Job,
    ballast: usize,
) -> Result<Vec<f32>, String> {
    let rank = group.rank();
    let device = Device::flex().autodiff();
    let model = match ballast {
        0 => model,
        n => model.with_ballast(n, &device),
    };
    let sampler = DistributedSampler::for_group(&group).seed(5);
    let probe = Probe {
        inner: sampler.dataset(Points(DATA)),
        sampler: sampler.clone(),
        fail_at: job.fail_at,
        count: job.count.clone(),
    };
    let valid_sampler = DistributedSampler::for_group(&group).shuffle(false);
    let dir = std::env::temp_dir().join(format!(
        "burn-ddp-job-{}-{:?}-{rank}",
        std::process::id(),
        std::thread::current().id()
    ));
    let training = SupervisedTraining::new(
        &dir,
        DataLoaderBuilder::new(ToBatch).batch_size(4).build(probe),
        DataLoaderBuilder::new(ToBatch)
            .batch_size(4)
            .build(valid_sampler.dataset(Points(DATA / 2))),
    )
    .renderer(Box::new(QuietRenderer))
    .with_application_logger(None)
    .num_epochs(JOB_EPOCHS);
    let schedule = LinearLrSchedulerConfig::new(0.05, 0.005, 20)
        .init()
        .map_err(|e| e.to_string())?;
    let mut learner =
        DdpLearner::with_group(group.clone(), model, AdamConfig::new().init(), schedule)
            .sampler(&sampler)
            .progress(ProgressOutput::Keep);
    if let Some(c) = &job.checkpoints {
        learner = learner.checkpoints(c.clone());
    }
    let result = training.launch_ddp(learner).map_err(|e| {
        if e.exit_code() != 1 {
            EXIT_CODE.store(e.exit_code(), Ordering::Relaxed);
        }
        e.to_string()
    });
    let _ = std::fs::remove_dir_all(&dir);
    let result = result.and_then(|r| match r.error {
        Some(e) => Err(format!("training error: {e}")),
        None => Ok(r),
    });
    result.map(|r| flat_parameters(&r.model))
}

fn scratch_dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("burn-ddp-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

#[test]
fn resuming_continues_exactly_as_an_uninterrupted_run() {
    let world = 2;
    let plain = |checkpoints| Job {
        world,
        checkpoints,
        fail_at: None,
        count: None,
    };
    let uninterrupted: Vec<Vec<f32>> = run_job(&plain(None))
        .into_iter()
        .map(Result::unwrap)
        .collect();

    // A run that writes a checkpoint every 2 optimizer steps and "crashes" while loading its
    // 5th batch of epoch 2 (position 17 of each rank's 24 samples): the last checkpoint is
    // epoch 2 after 4 batches.
    let dir = scratch_dir("resume");
    let config = CheckpointConfig::new(&dir).every(2);
    let crashed = run_job(&Job {
        fail_at: Some((2, 17)),
        ..plain(Some(config.clone()))
    });
    for r in &crashed {
        let e = r.as_ref().unwrap_err();
        assert!(e.contains("simulated crash"), "{e}");
    }
    let at = inspect_checkpoint(&config.path()).unwrap();
    assert_eq!(
        (at.epoch, at.batches, at.samples, at.world_size),
        (2, 4, 32, 2)
    );
    let other_world_dir = scratch_dir("resume-world1");
    std::fs::create_dir_all(&other_world_dir).unwrap();
    std::fs::copy(config.path(), other_world_dir.join(CHECKPOINT_FILE)).unwrap();

    // Same world size: bit-identical to the uninterrupted run, on every rank.
    let resumed = run_job(&plain(Some(config.clone())));
    for (r, params) in resumed.into_iter().enumerate() {
        let params = params.unwrap();
        assert_eq!(
            digest(bytemuck::cast_slice(&params)),
            digest(bytemuck::cast_slice(&uninterrupted[0])),
            "rank {r} differs from the uninterrupted run"
        );
    }
    let done = inspect_checkpoint(&config.path()).unwrap();
    assert_eq!((done.epoch, done.batches), (JOB_EPOCHS + 1, 0));

    // Another world size: one rank continues epoch 2 with the 16 samples not seen yet.
    let seen = Arc::new(AtomicUsize::new(0));
    let single = run_job(&Job {
        world: 1,
        checkpoints: Some(CheckpointConfig::new(&other_world_dir)),
        fail_at: None,
        count: Some((2, seen.clone())),
    });
    let params = single.into_iter().next().unwrap().unwrap();
    assert!(params.iter().all(|x| x.is_finite()));
    assert_eq!(seen.load(Ordering::Relaxed), DATA - 32);
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_dir_all(&other_world_dir);
}

#[test]
fn a_damaged_checkpoint_is_an_error_on_every_rank() {
    let dir = scratch_dir("damaged");
    std::fs::create_dir_all(&dir).unwrap();
    let config = CheckpointConfig::new(&dir);
    std::fs::write(config.path(), b"BDDPCKPT and then nothing useful").unwrap();
    let results = run_job(&Job {
        world: 2,
        checkpoints: Some(config),
        fail_at: None,
        count: None,
    });
    for r in results {
        let e = r.unwrap_err();
        assert!(e.contains("checkpoint") && e.contains("damaged"), "{e}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_rank_that_skips_a_step_stops_every_rank_with_a_desync_error() {
    let errors = run_world(2, options(20), |group| {
        let rank = group.rank();
        let ManualRank {
            mut model,
            reducer,
            loader,
            ..
        } = ManualRank::new(group, new_net(None, false));
        let mut optim = SgdConfig::new().init();
        for (step, batch) in loader.iter().enumerate() {
            // Same shapes, same number of collectives so far: only the fingerprint tells.
            if rank == 1 && step == 2 {
                continue;
            }
            let out = TrainStep::step(&model, batch.unwrap());
            match reducer.reduce_at(&model, out.grads, 1, step) {
                Ok(grads) => model = optim.step(0.5, model, grads),
                Err(e) => return e.to_string(),
            }
        }
        panic!("rank {rank}: the skipped step went unnoticed");
    });
    for e in errors {
        assert!(e.contains("desync"), "{e}");
        // Whichever rank noticed first wrote the cause both report.
        assert!(
            e.contains("epoch 1 step 2") && e.contains("epoch 1 step 3"),
            "{e}"
        );
    }
}

#[test]
fn a_checkpoint_of_another_model_is_an_error_not_a_panic() {
    let dir = scratch_dir("other-model");
    let config = CheckpointConfig::new(&dir);
    let written = run_job(&Job {
        world: 1,
        checkpoints: Some(config.clone()),
        fail_at: None,
        count: None,
    });
    assert!(written[0].is_ok());
    // The same directory, a model with an extra layer.
    let errors = run_world(1, options(30), |group| {
        let model = new_net(None, true);
        let learner = DdpLearner::with_group(Arc::new(group), model, SgdConfig::new().init(), 0.1)
            .checkpoints(config.clone())
            .progress(ProgressOutput::Keep);
        launch_to_error(learner, 4)
    });
    assert!(
        errors[0].contains("checkpoint") && errors[0].contains("does not fit this model"),
        "{}",
        errors[0]
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_checkpoint_rank_0_cannot_read_or_write_stops_every_rank_naming_it() {
    let job = |dir: std::path::PathBuf| {
        run_job(&Job {
            world: 2,
            checkpoints: Some(CheckpointConfig::new(dir)),
            fail_at: None,
            count: None,
        })
    };
    let expect = |results: Vec<Result<Vec<f32>, String>>, verb: &str| {
        for (r, result) in results.into_iter().enumerate() {
            let e = result.unwrap_err();
            let want = format!("rank {r}: checkpoint: rank 0 could not {verb} it");
            assert!(e.contains(&want), "rank {r}: {e}");
        }
    };
    // The directory lies below a regular file: rank 0 cannot even look for a checkpoint.
    let blocker = scratch_dir("unreadable");
    std::fs::write(&blocker, b"not a directory").unwrap();
    expect(job(blocker.join("ckpt")), "read");
    let _ = std::fs::remove_file(&blocker);
    // A directory stands where the temporary file goes: the first write fails.
    let dir = scratch_dir("unwritable");
    std::fs::create_dir_all(dir.join("checkpoint.tmp")).unwrap();
    expect(job(dir.clone()), "write");
    let _ = std::fs::remove_dir_all(&dir);
}

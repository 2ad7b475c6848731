//! Data-parallel training against single-process training: same data, seed and SGD; world
//! sizes 2 and 3 with per-rank batch b against one process with batch world * b.

use std::sync::{Arc, Mutex};

use burn::data::dataloader::DataLoaderBuilder;
use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::{Dataset, DatasetError};
use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::SgdConfig;
use burn::tensor::{Device, Int, Tensor, TensorData};
use burn::train::metric::LossMetric;
use burn::train::{
    ClassificationOutput, InferenceStep, SupervisedTraining, TrainOutput, TrainStep,
};
use burn_ddp::ProcessGroup;
use burn_ddp::train::{
    BucketConfig, DdpLearner, DdpTraining, DistributedSampler, GradientReducer, QuietRenderer,
    broadcast_module, flat_parameters,
};

use crate::common::{digest, options, run_world, value};

const FEATURES: usize = 6;
const CLASSES: usize = 3;

#[derive(Clone)]
struct Points(usize);

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
struct Batch {
    x: Tensor<2>,
    y: Tensor<1, Int>,
    /// Whether the `extra` layer takes part (data-dependent, differs across ranks).
    use_extra: bool,
}

#[derive(Clone)]
struct ToBatch;

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
struct Net {
    hidden: Linear,
    out: Linear,
    /// Used only by some batches: its parameters get no gradient in some steps.
    extra: Option<Linear>,
    act: Relu,
}

impl Net {
    fn new(device: &Device, with_extra: bool) -> Self {
        Net {
            hidden: LinearConfig::new(FEATURES, 16).init(device),
            out: LinearConfig::new(16, CLASSES).init(device),
            extra: with_extra.then(|| LinearConfig::new(16, CLASSES).init(device)),
            act: Relu::new(),
        }
    }

    fn forward(&self, b: Batch) -> ClassificationOutput {
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

/// Trains on `world` thread ranks. Rank 0 starts from the seed-7 model; other ranks from
/// different weights, which the start-up broadcast must replace.
fn train(run: &Run) -> Vec<Outcome> {
    let device = Device::flex().autodiff();
    // The device's random generator is shared by every test thread of this process.
    let guard = SEED_LOCK.lock().unwrap_or_else(|p| p.into_inner());
    let models: Vec<Option<Net>> = (0..run.world)
        .map(|r| {
            device.seed(if r == 0 { 7 } else { 1000 + r as u64 });
            // Read the values now: initialisation is lazy, and runs with whatever seed the
            // device has when it finally executes.
            let net = Net::new(&device, run.extra);
            flat_parameters(&net);
            Some(net)
        })
        .collect();
    drop(guard);
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
            .setting("batch", run.batch);
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
    let device = Device::flex().autodiff();
    let guard = SEED_LOCK.lock().unwrap_or_else(|p| p.into_inner());
    device.seed(7);
    let start = flat_parameters(&Net::new(&device, false));
    drop(guard);
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
    let buckets = plain[0].all_reduces / (epochs as u64 * steps_per_epoch);
    assert!(buckets > 1, "the small caps should give several buckets");
    assert_eq!(
        plain[0].all_reduces,
        epochs as u64 * steps_per_epoch * buckets
    );
    assert_eq!(
        accumulated[0].all_reduces,
        epochs as u64 * steps_per_epoch.div_ceil(2) * buckets,
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

#[test]
fn ranks_hold_identical_parameters_after_every_step() {
    let device = Device::flex().autodiff();
    let world = 3;
    let guard = SEED_LOCK.lock().unwrap_or_else(|p| p.into_inner());
    let models: Vec<Option<Net>> = (0..world)
        .map(|r| {
            device.seed(50 + r as u64);
            let net = Net::new(&device, true);
            flat_parameters(&net);
            Some(net)
        })
        .collect();
    drop(guard);
    let models = Mutex::new(models);
    let steps = run_world(world, options(60), |group| {
        let rank = group.rank();
        let group = Arc::new(group);
        let model = models.lock().unwrap()[rank].take().unwrap();
        let mut model = broadcast_module(model, &group).unwrap();
        let reducer = GradientReducer::new(&model, group.clone(), small_buckets()).unwrap();
        let mut optim = SgdConfig::new().init();
        let sampler = DistributedSampler::for_group(&group).seed(11);
        let loader = DataLoaderBuilder::new(ToBatch)
            .batch_size(4)
            .build(sampler.dataset(Points(DATA)))
            .to_device(&device);
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
    let device = Device::flex().autodiff();
    let errors = run_world(2, options(30), |group| {
        let group = Arc::new(group);
        let rank = group.rank();
        let launch = |model: Net, batch: usize| {
            let sampler = DistributedSampler::for_group(&group);
            let loader = || {
                DataLoaderBuilder::new(ToBatch)
                    .batch_size(batch)
                    .build(sampler.dataset(Points(8)))
            };
            let learner =
                DdpLearner::with_group(group.clone(), model, SgdConfig::new().init(), 0.1)
                    .setting("batch_size", batch);
            SupervisedTraining::new(std::env::temp_dir(), loader(), loader())
                .renderer(Box::new(QuietRenderer))
                .with_application_logger(None)
                .launch_ddp(learner)
                .map(|_| ())
                .unwrap_err()
                .to_string()
        };
        // Rank 1 has an extra layer, then a different batch size.
        let model_error = launch(Net::new(&device, rank == 1), 4);
        let setting_error = launch(Net::new(&device, false), 4 + rank);
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

//! The training job of the checkpoint tests and of the process tests (a rank of it is what a
//! rank process runs): Adam and a linear learning-rate schedule, so that optimizer and schedule
//! state matter on resume, and a dataset that can fail at a chosen sample.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use burn::data::dataloader::DataLoaderBuilder;
use burn::data::dataset::{Dataset, DatasetError};
use burn::optim::AdamConfig;
use burn::optim::lr_scheduler::linear::LinearLrSchedulerConfig;
use burn::train::SupervisedTraining;
use burn_ddp::ProcessGroup;
use burn_ddp::train::{
    CheckpointConfig, DdpLearner, DdpTraining, DistributedDataset, DistributedSampler,
    ProgressOutput, QuietRenderer, Sharding, parameters_to_vector,
};

use super::model::{DATA, EXIT_CODE, Net, Points, ToBatch, flex, new_net};
use crate::common::{digest, options, run_world};

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

/// A training job: its world size, checkpoints, where its data fails or is counted, and how
/// its optimizer is sharded.
pub(crate) struct Job {
    pub world: usize,
    pub checkpoints: Option<CheckpointConfig>,
    pub fail_at: Option<(usize, usize)>,
    pub count: Option<(usize, Arc<AtomicUsize>)>,
    pub sharding: Sharding,
}

impl Job {
    /// `world` ranks, checkpoints as given, data that neither fails nor is counted.
    pub fn plain(world: usize, checkpoints: Option<CheckpointConfig>) -> Self {
        Job {
            world,
            checkpoints,
            fail_at: None,
            count: None,
            sharding: Sharding::None,
        }
    }
}

pub(crate) const JOB_EPOCHS: usize = 3;

/// The digest of the job at world 2 run straight through, as threads: what a stopped, killed or
/// restarted job must end with.
pub(crate) fn uninterrupted_digest() -> String {
    let straight = run_job(&Job::plain(2, None));
    digest(bytemuck::cast_slice(straight[0].as_ref().unwrap())).to_string()
}

/// Runs `job` on thread ranks; rank 0's seed-7 model is broadcast to the others.
pub(crate) fn run_job(job: &Job) -> Vec<Result<Vec<f32>, String>> {
    let device = flex();
    let net = Mutex::new(Some(new_net(&device, Some(7), false)));
    run_world(job.world, options(60), |group: ProcessGroup| {
        let model = match group.rank() {
            0 => net.lock().unwrap().take().unwrap(),
            _ => new_net(&device, None, false),
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
    let model = match ballast {
        0 => model,
        n => model.with_ballast(n, &flex()),
    };
    let sampler = DistributedSampler::for_group(&group).seed(5);
    let probe = Probe {
        inner: sampler.dataset(Points(DATA)),
        sampler: sampler.clone(),
        fail_at: job.fail_at,
        count: job.count.clone(),
    };
    let valid_sampler = DistributedSampler::for_group(&group).shuffle(false);
    let dir = super::thread_dir("job");
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
            .valid_sampler(&valid_sampler)
            .shard_optimizer(job.sharding)
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
    result.map(|r| parameters_to_vector(&r.model))
}

//! DdpLearner without a DistributedSampler: it shards the loaders itself (every sample on
//! exactly one rank, in training and validation), trains as the sampler path does where the
//! two give the ranks the same samples, and catches misuse before the first step: ranks with
//! different numbers of batches, a sampler it does not know of, a loader that shuffles under a
//! sampler.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use burn::data::dataloader::{DataLoader, DataLoaderBuilder};
use burn::data::dataset::{Dataset, DatasetError};
use burn::optim::SgdConfig;
use burn::train::SupervisedTraining;
use burn_ddp::ProcessGroup;
use burn_ddp::train::{
    DdpLearner, DdpTraining, DistributedSampler, ProgressOutput, QuietRenderer,
    parameters_to_vector,
};

use super::model::{
    Batch, Net, Points, SeenRows, ToBatch, flex, new_net, record_rows, record_steps, sample_ids,
};
use crate::common::{digest, options, run_world};
use crate::security::watch::{keep_warnings, logged, warning};

type Loader = Arc<dyn DataLoader<Batch>>;

/// What a rank ends with: its parameters' digest and the samples its steps saw.
struct Trained {
    params: u64,
    seen: SeenRows,
}

fn loader(data: impl Dataset<(Vec<f32>, usize)> + 'static, batch: usize) -> Loader {
    DataLoaderBuilder::new(ToBatch)
        .batch_size(batch)
        .build(data)
}

/// Trains `net` (rank 0's is broadcast) on the loaders for `epochs`, with the learner as
/// `configure` leaves it; the error in words if training fails.
fn train(
    group: Arc<ProcessGroup>,
    (train, valid): (Loader, Loader),
    epochs: usize,
    configure: impl FnOnce(DdpLearner<Net>) -> DdpLearner<Net>,
) -> Result<Trained, String> {
    let dir = super::thread_dir("sharding");
    let training = SupervisedTraining::new(&dir, train, valid)
        .renderer(Box::new(QuietRenderer))
        .with_application_logger(None)
        .num_epochs(epochs);
    let net = new_net(&flex(), Some(7), false);
    let learner = DdpLearner::with_group(group, net, SgdConfig::new().init(), 0.1)
        .progress(ProgressOutput::Keep);
    record_rows(true);
    let outcome = training.launch_ddp(configure(learner));
    let seen = record_rows(false);
    let _ = std::fs::remove_dir_all(&dir);
    let result = outcome.map_err(|e| {
        assert_eq!(format!("{e:?}"), e.to_string(), "Debug prints the message");
        e.to_string()
    })?;
    if let Some(e) = result.error {
        return Err(format!("{e:?}"));
    }
    Ok(Trained {
        params: digest(bytemuck::cast_slice(&parameters_to_vector(&result.model))),
        seen,
    })
}

/// How many times each sample of `data` was seen, over the ranks' notes.
fn times_seen<'a>(data: &Points, notes: impl Iterator<Item = &'a Vec<u64>>) -> Vec<usize> {
    let ids: HashMap<u64, usize> = sample_ids(data);
    let mut times = vec![0; data.0];
    for note in notes {
        for row in note {
            times[ids[row]] += 1;
        }
    }
    times
}

#[test]
fn without_a_sampler_every_sample_is_on_one_rank_each_epoch() {
    keep_warnings();
    let (train_items, valid_items, epochs) = (50, 25, 2);
    for world in [2, 3] {
        let ranks = run_world(world, options(60), |group| {
            let feed = (
                loader(Points(train_items), 4),
                loader(Points(valid_items), 4),
            );
            train(Arc::new(group), feed, epochs, |l| l).expect("training")
        });
        for r in &ranks {
            assert_eq!(
                r.params, ranks[0].params,
                "world {world}: replicas identical"
            );
        }
        let train_times = times_seen(&Points(train_items), ranks.iter().map(|r| &r.seen.train));
        assert_eq!(
            train_times,
            vec![epochs; train_items],
            "world {world}: training"
        );
        let valid_times = times_seen(&Points(valid_items), ranks.iter().map(|r| &r.seen.valid));
        assert_eq!(
            valid_times,
            vec![epochs; valid_items],
            "world {world}: validation"
        );
    }
    // Rank 0 said what it did, for each split; at world 3 the training slices (16, 17, 17
    // items in batches of 4) make 4 or 5 batches, and the ranks join.
    let wait = Duration::from_secs(5);
    let said = |needles: &[&str]| logged(needles, wait).is_some();
    assert!(said(&[
        "shards the training loader",
        "each of the 3 ranks",
        "of its 50 items",
        "rank 0: 16 items; ranks 1-2: 17 items",
        "reshuffle",
        "sorted by class",
    ]));
    assert!(said(&[
        "shards the validation loader",
        "each of the 2 ranks",
        "of its 25 items"
    ]));
    assert!(said(&[
        "training slices make different numbers of batches",
        "rank 0: 4 batches (16 items); ranks 1-2: 5 batches (17 items)",
    ]));
}

/// `inner` reordered so that a strided [`DistributedSampler`] without shuffle gives rank `r`
/// of `world` the contiguous slice `r` of `inner`: what slicing gives it.
struct Strided {
    inner: Points,
    world: usize,
}

impl Dataset<(Vec<f32>, usize)> for Strided {
    fn get(&self, i: usize) -> Result<(Vec<f32>, usize), DatasetError> {
        let per_rank = self.inner.0 / self.world;
        self.inner.get((i % self.world) * per_rank + i / self.world)
    }
    fn len(&self) -> usize {
        self.inner.0
    }
}

#[test]
fn sliced_training_equals_the_sampler_path_over_the_same_shares() {
    let (world, items) = (2, 48);
    let sliced = run_world(world, options(60), |group| {
        let feed = (loader(Points(items), 4), loader(Points(12), 4));
        train(Arc::new(group), feed, 2, |l| l).expect("sliced")
    });
    let sampled = run_world(world, options(60), |group| {
        let group = Arc::new(group);
        let sampler = DistributedSampler::for_group(&group).shuffle(false);
        let valid = DistributedSampler::for_group(&group)
            .shuffle(false)
            .pad(false);
        let data = Strided {
            inner: Points(items),
            world,
        };
        let feed = (
            loader(sampler.dataset(data), 4),
            loader(valid.dataset(Points(12)), 4),
        );
        train(group, feed, 2, |l| {
            l.sampler(&sampler).valid_sampler(&valid)
        })
        .expect("sampled")
    });
    // Same samples per rank and step: the same bits.
    assert_eq!(sliced[0].params, sampled[0].params);
    assert_eq!(
        sliced[0].seen.train, sampled[0].seen.train,
        "same order on rank 0"
    );
}

#[test]
fn ranks_with_different_numbers_of_batches_stop_before_the_first_step() {
    let errors = run_world(2, options(60), |group| {
        let group = Arc::new(group);
        let rank = group.rank();
        let sampler = DistributedSampler::for_group(&group);
        // 24 items per rank, in batches of 4 on rank 0 and 3 on rank 1.
        let feed = (
            loader(sampler.dataset(Points(48)), 4 - rank),
            loader(Points(8), 4),
        );
        record_steps(true);
        let error = train(group, feed, 1, |l| l.sampler(&sampler)).err();
        (error, record_steps(false).len())
    });
    for (rank, (error, steps)) in errors.iter().enumerate() {
        let error = error.as_deref().expect("an error");
        for needle in [
            "different numbers of training batches",
            "rank 0: 6 batches (24 items); rank 1: 8 batches (24 items)",
            "uneven_inputs(true)",
        ] {
            assert!(error.contains(needle), "rank {rank}: {needle:?} in {error}");
        }
        assert_eq!(*steps, 0, "rank {rank} trained before the check");
    }
    // Allowed with uneven inputs.
    run_world(2, options(60), |group| {
        let group = Arc::new(group);
        let sampler = DistributedSampler::for_group(&group);
        let feed = (
            loader(sampler.dataset(Points(48)), 4 - group.rank()),
            loader(Points(8), 4),
        );
        train(group, feed, 1, |l| l.sampler(&sampler).uneven_inputs(true)).expect("join")
    });
}

#[test]
fn a_sampler_the_learner_does_not_know_is_refused() {
    let errors = run_world(2, options(60), |group| {
        let group = Arc::new(group);
        let sampler = DistributedSampler::for_group(&group);
        // Not registered at all.
        let feed = (loader(sampler.dataset(Points(16)), 4), loader(Points(8), 4));
        let unregistered = train(group.clone(), feed, 1, |l| l).err();
        // One sampler under both loaders, registered for training only.
        let shared = DistributedSampler::for_group(&group);
        let feed = (
            loader(shared.dataset(Points(16)), 4),
            loader(shared.dataset(Points(8)), 4),
        );
        let half = train(group.clone(), feed, 1, |l| l.sampler(&shared)).err();
        // Registered for both: trains.
        let feed = (
            loader(shared.dataset(Points(16)), 4),
            loader(shared.dataset(Points(8)), 4),
        );
        let both = train(group, feed, 1, |l| {
            l.sampler(&shared).valid_sampler(&shared)
        });
        (unregistered, half, both.err())
    });
    for (unregistered, half, both) in errors {
        let unregistered = unregistered.expect("refused");
        assert!(unregistered.contains("is not registered"), "{unregistered}");
        assert!(
            unregistered.contains(".valid_sampler(&s)"),
            "{unregistered}"
        );
        let half = half.expect("refused");
        assert!(half.contains("registered for one split only"), "{half}");
        assert_eq!(both, None);
    }
}

#[test]
fn a_loader_that_shuffles_under_a_sampler_is_warned_about() {
    keep_warnings();
    let needle = "the training loader shuffles on its own under a DistributedSampler";
    for shuffle in [false, true] {
        run_world(2, options(60), |group| {
            let group = Arc::new(group);
            let sampler = DistributedSampler::for_group(&group).seed(1);
            let mut builder = DataLoaderBuilder::new(ToBatch).batch_size(8);
            if shuffle {
                builder = builder.shuffle(3);
            }
            let feed = (
                builder.build(sampler.dataset(Points(200))),
                loader(Points(8), 4),
            );
            train(group, feed, 1, |l| l.sampler(&sampler)).expect("training")
        });
        let warned = warning(
            &[needle],
            Duration::from_millis(if shuffle { 5000 } else { 200 }),
        );
        assert_eq!(
            warned.is_some(),
            shuffle,
            "loader shuffle {shuffle}: {warned:?}"
        );
    }
}

//! `DistributedSampler`: each rank's share of a dataset, reshuffled every epoch, as PyTorch's.
//!
//! The permutation of `0..len` is seeded with `seed + epoch`; the list is padded by repeating
//! from its start (or cut, with `drop_last`) to a multiple of the world size; rank `r` takes
//! positions `r, r + world, r + 2 * world, ...`. Every rank gets the same number of samples, so
//! uneven datasets cannot leave one rank waiting in a collective, and the union of the ranks'
//! i-th batches is the single-process i-th batch of the global batch size.
//!
//! For evaluation, [`DistributedSampler::pad`]`(false)` neither pads nor cuts: every sample is
//! seen exactly once, and the ranks' counts differ by at most one (`DdpLearner` validates such
//! uneven shards without waiting on each other, and its metrics count each sample once).
//!
//! Resuming mid-epoch ([`DistributedSampler::resume`]): the first `samples` positions of the
//! epoch's order are skipped and the rest is padded and sharded as above, so with the same world
//! size each rank continues exactly where it stopped, and with another world size the job sees
//! the samples it had not seen yet.
//!
//! Without a sampler, `DdpLearner` shards the loaders itself (see `shard.rs`). A sampler made by
//! [`DistributedSampler::for_group`] is known to its group, so that one which wraps a dataset
//! but is not registered with the learner (the loader would be sharded twice) stops training
//! before it starts; its datasets also log the first indices a loader asks for, which tells a
//! loader that shuffles on its own.

use std::marker::PhantomData;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};

use burn::data::dataset::{Dataset, DatasetError};

/// An epoch and how many positions of its order are skipped (not a checkpoint's
/// [`Position`](crate::train::Position), which also counts batches and the world size).
type EpochCursor = (usize, usize);

/// Decides which samples each rank sees. Cloning shares the epoch counter.
#[derive(Debug, Clone)]
pub struct DistributedSampler {
    rank: usize,
    world_size: usize,
    seed: u64,
    shuffle: bool,
    drop_last: bool,
    pad: bool,
    epoch: Arc<AtomicUsize>,
    /// Positions of the current epoch's order already consumed (by the whole job).
    skip: Arc<AtomicUsize>,
    /// The datasets this sampler (or a clone) wraps.
    datasets: Arc<Datasets>,
}

/// The datasets a sampler wraps, each with its access log.
#[derive(Debug, Default)]
struct Datasets(Mutex<Vec<Weak<AccessLog>>>);

/// The first dataset indices a loader asked for while recording (at most [`AccessLog::KEEP`]).
#[derive(Debug, Default)]
struct AccessLog {
    recording: AtomicBool,
    indices: Mutex<Vec<usize>>,
}

impl AccessLog {
    const KEEP: usize = 64;

    fn record(&self, index: usize) {
        if self.recording.load(Ordering::Relaxed) {
            let mut indices = crate::sync::lock(&self.indices);
            if indices.len() < Self::KEEP {
                indices.push(index);
            }
        }
    }
}

/// The samplers made for one process group ([`DistributedSampler::for_group`]), attached to
/// the group ([`crate::ProcessGroup::attachment`]).
#[derive(Debug, Default)]
pub(crate) struct SamplerRegistry(Mutex<Vec<DistributedSampler>>);

impl SamplerRegistry {
    fn add(&self, sampler: &DistributedSampler) {
        let mut samplers = crate::sync::lock(&self.0);
        samplers.push(sampler.clone());
    }

    /// The samplers made for the group, with the number of live datasets each wraps.
    pub(crate) fn in_use(&self) -> Vec<(DistributedSampler, usize)> {
        let samplers = crate::sync::lock(&self.0);
        (samplers.iter())
            .map(|s| (s.clone(), s.datasets_alive()))
            .filter(|(_, n)| *n > 0)
            .collect()
    }
}

fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl DistributedSampler {
    /// Rank `rank` of `world_size`, shuffling with seed 0, padding (PyTorch's defaults).
    pub fn new(rank: usize, world_size: usize) -> Self {
        assert!(
            rank < world_size,
            "rank {rank} not below world size {world_size}"
        );
        DistributedSampler {
            rank,
            world_size,
            seed: 0,
            shuffle: true,
            drop_last: false,
            pad: true,
            epoch: Arc::new(AtomicUsize::new(0)),
            skip: Arc::new(AtomicUsize::new(0)),
            datasets: Arc::default(),
        }
    }

    /// The sampler of this process in `group`. The group knows it: a `DdpLearner` of the group
    /// refuses to train while it wraps more datasets than the splits it is registered for
    /// ([`DdpLearner::sampler`](crate::train::DdpLearner::sampler),
    /// [`DdpLearner::valid_sampler`](crate::train::DdpLearner::valid_sampler)), since the learner
    /// would shard such a loader a second time.
    pub fn for_group(group: &crate::ProcessGroup) -> Self {
        let sampler = Self::new(group.rank(), group.world_size());
        group.attachment::<SamplerRegistry>().add(&sampler);
        sampler
    }

    /// Whether `other` is this sampler or one of its clones.
    pub(crate) fn same_as(&self, other: &DistributedSampler) -> bool {
        Arc::ptr_eq(&self.datasets, &other.datasets)
    }

    /// How many datasets made by [`DistributedSampler::dataset`] are alive.
    pub(crate) fn datasets_alive(&self) -> usize {
        let datasets = crate::sync::lock(&self.datasets.0);
        datasets.iter().filter(|d| d.strong_count() > 0).count()
    }

    /// Starts (clearing) or stops logging the indices loaders ask of this sampler's datasets.
    pub(crate) fn record_access(&self, on: bool) {
        let datasets = crate::sync::lock(&self.datasets.0);
        for log in datasets.iter().filter_map(Weak::upgrade) {
            if on {
                crate::sync::lock(&log.indices).clear();
            }
            log.recording.store(on, Ordering::Relaxed);
        }
    }

    /// The indices logged since [`DistributedSampler::record_access`]`(true)`, per dataset.
    pub(crate) fn accessed(&self) -> Vec<Vec<usize>> {
        let datasets = crate::sync::lock(&self.datasets.0);
        (datasets.iter().filter_map(Weak::upgrade))
            .map(|log| crate::sync::lock(&log.indices).clone())
            .collect()
    }

    /// Shuffle seed (must be the same on every rank).
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// Whether to shuffle (default true).
    pub fn shuffle(mut self, shuffle: bool) -> Self {
        self.shuffle = shuffle;
        self
    }

    /// Cut the tail instead of padding (default false).
    pub fn drop_last(mut self, drop_last: bool) -> Self {
        self.drop_last = drop_last;
        self
    }

    /// Whether the list is padded to a multiple of the world size (default true, as PyTorch).
    /// Without padding (and without `drop_last`) every sample is seen exactly once and the
    /// ranks' shares differ by at most one sample: use it for validation, so that metrics
    /// count every sample once whatever the world size.
    pub fn pad(mut self, pad: bool) -> Self {
        self.pad = pad;
        self
    }

    /// Selects the epoch (the learner calls it at the start of each epoch).
    pub fn set_epoch(&self, epoch: usize) {
        self.resume(epoch, 0);
    }

    /// Selects `epoch`, of which the job already consumed the first `samples` positions
    /// (the learner calls it when resuming from a checkpoint).
    pub fn resume(&self, epoch: usize, samples: usize) {
        self.skip.store(samples, Ordering::Release);
        self.epoch.store(epoch, Ordering::Release);
    }

    /// The current epoch.
    pub fn epoch(&self) -> usize {
        self.epoch.load(Ordering::Acquire)
    }

    /// Samples of this rank for a dataset of `len` items.
    pub fn num_samples(&self, len: usize) -> usize {
        if self.drop_last {
            len / self.world_size
        } else if self.pad {
            len.div_ceil(self.world_size)
        } else {
            len.saturating_sub(self.rank).div_ceil(self.world_size)
        }
    }

    /// This rank's dataset indices for the current epoch (past the skipped part), in order.
    pub fn indices(&self, len: usize) -> Vec<usize> {
        self.indices_for(len, self.cursor())
    }

    /// The current epoch and how many of its positions are skipped.
    fn cursor(&self) -> EpochCursor {
        (
            self.epoch.load(Ordering::Acquire),
            self.skip.load(Ordering::Acquire),
        )
    }

    fn indices_for(&self, len: usize, (epoch, skip): EpochCursor) -> Vec<usize> {
        let mut order: Vec<usize> = (0..len).collect();
        if self.shuffle {
            let mut state = self.seed.wrapping_add(epoch as u64);
            for i in (1..len).rev() {
                let j = (splitmix(&mut state) % (i as u64 + 1)) as usize;
                order.swap(i, j);
            }
        }
        let mut rest = order[skip.min(len)..].to_vec();
        let total = if self.pad || self.drop_last {
            self.num_samples(rest.len()) * self.world_size
        } else {
            rest.len()
        };
        if total <= rest.len() {
            rest.truncate(total);
        } else {
            // Padding repeats the epoch's order from its start, as without a skip.
            let mut k = 0;
            while rest.len() < total {
                rest.push(order[k % len]);
                k += 1;
            }
        }
        rest.into_iter()
            .skip(self.rank)
            .step_by(self.world_size)
            .collect()
    }

    /// Wraps `dataset` so that it yields this rank's share, in the sampler's order.
    pub fn dataset<I, D: Dataset<I>>(&self, dataset: D) -> DistributedDataset<D, I> {
        let log = Arc::new(AccessLog::default());
        let mut datasets = crate::sync::lock(&self.datasets.0);
        datasets.retain(|d| d.strong_count() > 0);
        datasets.push(Arc::downgrade(&log));
        DistributedDataset {
            sampler: self.clone(),
            inner: dataset,
            cache: Mutex::new(None),
            log,
            _item: PhantomData,
        }
    }
}

/// A dataset restricted to one rank's share (see [`DistributedSampler::dataset`]). Build the
/// data loader without its own shuffle: the sampler shuffles, per epoch.
pub struct DistributedDataset<D, I> {
    sampler: DistributedSampler,
    inner: D,
    /// Indices of the last (epoch, skip) asked for.
    cache: Mutex<Option<(EpochCursor, Arc<Vec<usize>>)>>,
    log: Arc<AccessLog>,
    _item: PhantomData<fn() -> I>,
}

impl<D: Dataset<I>, I> DistributedDataset<D, I> {
    fn indices(&self) -> Arc<Vec<usize>> {
        let cursor = self.sampler.cursor();
        let mut cache = crate::sync::lock(&self.cache);
        match &*cache {
            Some((p, idx)) if *p == cursor => idx.clone(),
            _ => {
                let idx = Arc::new(self.sampler.indices_for(self.inner.len(), cursor));
                *cache = Some((cursor, idx.clone()));
                idx
            }
        }
    }
}

impl<D: Dataset<I>, I> Dataset<I> for DistributedDataset<D, I> {
    fn get(&self, index: usize) -> Result<I, DatasetError> {
        self.log.record(index);
        let indices = self.indices();
        match indices.get(index) {
            Some(i) => self.inner.get(*i),
            None => Err(DatasetError::new(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!(
                    "index {index} is beyond this rank's {} samples",
                    indices.len()
                ),
            ))),
        }
    }

    fn len(&self) -> usize {
        self.indices().len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_are_disjoint_cover_and_equal_sized() {
        for world in 1..=5 {
            for len in [0, 1, 7, 10, 33] {
                let shards: Vec<Vec<usize>> = (0..world)
                    .map(|r| DistributedSampler::new(r, world).seed(3).indices(len))
                    .collect();
                let n = len.div_ceil(world);
                assert!(shards.iter().all(|s| s.len() == n), "equal counts");
                let mut all: Vec<usize> = shards.concat();
                all.sort();
                all.dedup();
                assert_eq!(all, (0..len).collect::<Vec<_>>(), "covers every item");
            }
        }
    }

    #[test]
    fn without_padding_every_sample_once() {
        for world in 1..=4 {
            for len in [0, 1, 5, 10, 1025] {
                let shards: Vec<Vec<usize>> = (0..world)
                    .map(|r| DistributedSampler::new(r, world).pad(false).indices(len))
                    .collect();
                let mut all = shards.concat();
                assert_eq!(all.len(), len, "no sample added or lost");
                all.sort();
                assert_eq!(all, (0..len).collect::<Vec<_>>());
                for (r, s) in shards.iter().enumerate() {
                    let n = DistributedSampler::new(r, world)
                        .pad(false)
                        .num_samples(len);
                    assert_eq!(s.len(), n);
                    assert!(
                        s.len() + 1 >= len.div_ceil(world),
                        "counts differ by one at most"
                    );
                }
            }
        }
    }

    #[test]
    fn epochs_reshuffle_and_drop_last_cuts() {
        let s = DistributedSampler::new(0, 2).seed(1);
        let e0 = s.indices(100);
        s.set_epoch(1);
        assert_ne!(e0, s.indices(100));
        s.set_epoch(0);
        assert_eq!(e0, s.indices(100), "same epoch, same order");
        let d = DistributedSampler::new(1, 3).drop_last(true);
        assert_eq!(d.indices(10).len(), 3);
    }

    #[test]
    fn resuming_skips_what_the_job_consumed() {
        for (len, world, drop_last) in [
            (50usize, 3, false),
            (50, 3, true),
            (7, 2, false),
            (2, 4, false),
        ] {
            let make = |r| {
                DistributedSampler::new(r, world)
                    .seed(4)
                    .drop_last(drop_last)
            };
            for done in 0..=len.div_ceil(world) {
                // Same world size: each rank continues with the rest of its own shard.
                for r in 0..world {
                    let s = make(r);
                    s.set_epoch(2);
                    let full = s.indices(len);
                    s.resume(2, done * world);
                    assert_eq!(s.indices(len), full[done.min(full.len())..], "rank {r}");
                }
            }
            // Another world size: the new ranks share exactly what was not seen yet.
            let old = DistributedSampler::new(0, 1).seed(4);
            old.set_epoch(2);
            let order = old.indices(len);
            let done = 2 * world;
            let resumed: Vec<usize> = (0..world + 1)
                .flat_map(|r| {
                    let s = DistributedSampler::new(r, world + 1).seed(4);
                    s.resume(2, done.min(len));
                    s.indices(len)
                })
                .collect();
            let mut want: Vec<usize> = order[done.min(len)..].to_vec();
            let mut got = resumed.clone();
            got.sort();
            got.dedup();
            want.sort();
            assert_eq!(got, want);
        }
    }

    #[test]
    fn union_of_ith_batches_is_the_global_ith_batch() {
        let (len, world, b) = (50, 3, 4);
        let global = DistributedSampler::new(0, 1).seed(9).indices(len);
        let shards: Vec<_> = (0..world)
            .map(|r| DistributedSampler::new(r, world).seed(9).indices(len))
            .collect();
        for i in 0..len / (world * b) {
            let mut union: Vec<usize> = shards
                .iter()
                .flat_map(|s| s[i * b..(i + 1) * b].to_vec())
                .collect();
            let mut want = global[i * world * b..(i + 1) * world * b].to_vec();
            union.sort();
            want.sort();
            assert_eq!(union, want, "batch {i}");
        }
    }
}

//! The loaders before the first step: each split without a registered [`DistributedSampler`]
//! is sharded by `DdpLearner` itself (contiguous slices, every item on exactly one rank), then
//! the ranks agree on what each one holds: a training loader with more batches on one rank
//! than another stops every rank here, naming the ranks and their counts, instead of ending in
//! a desync error an epoch later; a loader that shuffles on its own under a sampler is warned
//! about.
//!
//! A split is measured by reading its first batch: the batch size is the number of items it
//! took (burn's loaders do not tell it otherwise), and the batches of the epoch follow from it.

use std::ops::Range;
use std::sync::Arc;

use burn::data::dataloader::DataLoader;

use crate::error::{DdpError, Result};
use crate::status::name_ranks;
use crate::train::learner::sampler::DistributedSampler;
use crate::train::learner::strategy::DdpStrategy;
use crate::wire::{DecodeError, Reader, Writer};

/// One split's loader, as this rank will iterate it.
pub(super) struct Shard<I> {
    /// This rank's loader (the user's, or this rank's slice of it).
    pub loader: Arc<dyn DataLoader<I>>,
    /// The user's loader and this rank's slice of it, when `DdpLearner` sharded it.
    sliced: Option<(Arc<dyn DataLoader<I>>, Range<usize>)>,
    /// Items in a batch (the first batch's; 1 for an empty loader).
    batch_size: usize,
}

impl<I> Shard<I> {
    /// The loader of an epoch resumed after the job consumed `samples` items of it: a sliced
    /// loader skips the same fraction of this rank's slice (with the same world size and
    /// without the loader's own shuffle, exactly the items this rank had done). A loader over
    /// a sampler is skipped by the sampler.
    pub fn resumed(&self, samples: usize) -> Arc<dyn DataLoader<I>> {
        match &self.sliced {
            Some((whole, range)) if samples > 0 && whole.num_items() > 0 => {
                let total = whole.num_items();
                let done = (samples.min(total) * range.len()).div_ceil(total);
                // Whole batches: a rank never resumes inside one.
                let done = done.div_ceil(self.batch_size) * self.batch_size;
                whole.slice((range.start + done).min(range.end), range.end)
            }
            _ => self.loader.clone(),
        }
    }
}

/// One split's figures on one rank, as all-gathered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Counts {
    /// Items of the loader the user gave (before slicing).
    given: u64,
    /// Items this rank will see per epoch.
    items: u64,
    /// Batches this rank will run per epoch.
    batches: u64,
    /// Whether the loader seems to shuffle on its own under a sampler.
    shuffles: bool,
}

impl Counts {
    fn encode(&self, w: &mut Writer) {
        w.u64(self.given)
            .u64(self.items)
            .u64(self.batches)
            .u8(u8::from(self.shuffles));
    }

    fn decode(r: &mut Reader<'_>) -> std::result::Result<Self, DecodeError> {
        Ok(Counts {
            given: r.u64()?,
            items: r.u64()?,
            batches: r.u64()?,
            shuffles: r.u8()? != 0,
        })
    }
}

/// A split and how it is fed.
pub(super) struct Split<'a> {
    /// `training` or `validation`.
    name: &'static str,
    /// The samplers registered for it.
    samplers: &'a [DistributedSampler],
    /// Whether ranks may hold different numbers of batches.
    uneven: bool,
}

impl<'a> Split<'a> {
    /// The split `name`, fed through `samplers` (none: sharded by slicing), whose ranks may
    /// hold different numbers of batches if `uneven`.
    pub fn new(name: &'static str, samplers: &'a [DistributedSampler], uneven: bool) -> Self {
        Split {
            name,
            samplers,
            uneven,
        }
    }

    /// The `DdpLearner` method that registers this split's sampler.
    fn registration(&self) -> &'static str {
        match self.name {
            "training" => "DdpLearner::sampler",
            _ => "DdpLearner::valid_sampler",
        }
    }
}

/// What the ranks agreed on the loaders.
pub(super) struct Plan<T, V> {
    /// The training split.
    pub train: Shard<T>,
    /// The validation split.
    pub valid: Shard<V>,
    /// Whether training runs with join: enabled by the user, or because slicing left ranks
    /// with different numbers of batches.
    pub train_uneven: bool,
}

impl DdpStrategy {
    /// Shards the splits without a registered sampler (when `shard_loaders` is on), measures
    /// both, and agrees with the other ranks (see the module's documentation).
    pub(super) fn plan_loaders<T, V>(
        &self,
        (train, train_split): (Arc<dyn DataLoader<T>>, Split<'_>),
        (valid, valid_split): (Arc<dyn DataLoader<V>>, Split<'_>),
    ) -> Result<Plan<T, V>> {
        let (train, train_counts) = self.measure(train, &train_split)?;
        let (valid, valid_counts) = self.measure(valid, &valid_split)?;
        let mut mine = Writer::default();
        train_counts.encode(&mut mine);
        valid_counts.encode(&mut mine);
        let said = self.group.all_gather_object(mine.buf)?;
        let decode = |r: &mut Reader<'_>| Ok((Counts::decode(r)?, Counts::decode(r)?));
        let (trains, valids): (Vec<_>, Vec<_>) = said
            .decode_each("loader counts", decode)?
            .into_iter()
            .unzip();
        let train_uneven = self.agree(&train_split, train.sliced.is_some(), &trains)?;
        self.agree(&valid_split, valid.sliced.is_some(), &valids)?;
        Ok(Plan {
            train,
            valid,
            train_uneven,
        })
    }

    /// This rank's loader of a split (sliced where `DdpLearner` shards it) and its counts.
    fn measure<I>(
        &self,
        loader: Arc<dyn DataLoader<I>>,
        split: &Split<'_>,
    ) -> Result<(Shard<I>, Counts)> {
        let (rank, world) = (self.group.rank(), self.group.world_size());
        let given = loader.num_items();
        let sliced = (split.samplers.is_empty() && self.shard_loaders && world > 1).then(|| {
            let range = given * rank / world..given * (rank + 1) / world;
            (loader.clone(), range)
        });
        let mine = match &sliced {
            Some((whole, range)) => whole.slice(range.start, range.end),
            None => loader,
        };
        for s in split.samplers {
            s.record_access(true);
        }
        let batch_size = self.first_batch(&mine, split);
        for s in split.samplers {
            s.record_access(false);
        }
        let batch_size = batch_size?;
        let shuffles = (split.samplers.iter())
            .flat_map(|s| s.accessed())
            .any(|indices| looks_shuffled(&indices));
        let items = mine.num_items();
        let counts = Counts {
            given: given as u64,
            items: items as u64,
            batches: items.div_ceil(batch_size) as u64,
            shuffles,
        };
        let shard = Shard {
            loader: mine,
            sliced,
            batch_size,
        };
        Ok((shard, counts))
    }

    /// The size of the loader's first batch (1 if it has none). Under a sampler, reads up to
    /// four batches until the sampler's datasets logged enough indices to tell a shuffle.
    fn first_batch<I>(&self, loader: &Arc<dyn DataLoader<I>>, split: &Split<'_>) -> Result<usize> {
        if loader.num_items() == 0 {
            return Ok(1);
        }
        let rank = self.group.rank();
        let mut batches = loader.iter();
        let mut batch_size = None;
        for _ in 0..4 {
            match batches.next() {
                None => break,
                Some(Err(e)) => {
                    return Err(DdpError::Data {
                        rank,
                        reason: format!("reading the first {} batch: {e}", split.name),
                    });
                }
                Some(Ok(_)) => {}
            }
            batch_size.get_or_insert(batches.progress().items_processed.max(1));
            let logged = (split.samplers.iter())
                .flat_map(|s| s.accessed())
                .map(|indices| indices.len())
                .max()
                .unwrap_or(LOGGED_ENOUGH);
            if logged >= LOGGED_ENOUGH {
                break;
            }
        }
        Ok(batch_size.unwrap_or(1))
    }

    /// Checks one split's counts on every rank; returns whether it runs with join.
    fn agree(&self, split: &Split<'_>, sliced: bool, counts: &[Counts]) -> Result<bool> {
        let main = self.group.rank() == 0;
        let name = split.name;
        let world = counts.len();
        if sliced {
            if counts.iter().any(|c| c.given != counts[0].given) {
                return Err(DdpError::Disagreement(format!(
                    "the ranks' {name} loaders hold different numbers of items ({}) and no \
                     DistributedSampler is registered for them. DdpLearner shards a loader that \
                     every rank builds over the same whole dataset: give every rank the same \
                     dataset, register the sampler that shares it ({}), or, if your \
                     loaders already hold each rank's share, DdpLearner::shard_loaders(false)",
                    describe(counts, |c| format!("{} items", c.given)),
                    split.registration(),
                )));
            }
            if main {
                log::info!(
                    "DdpLearner shards the {name} loader (no DistributedSampler registered): \
                     each of the {world} ranks takes a contiguous slice of its {} items, every \
                     item on exactly one rank ({}). A DistributedSampler ({}) would \
                     reshuffle the whole dataset across ranks every epoch; with slices a rank \
                     only ever sees its own (the loader's shuffle reorders within it), so a \
                     dataset sorted by class gives each rank a skewed share",
                    counts[0].given,
                    describe(counts, |c| format!("{} items", c.items)),
                    split.registration(),
                );
            }
        }
        if counts.iter().any(|c| c.shuffles) && main {
            log::warn!(
                "the {name} loader shuffles on its own under a DistributedSampler (ranks: {}): \
                 the sampler already shuffles, the same way on every rank; build the loader \
                 without .shuffle(seed) and give the seed to the sampler",
                describe_ranks(counts, |c| c.shuffles),
            );
        }
        let batches_differ = counts.iter().any(|c| c.batches != counts[0].batches);
        if !batches_differ || split.uneven {
            return Ok(split.uneven && batches_differ);
        }
        let counted = describe(counts, |c| {
            format!("{} batches ({} items)", c.batches, c.items)
        });
        if sliced {
            if main {
                log::info!(
                    "the {name} slices make different numbers of batches ({counted}): the ranks \
                     whose batches run out take part in the others' last steps with zero \
                     gradients (as with DdpLearner::uneven_inputs(true))"
                );
            }
            return Ok(true);
        }
        Err(DdpError::Disagreement(format!(
            "the ranks have different numbers of {name} batches per epoch ({counted}), so they \
             would run different numbers of optimizer steps and stop each other in a \
             collective. Give every rank as many batches: build the loaders over \
             DistributedSampler::for_group(&group).dataset(ds) (equal shares), or drop the \
             sampler and let DdpLearner shard the loader, or use the same batch size on every \
             rank; or accept uneven shares with DdpLearner::uneven_inputs(true)"
        )))
    }
}

/// Indices logged that tell a shuffle from loading in order.
const LOGGED_ENOUGH: usize = 16;

/// Whether a loader asked for these dataset indices in shuffled order: loading in order
/// (one thread, or a few each on its own contiguous part) asks for a few runs of consecutive
/// indices; a shuffle asks for scattered ones.
fn looks_shuffled(indices: &[usize]) -> bool {
    let mut sorted = indices.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    if sorted.len() < 8 {
        return false;
    }
    let runs = 1 + sorted.windows(2).filter(|w| w[1] != w[0] + 1).count();
    runs * 2 > sorted.len()
}

/// `rank 0: 17 batches, rank 1: 16 batches` (ranks with the same figure are grouped).
fn describe(counts: &[Counts], figure: impl Fn(&Counts) -> String) -> String {
    let mut groups: Vec<(String, Vec<usize>)> = Vec::new();
    for (rank, c) in counts.iter().enumerate() {
        let f = figure(c);
        match groups.iter_mut().find(|(g, _)| *g == f) {
            Some((_, ranks)) => ranks.push(rank),
            None => groups.push((f, vec![rank])),
        }
    }
    let parts: Vec<String> = groups
        .into_iter()
        .map(|(f, ranks)| format!("{}: {f}", name_ranks(&ranks)))
        .collect();
    parts.join("; ")
}

/// The ranks for which `pred` holds, as a list.
fn describe_ranks(counts: &[Counts], pred: impl Fn(&Counts) -> bool) -> String {
    let ranks: Vec<usize> = (0..counts.len()).filter(|r| pred(&counts[*r])).collect();
    name_ranks(&ranks)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shuffled_access_is_told_from_loading_in_order() {
        assert!(!looks_shuffled(&(0..32).collect::<Vec<_>>()));
        // Two worker threads, each on its own contiguous part, interleaved.
        let two: Vec<usize> = (0..16).flat_map(|i| [i, 500 + i]).collect();
        assert!(!looks_shuffled(&two));
        let scattered = [
            913, 4, 377, 650, 81, 222, 1000, 47, 530, 768, 312, 9, 600, 145, 877, 430,
        ];
        assert!(looks_shuffled(&scattered));
        assert!(!looks_shuffled(&[5, 3, 9]), "too few to tell");
    }

    #[test]
    fn counts_are_described_by_rank() {
        let c = |batches| Counts {
            given: 10,
            items: 5,
            batches,
            shuffles: false,
        };
        let counts = [c(3), c(3), c(4)];
        assert_eq!(
            describe(&counts, |c| format!("{} batches", c.batches)),
            "ranks 0-1: 3 batches; rank 2: 4 batches"
        );
    }
}

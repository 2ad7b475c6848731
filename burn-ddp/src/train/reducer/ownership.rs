//! Sharded optimizer state and gradients (ZeRO stages 1 and 2): each rank owns a part of the
//! model's parameters, and only the owner steps a parameter and keeps its optimizer state.
//!
//! Ownership ([`Owners`], [`place`]) is planned from the bucket plan, which every rank builds
//! alike from the sizes in visit order and the bucket settings: the tensors alone in a bucket
//! (those over the cap) largest first to the least loaded rank, then each other bucket's
//! tensors, largest first, to the rank that owns the fewest of that bucket's elements, among
//! those still within `1/N` of the model plus its largest tensor. So no rank's share of the
//! optimizer state exceeds `1/N` by more than the largest tensor, even when one tensor (a
//! vocabulary embedding) is larger than `1/N`, and most buckets are cut into nearly equal
//! parts (balanced reduce-scatters and all-gathers). A tensor is never split between ranks:
//! burn's optimizers step whole tensors, and keep state only for the tensors they are given
//! gradients for (`ModuleOptimizer`'s mapper skips a parameter without a gradient); cutting
//! one would need the optimizer to step a slice of a parameter, which burn-train's `Learner`
//! (the only way to its optimizer) cannot do. So a tensor alone in its bucket is reduced to
//! one rank and gathered from it: that bucket's parts are not even. Each bucket is then laid
//! out owner by owner, so that a rank's parameters lie together in it.
//!
//! A step: the gradients are averaged (all-reduced for [`Sharding::Optimizer`], reduce-scattered
//! for [`Sharding::OptimizerAndGradients`]), the optimizer steps the rank's own parameters, and
//! each bucket's updated parameters are all-gathered from their owners. The values that arrive
//! are put in place by a second optimizer call in which a parameter group of the tensors this
//! rank does not own has an optimizer that takes its "gradient" as the new value
//! ([`TakeOwners`]): burn-train's `Learner` offers no other way to change its model.

use std::ops::Range;

use burn::module::ParamGroup;
use burn::optim::{LearningRate, Optimizer};
use burn::tensor::{Device, Tensor};

use crate::train::reducer::bucket::{Bucket, BucketPlan};

/// How `DdpLearner` shards the optimizer's work across the ranks (ZeRO).
///
/// ```
/// # use burn::train::LearnerModel;
/// use burn_ddp::train::{DdpLearner, Sharding};
/// # fn configure<M: LearnerModel>(learner: DdpLearner<M>) -> DdpLearner<M> {
/// let learner = learner.shard_optimizer(Sharding::OptimizerAndGradients);
/// # learner }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Sharding {
    /// Every rank keeps the whole optimizer state and steps every parameter (plain DDP).
    #[default]
    None,
    /// ZeRO-1: each rank keeps the optimizer state of its own parameters (about 1/N of it) and
    /// steps only those; gradients are all-reduced as in plain DDP (every rank holds them all),
    /// and the updated parameters are all-gathered from their owners.
    Optimizer,
    /// ZeRO-2: as [`Sharding::Optimizer`], but gradients are reduce-scattered, so each rank
    /// receives (and keeps) only its own parameters' averaged gradients; a step sends what a
    /// plain DDP step sends (a reduce-scatter and an all-gather move what an all-reduce moves).
    OptimizerAndGradients,
}

impl Sharding {
    /// Whether parameters are owned by ranks.
    pub(crate) fn shards(self) -> bool {
        self != Sharding::None
    }
}

impl std::fmt::Display for Sharding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Sharding::None => "none",
            Sharding::Optimizer => "optimizer",
            Sharding::OptimizerAndGradients => "optimizer and gradients",
        })
    }
}

/// Which rank owns each trainable parameter, and the bucket plan laid out owner by owner.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Owners {
    /// The buckets, each with its parameters grouped by owner (rank 0's first).
    pub plan: BucketPlan,
    /// Elements of each bucket that each rank owns, by bucket then rank.
    pub parts: Vec<Vec<usize>>,
    /// The owner of each trainable parameter, by index in visit order.
    pub owner: Vec<usize>,
    /// This rank.
    pub rank: usize,
}

impl Owners {
    /// Plans the ownership of parameters of `sizes[i]` elements, bucketed as `plan`, among
    /// `world` ranks, as seen by `rank` (see [`place`]).
    pub(crate) fn new(plan: &BucketPlan, sizes: &[usize], world: usize, rank: usize) -> Self {
        let world = world.max(1);
        let owner = place(plan, sizes, world);
        let mut buckets = Vec::with_capacity(plan.buckets.len());
        let mut parts = Vec::with_capacity(plan.buckets.len());
        for bucket in &plan.buckets {
            let mut load = vec![0usize; world];
            for &p in &bucket.params {
                load[owner[p]] += sizes[p];
            }
            // Owner by owner, each keeping the bucket's order.
            let mut params = bucket.params.clone();
            params.sort_by_key(|&p| owner[p]);
            let mut offsets = Vec::with_capacity(params.len());
            let mut len = 0;
            for &p in &params {
                offsets.push(len);
                len += sizes[p];
            }
            buckets.push(Bucket {
                params,
                offsets,
                len,
            });
            parts.push(load);
        }
        Owners {
            plan: BucketPlan { buckets },
            parts,
            owner,
            rank,
        }
    }

    /// Whether this rank owns trainable parameter `p`.
    pub(crate) fn owns(&self, p: usize) -> bool {
        self.owner.get(p) == Some(&self.rank)
    }

    /// Drops what belongs to parameters this rank does not own (`per_param` in visit order).
    pub(crate) fn keep_own<T>(&self, per_param: &mut [Option<T>]) {
        for (p, value) in per_param.iter_mut().enumerate() {
            if !self.owns(p) {
                *value = None;
            }
        }
    }

    /// The elements of bucket `b` this rank owns.
    pub(crate) fn window(&self, b: usize) -> Range<usize> {
        let parts = &self.parts[b];
        let start: usize = parts[..self.rank].iter().sum();
        start..start + parts[self.rank]
    }

    /// Elements this rank owns in all.
    #[cfg(test)]
    pub(crate) fn owned_elements(&self) -> usize {
        self.parts.iter().map(|p| p[self.rank]).sum()
    }
}

/// The owner of each parameter (of `sizes[i]` elements, bucketed as `plan`) among `world`
/// ranks: a function of the plan and the sizes alone, so every rank computes the same.
///
/// First the tensors alone in their bucket (those over the bucket cap among them), largest
/// first, each to the rank that owns the fewest elements so far: such a bucket cannot be cut
/// between ranks anyway, and placing the largest tensors first is what keeps the shares even
/// (a vocabulary embedding placed last would land on a rank that already has its share).
/// Then the other buckets in plan order, each tensor largest first to the rank that owns the
/// fewest of that bucket's elements (so that its reduce-scatter and all-gather parts are
/// even), among the ranks it leaves within the limit: `1/N` of the model plus the largest
/// tensor of such a bucket, or the most a rank holds after the first pass if that is more.
/// When no rank is within it, the rank that owns the fewest elements in all. Every choice is
/// either within the limit or to the least loaded rank, so no rank's share exceeds `1/N` of
/// the model by more than the largest tensor (list scheduling's bound).
fn place(plan: &BucketPlan, sizes: &[usize], world: usize) -> Vec<usize> {
    let world = world.max(1);
    let mut owner = vec![0; sizes.len()];
    let mut total = vec![0usize; world];
    let least = |total: &[usize]| (0..world).min_by_key(|&r| (total[r], r)).unwrap_or(0);
    let alone = |b: &&Bucket| b.params.len() == 1;
    let mut single: Vec<usize> = (plan.buckets.iter().filter(alone))
        .flat_map(|b| b.params.iter().copied())
        .collect();
    single.sort_by_key(|&p| (std::cmp::Reverse(sizes[p]), p));
    for p in single {
        let r = least(&total);
        owner[p] = r;
        total[r] += sizes[p];
    }
    // The limit, times `world` (whole numbers): `1/N` of the model plus the largest tensor
    // of a shared bucket, or the fullest rank after the first pass.
    let shared = || plan.buckets.iter().filter(|b| b.params.len() > 1);
    let largest = (shared().flat_map(|b| &b.params))
        .map(|&p| sizes[p])
        .max()
        .unwrap_or(0);
    let fullest = total.iter().copied().max().unwrap_or(0);
    let limit = (sizes.iter().sum::<usize>() + world * largest).max(world * fullest);
    for bucket in shared() {
        let mut by_size: Vec<usize> = bucket.params.clone();
        by_size.sort_by_key(|&p| (std::cmp::Reverse(sizes[p]), p));
        let mut load = vec![0usize; world];
        for p in by_size {
            let r = (0..world)
                .filter(|&r| world * (total[r] + sizes[p]) <= limit)
                .min_by_key(|&r| (load[r], total[r], r))
                .unwrap_or_else(|| least(&total));
            owner[p] = r;
            load[r] += sizes[p];
            total[r] += sizes[p];
        }
    }
    owner
}

/// The optimizer of the parameters a rank does not own: their "gradient" is the value their
/// owner computed, which becomes the parameter. It keeps no state.
#[derive(Debug, Clone, Copy)]
pub(crate) struct TakeOwners;

impl Optimizer for TakeOwners {
    type State<const D: usize> = ();

    fn step<const D: usize>(
        &self,
        _lr: LearningRate,
        _tensor: Tensor<D>,
        value: Tensor<D>,
        _state: Option<()>,
    ) -> (Tensor<D>, Option<()>) {
        (value, None)
    }

    fn to_device<const D: usize>(state: (), _device: &Device) {
        state
    }
}

/// Paths per regular expression of [`take_owners_group`]: each compiles in milliseconds,
/// far within the regex crate's size limit.
const PATHS_PER_PATTERN: usize = 4096;

/// The parameter group of the trainable parameters at `paths` (their module paths), for
/// [`TakeOwners`]: anchored regular expressions of the paths, which burn matches in time
/// proportional to a path's length, not to the number of paths (`ParamGroup::from_paths`
/// compares each parameter with every path: burn's optimizer looks up the group of every
/// parameter without optimizer state at each step, which all of these are, so that was
/// `O(P^2)` per step). Empty `paths`: a group of no parameter.
pub(crate) fn take_owners_group(paths: &[String]) -> ParamGroup {
    if paths.is_empty() {
        return ParamGroup::from_paths(Vec::<String>::new());
    }
    let patterns: Vec<String> = (paths.chunks(PATHS_PER_PATTERN))
        .map(|chunk| {
            let alternatives: Vec<String> = chunk.iter().map(|p| escape(p)).collect();
            format!("^(?:{})$", alternatives.join("|"))
        })
        .collect();
    ParamGroup::from_any_regexes(patterns).unwrap_or_else(|e| {
        log::debug!("matching {} paths one by one: {e:?}", paths.len());
        ParamGroup::from_paths(paths.to_vec())
    })
}

/// `text` as a regular expression that matches exactly it (the characters `regex::escape`
/// escapes).
fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        if "\\.+*?()|[]{}^$#&-~".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod placement_tests;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::train::BucketConfig;

    fn plan_of(sizes: &[usize], cap: usize) -> BucketPlan {
        let cfg = BucketConfig {
            cap_bytes: cap * 4,
            first_cap_bytes: cap * 4,
        };
        BucketPlan::new(sizes, 4, &cfg)
    }

    #[test]
    fn every_parameter_has_one_owner_and_buckets_are_cut_evenly() {
        let sizes: Vec<usize> = (0..40).map(|i| (i * 37) % 100 + 1).collect();
        let plan = plan_of(&sizes, 400);
        for world in 1..=4 {
            let owners: Vec<Owners> = (0..world)
                .map(|r| Owners::new(&plan, &sizes, world, r))
                .collect();
            // The same plan on every rank.
            assert!(owners.iter().all(|o| o.plan == owners[0].plan));
            let o = &owners[0];
            for (b, bucket) in o.plan.buckets.iter().enumerate() {
                assert_eq!(o.parts[b].iter().sum::<usize>(), bucket.len);
                // Owner-major: each rank's parameters lie in its window.
                for (k, &p) in bucket.params.iter().enumerate() {
                    let window = owners[o.owner[p]].window(b);
                    let range = bucket.offsets[k]..bucket.offsets[k] + sizes[p];
                    assert!(window.start <= range.start && range.end <= window.end);
                }
                // Balanced within the largest tensor of the bucket.
                let largest = bucket.params.iter().map(|&p| sizes[p]).max().unwrap_or(0);
                let (lo, hi) = (o.parts[b].iter().min(), o.parts[b].iter().max());
                assert!(
                    hi.unwrap() - lo.unwrap() <= largest,
                    "bucket {b}: {:?}",
                    o.parts[b]
                );
            }
            let owned: Vec<usize> = owners.iter().map(Owners::owned_elements).collect();
            assert_eq!(owned.iter().sum::<usize>(), sizes.iter().sum::<usize>());
            let per_rank = sizes.iter().sum::<usize>() / world;
            for (r, &n) in owned.iter().enumerate() {
                assert!(
                    n.abs_diff(per_rank) <= 100,
                    "rank {r} owns {n} of ~{per_rank}"
                );
            }
            for p in 0..sizes.len() {
                assert_eq!((0..world).filter(|&r| owners[r].owns(p)).count(), 1);
            }
        }
    }
}

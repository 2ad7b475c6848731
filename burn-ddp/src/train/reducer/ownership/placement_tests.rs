//! Tests of what ownership costs: the ranks' shares with tensors of any size (one larger than
//! a rank's share among them), and the group of the parameters a rank does not own, which
//! burn's optimizer resolves at every step.

use burn::module::{Module, Param, ParamGroup, ParamId};
use burn::nn::{Linear, LinearConfig};
use burn::optim::{GradientsParams, SgdConfig};
use burn::tensor::{Device, Tensor};

use super::*;
use crate::train::BucketConfig;
use crate::train::reducer::params::layout;

/// Each rank's elements under the placement of `sizes` among `world` ranks, buckets as `cfg`.
fn shares(sizes: &[usize], world: usize, cfg: &BucketConfig) -> Vec<usize> {
    let plan = BucketPlan::new(sizes, 4, cfg);
    let owners = Owners::new(&plan, sizes, world, 0);
    let mut total = vec![0; world];
    for (p, &r) in owners.owner.iter().enumerate() {
        total[r] += sizes[p];
    }
    assert_eq!(
        owners.parts.iter().flatten().sum::<usize>(),
        sizes.iter().sum::<usize>()
    );
    total
}

/// Whether no rank's share exceeds `1/N` of the model by more than its largest tensor.
fn within_bound(sizes: &[usize], total: &[usize]) -> bool {
    let (all, largest) = (sizes.iter().sum::<usize>(), sizes.iter().max().copied());
    let n = total.len();
    (total.iter()).all(|&t| n * t <= all + n * largest.unwrap_or(0))
}

#[test]
fn no_rank_owns_more_than_its_share_by_more_than_the_largest_tensor() {
    // A fixed pseudo-random sweep of models, worlds and bucket caps (a linear congruential
    // generator: the same cases every run).
    let mut state = 0x2545_f491_u64;
    let mut next = |n: u64| {
        state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1);
        ((state >> 33) % n) as usize
    };
    let mut cases = 0;
    for _ in 0..20_000 {
        let sizes: Vec<usize> = (0..2 + next(11)).map(|_| 1 + next(30)).collect();
        let world = 2 + next(3);
        let cfg = BucketConfig {
            cap_bytes: 4 * (4 + next(76)),
            first_cap_bytes: 4 * (1 + next(79)),
        };
        let total = shares(&sizes, world, &cfg);
        assert!(
            within_bound(&sizes, &total),
            "sizes {sizes:?}, world {world}, {cfg:?}: shares {total:?}"
        );
        cases += 1;
    }
    assert_eq!(cases, 20_000);
}

/// The sizes of the `charlm` transformer (26 blocks of width 256, sequences of 128) with a
/// vocabulary of `vocab` tokens, in visit order: token and position embeddings, per block four
/// attention projections, the feed-forward pair and two norms, the final norm and the head.
fn charlm(vocab: usize) -> Vec<usize> {
    let d = 256;
    let mut sizes = vec![vocab * d, 128 * d];
    for _ in 0..26 {
        for _ in 0..4 {
            sizes.extend([d * d, d]);
        }
        sizes.extend([d * 4 * d, 4 * d, 4 * d * d, d, d, d, d, d]);
    }
    sizes.extend([d, d, d * vocab, vocab]);
    sizes
}

#[test]
fn a_tensor_larger_than_a_share_does_not_pile_up_with_others() {
    // With 50 000 tokens each embedding is 12.8 M values, over a quarter of the 46 M model.
    let sizes = charlm(50_000);
    let all: usize = sizes.iter().sum();
    let largest = *sizes.iter().max().unwrap_or(&0);
    for world in [2, 4, 8] {
        let total = shares(&sizes, world, &BucketConfig::default());
        // The fullest rank holds one embedding (or 1/N) plus at most one block tensor.
        let fair = largest.max(all.div_ceil(world)) + 4 * 256 * 256;
        let fullest = total.iter().max().copied().unwrap_or(0);
        assert!(
            fullest <= fair,
            "world {world}: shares {total:?}, at most {fair}"
        );
        assert!(within_bound(&sizes, &total), "world {world}: {total:?}");
    }
}

#[test]
fn the_take_owners_group_matches_exactly_its_paths() {
    // Paths that are prefixes, suffixes and near misses of each other, with every character
    // regular expressions give a meaning to, in more paths than one pattern holds.
    let mut paths: Vec<String> = (0..5000).map(|i| format!("layers.{i}.weight")).collect();
    paths.extend(["a.weight", "inner.a.weight", "a.weightx", "aXweight"].map(String::from));
    paths.extend(["w\\.+*?()|[]{}^$#&-~", "w", "w.", "é.ü"].map(String::from));
    let chosen: Vec<String> = (paths.iter().enumerate())
        .filter(|(i, _)| i % 3 != 1)
        .map(|(_, p)| p.clone())
        .collect();
    let group = take_owners_group(&chosen);
    let exact = ParamGroup::from_paths(chosen.clone());
    let id = ParamId::new();
    for path in paths
        .iter()
        .map(String::as_str)
        .chain(["", "layers.1", "x.w"])
    {
        let matched = group.matches(&id, Some(path));
        assert_eq!(matched, exact.matches(&id, Some(path)), "{path:?}");
        assert_eq!(matched, chosen.iter().any(|p| p == path), "{path:?}");
    }
    assert!(!group.matches(&id, None));
    assert!(!take_owners_group(&[]).matches(&id, Some("a.weight")));
}

#[derive(Module, Debug)]
struct Inner {
    a: Linear,
}

#[derive(Module, Debug)]
struct Outer {
    a: Linear,
    inner: Inner,
}

/// Registers `value(param)` as the "gradient" of every parameter of `model`.
struct Everything<'a, F> {
    grads: &'a mut GradientsParams,
    value: F,
}

impl<F: FnMut(Tensor<2>) -> Tensor<2>> burn::module::ModuleVisitor for Everything<'_, F> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let t = param.val().inner();
        let dims = t.dims();
        let flat = t.reshape([1, dims.iter().product::<usize>()]);
        let value = (self.value)(flat).reshape(dims);
        self.grads.register::<D>(param.id, value);
    }
}

#[test]
fn with_the_take_owners_group_an_optimizer_step_takes_the_values_of_exactly_those_paths() {
    let device = Device::flex().autodiff();
    let model = Outer {
        a: LinearConfig::new(3, 2).init(&device),
        inner: Inner {
            a: LinearConfig::new(3, 2).init(&device),
        },
    };
    let paths: Vec<String> = layout(&model).into_iter().map(|p| p.path).collect();
    // The outer layer's: `inner.a.weight` ends with `a.weight`, and is not among them.
    let taken: Vec<String> = paths
        .iter()
        .filter(|p| p.starts_with("a."))
        .cloned()
        .collect();
    assert_eq!(taken.len(), 2, "{paths:?}");
    let before = crate::train::parameters_to_vector(&model);
    let mut optim = SgdConfig::new()
        .init()
        .with_group(take_owners_group(&taken), TakeOwners, None);
    let mut grads = GradientsParams::new();
    model.visit(&mut Everything {
        grads: &mut grads,
        value: |t: Tensor<2>| t.ones_like() * 7.0,
    });
    let model = optim.step(0.5, model, grads);
    let after = crate::train::parameters_to_vector(&model);
    // Visit order: a.weight (6), a.bias (2), inner.a.weight (6), inner.a.bias (2).
    for (i, (x, y)) in before.iter().zip(&after).enumerate() {
        let expected = if i < 8 { 7.0 } else { x - 0.5 * 7.0 };
        assert_eq!(*y, expected, "value {i} of {paths:?}");
    }
}

/// A model of many small parameters (`params.{i}`).
#[derive(Module, Debug)]
struct Many {
    params: Vec<Param<Tensor<1>>>,
}

/// Not a test: what the optimizer step that takes the owners' values costs with `P`
/// parameters, half of them another rank's, with the group burn matched by comparing paths
/// (`ParamGroup::from_paths`, before) and with [`take_owners_group`]. Prints the figures:
/// `cargo test --workspace --features burn-ddp/wgpu --lib -- --ignored --nocapture
/// take_owners_step_cost`.
#[test]
#[ignore = "a measurement, not a test"]
fn take_owners_step_cost() {
    let device = Device::flex().autodiff();
    for p in [500, 2000, 8000, 32000] {
        let model = Many {
            params: (0..p)
                .map(|_| Param::from_tensor(Tensor::<1>::zeros([2], &device)))
                .collect(),
        };
        let taken: Vec<String> = (0..p)
            .filter(|i| i % 2 == 1)
            .map(|i| format!("params.{i}"))
            .collect();
        let groups = [
            ("no group (burn alone)", None),
            ("from_paths", Some(ParamGroup::from_paths(taken.clone()))),
            ("take_owners_group", Some(take_owners_group(&taken))),
        ];
        for (name, group) in groups {
            let mut optim = SgdConfig::new().init();
            if let Some(group) = group {
                optim = optim.with_group(group, TakeOwners, None);
            }
            let mut model = Many {
                params: model.params.clone(),
            };
            let mut times = Vec::new();
            for _ in 0..3 {
                let mut grads = GradientsParams::new();
                for (i, param) in model.params.iter().enumerate() {
                    if i % 2 == 1 {
                        grads.register::<1>(param.id, param.val().inner().ones_like());
                    }
                }
                let start = std::time::Instant::now();
                model = optim.step(0.1, model, grads);
                times.push(start.elapsed().as_secs_f64() * 1e3);
            }
            times.sort_by(f64::total_cmp);
            println!(
                "P = {p:5}, {name:20}: {:8.2} ms per step (median of 3)",
                times[1]
            );
        }
    }
}

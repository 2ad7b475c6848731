//! A NaN or an infinity in one rank's gradients: every rank stops naming the rank (the
//! default), or every rank skips the step, or (`Propagate`, PyTorch's way) the values reach
//! every replica.

use burn::train::TrainStep;
use burn_ddp::DdpError;
use burn_ddp::train::{Compression, GradientReducer, NonFinite};

use super::compression::flat_grads;
use super::lockstep::ManualRank;
use super::model::{flex, new_net};
use super::small_buckets;
use crate::common::{options, run_world};

#[test]
fn a_rank_with_non_finite_gradients_is_named_or_its_step_skipped() {
    let device = flex();
    let outcomes = run_world(3, options(60), |group| {
        let rank = ManualRank::new(group, new_net(&device, Some(7), false), &device);
        let me = rank.group.rank();
        let batch = rank.loader.iter().next().unwrap().unwrap();
        // Rank 1's features are multiplied by NaN or infinity, the others' by 1.
        let grads = |factor: f32| {
            let factor = if me == 1 { factor } else { 1.0 };
            TrainStep::step(&rank.model, batch.clone().scaled(factor)).grads
        };
        let reducer = |non_finite, compression| {
            GradientReducer::new(&rank.model, rank.group.clone(), small_buckets())
                .unwrap()
                .non_finite(non_finite)
                .compression(compression)
        };
        let stopped = |r: GradientReducer, factor, step| match r.reduce_at(
            &rank.model,
            grads(factor),
            2,
            step,
        ) {
            Err(DdpError::NonFiniteGradients {
                culprits, detail, ..
            }) => (culprits, detail),
            other => panic!("rank {me}: expected a non-finite error, got {other:?}"),
        };
        let nan = stopped(reducer(NonFinite::Stop, Compression::None), f32::NAN, 5);
        let inf = stopped(
            reducer(NonFinite::Stop, Compression::Bf16),
            f32::INFINITY,
            6,
        );
        let skip = reducer(NonFinite::SkipStep, Compression::None);
        let skipped = skip.reduce_at(&rank.model, grads(f32::NAN), 2, 7).unwrap();
        // The next step of the same reducer is applied as usual.
        let after = skip.reduce_at(&rank.model, grads(1.0), 2, 8).unwrap();
        let through = reducer(NonFinite::Propagate, Compression::None)
            .reduce_at(&rank.model, grads(f32::NAN), 2, 9)
            .unwrap();
        let clean = reducer(NonFinite::Stop, Compression::None)
            .reduce_at(&rank.model, grads(1.0), 2, 10)
            .unwrap();
        (
            nan,
            inf,
            skipped.len(),
            flat_grads(&rank.model, &after),
            flat_grads(&rank.model, &through),
            flat_grads(&rank.model, &clean),
        )
    });
    for (rank, (nan, inf, skipped, after, through, clean)) in outcomes.into_iter().enumerate() {
        assert_eq!(nan.0, vec![1], "rank {rank}: {}", nan.1);
        assert!(
            nan.1
                .contains("rank 1 produced gradients that are not finite")
                && nan.1.contains("epoch 2 step 5"),
            "rank {rank}: {}",
            nan.1
        );
        assert_eq!(inf.0, vec![1], "bf16 buckets, rank {rank}: {}", inf.1);
        assert_eq!(
            skipped, 0,
            "rank {rank}: a skipped step applies no gradient"
        );
        assert!(!after.is_empty() && after.iter().all(|g| g.is_finite()));
        assert!(
            through.iter().any(|g| !g.is_finite()),
            "rank {rank}: Propagate lets the NaN reach every replica"
        );
        assert!(!clean.is_empty() && clean.iter().all(|g| g.is_finite()));
    }
}

//! The NCCL backend's plans (what every rank agrees on, how unequal or empty parts are padded
//! and cut, which equal-part NCCL call runs) on real ranks over loopback, with the host
//! collectives in place of each NCCL call (`ProcessGroupBuilder::nccl_plans_on_host`): all of
//! the NCCL backend but its calls into NCCL runs here, on every world, element type, reduction,
//! and equal, unequal and empty parts, against the host collectives of `Vec`s, and against host
//! staging (the same cases, the other backend).

use burn::tensor::{DType, Device, Tensor};
use burn_ddp::{DdpError, ProcessGroup, ReduceOp, testing};
use half::{bf16, f16};

use crate::common::{TestFloat, options, run_world, run_world_nccl_plans};
use crate::tensors::{check_tensor_collectives, check_tensor_collectives_by_nccl_plans};
use crate::tensors::{host, tensor, values};

#[test]
fn nccl_plans_match_host_collectives_at_worlds_2_3_4() {
    for n in [2, 3, 4] {
        check_tensor_collectives_by_nccl_plans(n, Device::flex);
        run_world_nccl_plans(n, options(60), check_parts);
    }
}

#[test]
fn host_staging_matches_host_collectives_at_worlds_2_and_4() {
    for n in [2, 4] {
        check_tensor_collectives(n, Device::flex);
        run_world(n, options(60), check_parts);
    }
}

/// The ways of cutting a buffer among `n` ranks that a sharded optimizer meets: all empty, one
/// rank owning everything, the first owning nothing, unequal with empty parts, equal.
fn cuttings(n: usize) -> Vec<Vec<usize>> {
    vec![
        vec![0; n],
        (0..n).map(|r| if r == n - 1 { 10 } else { 0 }).collect(),
        (0..n).map(|r| if r == 0 { 0 } else { 5 }).collect(),
        (0..n).map(|r| [3, 0, 8, 1][r % 4]).collect(),
        vec![4; n],
    ]
}

/// Reduce-scatter and all-gather of every cutting, element type and reduction, against the same
/// on host vectors (bit for bit).
fn check_parts(g: ProcessGroup) {
    for parts in cuttings(g.world_size()) {
        for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min] {
            check_parts_as::<f32>(&g, &parts, op, DType::F32);
            check_parts_as::<f64>(&g, &parts, op, DType::F64);
            check_parts_as::<f16>(&g, &parts, op, DType::F16);
            check_parts_as::<bf16>(&g, &parts, op, DType::BF16);
        }
        let (rank, device) = (g.rank(), Device::flex());
        let mine = tensor(values(rank, parts[rank]), &device);
        let all = testing::all_gather_parts(&g, mine, &parts)
            .wait()
            .unwrap_or_else(|e| panic!("rank {rank}: all_gather of {parts:?}: {e}"));
        let want: Vec<f32> = (0..parts.len()).flat_map(|r| values(r, parts[r])).collect();
        assert_eq!(host(all), want, "rank {rank}: all_gather of {parts:?}");
    }
}

/// [`check_parts`]' reduce-scatter in element type `T` (`dtype`).
fn check_parts_as<T: TestFloat + burn::tensor::Element>(
    g: &ProcessGroup,
    parts: &[usize],
    op: ReduceOp,
    dtype: DType,
) {
    let (rank, total) = (g.rank(), parts.iter().sum());
    let mine = tensor(values(rank, total), &Device::flex()).cast(dtype);
    let got = g
        .reduce_scatter_parts(mine, parts, op)
        .wait()
        .unwrap_or_else(|e| panic!("rank {rank}: {op:?} of {parts:?} as {dtype:?}: {e}"));
    assert_eq!(got.dtype(), dtype, "the result keeps its element type");
    let vector: Vec<T> = values(rank, total).into_iter().map(T::from_f32).collect();
    let want = g.reduce_scatter_parts(vector, parts, op).wait().unwrap();
    let want: Vec<f32> = want.into_iter().map(|v| v.to_f64() as f32).collect();
    assert_eq!(
        host(got),
        want,
        "rank {rank}: {op:?} of {parts:?} as {dtype:?}"
    );
}

/// What each rank asks of a collective in [`a_rank_asking_for_another_collective_is_named`].
type Ask = fn(&ProcessGroup, &Device) -> Result<(), DdpError>;

/// A rank that asks for another length, element type, root or cutting than rank 0, or whose own
/// tensor does not fit its part, fails the collective on every rank with the same words, naming
/// it (NCCL would hang or read past a buffer); the group goes on.
#[test]
fn a_rank_asking_for_another_collective_is_named() {
    let asks: [(Ask, &str); 6] = [
        (
            |g, d| {
                let len = if g.rank() == 2 { 8 } else { 7 };
                g.all_reduce(tensor(values(0, len), d), ReduceOp::Sum)
                    .wait()
                    .map(drop)
            },
            "rank 0 runs all_reduce (Sum) of 7 x F32 but rank 2 all_reduce (Sum) of 8 x F32",
        ),
        (
            |g, d| {
                let t = tensor(values(0, 6), d);
                let t = if g.rank() == 1 { t.cast(DType::F16) } else { t };
                g.all_reduce(t, ReduceOp::Max).wait().map(drop)
            },
            "rank 0 runs all_reduce (Max) of 6 x F32 but rank 1 all_reduce (Max) of 6 x F16",
        ),
        (
            |g, d| {
                let root = if g.rank() == 1 { 2 } else { 0 };
                g.broadcast(tensor(values(0, 3), d), root).wait().map(drop)
            },
            "rank 0 runs broadcast from rank 0 of 3 x F32 but rank 1 broadcast from rank 2",
        ),
        (
            |g, d| {
                let len = if g.rank() == 1 { 4 } else { 5 };
                let work = testing::all_gather_parts(g, tensor(values(0, len), d), &[5, 5, 5]);
                work.wait().map(drop)
            },
            "rank 1: rank 1 gives 4 elements but its part of [5, 5, 5] is 5",
        ),
        (
            |g, d| {
                let parts: &[usize] = if g.rank() == 2 {
                    &[1, 1, 4]
                } else {
                    &[2, 2, 2]
                };
                let t = tensor(values(0, 6), d);
                g.reduce_scatter_parts(t, parts, ReduceOp::Sum)
                    .wait()
                    .map(drop)
            },
            "in parts [2, 2, 2] but rank 2 reduce_scatter (Sum) of 6 x F32 in parts [1, 1, 4]",
        ),
        (
            |g, d| {
                let parts: &[usize] = &[2, 2, 3];
                let t = tensor(values(0, 6), d);
                g.reduce_scatter_parts(t, parts, ReduceOp::Sum)
                    .wait()
                    .map(drop)
            },
            "rank 0: parts [2, 2, 3] do not cut 6 elements among 3 ranks",
        ),
    ];
    run_world_nccl_plans(3, options(30), |g| {
        let (rank, device) = (g.rank(), Device::flex());
        for (ask, words) in asks {
            match ask(&g, &device) {
                Err(DdpError::InvalidArgument { reason, .. }) => {
                    assert!(reason.contains(words), "rank {rank}: {reason}");
                }
                other => panic!("rank {rank}: expected an error with {words:?}, got {other:?}"),
            }
            // The group goes on: nothing was half sent.
            let after = g.all_reduce(tensor(values(rank, 4), &device), ReduceOp::Sum);
            let after = after.wait().expect("the next collective");
            let want = g.all_reduce(values(rank, 4), ReduceOp::Sum).wait().unwrap();
            assert_eq!(host(after), want, "rank {rank}");
        }
    });
}

/// Many collectives in flight at once keep their order and their results (the reducer's
/// pattern), with empty tensors among them.
#[test]
fn nccl_plans_keep_the_order_of_collectives_in_flight() {
    run_world_nccl_plans(3, options(60), |g| {
        let (rank, device) = (g.rank(), Device::flex());
        let lengths = [5usize, 0, 1000, 0, 3, 64];
        let started: Vec<_> = (lengths.iter())
            .map(|&len| g.all_reduce(tensor(values(rank, len), &device), ReduceOp::Avg))
            .collect();
        for (&len, work) in lengths.iter().zip(started) {
            let got: Tensor<1> = work.wait().expect("all_reduce in flight");
            let want = g
                .all_reduce(values(rank, len), ReduceOp::Avg)
                .wait()
                .unwrap();
            assert_eq!(host(got), want, "rank {rank}: {len} values");
        }
    });
}

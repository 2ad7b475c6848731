//! The group's tensor collectives (`all_reduce`, `reduce_scatter`, `broadcast`, `all_gather` on
//! `Tensor<1>`) on real ranks (threads over loopback). The checks take the device, so the same
//! body runs on `flex` here and on wgpu where that feature is on.

use burn::tensor::{DType, Device, Tensor, TensorData};
use burn_ddp::{DdpError, ProcessGroup, ReduceOp};

use crate::common::{options, run_world, run_world_nccl_plans};

pub fn tensor(values: Vec<f32>, device: &Device) -> Tensor<1> {
    let n = values.len();
    Tensor::from_data(TensorData::new(values, [n]), device)
}

pub fn host(t: Tensor<1>) -> Vec<f32> {
    t.into_data()
        .convert::<f32>()
        .try_to_vec::<f32>()
        .expect("f32 values")
}

/// A rank's values: distinct per rank and index, exactly representable in f16.
pub fn values(rank: usize, len: usize) -> Vec<f32> {
    (0..len)
        .map(|i| ((i * 7 + rank * 13) % 64) as f32 - 32.0)
        .collect()
}

/// Every tensor collective on `device` against the same collective on host vectors, on a
/// world of `n`: results must be bit-identical, whatever travelled.
pub fn check_tensor_collectives(n: usize, device: fn() -> Device) {
    run_world(n, options(60), |g| check_on(g, device));
}

/// As [`check_tensor_collectives`], the tensors going by the NCCL backend's plans with host
/// collectives in NCCL's place.
pub fn check_tensor_collectives_by_nccl_plans(n: usize, device: fn() -> Device) {
    run_world_nccl_plans(n, options(60), |g| check_on(g, device));
}

/// The body of [`check_tensor_collectives`], on one rank.
fn check_on(g: ProcessGroup, device: fn() -> Device) {
    let n = g.world_size();
    let lengths = [0usize, 1, 7, 100_003];
    let (rank, device) = (g.rank(), device());
    // Several reductions in flight before the first wait, as the reducer does.
    let started: Vec<_> = lengths
        .iter()
        .map(|&len| g.all_reduce(tensor(values(rank, len), &device), ReduceOp::Sum))
        .collect();
    for (&len, work) in lengths.iter().zip(started) {
        let got = work.wait().expect("tensor all_reduce");
        assert_eq!(
            got.device(),
            device,
            "the result stays on the tensor's device"
        );
        let want = g
            .all_reduce(values(rank, len), ReduceOp::Sum)
            .wait()
            .unwrap();
        assert_eq!(host(got), want, "rank {rank}: all_reduce of {len} values");
    }
    let avg = g
        .all_reduce(tensor(values(rank, 5), &device), ReduceOp::Avg)
        .wait()
        .expect("average");
    let want = g.all_reduce(values(rank, 5), ReduceOp::Avg).wait().unwrap();
    assert_eq!(host(avg), want, "rank {rank}: average");

    // Half precision stays half precision on the way.
    let half = tensor(values(rank, 9), &device).cast(DType::F16);
    let summed = g
        .all_reduce(half, ReduceOp::Max)
        .wait()
        .expect("f16 all_reduce");
    assert_eq!(summed.dtype(), DType::F16);
    let want = g.all_reduce(values(rank, 9), ReduceOp::Max).wait().unwrap();
    assert_eq!(host(summed), want, "rank {rank}: f16 max");

    let root = n - 1;
    let sent = g
        .broadcast(tensor(values(rank, 11), &device), root)
        .wait()
        .expect("tensor broadcast");
    assert_eq!(
        host(sent),
        values(root, 11),
        "rank {rank}: broadcast from {root}"
    );

    // Reduce-scatter: this rank's part, equal parts and given ones.
    let len = 5 * n;
    let part = g
        .reduce_scatter(tensor(values(rank, len), &device), ReduceOp::Sum)
        .wait()
        .expect("tensor reduce_scatter");
    assert_eq!(part.device(), device);
    let want = g
        .reduce_scatter(values(rank, len), ReduceOp::Sum)
        .wait()
        .unwrap();
    assert_eq!(host(part), want, "rank {rank}: reduce_scatter");
    let parts: Vec<usize> = (0..n).map(|r| [3, 0, 8, 1][r % 4]).collect();
    let total = parts.iter().sum();
    let part = g
        .reduce_scatter_parts(tensor(values(rank, total), &device), &parts, ReduceOp::Avg)
        .wait()
        .expect("tensor reduce_scatter_parts");
    let want = g
        .reduce_scatter_parts(values(rank, total), &parts, ReduceOp::Avg)
        .wait()
        .unwrap();
    assert_eq!(want.len(), parts[rank]);
    assert_eq!(host(part), want, "rank {rank}: reduce_scatter_parts");

    let all = g
        .all_gather(tensor(values(rank, 6), &device))
        .wait()
        .expect("tensor all_gather");
    assert_eq!(all.len(), n);
    for (r, t) in all.into_iter().enumerate() {
        assert_eq!(
            host(t),
            values(r, 6),
            "rank {rank}: gathered tensor of rank {r}"
        );
    }
}

#[test]
fn tensor_collectives_on_flex_match_host_collectives() {
    check_tensor_collectives(3, Device::flex);
}

#[test]
fn tensor_all_gather_of_unequal_lengths_fails_on_every_rank() {
    let results = run_world(2, options(30), |g: ProcessGroup| {
        let device = Device::flex();
        let mine = tensor(values(g.rank(), 3 + g.rank()), &device);
        g.all_gather(mine).wait().map(|_| ())
    });
    for (rank, result) in results.into_iter().enumerate() {
        match result {
            Err(DdpError::InvalidArgument { reason, .. }) => {
                assert!(reason.contains("same length"), "rank {rank}: {reason}");
            }
            other => panic!("rank {rank}: expected an invalid-argument error, got {other:?}"),
        }
    }
}

#[test]
fn world_of_one_tensor_collectives_return_the_tensor() {
    run_world(1, options(10), |g: ProcessGroup| {
        let device = Device::flex();
        let t = tensor(values(0, 4), &device);
        let reduced = g.all_reduce(t.clone(), ReduceOp::Avg).wait().unwrap();
        assert_eq!(host(reduced), values(0, 4));
        let part = g.reduce_scatter(t.clone(), ReduceOp::Sum).wait().unwrap();
        assert_eq!(host(part), values(0, 4));
        let gathered = g.all_gather(t).wait().unwrap();
        assert_eq!(gathered.len(), 1);
    });
}

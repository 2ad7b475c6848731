//! Correctness of the collectives on 1 to 4 ranks (threads over loopback).

use std::time::{Duration, Instant};

use burn_ddp::{ProcessGroup, ReduceOp};
use half::{bf16, f16};

use crate::common::{TestFloat, digest, options, rank_data, run_world, value};

const LENGTHS: [usize; 5] = [0, 1, 7, 1_000_003, 16 << 20];
const OPS: [ReduceOp; 3] = [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max];

/// All-reduces one case and checks it: rank 0 against a serial reference over every element,
/// every rank bit-identical to every other (hashes gathered).
fn check_case<T: TestFloat>(g: &ProcessGroup, case: u64, len: usize, op: ReduceOp) {
    let n = g.world_size();
    let mine = rank_data::<T>(case, g.rank(), len);
    let out = g.all_reduce(mine, op).wait().expect("all_reduce");
    assert_eq!(out.len(), len);
    let what = format!("{} {op:?} len {len} world {n}", std::any::type_name::<T>());
    if g.rank() == 0 {
        // Error bound of n - 1 rounded additions of values of magnitude <= n.
        let tol = match op {
            ReduceOp::Max | ReduceOp::Min => 0.0,
            _ => (n * n) as f64 * T::EPS,
        };
        for (i, got) in out.iter().enumerate() {
            let xs = (0..n).map(|r| T::from_f32(value(case, r, i)).to_f64());
            let want = match op {
                ReduceOp::Sum => xs.sum::<f64>(),
                ReduceOp::Avg => xs.sum::<f64>() / n as f64,
                ReduceOp::Max => xs.fold(f64::MIN, f64::max),
                ReduceOp::Min => xs.fold(f64::MAX, f64::min),
            };
            let err = (got.to_f64() - want).abs();
            assert!(
                err <= tol,
                "{what}: element {i} is {got:?}, want {want} (tol {tol})"
            );
        }
    }
    let hashes = g
        .all_gather(digest(bytemuck::cast_slice(&out)).to_le_bytes().to_vec())
        .wait()
        .expect("all_gather");
    assert!(
        hashes.iter().all(|h| *h == hashes[0]),
        "{what}: ranks differ"
    );
}

fn all_reduce_grid(n: usize) {
    run_world(n, options(60), |g| {
        let mut case = 0;
        for len in LENGTHS {
            for op in OPS {
                case += 1;
                check_case::<f32>(&g, case, len, op);
                check_case::<f16>(&g, case, len, op);
                check_case::<bf16>(&g, case, len, op);
            }
        }
    });
}

#[test]
fn all_reduce_world_1() {
    all_reduce_grid(1);
}

#[test]
fn all_reduce_world_2() {
    all_reduce_grid(2);
}

#[test]
fn all_reduce_world_3() {
    all_reduce_grid(3);
}

#[test]
fn all_reduce_world_4() {
    all_reduce_grid(4);
}

#[test]
fn broadcast_from_every_root() {
    for n in [1, 2, 3, 4] {
        run_world(n, options(30), |g| {
            for root in 0..n {
                for len in [0usize, 1, 7, 1_000_003] {
                    let case = (root * 10 + len) as u64;
                    let data: Vec<f32> = rank_data(case, g.rank(), len);
                    let out = g.broadcast(data, root).wait().expect("broadcast");
                    assert_eq!(
                        out,
                        rank_data::<f32>(case, root, len),
                        "root {root} len {len}"
                    );
                }
            }
            let err = g
                .broadcast(vec![0u8; 3], n)
                .wait()
                .expect_err("root out of range");
            assert!(err.to_string().contains(&format!("root {n}")), "{err}");
        });
    }
}

#[test]
fn all_gather_of_uneven_buffers() {
    for n in [1, 2, 3, 4] {
        run_world(n, options(30), |g| {
            let block =
                |r: usize| -> Vec<u8> { (0..r * 100_003 + 3).map(|i| (i * 7 + r) as u8).collect() };
            let got = g.all_gather(block(g.rank())).wait().expect("all_gather");
            assert_eq!(got.len(), n);
            for (r, b) in got.iter().enumerate() {
                assert_eq!(*b, block(r), "block of rank {r}");
            }
            let empty = g.all_gather(Vec::new()).wait().expect("empty all_gather");
            assert!(empty.iter().all(Vec::is_empty));
        });
    }
}

#[test]
fn barrier_waits_for_the_slowest_rank() {
    let n = 4;
    let start = Instant::now();
    let step = Duration::from_millis(150);
    run_world(n, options(30), |g| {
        let arrive = Instant::now();
        std::thread::sleep(step * g.rank() as u32);
        g.barrier().wait().expect("barrier");
        // Every rank leaves after the last one arrived.
        assert!(
            start.elapsed() >= step * (n as u32 - 1),
            "rank {} left the barrier after {:?}",
            g.rank(),
            arrive.elapsed()
        );
    });
}

#[test]
fn started_operations_complete_in_issue_order() {
    run_world(3, options(30), |g| {
        let r = g.rank() as f32;
        // Several operations in flight at once, of different kinds and sizes.
        let big = g.all_reduce(vec![r; 3_000_000], ReduceOp::Sum);
        let small = g.all_reduce(vec![r + 1.0; 5], ReduceOp::Max);
        let names = g.all_gather(vec![g.rank() as u8; 10]);
        let bcast = g.broadcast(vec![r; 1000], 2);
        let mut last = g.all_reduce(vec![1.0f32; 100_000], ReduceOp::Avg);
        // Wait for the last first: then every earlier one must already be complete.
        while !last.is_completed() {
            std::thread::sleep(Duration::from_millis(1));
        }
        let mut earlier = [big, small];
        for w in &mut earlier {
            assert!(
                w.is_completed(),
                "an earlier operation finished after a later one"
            );
        }
        assert_eq!(last.wait().unwrap(), vec![1.0; 100_000]);
        assert_eq!(bcast.wait().unwrap(), vec![2.0; 1000]);
        let names = names.wait().unwrap();
        assert_eq!(names, (0..3u8).map(|i| vec![i; 10]).collect::<Vec<_>>());
        let [big, small] = earlier;
        assert_eq!(small.wait().unwrap(), vec![3.0; 5]);
        assert!(big.wait().unwrap().iter().all(|x| *x == 3.0));
    });
}

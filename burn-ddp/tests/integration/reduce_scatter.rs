//! Reduce-scatter on host buffers: each part has the bits of the same slice of an all-reduce on
//! the same transport (TCP ring, shared memory, hierarchical across simulated hosts), for every
//! element type and reduction, worlds 1-4; given parts; and bad lengths refused alike on every
//! rank, the group going on.

use burn_ddp::{DdpError, GroupOptions, ProcessGroup, ReduceOp, Transport};
use half::{bf16, f16};

use crate::common::{TestFloat, options, rank_data, run_world, run_world_each};

const OPS: [ReduceOp; 4] = [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min];

fn opts(transport: Transport) -> GroupOptions {
    GroupOptions {
        transport,
        // Small slots, so that shared memory works in several rounds.
        shm_slot_bytes: 4096,
        ..options(30)
    }
}

fn bits<T: TestFloat>(v: &[T]) -> Vec<u8> {
    bytemuck::cast_slice(v).to_vec()
}

/// On rank `g`, for lengths of `per_rank` elements a rank: the reduce-scatter's part against
/// the all-reduce's slice, bit for bit.
fn check_slices<T: TestFloat>(g: &ProcessGroup, case: u64) {
    let (rank, world) = (g.rank(), g.world_size());
    for per_rank in [0, 1, 7, 1000, 3 * 4096 + 5] {
        for op in OPS {
            let len = per_rank * world;
            let mine = rank_data::<T>(case + per_rank as u64, rank, len);
            let all = g.all_reduce(mine.clone(), op).wait().expect("all_reduce");
            let part = g.reduce_scatter(mine, op).wait().expect("reduce_scatter");
            let slice = &all[rank * per_rank..(rank + 1) * per_rank];
            assert_eq!(
                bits(&part),
                bits(slice),
                "{:?}, world {world}, rank {rank}, {op:?} of {len} x {}",
                g.transport(),
                std::any::type_name::<T>()
            );
        }
    }
}

fn check_all_types(g: &ProcessGroup) {
    check_slices::<f32>(g, 10);
    check_slices::<f64>(g, 20);
    check_slices::<f16>(g, 30);
    check_slices::<bf16>(g, 40);
}

#[test]
fn parts_are_the_all_reduce_slices_bit_for_bit_on_tcp_and_shared_memory() {
    run_world(1, opts(Transport::Auto), |g| check_all_types(&g));
    for world in 2..=4 {
        for transport in [Transport::Tcp, Transport::Shm] {
            run_world(world, opts(transport), |g| {
                assert_eq!(g.transport(), transport);
                check_all_types(&g);
            });
        }
    }
}

#[test]
fn parts_are_the_hierarchical_all_reduce_slices_across_simulated_hosts() {
    for (hosts, per_host) in [(2, 2), (2, 3)] {
        let host_opts = |rank: usize| GroupOptions {
            host_id: Some(format!("simulated-host-{}", rank % hosts)),
            ..opts(Transport::Shm)
        };
        run_world_each(hosts * per_host, host_opts, None, |g| {
            assert_eq!(g.transport(), Transport::Shm);
            check_slices::<f32>(&g, 50);
        });
    }
}

/// Given parts of any lengths (empty ones too): each rank gets its own part of the reduction
/// (integer-valued data, so every reduction order gives the same value).
#[test]
fn given_parts_reach_their_ranks() {
    for world in [2, 3, 4] {
        for transport in [Transport::Tcp, Transport::Shm] {
            run_world(world, opts(transport), |g| {
                let rank = g.rank();
                let parts: Vec<usize> = (0..world).map(|r| [5000, 0, 17, 1][r % 4]).collect();
                let total: usize = parts.iter().sum();
                let start: usize = parts[..rank].iter().sum();
                let mine: Vec<f64> = (0..total).map(|i| (i * 3 + rank) as f64).collect();
                for op in OPS {
                    let got = g
                        .reduce_scatter_parts(mine.clone(), &parts, op)
                        .wait()
                        .expect("reduce_scatter_parts");
                    let want: Vec<f64> = (start..start + parts[rank])
                        .map(|i| {
                            let each = (0..world).map(|r| (i * 3 + r) as f64);
                            match op {
                                ReduceOp::Sum => each.sum(),
                                ReduceOp::Avg => each.sum::<f64>() / world as f64,
                                ReduceOp::Max => each.fold(f64::MIN, f64::max),
                                ReduceOp::Min => each.fold(f64::MAX, f64::min),
                            }
                        })
                        .collect();
                    assert_eq!(got, want, "{transport:?} world {world} rank {rank} {op:?}");
                }
            });
        }
    }
}

/// A length that does not cut into equal parts, and parts that do not sum to the length, are
/// refused on every rank with the same error; nothing was sent, and the group goes on.
#[test]
fn bad_lengths_are_refused_on_every_rank_and_the_group_goes_on() {
    for transport in [Transport::Tcp, Transport::Shm] {
        let outcomes = run_world(3, opts(transport), |g| {
            let uneven = g.reduce_scatter(vec![1.0f32; 10], ReduceOp::Sum).wait();
            let bad_parts = g
                .reduce_scatter_parts(vec![1.0f32; 10], &[3, 3, 3], ReduceOp::Sum)
                .wait();
            let after = g.reduce_scatter(vec![1.0f32; 9], ReduceOp::Sum).wait();
            (
                uneven.err(),
                bad_parts.err(),
                after.expect("the group goes on"),
            )
        });
        for (rank, (uneven, bad_parts, after)) in outcomes.into_iter().enumerate() {
            match uneven {
                Some(DdpError::InvalidArgument { reason, .. }) => {
                    assert!(reason.contains("equal parts"), "rank {rank}: {reason}")
                }
                other => panic!("rank {rank}: {other:?}"),
            }
            let message = bad_parts.expect("bad parts refused").to_string();
            assert!(message.contains("do not cut"), "rank {rank}: {message}");
            assert_eq!(after, vec![3.0; 3]);
        }
    }
}

/// Ranks that cut the same buffer differently are stopped with a desync error naming the
/// collective, not given each other's bytes.
#[test]
fn ranks_that_cut_the_buffer_differently_stop_with_a_desync_error() {
    let outcomes = run_world(2, opts(Transport::Shm), |g| {
        let parts = if g.rank() == 0 { [4, 6] } else { [6, 4] };
        g.reduce_scatter_parts(vec![1.0f32; 10], &parts, ReduceOp::Sum)
            .wait()
            .map(drop)
            .map_err(|e| e.to_string())
    });
    for (rank, outcome) in outcomes.into_iter().enumerate() {
        let message = outcome.expect_err("a desync");
        assert!(
            message.contains("desync") && message.contains("reduce_scatter"),
            "rank {rank}: {message}"
        );
    }
}

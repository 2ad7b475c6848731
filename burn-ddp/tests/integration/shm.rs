//! The shared-memory transport: the same bits as the TCP transport, failures named, desyncs
//! caught, segments that have no name anywhere (so nothing is left behind, however ranks end)
//! and cannot be resized under the ranks.

use std::time::{Duration, Instant};

use burn_ddp::launch::free_port;
use burn_ddp::{GroupOptions, ProcessGroup, ReduceOp, Transport};
use half::{bf16, f16};

use crate::common::{TestFloat, digest, options, rank_data, run_world, run_world_each};
use crate::processes::{kill_and_expect_named, looping_ranks};

/// Options with `transport` and small slots, so that buffers move in several rounds.
fn opts(transport: Transport, timeout_secs: u64) -> GroupOptions {
    GroupOptions {
        transport,
        shm_slot_bytes: 4096,
        ..options(timeout_secs)
    }
}

/// The address ranges at which process `pid` maps shared-memory segments, and the file each
/// maps (from `/proc/<pid>/maps`).
fn segments(pid: u32) -> Vec<(String, String)> {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap_or_default();
    maps.lines()
        .filter(|l| l.contains("burn-ddp-segment"))
        .filter_map(|l| {
            let range = l.split_whitespace().next()?;
            let file = l.split_whitespace().skip(5).collect::<Vec<_>>().join(" ");
            Some((range.to_string(), file))
        })
        .collect()
}

/// Asserts that process `pid` maps at least one segment and that every one is an anonymous
/// memory file (no name in /dev/shm or anywhere, so the kernel frees it with its last user).
fn assert_anonymous_segments(pid: u32) {
    let found = segments(pid);
    assert!(!found.is_empty(), "process {pid} maps no segment");
    for (_, file) in found {
        assert!(file.starts_with("/memfd:burn-ddp-segment"), "{file}");
    }
}

/// Digests of every collective result of one rank, for one transport.
fn results<T: TestFloat>(g: &ProcessGroup, case: u64) -> Vec<u64> {
    let mut out = Vec::new();
    for len in [0, 1, 7, 1000, 3 * 4096 + 5] {
        for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min] {
            let mine = rank_data::<T>(case + len as u64, g.rank(), len);
            let r = g.all_reduce(mine, op).wait().expect("all_reduce");
            out.push(digest(bytemuck::cast_slice(&r)));
        }
    }
    out
}

fn run_all(g: &ProcessGroup) -> Vec<u64> {
    let mut out = results::<f32>(g, 1);
    out.extend(results::<f64>(g, 2));
    out.extend(results::<f16>(g, 3));
    out.extend(results::<bf16>(g, 4));
    let len = 9000 + g.rank();
    let mine: Vec<u8> = (0..len).map(|i| (i * 7 + g.rank()) as u8).collect();
    let gathered = g.all_gather(mine).wait().expect("all_gather");
    for (r, b) in gathered.iter().enumerate() {
        assert_eq!(b.len(), 9000 + r);
        assert!(b.iter().enumerate().all(|(i, x)| *x == (i * 7 + r) as u8));
    }
    let root = g.world_size() - 1;
    let data = vec![g.rank() as f32 + 0.5; 5000];
    let b = g.broadcast(data, root).wait().expect("broadcast");
    assert!(b.iter().all(|x| *x == root as f32 + 0.5));
    g.barrier().wait().expect("barrier");
    out
}

#[test]
fn shm_results_equal_tcp_results_bit_for_bit() {
    for world in [2, 3] {
        let by = |transport| {
            run_world(world, opts(transport, 30), |g| {
                assert_eq!(g.transport(), transport);
                g.barrier().wait().expect("barrier");
                if transport == Transport::Shm {
                    assert_anonymous_segments(std::process::id());
                }
                run_all(&g)
            })
        };
        let tcp = by(Transport::Tcp);
        let shm = by(Transport::Shm);
        for r in 0..world {
            assert_eq!(tcp[r], tcp[0], "world {world}: ranks differ over tcp");
            assert_eq!(
                shm[r], tcp[r],
                "world {world} rank {r}: shm differs from tcp"
            );
        }
    }
}

/// Integer-valued data (exact sums in any order), so a hierarchical all-reduce must give the
/// bits of the flat TCP ring.
fn integer_results(g: &ProcessGroup) -> Vec<u64> {
    let mut out = Vec::new();
    for len in [0, 1, 7, 1000, 3 * 4096 + 5, 40_000] {
        for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min] {
            let mine: Vec<f32> = (0..len)
                .map(|i| ((i * 7 + g.rank() * 13) % 101) as f32 - 50.0)
                .collect();
            let r = g.all_reduce(mine, op).wait().expect("all_reduce");
            if op == ReduceOp::Sum && len > 0 {
                let want: f32 = (0..g.world_size())
                    .map(|q| ((len - 1) * 7 + q * 13) as f32 % 101.0 - 50.0)
                    .sum();
                assert_eq!(r[len - 1], want, "sum of the last element");
            }
            out.push(digest(bytemuck::cast_slice(&r)));
        }
    }
    out
}

#[test]
fn hierarchical_all_reduce_across_simulated_hosts_equals_the_flat_ring() {
    // (hosts, ranks per host); host of rank r is r % hosts, so a host's ranks are not contiguous.
    for (hosts, per_host) in [(2, 2), (3, 2), (2, 3)] {
        let world = hosts * per_host;
        let host_opts = |rank: usize| GroupOptions {
            host_id: Some(format!("simulated-host-{}", rank % hosts)),
            ..opts(Transport::Shm, 30)
        };
        let hier = run_world_each(world, host_opts, None, |g| {
            assert_eq!(g.transport(), Transport::Shm);
            let ints = integer_results(&g);
            (ints, run_all(&g))
        });
        let flat = run_world(world, opts(Transport::Tcp, 30), |g| integer_results(&g));
        for r in 0..world {
            let what = format!("{hosts} hosts x {per_host}, rank {r}");
            assert_eq!(
                hier[r].0, flat[r],
                "{what}: hierarchical differs from the ring"
            );
            assert_eq!(hier[r].1, hier[0].1, "{what}: ranks differ");
        }
    }
}

#[test]
fn auto_stays_on_tcp_where_hosts_have_different_numbers_of_ranks() {
    let transports = run_world_each(
        3,
        |rank| GroupOptions {
            host_id: Some(format!("h{}", rank.min(1))),
            ..opts(Transport::Auto, 10)
        },
        None,
        |g| {
            let r = g
                .all_reduce(vec![g.rank() as f32; 10], ReduceOp::Sum)
                .wait();
            assert_eq!(r.expect("all_reduce"), vec![3.0; 10]);
            g.transport()
        },
    );
    assert_eq!(transports, vec![Transport::Tcp; 3]);
}

#[test]
fn shm_is_the_default_on_one_host_and_tcp_can_be_chosen() {
    assert_eq!(GroupOptions::default().transport, Transport::Auto);
    run_world(2, options(10), |g| {
        assert_eq!(g.transport(), Transport::Shm)
    });
    run_world(2, opts(Transport::Tcp, 10), |g| {
        assert_eq!(g.transport(), Transport::Tcp)
    });
}

#[test]
fn a_rank_that_leaves_is_named_at_once() {
    let errors = run_world(3, opts(Transport::Shm, 20), |g| {
        if g.rank() == 2 {
            return None;
        }
        let start = Instant::now();
        let e = g
            .all_reduce(vec![1.0f32; 10_000], ReduceOp::Sum)
            .wait()
            .unwrap_err();
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "{:?}",
            start.elapsed()
        );
        Some(e.to_string())
    });
    for e in errors.into_iter().flatten() {
        assert!(e.contains("all_reduce #0"), "{e}");
        assert!(e.contains("rank 2 left the group"), "{e}");
    }
}

#[test]
fn a_stalled_rank_is_named_after_the_timeout() {
    let timeout = Duration::from_millis(800);
    let mut o = opts(Transport::Shm, 1);
    o.timeout = timeout;
    let errors = run_world(3, o, |g| {
        if g.rank() == 1 {
            std::thread::sleep(timeout * 3);
            return None;
        }
        let start = Instant::now();
        let e = g
            .all_reduce(vec![0.5f64; 3000], ReduceOp::Avg)
            .wait()
            .unwrap_err();
        let took = start.elapsed();
        assert!(took >= timeout && took < timeout * 2, "took {took:?}");
        Some(e.to_string())
    });
    for e in errors.into_iter().flatten() {
        assert!(e.contains("for rank 1 without progress"), "{e}");
        assert!(e.contains("all_reduce #0 of 3000 x f64"), "{e}");
    }
}

#[test]
fn ranks_in_different_collectives_stop_with_a_desync_error() {
    let errors = run_world(2, opts(Transport::Shm, 10), |g| {
        let len = if g.rank() == 0 { 100 } else { 101 };
        let e = g
            .all_reduce(vec![1.0f32; len], ReduceOp::Sum)
            .wait()
            .unwrap_err();
        let again = g.barrier().wait().unwrap_err();
        assert!(again.to_string().contains("refused"), "{again}");
        e.to_string()
    });
    for e in errors {
        assert!(e.contains("desync"), "{e}");
        assert!(e.contains("100 x f32") && e.contains("101 x f32"), "{e}");
    }
}

#[test]
fn a_rank_killed_mid_all_reduce_is_named() {
    let (world, victim) = (3, 1);
    let timeout = Duration::from_secs(5);
    let port = free_port("127.0.0.1").unwrap();
    let (mut ranks, ready) = looping_ranks(world, port, timeout, &[("BURN_DDP_TRANSPORT", "shm")]);
    for line in ready {
        assert!(line.ends_with("READY shm"), "{line}");
    }
    for rank in &ranks.0 {
        assert_anonymous_segments(rank.id());
    }
    // A dead peer is seen through its connection at once, not after the timeout.
    kill_and_expect_named(&mut ranks, victim, timeout);
}

/// Another process of the user opens a rank's segment (through `/proc/<pid>/map_files`, which
/// root may do) and tries to shrink or grow it: the seals refuse, and the ranks go on (a
/// truncated POSIX segment killed every rank with SIGBUS).
#[test]
fn a_segment_cannot_be_resized_under_the_ranks() {
    let port = free_port("127.0.0.1").unwrap();
    let timeout = Duration::from_secs(20);
    let (mut ranks, _) = looping_ranks(2, port, timeout, &[("BURN_DDP_TRANSPORT", "shm")]);
    let pid = ranks.0[1].id();
    let (range, _) = segments(pid)
        .into_iter()
        .next()
        .expect("rank 1 maps its segment");
    let path = format!("/proc/{pid}/map_files/{range}");
    let file = match std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
    {
        Ok(file) => file,
        Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => {
            eprintln!("SKIPPED: opening {path} needs CAP_SYS_ADMIN ({e})");
            return;
        }
        Err(e) => panic!("{path}: {e}"),
    };
    let size = file.metadata().unwrap().len();
    for to in [0, size / 2, size * 2] {
        let e = file.set_len(to).expect_err("resizing a sealed segment");
        assert_eq!(e.raw_os_error(), Some(1), "EPERM resizing to {to}: {e}");
    }
    // The ranks keep all-reducing through it.
    std::thread::sleep(Duration::from_millis(500));
    for (rank, child) in ranks.0.iter_mut().enumerate() {
        assert!(
            child.try_wait().unwrap().is_none(),
            "rank {rank} ended: {:?}",
            child.try_wait()
        );
    }
}

/// A rank that leaves the instant its collective returns, while another still waits between
/// reading its step counter and checking its connection (that window made 50 ms wide, see
/// `testing::widen_leave_window`): nobody fails, for barrier, all-reduce and all-gather, over
/// shared memory and over TCP (where the goodbye follows the data on the same connection).
#[test]
fn ranks_that_leave_right_after_a_collective_fail_no_one() {
    for transport in [Transport::Shm, Transport::Tcp] {
        for op in ["barrier", "all_reduce", "all_gather"] {
            let server = burn_ddp::store::StoreServer::bind("127.0.0.1:0").unwrap();
            let port = server.local_addr().port();
            burn_ddp::testing::widen_leave_window(port, Duration::from_millis(50));
            let outcomes: Vec<Result<(), String>> = std::thread::scope(|s| {
                let ranks: Vec<_> = (0..3)
                    .map(|rank| {
                        s.spawn(move || {
                            let g = ProcessGroup::builder(rank, 3)
                                .master_addr("127.0.0.1")
                                .master_port(port)
                                .host_store(false)
                                .options(opts(transport, 20))
                                .build()
                                .map_err(|e| e.to_string())?;
                            // Rank 0 waits first; the others come late, and leave at once.
                            if rank > 0 {
                                std::thread::sleep(Duration::from_millis(100));
                            }
                            let done = match op {
                                "barrier" => g.barrier().wait(),
                                "all_reduce" => g
                                    .all_reduce(vec![1.0f32; 64], ReduceOp::Sum)
                                    .wait()
                                    .map(drop),
                                _ => g.all_gather(vec![rank as u8; 8]).wait().map(drop),
                            };
                            done.map_err(|e| e.to_string())
                        })
                    })
                    .collect();
                ranks.into_iter().map(|r| r.join().unwrap()).collect()
            });
            for (rank, outcome) in outcomes.into_iter().enumerate() {
                assert_eq!(outcome, Ok(()), "{transport} {op}, rank {rank}");
            }
        }
    }
}

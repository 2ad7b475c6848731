//! Failures seen by ranks as threads: a rank that leaves, stalls, disagrees, or never joins.

use std::time::{Duration, Instant};

use burn_ddp::status::Phase;
use burn_ddp::{DdpError, ProcessGroup, ReduceOp};
use half::f16;

use crate::common::{options as any_transport, run_world};

/// The common options on the TCP transport: these are its fault paths (shared memory has its own
/// in `shm.rs`, and is the default elsewhere).
fn options(timeout_secs: u64) -> burn_ddp::GroupOptions {
    burn_ddp::GroupOptions {
        transport: burn_ddp::Transport::Tcp,
        ..any_transport(timeout_secs)
    }
}

#[test]
fn a_rank_that_leaves_is_named_by_the_others() {
    let errors = run_world(3, options(10), |g| {
        if g.rank() == 1 {
            drop(g);
            return None;
        }
        let start = Instant::now();
        let e = g
            .all_reduce(vec![1.0f32; 1 << 20], ReduceOp::Sum)
            .wait()
            .unwrap_err();
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "took {:?}",
            start.elapsed()
        );
        // Later calls fail at once with the same cause.
        let again = g.barrier().wait().unwrap_err();
        assert!(matches!(again, DdpError::Aborted { .. }), "{again}");
        Some(e.to_string())
    });
    for e in errors.into_iter().flatten() {
        assert!(e.contains("all_reduce #0"), "{e}");
        assert!(
            e.contains("rank 1 left the group") || e.contains("rank 1 closed"),
            "{e}"
        );
    }
}

#[test]
fn a_stalled_rank_is_a_timeout_naming_it() {
    let timeout = Duration::from_millis(800);
    let mut opts = options(1);
    opts.timeout = timeout;
    let errors = run_world(2, opts, |g| {
        if g.rank() == 1 {
            std::thread::sleep(timeout * 3);
            return None;
        }
        let start = Instant::now();
        let e = g
            .all_reduce(vec![0.5f32; 1000], ReduceOp::Avg)
            .wait()
            .unwrap_err();
        let took = start.elapsed();
        assert!(took >= timeout && took < timeout * 2, "took {took:?}");
        Some(e.to_string())
    });
    let e = errors[0].as_ref().unwrap();
    assert!(
        e.contains("rank 0") && e.contains("rank 1 without progress"),
        "{e}"
    );
    assert!(e.contains("all_reduce #0 of 1000 x f32"), "{e}");
}

#[test]
fn ranks_that_disagree_on_the_operation_stop_with_a_desync_error() {
    let errors = run_world(2, options(10), |g| {
        let e = if g.rank() == 0 {
            g.all_reduce(vec![1.0f32; 64], ReduceOp::Sum)
                .wait()
                .unwrap_err()
        } else {
            g.all_reduce(vec![f16::ONE; 128], ReduceOp::Sum)
                .wait()
                .unwrap_err()
        };
        e.to_string()
    });
    for e in errors {
        assert!(e.contains("desync"), "{e}");
        assert!(e.contains("f32") && e.contains("f16"), "{e}");
    }
}

#[test]
fn broadcast_with_different_lengths_is_an_error_not_garbage() {
    let errors = run_world(3, options(10), |g| {
        let len = if g.rank() == 2 { 10 } else { 12 };
        // Ranks 0 and 1 may finish the broadcast before rank 2 checks it; then their next
        // collective reports what rank 2 found.
        let first = g.broadcast(vec![7u8; len], 0).wait().map(|_| ());
        first
            .and_then(|()| g.barrier().wait())
            .unwrap_err()
            .to_string()
    });
    for e in errors {
        assert!(e.contains("desync") && e.contains("broadcast #0"), "{e}");
    }
}

#[test]
fn a_rank_that_never_joins_is_named() {
    let port = burn_ddp::launch::free_port("127.0.0.1").unwrap();
    let start = Instant::now();
    let e = ProcessGroup::builder(0, 3)
        .master_addr("127.0.0.1")
        .master_port(port)
        .rendezvous_timeout(Duration::from_millis(1500))
        .build()
        .unwrap_err()
        .to_string();
    assert!(e.contains("ranks 1-2 did not join"), "{e}");
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "{:?}",
        start.elapsed()
    );
    // A non-zero rank whose rank 0 never comes: the store is unreachable.
    let e = ProcessGroup::builder(1, 2)
        .master_addr("127.0.0.1")
        .master_port(port)
        .rendezvous_timeout(Duration::from_millis(800))
        .build()
        .unwrap_err()
        .to_string();
    assert!(e.contains("not reachable"), "{e}");
}

#[test]
fn rank_zero_may_start_last() {
    let port = burn_ddp::launch::free_port("127.0.0.1").unwrap();
    let n = 3;
    let sums: Vec<f32> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..n)
            .map(|rank| {
                s.spawn(move || {
                    if rank == 0 {
                        std::thread::sleep(Duration::from_millis(700));
                    }
                    let g = ProcessGroup::builder(rank, n)
                        .master_addr("127.0.0.1")
                        .master_port(port)
                        .options(options(20))
                        .build()
                        .unwrap();
                    g.all_reduce(vec![rank as f32], ReduceOp::Sum)
                        .wait()
                        .unwrap()[0]
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(sums, vec![3.0; 3]);
}

#[test]
fn a_timeout_report_says_where_every_rank_is() {
    let timeout = Duration::from_millis(1500);
    let mut opts = options(1);
    opts.timeout = timeout;
    let errors = run_world(3, opts, |g| {
        let status = g.status();
        if g.rank() == 1 {
            // Stuck in validation while the others all-reduce gradients.
            status.enter(Phase::Validation, Some(2));
            status.step(118);
            std::thread::sleep(timeout * 3);
            return None;
        }
        status.enter(Phase::Training, Some(2));
        status.step(118);
        status.activity(Some("waits for bucket 4 of 7".into()));
        let e = g
            .all_reduce(vec![0.5f32; 1000], ReduceOp::Avg)
            .wait()
            .unwrap_err();
        Some(e.to_string())
    });
    for e in errors.into_iter().flatten() {
        assert!(e.contains("rank 1: validation, epoch 2, step 118"), "{e}");
        assert!(
            e.contains("training, epoch 2, step 118, waits for bucket 4 of 7"),
            "{e}"
        );
    }
}

#[test]
fn a_rank_number_already_taken_is_an_error_naming_it() {
    let server = burn_ddp::store::StoreServer::bind("127.0.0.1:0").unwrap();
    let port = server.local_addr().port();
    let join = |rank| {
        ProcessGroup::builder(rank, 3)
            .master_addr("127.0.0.1")
            .master_port(port)
            .host_store(false)
            .rendezvous_timeout(Duration::from_secs(2))
            .build()
    };
    std::thread::scope(|s| {
        let first = s.spawn(|| join(1));
        std::thread::sleep(Duration::from_millis(300));
        let start = Instant::now();
        let e = join(1).unwrap_err().to_string();
        assert!(
            start.elapsed() < Duration::from_secs(1),
            "{:?}",
            start.elapsed()
        );
        assert!(
            e.contains("rank 1 is already taken by process") && e.contains("RANK=1"),
            "{e}"
        );
        // The first holder waits for the missing ranks and says which.
        let e = first.join().unwrap().unwrap_err().to_string();
        assert!(e.contains("ranks 0, 2 did not join"), "{e}");
    });
}

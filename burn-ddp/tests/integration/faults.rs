//! Failures seen by ranks as threads: a rank that leaves, stalls, disagrees, or never joins;
//! and, with ranks as processes, ranks that exit without leaving once their part is done, which
//! is no failure of the operation the others are still in.

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

/// The rank processes of [`ranks_that_exit_after_a_collective_fail_no_one`] run this entry.
const EXIT_ENTRY: &str = "faults::rank_that_may_exit_after_a_collective";

/// Entry point of those rank processes (does nothing useful when run directly): joins the
/// group the environment describes (`BDDP_HOSTS` simulated hosts sharing memory, or TCP),
/// runs `BDDP_OP`, then either exits at once without leaving the group (`BDDP_EXITS`), or
/// tries a barrier, which must fail at once naming a rank that exited.
#[test]
#[ignore = "entry point of the rank processes ranks_that_exit_after_a_collective_fail_no_one starts"]
fn rank_that_may_exit_after_a_collective() {
    let var = |k: &str| std::env::var(k).unwrap_or_default();
    let (rank, world): (usize, usize) =
        (var("RANK").parse().unwrap(), var("WORLD").parse().unwrap());
    let hosts: Option<usize> = var("BDDP_HOSTS").parse().ok();
    let opts = burn_ddp::GroupOptions {
        transport: if hosts.is_some() {
            burn_ddp::Transport::Shm
        } else {
            burn_ddp::Transport::Tcp
        },
        host_id: hosts.map(|h| format!("simulated-host-{}", rank % h)),
        ..any_transport(20)
    };
    let stop = |what: String| -> ! {
        eprintln!("RANK_ERROR: {what}");
        std::process::exit(3)
    };
    let g = ProcessGroup::builder(rank, world)
        .master_addr("127.0.0.1")
        .master_port(var("MASTER_PORT").parse().unwrap())
        .host_store(false)
        .options(opts)
        .build()
        .unwrap_or_else(|e| stop(format!("joining: {e}")));
    let done = match var("BDDP_OP").as_str() {
        "barrier" => g.barrier().wait(),
        "all_reduce" => g
            .all_reduce(vec![1.0f32; 1000], ReduceOp::Sum)
            .wait()
            .map(drop),
        "all_gather" => g.all_gather(vec![rank as u8; 100]).wait().map(drop),
        _ => g.broadcast(vec![rank as u8; 100], 1).wait().map(drop),
    };
    if let Err(e) = done {
        stop(e.to_string());
    }
    if var("BDDP_EXITS") == "1" {
        // As a program that ends with `process::exit`: no goodbye, the sockets just close.
        std::process::exit(0);
    }
    let start = Instant::now();
    match g.barrier().wait() {
        Ok(()) => stop("a barrier without the ranks that exited passed".into()),
        Err(e) if start.elapsed() > Duration::from_secs(5) => stop(format!(
            "the next barrier failed after {:?}: {e}",
            start.elapsed()
        )),
        Err(e) => eprintln!("NEXT_ERROR after {:?}: {e}", start.elapsed()),
    }
}

/// Runs one job of [`rank_that_may_exit_after_a_collective`]: `world` rank processes (on
/// `hosts` simulated hosts, or TCP), `exits` leave without a goodbye right after `op`, and
/// `holder` holds back the last chunk of each schedule for 500 ms, so that its successor still
/// waits for it when they leave. Returns what went wrong, a line per rank that did not end
/// well (every rank must end its collective well; those that stay, fail their next at once).
fn exit_after_collective_job(
    world: usize,
    hosts: Option<usize>,
    op: &str,
    holder: usize,
    exits: &[usize],
) -> Vec<String> {
    let store = burn_ddp::store::StoreServer::bind("127.0.0.1:0").unwrap();
    let port = store.local_addr().port().to_string();
    let mut ranks = crate::processes::Ranks(
        (0..world)
            .map(|rank| {
                let mut cmd = crate::processes::rank_entry_command(EXIT_ENTRY);
                cmd.env("RANK", rank.to_string())
                    .env("WORLD", world.to_string())
                    .env("MASTER_PORT", &port)
                    .env("BDDP_OP", op)
                    .env("BDDP_EXITS", if exits.contains(&rank) { "1" } else { "0" })
                    .env(
                        "BDDP_HOSTS",
                        hosts.map(|h| h.to_string()).unwrap_or_default(),
                    )
                    .stdin(std::process::Stdio::null())
                    .stdout(std::process::Stdio::null())
                    .stderr(std::process::Stdio::piped());
                if rank == holder {
                    cmd.env("BURN_DDP_TEST_HOLD_LAST_SEND_MS", "500");
                }
                cmd.spawn().unwrap()
            })
            .collect(),
    );
    let deadline = Instant::now() + Duration::from_secs(50);
    let mut failed = Vec::new();
    for (rank, child) in ranks.0.iter_mut().enumerate() {
        let (code, err) = crate::processes::finish(child, deadline);
        let what = format!("{op}, world {world}, hosts {hosts:?}, rank {rank}");
        if code != Some(0) {
            failed.push(format!("{what} exited with {code:?}: {err}"));
            continue;
        }
        // The next collective fails at once, naming a rank that exited.
        let line = err.lines().find(|l| l.starts_with("NEXT_ERROR"));
        if !exits.contains(&rank) && !line.is_some_and(|l| l.contains("closed its connection")) {
            failed.push(format!(
                "{what}: its next barrier did not name a rank that exited: {err}"
            ));
        }
    }
    failed
}

/// Ranks that finish a collective and exit without leaving the group (`process::exit`: no
/// goodbye), while another rank still waits for its last chunk from a neighbour: nobody fails,
/// whether the rank that exited is the waiting rank's successor or no neighbour of it; on TCP
/// (worlds 3 and 4, barrier, all-reduce, all-gather, broadcast) and in the ring across hosts of
/// a hierarchical all-reduce (3 simulated hosts of 2 ranks). Rank 0 waits for `world - 1`
/// (hierarchical: for rank 2, its predecessor across hosts), which holds back its last chunk.
#[test]
fn ranks_that_exit_after_a_collective_fail_no_one() {
    let mut failed = Vec::new();
    for world in [3, 4] {
        // Broadcast from rank 1: the chain 1 -> 2 -> ... -> 0 ends at rank 0.
        let exits: Vec<usize> = (1..world - 1).collect();
        for op in ["barrier", "all_reduce", "all_gather", "broadcast"] {
            failed.extend(exit_after_collective_job(
                world,
                None,
                op,
                world - 1,
                &exits,
            ));
        }
    }
    // Hosts {0, 3}, {1, 4}, {2, 5}; rings across hosts 0 -> 1 -> 2 and 3 -> 4 -> 5. With rank 2
    // holding back, host {1, 4} ends the all-reduce first.
    failed.extend(exit_after_collective_job(
        6,
        Some(3),
        "all_reduce",
        2,
        &[1, 4],
    ));
    assert!(failed.is_empty(), "{}", failed.join("\n"));
}

//! Rank processes the test starts itself, with the launcher's variables: they read the
//! environment, and every survivor names a rank killed in the middle of an all-reduce.

use std::time::{Duration, Instant};

use burn_ddp::launch::free_port;

use super::{COLLECTIVE_FAILED, Ranks, finish, kill_and_expect_named, looping_ranks, rank_command};

#[test]
fn ranks_as_processes_read_the_environment() {
    let port = free_port("127.0.0.1").unwrap();
    let mut ranks = Ranks(
        (0..3)
            .map(|r| rank_command("sum", r, 3, port).spawn().unwrap())
            .collect(),
    );
    let deadline = Instant::now() + Duration::from_secs(60);
    for child in &mut ranks.0 {
        let mut out = String::new();
        let mut stdout = child.stdout.take().unwrap();
        let (code, err) = finish(child, deadline);
        let _ = std::io::Read::read_to_string(&mut stdout, &mut out);
        assert_eq!(code, Some(0), "{err}");
        assert!(out.contains("SUM_OK 3"), "{out}");
    }
}

#[test]
fn invalid_environment_stops_the_process_with_the_variable_named() {
    let port = free_port("127.0.0.1").unwrap();
    let mut cmd = rank_command("sum", 0, 2, port);
    cmd.env("RANK", "2");
    let mut ranks = Ranks(vec![cmd.spawn().unwrap()]);
    let (code, err) = finish(&mut ranks.0[0], Instant::now() + Duration::from_secs(30));
    assert_eq!(code, Some(COLLECTIVE_FAILED), "{err}");
    assert!(
        err.contains("RANK=\"2\"") && err.contains("below WORLD_SIZE=2"),
        "{err}"
    );
}

#[test]
fn a_rank_killed_mid_all_reduce_is_named_by_every_other_rank() {
    let (world, victim) = (4, 2);
    let timeout = Duration::from_secs(4);
    let port = free_port("127.0.0.1").unwrap();
    // Every rank has done a few all-reduces when it prints READY.
    // Over TCP: the shared-memory path has its own test in shm.rs.
    let (mut ranks, _) = looping_ranks(world, port, timeout, &[("BURN_DDP_TRANSPORT", "tcp")]);
    for line in kill_and_expect_named(&mut ranks, victim, timeout * 2) {
        assert!(line.contains("where the ranks were: "), "{line}");
    }
}

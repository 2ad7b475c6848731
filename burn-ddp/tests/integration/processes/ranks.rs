//! Rank processes the test starts itself, with the launcher's variables: they read the
//! environment, and every survivor names a rank killed in the middle of an all-reduce.

use std::io::{BufRead, BufReader};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use burn_ddp::launch::free_port;

use super::{COLLECTIVE_FAILED, Ranks, finish, rank_command};

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
    let mut ranks = Ranks(
        (0..world)
            .map(|r| {
                let mut cmd = rank_command("loop", r, world, port);
                cmd.env("BURN_DDP_TIMEOUT", timeout.as_secs().to_string());
                cmd.spawn().unwrap()
            })
            .collect(),
    );
    // Wait until every rank has done a few all-reduces.
    let (tx, rx) = mpsc::channel();
    for child in &mut ranks.0 {
        let out = child.stdout.take().unwrap();
        let tx = tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if line.contains("READY") {
                    let _ = tx.send(());
                }
            }
        });
    }
    for _ in 0..world {
        rx.recv_timeout(Duration::from_secs(120))
            .expect("ranks never got going");
    }
    std::thread::sleep(Duration::from_millis(100));
    ranks.0[victim].kill().unwrap(); // SIGKILL
    let killed_at = Instant::now();
    let deadline = killed_at + timeout * 2;
    for (r, child) in ranks.0.iter_mut().enumerate() {
        if r == victim {
            continue;
        }
        let (code, err) = finish(child, deadline + Duration::from_secs(1));
        let took = killed_at.elapsed();
        assert_eq!(code, Some(COLLECTIVE_FAILED), "rank {r}: {err}");
        assert!(took < timeout * 2, "rank {r} took {took:?}");
        let line = err
            .lines()
            .find(|l| l.contains("RANK_ERROR"))
            .unwrap_or_default();
        assert!(
            line.contains(&format!("rank {victim} closed its connection")),
            "rank {r}: {line}"
        );
        assert!(line.contains("all_reduce #"), "rank {r}: {line}");
        assert!(line.contains("where the ranks were: "), "rank {r}: {line}");
    }
}

//! Across hosts for real: a cluster of network namespaces on this machine
//! (`burn_ddp::testing::cluster`), one `burn-ddp-run` per host. Correct results across hosts,
//! faults of the network between them, and nothing left behind. Needs root: without it each
//! test prints SKIPPED and why.

use std::io::Read;
use std::path::PathBuf;
use std::process::{Child, ExitStatus};
use std::time::{Duration, Instant};

use burn_ddp::secret::JobSecret;
use burn_ddp::testing::cluster::{Cluster, ClusterConfig, ClusterError, ClusterJob};

use crate::bins::example_bin;

/// The cluster, or `None` after printing why the test is skipped.
fn cluster_or_skip(test: &str, config: ClusterConfig) -> Option<Cluster> {
    match Cluster::create(&config) {
        Ok(c) => Some(c),
        Err(ClusterError::Unavailable(why)) => {
            eprintln!("SKIPPED {test}: {why}");
            None
        }
        Err(e) => panic!("{test}: building the cluster failed: {e}"),
    }
}

fn launcher() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_burn-ddp-run"))
}

fn job(nproc_per_host: usize, program: PathBuf, args: &[&str], env: &[(&str, &str)]) -> ClusterJob {
    let secret = JobSecret::generate().expect("a secret").to_env_value();
    let mut all = vec![program.into_os_string()];
    all.extend(args.iter().map(|a| a.into()));
    ClusterJob {
        launcher: launcher(),
        nproc_per_host,
        program: all,
        env: env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        master_port: 29_400,
        secret,
    }
}

/// A host's launcher: its exit status (`None`: killed at the deadline) and output.
struct Ended {
    status: Option<ExitStatus>,
    output: String,
}

/// Waits for every child until `deadline` from now, killing those still running then.
fn wait_all(children: Vec<Child>, deadline: Duration) -> Vec<Ended> {
    let start = Instant::now();
    let handles: Vec<_> = children
        .into_iter()
        .map(|mut c| {
            // One reader per pipe: a full stderr must not block the launcher while stdout is
            // being read.
            fn drain(mut pipe: impl Read + Send + 'static) -> std::thread::JoinHandle<String> {
                std::thread::spawn(move || {
                    let mut s = String::new();
                    let _ = pipe.read_to_string(&mut s);
                    s
                })
            }
            let out = drain(c.stdout.take().expect("piped stdout"));
            let err = drain(c.stderr.take().expect("piped stderr"));
            (c, [out, err])
        })
        .collect();
    let mut ended = Vec::new();
    for (mut child, reader) in handles {
        let status = loop {
            match child.try_wait() {
                Ok(Some(s)) => break Some(s),
                Ok(None) if start.elapsed() < deadline => {
                    std::thread::sleep(Duration::from_millis(50))
                }
                _ => {
                    let _ = child.kill();
                    let _ = child.wait();
                    break None;
                }
            }
        };
        let output: String = reader
            .into_iter()
            .map(|r| r.join().unwrap_or_default())
            .collect();
        ended.push(Ended { status, output });
    }
    ended
}

fn run_on(cluster: &Cluster, job: &ClusterJob, deadline: Duration) -> Vec<Ended> {
    let children = (0..cluster.hosts())
        .map(|i| cluster.spawn(job, i).expect("starting a host's launcher"))
        .collect();
    wait_all(children, deadline)
}

fn assert_all_succeeded(ended: &[Ended]) {
    for (i, e) in ended.iter().enumerate() {
        assert!(
            e.status.is_some_and(|s| s.success()),
            "host {i} ended with {:?}:\n{}",
            e.status,
            e.output
        );
    }
}

/// Drops the cluster and checks it left no namespace or link.
fn remove(cluster: Cluster) {
    let id = cluster.id().to_string();
    drop(cluster);
    assert_eq!(
        Cluster::leftovers_of(&id),
        Vec::<String>::new(),
        "left behind"
    );
}

#[test]
fn hello_ddp_runs_on_two_hosts_of_two_ranks_and_three_of_one() {
    for (hosts, per_host) in [(2, 2), (3, 1)] {
        let test = format!("hello_ddp on {hosts} hosts x {per_host}");
        let Some(cluster) = cluster_or_skip(&test, ClusterConfig::new(hosts)) else {
            return;
        };
        let hello = example_bin("hello_ddp", "hello_ddp");
        let ended = run_on(
            &cluster,
            &job(per_host, hello, &[], &[]),
            Duration::from_secs(60),
        );
        assert_all_succeeded(&ended);
        let world = hosts * per_host;
        let sum: usize = (0..world).sum();
        let line = format!("rank 0 of {world}: sum of ranks {sum} over {world} ranks");
        assert!(
            ended[0].output.contains(&line),
            "{test}:\n{}",
            ended[0].output
        );
        remove(cluster);
    }
}

/// Final parameters of a quickstart run (raw f32, `--params-out`).
fn params(path: &std::path::Path) -> Vec<f32> {
    let bytes = std::fs::read(path).expect("the parameters file");
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

#[test]
fn quickstart_across_hosts_equals_one_rank_with_the_whole_batch() {
    let quickstart = example_bin("quickstart", "quickstart");
    let dir = std::env::temp_dir().join(format!("burn-ddp-cluster-eq-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let common = ["--epochs", "1", "--quiet", "--samples", "1024"];
    let single = dir.join("single.f32");
    let status = std::process::Command::new(&quickstart)
        .args(common)
        .args(["--batch-size", "32", "--params-out"])
        .arg(&single)
        .args(["--artifacts"])
        .arg(dir.join("single"))
        .status()
        .expect("the single run");
    assert!(status.success());
    let want = params(&single);
    for (hosts, per_host) in [(2, 2), (4, 1)] {
        let test = format!("quickstart on {hosts} hosts x {per_host}");
        let Some(cluster) = cluster_or_skip(&test, ClusterConfig::new(hosts)) else {
            return;
        };
        let out = dir.join(format!("{hosts}x{per_host}.f32"));
        let batch = (32 / (hosts * per_host)).to_string();
        let mut args: Vec<&str> = common.to_vec();
        let (out_s, art) = (
            out.display().to_string(),
            dir.join(format!("art{hosts}")).display().to_string(),
        );
        args.extend([
            "--batch-size",
            &batch,
            "--params-out",
            &out_s,
            "--artifacts",
            &art,
        ]);
        let ended = run_on(
            &cluster,
            &job(per_host, quickstart.clone(), &args, &[]),
            Duration::from_secs(120),
        );
        assert_all_succeeded(&ended);
        let got = params(&out);
        assert_eq!(got.len(), want.len());
        let err = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs() as f64)
            .fold(0.0, f64::max)
            / want.iter().map(|b| b.abs() as f64).fold(1e-12, f64::max);
        assert!(err <= 1e-5, "{test}: relative error {err:e}");
        remove(cluster);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Host 1's link cut after a few seconds of training, with a long collective timeout and a
/// short link timeout: every rank on every host fails within the link timeout (the kernel's
/// keepalive and `TCP_USER_TIMEOUT`), naming an operation; both launchers exit non-zero.
#[test]
fn a_cut_link_is_detected_by_the_transport_and_stops_every_host() {
    let test = "link of host 1 cut mid-training";
    let Some(cluster) = cluster_or_skip(test, ClusterConfig::new(2)) else {
        return;
    };
    let quickstart = example_bin("quickstart", "quickstart");
    let (timeout, link) = (300, 8);
    let job = job(
        2,
        quickstart,
        &["--epochs", "1000", "--samples", "1024"],
        &[
            ("BURN_DDP_TIMEOUT", &timeout.to_string()),
            ("BURN_DDP_LINK_TIMEOUT", &link.to_string()),
        ],
    );
    let children: Vec<Child> = (0..2).map(|i| cluster.spawn(&job, i).unwrap()).collect();
    // Let them train a while, then pull host 1's cable.
    std::thread::sleep(Duration::from_secs(4));
    cluster.set_link(1, false).unwrap();
    let cut = Instant::now();
    let ended = wait_all(children, Duration::from_secs(120));
    let after = cut.elapsed();
    for (i, e) in ended.iter().enumerate() {
        eprintln!(
            "--- host {i} (all ended {after:?} after the cut):\n{}",
            e.output
        );
        assert!(
            e.status.is_some_and(|s| !s.success()),
            "host {i} must fail (status {:?})",
            e.status
        );
        assert!(e.output.contains("failed first"), "host {i}: {}", e.output);
        assert!(
            e.output.contains(" #"),
            "host {i} names no operation: {}",
            e.output
        );
    }
    // Far below the collective timeout: link timeout, plus a store check or two.
    assert!(after < Duration::from_secs(60), "took {after:?}");
    assert!(
        cluster.pids(0).is_empty() && cluster.pids(1).is_empty(),
        "processes left"
    );
    remove(cluster);
}

/// Host 1's processes stopped (SIGSTOP) for three link timeouts, then resumed: their kernel
/// still acknowledges, so nothing fails and the job finishes.
#[test]
fn a_slow_but_connected_host_gets_the_whole_collective_timeout() {
    let test = "host 1 stopped for a while";
    let Some(cluster) = cluster_or_skip(test, ClusterConfig::new(2)) else {
        return;
    };
    let quickstart = example_bin("quickstart", "quickstart");
    let link = 3;
    let job = job(
        1,
        quickstart,
        &["--epochs", "30", "--samples", "2048", "--quiet"],
        &[
            ("BURN_DDP_TIMEOUT", "120"),
            ("BURN_DDP_LINK_TIMEOUT", &link.to_string()),
        ],
    );
    let children: Vec<Child> = (0..2).map(|i| cluster.spawn(&job, i).unwrap()).collect();
    std::thread::sleep(Duration::from_millis(1500));
    cluster.signal_host(1, rustix::process::Signal::STOP);
    std::thread::sleep(Duration::from_secs(3 * link));
    cluster.signal_host(1, rustix::process::Signal::CONT);
    let ended = wait_all(children, Duration::from_secs(120));
    assert_all_succeeded(&ended);
    remove(cluster);
}

/// Host 1's launcher SIGKILLed mid-training: its ranks die with it (they asked the kernel to),
/// and the ranks on host 0 name a lost rank and exit.
#[test]
fn a_killed_host_launcher_takes_its_ranks_and_host_0_names_them() {
    let test = "host 1's launcher killed";
    let Some(cluster) = cluster_or_skip(test, ClusterConfig::new(2)) else {
        return;
    };
    let quickstart = example_bin("quickstart", "quickstart");
    let job = job(
        2,
        quickstart,
        &["--epochs", "1000", "--samples", "1024", "--quiet"],
        &[("BURN_DDP_TIMEOUT", "300"), ("BURN_DDP_LINK_TIMEOUT", "8")],
    );
    let mut children: Vec<Child> = (0..2).map(|i| cluster.spawn(&job, i).unwrap()).collect();
    std::thread::sleep(Duration::from_secs(4));
    children[1].kill().unwrap();
    let killed = Instant::now();
    let ended = wait_all(children, Duration::from_secs(120));
    let after = killed.elapsed();
    eprintln!(
        "--- host 0 ({after:?} after the kill):\n{}",
        ended[0].output
    );
    assert!(ended[0].status.is_some_and(|s| !s.success()));
    let out = &ended[0].output;
    assert!(
        out.contains("rank 2") || out.contains("rank 3"),
        "host 0 names no rank of host 1: {out}"
    );
    assert!(after < Duration::from_secs(30), "took {after:?}");
    assert_eq!(cluster.pids(1), Vec::<i32>::new(), "ranks of host 1 left");
    remove(cluster);
}

/// A checkpointing job cut by a link failure, started again on the healed cluster, resumes
/// from its last checkpoint and ends with the bits of an uninterrupted run.
#[test]
fn a_job_cut_by_a_link_failure_resumes_bit_identical() {
    let test = "resume after a cut link";
    let Some(cluster) = cluster_or_skip(test, ClusterConfig::new(2)) else {
        return;
    };
    let quickstart = example_bin("quickstart", "quickstart");
    let dir = std::env::temp_dir().join(format!("burn-ddp-cluster-resume-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let run = |name: &str| {
        let (ckpt, out, art) = (
            dir.join(format!("{name}-ckpt")).display().to_string(),
            dir.join(format!("{name}.f32")).display().to_string(),
            dir.join(format!("{name}-art")).display().to_string(),
        );
        let args = [
            "--epochs",
            "40",
            "--samples",
            "4096",
            "--quiet",
            "--checkpoint-dir",
            &ckpt,
            "--params-out",
            &out,
            "--artifacts",
            &art,
        ];
        job(
            1,
            quickstart.clone(),
            &args,
            &[("BURN_DDP_TIMEOUT", "300"), ("BURN_DDP_LINK_TIMEOUT", "4")],
        )
    };
    let whole = run("whole");
    assert_all_succeeded(&run_on(&cluster, &whole, Duration::from_secs(300)));

    let cut = run("cut");
    let children: Vec<Child> = (0..2).map(|i| cluster.spawn(&cut, i).unwrap()).collect();
    std::thread::sleep(Duration::from_secs(5));
    cluster.set_link(1, false).unwrap();
    let ended = wait_all(children, Duration::from_secs(120));
    assert!(
        ended.iter().all(|e| e.status.is_some_and(|s| !s.success())),
        "the cut must stop the job"
    );
    cluster.set_link(1, true).unwrap();
    let again = run_on(&cluster, &cut, Duration::from_secs(300));
    assert_all_succeeded(&again);
    // Rank 0 logs where it resumed from into burn-train's log of the run.
    let log = std::fs::read_to_string(dir.join("cut-art").join("experiment.log")).unwrap();
    let resumed = log.lines().find(|l| l.contains("resuming from"));
    eprintln!("{resumed:?}");
    assert!(
        resumed.is_some_and(|l| !l.contains("epoch 0,")),
        "the second run must resume from a checkpoint past the start:\n{log}"
    );
    assert_eq!(
        std::fs::read(dir.join("cut.f32")).unwrap(),
        std::fs::read(dir.join("whole.f32")).unwrap(),
        "resumed run differs from the uninterrupted one"
    );
    let _ = std::fs::remove_dir_all(&dir);
    remove(cluster);
}

/// `BURN_DDP_SOCKET_IFNAME` on real hosts: the host's own interface works, an unknown name is a
/// clear error before any rank waits.
#[test]
fn socket_ifname_picks_the_hosts_interface_and_a_wrong_one_is_named() {
    let test = "BURN_DDP_SOCKET_IFNAME across hosts";
    let Some(cluster) = cluster_or_skip(test, ClusterConfig::new(2)) else {
        return;
    };
    let hello = example_bin("hello_ddp", "hello_ddp");
    let good = job(1, hello.clone(), &[], &[("BURN_DDP_SOCKET_IFNAME", "eth0")]);
    assert_all_succeeded(&run_on(&cluster, &good, Duration::from_secs(60)));
    let bad = job(1, hello, &[], &[("BURN_DDP_SOCKET_IFNAME", "eth9")]);
    let start = Instant::now();
    let ended = run_on(&cluster, &bad, Duration::from_secs(60));
    for (i, e) in ended.iter().enumerate() {
        assert!(
            e.status.is_some_and(|s| !s.success()),
            "host {i}: {}",
            e.output
        );
        assert!(
            e.output.contains("eth9"),
            "host {i} does not name it: {}",
            e.output
        );
    }
    assert!(
        start.elapsed() < Duration::from_secs(30),
        "{:?}",
        start.elapsed()
    );
    remove(cluster);
}

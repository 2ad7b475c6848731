//! What ranks started by the launcher binary (`burn-ddp-run`) inherit from it besides their
//! variables: forwarded stop signals only while they run (never to a process that took a
//! finished rank's pid), and the open-file limit the launcher was started with.
//!
//! The ranks run the scenarios here before joining a group (see [`before_joining`]).

use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::bins::run_bounded;

use super::ENTRY;

/// Runs `scenario` if it is one of this file's (they start no group), then exits.
pub(super) fn before_joining(scenario: &str) {
    match scenario {
        "nofile" => {
            println!("NOFILE soft={}", soft_open_files());
            std::process::exit(0);
        }
        "pid_reuse" => {
            pid_reuse();
            std::process::exit(0);
        }
        _ => {}
    }
}

/// This process's soft limit on open files, as `/proc/self/limits` shows it.
fn soft_open_files() -> String {
    let limits = std::fs::read_to_string("/proc/self/limits").unwrap();
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .expect("an open-file line in /proc/self/limits");
    line.split_whitespace().nth(3).unwrap().to_string()
}

/// Waits up to `limit` for `done`; whether it came.
fn wait_for(limit: Duration, mut done: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    while !done() {
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    true
}

/// In a PID namespace of its own (see the test): rank 1 writes its pid down and exits; once the
/// launcher has reaped it, rank 0 starts a process that takes rank 1's pid (`ns_last_pid`),
/// then signals the launcher and reports whether the SIGTERM the launcher forwards reached
/// that process (`VICTIM signalled`) or not (`VICTIM spared`).
fn pid_reuse() {
    let dir = std::path::PathBuf::from(std::env::var("BDDP_PID_DIR").unwrap());
    let file = dir.join("rank-1.pid");
    if std::env::var("RANK").as_deref() == Ok("1") {
        let tmp = dir.join("rank-1.tmp");
        std::fs::write(&tmp, std::process::id().to_string()).unwrap();
        std::fs::rename(&tmp, &file).unwrap();
        return;
    }
    // The forwarded SIGTERM is received, not acted on.
    let got = Arc::new(AtomicBool::new(false));
    let flag = got.clone();
    let _subscription = burn_ddp::signals::subscribe(move |_| flag.store(true, Ordering::SeqCst))
        .expect("stop signals");
    let mut pid = None;
    let written = wait_for(Duration::from_secs(30), || {
        pid = std::fs::read_to_string(&file)
            .ok()
            .and_then(|s| s.parse::<u32>().ok());
        pid.is_some()
    });
    let pid = pid.filter(|_| written).expect("rank 1 wrote its pid");
    let reaped = wait_for(Duration::from_secs(30), || {
        !Path::new(&format!("/proc/{pid}")).exists()
    });
    assert!(reaped, "the launcher never reaped rank 1 (pid {pid})");
    let mut victim = None;
    for _ in 0..20 {
        std::fs::write("/proc/sys/kernel/ns_last_pid", (pid - 1).to_string())
            .expect("setting ns_last_pid");
        let mut child = Command::new("sleep")
            .arg("30")
            .stdin(Stdio::null())
            .spawn()
            .unwrap();
        if child.id() == pid {
            victim = Some(child);
            break;
        }
        let _ = child.kill();
        let _ = child.wait();
    }
    let mut victim = victim.expect("a process took rank 1's pid");
    println!("VICTIM started with rank 1's pid {pid}");
    let launcher = rustix::process::getppid().expect("a parent process");
    rustix::process::kill_process(launcher, rustix::process::Signal::TERM).unwrap();
    assert!(
        wait_for(Duration::from_secs(10), || got.load(Ordering::SeqCst)),
        "the launcher did not forward SIGTERM to rank 0"
    );
    let mut ended = None;
    wait_for(Duration::from_secs(1), || {
        ended = victim.try_wait().unwrap();
        ended.is_some()
    });
    match ended {
        Some(status) => println!("VICTIM signalled: {status}"),
        None => println!("VICTIM spared"),
    }
    let _ = victim.kill();
    let _ = victim.wait();
}

/// The launcher binary running 2 ranks of `scenario`, run through `wrapper` (a command and its
/// arguments).
fn launcher(wrapper: &[&str], scenario: &str) -> Command {
    let mut cmd = Command::new(wrapper[0]);
    cmd.args(&wrapper[1..])
        .arg(env!("CARGO_BIN_EXE_burn-ddp-run"))
        .args(["--nproc", "2"])
        .arg(std::env::current_exe().unwrap())
        .args(["--exact", ENTRY, "--ignored", "--nocapture"])
        .env("BDDP_TEST_SCENARIO", scenario);
    cmd
}

/// `unshare` into new user, PID and mount namespaces (root inside, so `ns_last_pid` can be
/// written), if this machine allows it.
const UNSHARE: [&str; 6] = [
    "unshare",
    "--user",
    "--map-root-user",
    "--pid",
    "--fork",
    "--mount-proc",
];

#[test]
fn signals_forwarded_by_the_launcher_never_reach_a_process_that_took_a_finished_ranks_pid() {
    let works = Command::new(UNSHARE[0])
        .args(&UNSHARE[1..])
        .arg("true")
        .output()
        .is_ok_and(|o| o.status.success());
    if !works {
        eprintln!("skipped: user and PID namespaces are not available (unshare failed)");
        return;
    }
    let dir = std::env::temp_dir().join(format!("burn-ddp-pids-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let mut cmd = launcher(&UNSHARE, "pid_reuse");
    cmd.env("BDDP_PID_DIR", &dir);
    let out = run_bounded(cmd, Duration::from_secs(60));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let _ = std::fs::remove_dir_all(&dir);
    assert!(text.contains("VICTIM started"), "{text}");
    assert!(
        text.contains("VICTIM spared"),
        "the launcher signalled the process that reused rank 1's pid:\n{text}"
    );
    assert_eq!(out.status.code(), Some(0), "{text}");
}

#[test]
fn ranks_get_the_open_file_limit_the_launcher_was_started_with() {
    let hard = rustix::process::getrlimit(rustix::process::Resource::Nofile).maximum;
    // A soft limit below the hard one, that the launcher could raise.
    let soft = match hard {
        Some(h) if h <= 64 => {
            eprintln!("skipped: the hard open-file limit is {h}");
            return;
        }
        Some(h) => h.min(2048) / 2,
        None => 1024,
    };
    let set = format!("ulimit -Sn {soft} && exec \"$0\" \"$@\"");
    let out = run_bounded(
        launcher(&["sh", "-c", &set], "nofile"),
        Duration::from_secs(60),
    );
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let seen: Vec<&str> = text
        .lines()
        .filter_map(|l| l.split("NOFILE soft=").nth(1))
        .collect();
    assert_eq!(seen.len(), 2, "both ranks report their limit:\n{text}");
    for s in seen {
        assert_eq!(
            s.trim(),
            soft.to_string(),
            "a rank's soft open-file limit (the launcher was started with {soft}, hard \
             {hard:?}):\n{text}"
        );
    }
    assert_eq!(out.status.code(), Some(0), "{text}");
}

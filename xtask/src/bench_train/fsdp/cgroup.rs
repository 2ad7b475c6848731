//! The memory cap of the capped runs: one cgroup per rank with a memory limit, made for a run
//! and removed after it ([`Capped`]). With cgroup v2 at `/sys/fs/cgroup` (the memory controller
//! enabled for its root's children): `memory.max`, in a cgroup under the hierarchy's root; where
//! the memory controller is on a v1 hierarchy (`/sys/fs/cgroup/memory`): `memory.limit_in_bytes`,
//! nested in this process's own memory cgroup (so whatever limits that one stays in force).
//! Each rank enters its cgroup before it starts: the launcher runs `/bin/sh -c 'echo $$ >
//! DIR/rank$LOCAL_RANK/cgroup.procs && exec PROGRAM ARGS'`, so everything the program allocates
//! is charged to its rank's cgroup. Needs root; without it, or without a memory controller,
//! [`Capped::create`] says why.

use std::path::{Path, PathBuf};
use std::time::Duration;

use burn_ddp::launch::LaunchConfig;

/// Which cgroup interface holds the memory controller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    V2,
    V1,
}

impl Kind {
    /// The file of a cgroup's memory limit.
    fn limit_file(self) -> &'static str {
        match self {
            Kind::V2 => "memory.max",
            Kind::V1 => "memory.limit_in_bytes",
        }
    }
}

/// The variable naming the run's cgroup to the ranks' shell.
const VAR: &str = "BURN_DDP_BENCH_CGROUP";
/// What each rank's shell runs: enter the rank's cgroup, then become the program.
const ENTER: &str =
    r#"echo $$ > "$BURN_DDP_BENCH_CGROUP/rank$LOCAL_RANK/cgroup.procs" && exec "$0" "$@""#;
/// v1 and v2: the cgroups of the memory controller, where it is on a v1 hierarchy.
const V1_ROOT: &str = "/sys/fs/cgroup/memory";
const V2_ROOT: &str = "/sys/fs/cgroup";

/// A cgroup for a run with one child per rank, each limited to the same number of bytes;
/// removed when dropped.
#[derive(Debug)]
pub(super) struct Capped {
    dir: PathBuf,
    kind: Kind,
    /// Rank cgroups made so far.
    ranks: usize,
}

impl Capped {
    /// A cgroup for `ranks` ranks, each limited to `cap` bytes (no swap); `Err` says why none
    /// can be made here.
    pub(super) fn create(ranks: usize, cap: u64) -> Result<Self, String> {
        if !is_root() {
            return Err("not running as root: capping a rank's memory takes a cgroup".into());
        }
        let (kind, parent) = hierarchy()?;
        let dir = parent.join(format!("burn-ddp-bench-{}", std::process::id()));
        std::fs::create_dir(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
        let mut capped = Capped {
            dir,
            kind,
            ranks: 0,
        };
        if kind == Kind::V2 {
            write(&capped.dir.join("cgroup.subtree_control"), "+memory")?;
        }
        for r in 0..ranks {
            let rank = capped.rank_dir(r);
            std::fs::create_dir(&rank).map_err(|e| format!("creating {}: {e}", rank.display()))?;
            capped.ranks += 1;
            write(&rank.join(kind.limit_file()), &cap.to_string())?;
            // No swap either (where the files exist: a machine without swap lacks them).
            let swap = match kind {
                Kind::V2 => rank.join("memory.swap.max"),
                Kind::V1 => rank.join("memory.memsw.limit_in_bytes"),
            };
            if swap.exists() {
                let value = if kind == Kind::V2 {
                    "0".into()
                } else {
                    cap.to_string()
                };
                write(&swap, &value)?;
            }
        }
        Ok(capped)
    }

    fn rank_dir(&self, rank: usize) -> PathBuf {
        self.dir.join(format!("rank{rank}"))
    }

    /// How the limit is set, for the table.
    pub(super) fn describe(&self) -> String {
        let v = if self.kind == Kind::V2 { "v2" } else { "v1" };
        format!("cgroup {v} {} per rank", self.kind.limit_file())
    }

    /// A launch of `program` on `world` ranks, each entering its cgroup first (the program's
    /// arguments are to be added after).
    pub(super) fn launch_config(&self, program: &Path, world: usize) -> LaunchConfig {
        LaunchConfig::new("/bin/sh", world)
            .args(["-c", ENTER])
            .args([program])
            .env(VAR, &self.dir)
    }

    /// Processes the kernel's OOM killer ended in the ranks' cgroups.
    pub(super) fn oom_kills(&self) -> u64 {
        let file = match self.kind {
            Kind::V2 => "memory.events",
            Kind::V1 => "memory.oom_control",
        };
        (0..self.ranks)
            .filter_map(|r| std::fs::read_to_string(self.rank_dir(r).join(file)).ok())
            .flat_map(|text| {
                (text.lines())
                    .filter_map(|l| l.strip_prefix("oom_kill "))
                    .filter_map(|n| n.trim().parse::<u64>().ok())
                    .collect::<Vec<_>>()
            })
            .sum()
    }
}

impl Drop for Capped {
    fn drop(&mut self) {
        let dirs = (0..self.ranks).map(|r| self.rank_dir(r));
        for dir in dirs.chain([self.dir.clone()]) {
            // A rank's cgroup empties as its last process is reaped: moments at most.
            let removed = (0..50).any(|_| {
                let done = std::fs::remove_dir(&dir).is_ok() || !dir.exists();
                if !done {
                    std::thread::sleep(Duration::from_millis(20));
                }
                done
            });
            if !removed {
                eprintln!(
                    "bench-train --fsdp: could not remove the cgroup {} (remove it with rmdir)",
                    dir.display()
                );
            }
        }
    }
}

/// Whether this process runs as root (its effective user id, from `/proc/self/status`).
fn is_root() -> bool {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|ids| ids.split_whitespace().nth(1))
        == Some("0")
}

/// Where the run's cgroup goes: under the v2 root with the memory controller enabled for its
/// children, or in this process's own v1 memory cgroup.
fn hierarchy() -> Result<(Kind, PathBuf), String> {
    let v2 = Path::new(V2_ROOT);
    if let Ok(controllers) = std::fs::read_to_string(v2.join("cgroup.controllers")) {
        if !controllers.split_whitespace().any(|c| c == "memory") {
            return Err(format!(
                "cgroup v2 at {V2_ROOT} has no memory controller (cgroup.controllers: {})",
                controllers.trim()
            ));
        }
        let control = v2.join("cgroup.subtree_control");
        let enabled = std::fs::read_to_string(&control).unwrap_or_default();
        if !enabled.split_whitespace().any(|c| c == "memory") {
            write(&control, "+memory")?;
        }
        return Ok((Kind::V2, v2.to_path_buf()));
    }
    let v1 = Path::new(V1_ROOT);
    if v1.join("memory.limit_in_bytes").exists() {
        let own = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
        let path = own.lines().find_map(|l| {
            let mut parts = l.splitn(3, ':');
            let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
            controllers
                .split(',')
                .any(|c| c == "memory")
                .then_some(path)
        });
        let Some(path) = path else {
            return Err("this process is in no v1 memory cgroup (/proc/self/cgroup)".into());
        };
        return Ok((Kind::V1, v1.join(path.trim_start_matches('/'))));
    }
    Err(format!(
        "no cgroup memory controller: neither cgroup v2 at {V2_ROOT} nor a v1 memory hierarchy \
         at {V1_ROOT}"
    ))
}

fn write(path: &Path, value: &str) -> Result<(), String> {
    std::fs::write(path, value).map_err(|e| format!("writing {value} to {}: {e}", path.display()))
}

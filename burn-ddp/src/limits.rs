//! The open-file limit: rank 0 holds about three descriptors per rank (its store's connections
//! and the data plane), every rank one per peer, and the launcher of node 0 one per rank of the
//! job (its store) besides each local rank's pipes, so the common soft limit of 1024 stops a job
//! of a few hundred ranks at once ("Too many open files").
//!
//! A group raises its process's soft limit to the hard one when it starts, as NCCL does. The
//! launcher raises its own only as far as its job needs ([`launcher_needs`]): its ranks inherit
//! it, and a soft limit above 1024 lets a library that uses `select()` (whose descriptor sets
//! end at 1024) overflow instead of failing with "Too many open files". So in every job but the
//! largest (which need more in every rank anyway) the ranks start with the limit the launcher
//! was started with, and raise it only when they start a group.

/// Descriptors the launcher holds per local rank: its output pipes and log files.
const PER_LOCAL_RANK: u64 = 4;
/// Store connections per rank of the job the launcher of node 0 may hold at once (a rank's and
/// its reconnection's).
const STORE_PER_RANK: u64 = 2;
/// The launcher's other descriptors, with room to spare: the standard streams, the store's
/// listener and the connections it is admitting, the signal pipe, the libraries' own.
const RESERVE: u64 = 256;

/// Raises this process's soft limit on open files to its hard limit (once; a failure is only
/// logged: the old limit stays, and running out of descriptors is reported where it happens).
pub(crate) fn raise_open_files() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| raise_to(None));
}

/// Raises this process's soft limit on open files to `needed` if it is lower, never past the
/// hard limit (a failure is only logged, as in [`raise_open_files`]).
pub(crate) fn raise_open_files_to(needed: u64) {
    raise_to(Some(needed));
}

/// The descriptors a launcher of `local` ranks of a job of `world` needs at most; node 0's
/// (`serves_store`) holds the store's connections too.
pub(crate) fn launcher_needs(world: usize, local: usize, serves_store: bool) -> u64 {
    let store = if serves_store {
        STORE_PER_RANK * world as u64
    } else {
        0
    };
    PER_LOCAL_RANK * local as u64 + store + RESERVE
}

/// Raises the soft limit to `needed` (`None`: the hard limit) if it is lower.
fn raise_to(needed: Option<u64>) {
    // One reading and setting at a time, so that none lowers what another just raised.
    static SETTING: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _setting = crate::sync::lock(&SETTING);
    #[cfg(unix)]
    {
        use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
        let limit = getrlimit(Resource::Nofile);
        // `None` is unlimited.
        let Some(current) = limit.current else {
            return;
        };
        let target = match (needed, limit.maximum) {
            (Some(n), Some(max)) => n.min(max),
            (Some(n), None) => n,
            (None, max) => max.unwrap_or(u64::MAX),
        };
        if let (Some(n), Some(max)) = (needed, limit.maximum)
            && n > max
        {
            log::warn!(
                "this launch may need {n} open files, above the hard limit of {max}: raise it \
                 (`ulimit -Hn`) if the launcher runs out of descriptors"
            );
        }
        if target <= current {
            return;
        }
        let current_new = (target != u64::MAX).then_some(target);
        let raised = Rlimit {
            current: current_new,
            maximum: limit.maximum,
        };
        match setrlimit(Resource::Nofile, raised) {
            Ok(()) => log::debug!("raised the open-file limit from {current} to {target}"),
            Err(e) => log::warn!("could not raise the open-file limit: {e}"),
        }
    }
    #[cfg(not(unix))]
    let _ = needed;
}

#[cfg(all(test, unix))]
mod tests {
    use rustix::process::{Resource, getrlimit};

    use super::*;

    #[test]
    fn an_ordinary_launch_keeps_a_soft_limit_of_1024_and_a_large_one_raises_it() {
        assert!(launcher_needs(16, 8, true) <= 1024);
        assert!(launcher_needs(64, 8, false) <= 1024);
        assert!(launcher_needs(1024, 8, true) > 1024);
    }

    #[test]
    fn raising_never_lowers_the_soft_limit_nor_passes_the_hard_one() {
        // `None` is unlimited.
        let at_least = |a: Option<u64>, b: Option<u64>| match (a, b) {
            (None, _) => true,
            (Some(_), None) => false,
            (Some(a), Some(b)) => a >= b,
        };
        let before = getrlimit(Resource::Nofile);
        raise_open_files_to(1);
        let after = getrlimit(Resource::Nofile);
        assert!(
            at_least(after.current, before.current),
            "{before:?} -> {after:?}"
        );
        raise_open_files_to(u64::MAX);
        let raised = getrlimit(Resource::Nofile);
        assert_eq!(
            raised.current, raised.maximum,
            "raised as far as the hard limit"
        );
        assert_eq!(
            raised.maximum, before.maximum,
            "the hard limit is left alone"
        );
    }
}

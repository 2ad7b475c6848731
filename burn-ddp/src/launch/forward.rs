//! The launcher's side of stop signals: SIGTERM, SIGINT or SIGUSR1 sent to the launcher (a
//! cluster's preemption, Ctrl-C, `kill`) is forwarded to every rank, which then stop together
//! at a step boundary (see [`crate::signals`]). A second signal, or ranks still running
//! [`LaunchConfig::stop_grace`](super::LaunchConfig::stop_grace) after the first, get SIGKILL.
//!
//! Every signal the launcher sends a rank goes through here, and never reaches a process that
//! took a finished rank's pid: a rank's pid leaves the list before its process is reaped
//! ([`Forwarder::wait`]), and signals are sent while holding the list.

use std::process::{Child, ExitStatus};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::error::Result;
use crate::signals::{Arrival, Repeats, Subscription, signal_name, subscribe};

/// Forwards stop signals to the ranks of the current start while it lives.
pub(crate) struct Forwarder {
    state: Arc<State>,
    _subscription: Subscription,
}

#[derive(Default)]
struct State {
    /// The pids of the current start's ranks, by local rank; `None` once the rank exited (before
    /// it is reaped, so that a pid here is never another process's).
    pids: Mutex<Vec<Option<u32>>>,
    repeats: Repeats,
}

impl Forwarder {
    pub(crate) fn start() -> Result<Self> {
        let state = Arc::new(State::default());
        let listener = state.clone();
        let subscription = subscribe(move |signal| listener.on_signal(signal))
            .map_err(|e| crate::error::DdpError::io("forwarding stop signals", e))?;
        Ok(Forwarder {
            state,
            _subscription: subscription,
        })
    }

    /// The ranks signals go to (the processes of the current start, none of them waited for
    /// yet). A signal that arrived while they were being started is passed on to them now.
    pub(crate) fn set_ranks(&self, pids: &[u32]) {
        let mut list = crate::sync::lock(&self.state.pids);
        *list = pids.iter().copied().map(Some).collect();
        if let Some(signal) = self.state.repeats.first() {
            for pid in list.iter().flatten() {
                super::kill_pid(*pid, Some(signal));
            }
        }
    }

    /// Waits for local rank `local` (`child`, whose pid [`Forwarder::set_ranks`] was given) to
    /// exit, takes its pid off the list, and only then reaps it.
    pub(crate) fn wait(&self, local: usize, child: &mut Child) -> std::io::Result<ExitStatus> {
        if exited_unreaped(child.id()) {
            self.forget(local);
        }
        let status = child.wait();
        self.forget(local);
        status
    }

    /// Takes local rank `local` off the list.
    fn forget(&self, local: usize) {
        if let Some(slot) = crate::sync::lock(&self.state.pids).get_mut(local) {
            *slot = None;
        }
    }

    /// The first stop signal received and when, if one was.
    pub(crate) fn received(&self) -> Option<(i32, Instant)> {
        Some((self.state.repeats.first()?, self.state.repeats.first_at()?))
    }

    /// Kills every rank still running.
    pub(crate) fn kill_all(&self) {
        self.state.signal_all(None);
    }
}

impl State {
    /// Sends `signal` (SIGKILL if `None`) to every rank not yet reaped.
    fn signal_all(&self, signal: Option<i32>) {
        let list = crate::sync::lock(&self.pids);
        for pid in list.iter().flatten() {
            super::kill_pid(*pid, signal);
        }
    }

    fn on_signal(&self, signal: i32) {
        let name = signal_name(signal);
        match self.repeats.arrive(signal) {
            Arrival::First => {
                say!(
                    "[burn-ddp] {name}: forwarded to the ranks; they stop at the next step \
                     boundary (checkpoint if configured); a second signal kills them"
                );
                self.signal_all(Some(signal));
            }
            Arrival::Repeat => {}
            Arrival::Second => {
                say!("[burn-ddp] {name} again: killing the ranks");
                self.signal_all(None);
            }
        }
    }
}

/// Blocks until the child `pid` exits and returns true, leaving it unreaped (`waitid` with
/// `WNOWAIT`): its pid stays its own until [`Child::wait`] reaps it. False where that cannot
/// be done: the pid then leaves the list only as the child is reaped, and a signal sent at that
/// moment could reach a process that took the pid at once.
#[cfg(all(
    unix,
    not(any(
        target_os = "cygwin",
        target_os = "horizon",
        target_os = "openbsd",
        target_os = "redox"
    ))
))]
fn exited_unreaped(pid: u32) -> bool {
    use rustix::process::{Pid, WaitId, WaitIdOptions, waitid};
    let Some(pid) = Pid::from_raw(pid as i32) else {
        return false;
    };
    let options = WaitIdOptions::EXITED | WaitIdOptions::NOWAIT;
    loop {
        match waitid(WaitId::Pid(pid), options) {
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => {
                log::debug!("waiting for process {pid:?} without reaping it: {e}");
                return false;
            }
            Ok(_) => return true,
        }
    }
}

#[cfg(not(all(
    unix,
    not(any(
        target_os = "cygwin",
        target_os = "horizon",
        target_os = "openbsd",
        target_os = "redox"
    ))
)))]
fn exited_unreaped(_pid: u32) -> bool {
    false
}

//! The launcher's side of stop signals: SIGTERM, SIGINT or SIGUSR1 sent to the launcher (a
//! cluster's preemption, Ctrl-C, `kill`) is forwarded to every rank, which then stop together
//! at a step boundary (see [`crate::signals`]). A second signal, or ranks still running
//! [`LaunchConfig::stop_grace`](super::LaunchConfig::stop_grace) after the first, get SIGKILL.

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
    pids: Mutex<Vec<u32>>,
    repeats: Repeats,
}

impl Forwarder {
    pub(crate) fn start() -> Result<Self> {
        let state = Arc::new(State::default());
        let listener = state.clone();
        let subscription = subscribe(move |signal| listener.on_signal(signal))?;
        Ok(Forwarder {
            state,
            _subscription: subscription,
        })
    }

    /// The ranks signals go to (the processes of the current start). A signal that arrived
    /// while they were being started is passed on to them now.
    pub(crate) fn set_ranks(&self, pids: &[u32]) {
        *crate::sync::lock(&self.state.pids) = pids.to_vec();
        if let Some(signal) = self.state.repeats.first() {
            for pid in pids {
                super::kill_pid(*pid, Some(signal));
            }
        }
    }

    /// The first stop signal received and when, if one was.
    pub(crate) fn received(&self) -> Option<(i32, Instant)> {
        Some((self.state.repeats.first()?, self.state.repeats.first_at()?))
    }

    /// Kills every rank still running (the grace after the first signal is over).
    pub(crate) fn kill_all(&self) {
        for pid in self.state.pids() {
            super::kill_pid(pid, None);
        }
    }
}

impl State {
    fn pids(&self) -> Vec<u32> {
        crate::sync::lock(&self.pids).clone()
    }

    fn on_signal(&self, signal: i32) {
        let name = signal_name(signal);
        match self.repeats.arrive(signal) {
            Arrival::First => {
                say!(
                    "[burn-ddp] {name}: forwarded to the ranks; they stop at the next step \
                     boundary (checkpoint if configured); a second signal kills them"
                );
                for pid in self.pids() {
                    super::kill_pid(pid, Some(signal));
                }
            }
            Arrival::Repeat => {}
            Arrival::Second => {
                say!("[burn-ddp] {name} again: killing the ranks");
                for pid in self.pids() {
                    super::kill_pid(pid, None);
                }
            }
        }
    }
}

//! The launcher's watch over one start of its ranks: one waiter thread per rank, so exits are
//! seen in the order they happen; the first failure names the rank the ranks' failure record
//! blames (given a moment to exit too) with what it last reported, and stops the others; after
//! a stop signal the ranks have `stop_grace` to end before they are killed.

use std::process::Child;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use super::LaunchConfig;
use super::exits::{Exit, Exits};
use super::forward::Forwarder;
use crate::error::{DdpError, Result};
use crate::failure::{FAILURE_KEY, FailureRecord};
use crate::status::{RankStatus, status_key};
use crate::store::StoreServer;

/// How long the launcher waits for the rank the others blame to exit, before naming the rank
/// whose exit it saw first.
const CULPRIT_GRACE: Duration = Duration::from_secs(2);

/// Watches the ranks of one start.
pub(super) struct Supervisor<'a> {
    cfg: &'a LaunchConfig,
    forwarder: &'a Forwarder,
    /// The store node 0 serves (the failure record and the ranks' status), if this is node 0.
    server: Option<&'a StoreServer>,
    /// The rank of this node's first process.
    first: usize,
}

impl<'a> Supervisor<'a> {
    pub(super) fn new(
        cfg: &'a LaunchConfig,
        forwarder: &'a Forwarder,
        server: Option<&'a StoreServer>,
    ) -> Self {
        Supervisor {
            cfg,
            forwarder,
            server,
            first: cfg.node_rank * cfg.nproc_per_node,
        }
    }

    /// Waits for every child; returns the first failure (naming the culprit), or the outcome of
    /// a stop by signal.
    pub(super) fn watch(&self, children: Vec<Child>) -> Result<()> {
        let pids: Vec<u32> = children.iter().map(Child::id).collect();
        self.forwarder.set_ranks(&pids);
        let (tx, rx) = mpsc::channel();
        let result = std::thread::scope(|s| {
            for (i, mut child) in children.into_iter().enumerate() {
                let (tx, forwarder) = (tx.clone(), self.forwarder);
                s.spawn(move || {
                    let _ = tx.send((i, forwarder.wait(i, &mut child)));
                });
            }
            drop(tx);
            self.follow(pids.len(), &rx)
        });
        self.forwarder.set_ranks(&[]);
        result
    }

    /// Follows the exits of `n` ranks as their waiters report them (see [`Supervisor::watch`]).
    fn follow(&self, n: usize, rx: &Receiver<Exit>) -> Result<()> {
        let mut exits = Exits::new(n);
        let mut result = Ok(());
        let mut killed = false;
        while let Some(exit) = self.next_exit(rx, &mut killed) {
            let i = exit.0;
            // While the ranks stop for a signal, their exits are expected: no rank is blamed.
            if !exits.record(exit) || result.is_err() || self.forwarder.received().is_some() {
                continue;
            }
            let named = self.culprit(i, &mut exits, rx);
            result = Err(self.failed(named, &exits));
            // Every rank still running (the others were taken off the forwarder's list).
            self.forwarder.kill_all();
        }
        match self.forwarder.received() {
            Some((signal, _)) => exits.stopped(signal, self.first),
            None => result,
        }
    }

    /// The next rank's exit, or `None` once every rank exited. After a stop signal the ranks
    /// have `stop_grace` to end; then they are killed.
    fn next_exit(&self, rx: &Receiver<Exit>, killed: &mut bool) -> Option<Exit> {
        loop {
            let wait = match self.forwarder.received() {
                _ if *killed => Duration::from_millis(50),
                Some((_, at)) => {
                    (at + self.cfg.stop_grace).saturating_duration_since(Instant::now())
                }
                None => Duration::from_millis(200),
            };
            match rx.recv_timeout(wait) {
                Ok(exit) => return Some(exit),
                Err(RecvTimeoutError::Disconnected) => return None,
                Err(RecvTimeoutError::Timeout) => {
                    if let Some((signal, _)) = self.forwarder.received()
                        && wait.is_zero()
                        && !*killed
                    {
                        say!(
                            "[burn-ddp] the ranks did not stop within {:?} of {}: killing them",
                            self.cfg.stop_grace,
                            crate::signals::signal_name(signal)
                        );
                        self.forwarder.kill_all();
                        *killed = true;
                    }
                }
            }
        }
    }

    /// The local rank to name for a failure first seen at local rank `i`: `i` may have failed
    /// because of another, which the ranks' failure record names; it gets a moment to exit
    /// too, so that the report names the root cause.
    fn culprit(&self, i: usize, exits: &mut Exits, rx: &Receiver<Exit>) -> usize {
        let n = exits.running.len();
        let blamed = self
            .server
            .and_then(|s| s.value(FAILURE_KEY))
            .and_then(|raw| FailureRecord::from_bytes(&raw))
            .and_then(|r| r.culprit?.checked_sub(self.first))
            .filter(|c| *c < n && *c != i);
        let Some(c) = blamed else {
            return i;
        };
        let deadline = Instant::now() + CULPRIT_GRACE;
        while exits.running[c] {
            match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                Ok(other) => {
                    exits.record(other);
                }
                Err(_) => break,
            }
        }
        if exits.failures[c].is_some() { c } else { i }
    }

    /// The error naming local rank `named`, how it ended and what it last reported.
    fn failed(&self, named: usize, exits: &Exits) -> DdpError {
        let rank = self.first + named;
        let failure = exits.failures[named].clone().unwrap_or_default();
        let last = self
            .server
            .and_then(|s| s.value(&status_key(rank)))
            .and_then(|raw| RankStatus::from_bytes(&raw));
        let failure = match last {
            Some(status) => format!("{failure}; it last reported: {status}"),
            None => failure,
        };
        log::error!("rank {rank} {failure}; stopping the other ranks");
        DdpError::RankFailed {
            rank,
            status: failure,
        }
    }
}

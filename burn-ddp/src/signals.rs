//! Stop requests from signals: a cluster that preempts a job (Slurm's SIGTERM, or SIGUSR1 with
//! `--signal`), Ctrl-C (SIGINT) or `kill` asks a rank to stop at the next step boundary instead
//! of dying mid-step.
//!
//! One handler thread per process receives the signals and hands them to whoever
//! [`subscribe`]d: a training loop ([`StopSignals`]) or the launcher (which forwards them to its
//! ranks). In a training loop the first SIGTERM, SIGINT or SIGUSR1 is then only recorded: the training loop reads it
//! with [`StopSignals::requested`], the ranks agree on it at a step boundary, write a checkpoint
//! and end with [`crate::DdpError::Stopped`], whose exit code is
//! [`exit_code`]`(signal)` = 128 + the signal's number (143 for SIGTERM, 130 for SIGINT, 138
//! for SIGUSR1), what a shell reports for a process the signal ended. What stops a rank at once:
//! - a second signal, at least [`REPEAT_WINDOW`] after the first (a terminal's Ctrl-C reaches
//!   a rank twice within it: directly, and forwarded by the launcher; that counts as one);
//! - no agreement within the collective timeout after the first signal (a rank stuck in a step);
//! - any of these signals while no training loop is armed (the default action: exit).

use std::io::Write;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use crate::error::{DdpError, Result};

/// The signals that request a graceful stop.
#[cfg(unix)]
pub const STOP_SIGNALS: [i32; 3] = [
    signal_hook::consts::SIGTERM,
    signal_hook::consts::SIGINT,
    signal_hook::consts::SIGUSR1,
];

/// A repeat of a signal within this time of the first counts as the same request.
pub const REPEAT_WINDOW: Duration = Duration::from_secs(1);

/// The exit code of a process stopped by `signal`: 128 + its number, as a shell reports it.
pub fn exit_code(signal: i32) -> i32 {
    128 + signal
}

/// The signal's name, `SIGTERM` for 15.
pub fn signal_name(signal: i32) -> String {
    #[cfg(unix)]
    if let Some(name) = signal_hook::low_level::signal_name(signal) {
        return name.to_string();
    }
    format!("signal {signal}")
}

/// A function called on the handler thread with each stop signal received.
type Listener = Arc<dyn Fn(i32) + Send + Sync>;

/// The process's one handler thread and who listens to it.
struct Dispatcher {
    listeners: Mutex<Vec<(u64, Listener)>>,
    next_id: AtomicU64,
}

/// The dispatcher, or why installing it failed (kept for every later caller).
static DISPATCHER: OnceLock<std::io::Result<Dispatcher>> = OnceLock::new();

/// Calls `listener` with every stop signal this process receives until the returned
/// [`Subscription`] is dropped. While nobody listens, a stop signal ends the process at once
/// with [`exit_code`] (the signals' default action). The handlers are installed by the first
/// call and stay for the process's life.
pub fn subscribe(listener: impl Fn(i32) + Send + Sync + 'static) -> Result<Subscription> {
    let dispatcher = DISPATCHER.get_or_init(install).as_ref().map_err(|e| {
        DdpError::io(
            "installing signal handlers",
            std::io::Error::new(e.kind(), e.to_string()),
        )
    })?;
    let id = dispatcher.next_id.fetch_add(1, Ordering::Relaxed);
    let mut listeners = crate::sync::lock(&dispatcher.listeners);
    listeners.push((id, Arc::new(listener)));
    Ok(Subscription { id, dispatcher })
}

/// A listener registered with [`subscribe`]; dropping it unregisters the listener.
pub struct Subscription {
    id: u64,
    dispatcher: &'static Dispatcher,
}

impl std::fmt::Debug for Subscription {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Subscription")
            .field("id", &self.id)
            .finish()
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        let mut listeners = crate::sync::lock(&self.dispatcher.listeners);
        listeners.retain(|(id, _)| *id != self.id);
    }
}

#[cfg(unix)]
fn install() -> std::io::Result<Dispatcher> {
    let mut signals = signal_hook::iterator::Signals::new(STOP_SIGNALS)?;
    std::thread::Builder::new()
        .name("burn-ddp-signals".into())
        .spawn(move || {
            for signal in signals.forever() {
                dispatch(signal);
            }
        })?;
    Ok(Dispatcher {
        listeners: Mutex::new(Vec::new()),
        next_id: AtomicU64::new(0),
    })
}

#[cfg(not(unix))]
fn install() -> std::io::Result<Dispatcher> {
    Err(std::io::Error::other(
        "stop signals are handled on Unix only",
    ))
}

fn dispatch(signal: i32) {
    let Some(Ok(dispatcher)) = DISPATCHER.get() else {
        return;
    };
    let listeners: Vec<Listener> = crate::sync::lock(&dispatcher.listeners)
        .iter()
        .map(|(_, l)| l.clone())
        .collect();
    if listeners.is_empty() {
        exit_now(
            "this process",
            signal,
            "received with no training or launch running",
        );
    }
    for listener in listeners {
        listener(signal);
    }
}

/// Exits at once with the signal's exit code, saying why on stderr (the log may be captured).
pub(crate) fn exit_now(who: &str, signal: i32, why: &str) -> ! {
    let message = format!(
        "{who}: {}: {why}; exiting with code {}",
        signal_name(signal),
        exit_code(signal)
    );
    log::error!("{message}");
    // Never a panic on a closed stderr (its reader may be gone already).
    let _ = writeln!(std::io::stderr(), "{message}");
    std::process::exit(exit_code(signal));
}

/// Tells a first stop signal from a second one (a repeat within [`REPEAT_WINDOW`] is the
/// same request).
#[derive(Debug, Default)]
pub(crate) struct Repeats {
    first: Mutex<Option<(i32, Instant)>>,
}

/// What a signal means to a [`Repeats`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Arrival {
    /// The first stop request.
    First,
    /// The same request again (within [`REPEAT_WINDOW`]).
    Repeat,
    /// A second request: stop at once.
    Second,
}

impl Repeats {
    /// Classifies `signal`, received now.
    pub fn arrive(&self, signal: i32) -> Arrival {
        let mut first = crate::sync::lock(&self.first);
        match *first {
            None => {
                *first = Some((signal, Instant::now()));
                Arrival::First
            }
            Some((_, at)) if at.elapsed() >= REPEAT_WINDOW => Arrival::Second,
            Some(_) => Arrival::Repeat,
        }
    }

    /// The first signal received, if any.
    pub fn first(&self) -> Option<i32> {
        crate::sync::lock(&self.first).map(|(s, _)| s)
    }

    /// When the first signal arrived, if one did.
    pub fn first_at(&self) -> Option<Instant> {
        crate::sync::lock(&self.first).map(|(_, t)| t)
    }
}

/// A training loop's view of the stop signals (see the module documentation).
#[derive(Debug)]
pub struct StopSignals {
    state: Arc<StopState>,
    _subscription: Subscription,
}

#[derive(Debug, Default)]
struct StopState {
    repeats: Repeats,
    /// The ranks agreed to stop (the watchdog stands down).
    agreed: AtomicBool,
}

impl StopSignals {
    /// Listens for stop signals on behalf of `rank`'s training loop; an agreement must follow
    /// the first signal within `timeout`, or the process exits. Stops listening when dropped.
    pub fn arm(rank: usize, timeout: Duration) -> Result<Self> {
        let state = Arc::new(StopState::default());
        let listener = state.clone();
        let subscription = subscribe(move |signal| listener.on_signal(rank, timeout, signal))?;
        Ok(StopSignals {
            state,
            _subscription: subscription,
        })
    }

    /// The signal that asked this process to stop, if one did.
    pub fn requested(&self) -> Option<i32> {
        self.state.repeats.first()
    }

    /// Records that every rank agreed to stop: from now on the collectives' timeouts bound the
    /// way out, and the agreement watchdog stands down.
    pub fn agreed(&self) {
        self.state.agreed.store(true, Ordering::Release);
    }
}

impl StopState {
    fn on_signal(self: &Arc<Self>, rank: usize, timeout: Duration, signal: i32) {
        let who = format!("rank {rank}");
        match self.repeats.arrive(signal) {
            Arrival::First => {
                log::warn!(
                    "rank {rank}: received {}: every rank stops at the next step boundary (a \
                     checkpoint is written if configured); a second signal stops at once",
                    signal_name(signal)
                );
                let state = self.clone();
                let spawned = std::thread::Builder::new()
                    .name("burn-ddp-stop-watchdog".into())
                    .spawn(move || {
                        std::thread::sleep(timeout);
                        if !state.agreed.load(Ordering::Acquire) {
                            let why = format!("the ranks did not agree to stop within {timeout:?}");
                            exit_now(&format!("rank {rank}"), signal, &why);
                        }
                    });
                if spawned.is_err() {
                    exit_now(&who, signal, "cannot start the stop watchdog");
                }
            }
            Arrival::Repeat => log::debug!(
                "{who}: {} again within {REPEAT_WINDOW:?}: the same request",
                signal_name(signal)
            ),
            Arrival::Second => exit_now(&who, signal, "second stop signal"),
        }
    }
}

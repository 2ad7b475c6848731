//! Stop requests from signals: a cluster that preempts a job (Slurm's SIGTERM, or SIGUSR1 with
//! `--signal`), Ctrl-C (SIGINT) or `kill` asks a rank to stop at the next step boundary instead
//! of dying mid-step.
//!
//! One handler thread per process receives the signals and hands them to whoever
//! [`subscribe`]d: a training loop ([`StopSignals`]) or the launcher (which forwards them to its
//! ranks). In a training loop the first SIGTERM, SIGINT or SIGUSR1 is then only recorded: the
//! training loop reads it with [`StopSignals::requested`], the ranks agree on it at a step
//! boundary, write a checkpoint and end with [`crate::DdpError::Stopped`], whose exit code is
//! [`exit_code`]`(signal)` = 128 + the signal's number (143 for SIGTERM, 130 for SIGINT, 138
//! for SIGUSR1), what a shell reports for a process the signal ended. What stops a rank at once:
//! - a second signal, at least [`REPEAT_WINDOW`] after the first (a terminal's Ctrl-C reaches
//!   a rank twice within it: directly, and forwarded by the launcher; that counts as one);
//! - no agreement within the collective timeout after the first signal (a rank stuck in a step),
//!   not counting the time the rank writes a checkpoint (see [`StopSignals::arm_for`]); this
//!   watchdog stands down when the training loop returns (its [`StopSignals`] is dropped);
//! - any of these signals while no training loop is armed (the default action: exit).
//!
//! At start-up the listeners' table exists before the handlers are installed, and they are
//! installed only once the thread that reads them exists (handlers without a reader would
//! swallow every signal). signal-hook-registry's first registration of a signal installs its
//! handler a moment before it stores what the handler does, and drops a signal arriving in
//! between when the signal's previous action is the default one; so a raw handler of
//! burn-ddp's own (`sys::signal`) is installed first, records such a signal, and the handler
//! thread dispatches it. No stop signal is lost at start-up: before the first subscription it
//! has its default action (the process exits), after it a listener receives it.

use std::io;
use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

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

/// Who listens, by subscription id. A static, so that it exists before the handlers are
/// installed: a signal that arrives while they are being installed finds it.
static LISTENERS: Mutex<Vec<(u64, Listener)>> = Mutex::new(Vec::new());

/// The next subscription's id.
static NEXT_ID: AtomicU64 = AtomicU64::new(0);

/// Whether installing the handlers worked, or why not (tried once, kept for every later caller).
static INSTALLED: OnceLock<std::io::Result<()>> = OnceLock::new();

/// Calls `listener` with every stop signal this process receives until the returned
/// [`Subscription`] is dropped. While nobody listens, a stop signal ends the process at once
/// with [`exit_code`] (the signals' default action). The handlers are installed by the first
/// call and stay for the process's life; a signal that arrives while they are being installed
/// reaches `listener`.
pub fn subscribe(listener: impl Fn(i32) + Send + Sync + 'static) -> io::Result<Subscription> {
    let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
    crate::sync::lock(&LISTENERS).push((id, Arc::new(listener)));
    // Dropped (so unregistered) on the way out if the handlers cannot be installed.
    let subscription = Subscription { id };
    if let Err(e) = INSTALLED.get_or_init(install) {
        let why = format!("installing signal handlers: {e}");
        return Err(io::Error::new(e.kind(), why));
    }
    Ok(subscription)
}

/// A listener registered with [`subscribe`]; dropping it unregisters the listener.
#[derive(Debug)]
pub struct Subscription {
    id: u64,
}

impl Drop for Subscription {
    fn drop(&mut self) {
        crate::sync::lock(&LISTENERS).retain(|(id, _)| *id != self.id);
    }
}

/// Starts the handler thread, then installs the handlers and hands them to it: a thread that
/// cannot be started leaves the signals' default action in place, and no signal waits for a
/// reader that never comes. A raw handler of burn-ddp's own holds the signals that arrive
/// while signal-hook installs its handlers (`sys::signal`, see the module documentation); the
/// thread dispatches them first, each once.
#[cfg(unix)]
fn install() -> std::io::Result<()> {
    type Handoff = (signal_hook::iterator::Signals, Vec<i32>);
    let (tx, rx) = std::sync::mpsc::channel::<Handoff>();
    std::thread::Builder::new()
        .name("burn-ddp-signals".into())
        .spawn(move || {
            // Returns at once when the handlers could not be installed (the sender is gone).
            let Ok((mut signals, early)) = rx.recv() else {
                return;
            };
            for signal in early {
                dispatch(signal);
            }
            for signal in signals.forever() {
                dispatch(signal);
            }
        })?;
    let held = crate::sys::signal::hold(&STOP_SIGNALS)?;
    let signals = signal_hook::iterator::Signals::new(STOP_SIGNALS);
    let mut early = crate::sys::signal::release();
    let mut signals = match signals {
        Ok(signals) => signals,
        Err(e) => {
            // Nobody will read them: the default action again, and a signal that came
            // meanwhile has it now.
            crate::sys::signal::give_back(&held, &early);
            return Err(e);
        }
    };
    // A signal that arrived after signal-hook's handler was in place but before the release
    // was most often both recorded and delivered to `signals`: merged into one. (One handled
    // on another thread right at the release may still come twice, microseconds apart: the
    // same request, see `Repeats`.)
    early.extend(signals.pending());
    early.sort_unstable();
    early.dedup();
    // The thread waits for them from its first instruction; it cannot have ended.
    tx.send((signals, early))
        .map_err(|_| std::io::Error::other("the signal thread ended before it got the handlers"))
}

#[cfg(not(unix))]
fn install() -> std::io::Result<()> {
    Err(std::io::Error::other(
        "stop signals are handled on Unix only",
    ))
}

/// Hands `signal` to every listener; with none (or one that panicked), the default action.
fn dispatch(signal: i32) {
    let listeners: Vec<Listener> = crate::sync::lock(&LISTENERS)
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
    // A listener's panic must not end this thread: every later signal would be swallowed.
    let delivered = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        for listener in &listeners {
            listener(signal);
        }
    }));
    if delivered.is_err() {
        exit_now("this process", signal, "its stop-signal listener panicked");
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
    /// `None` once dropping began.
    subscription: Option<Subscription>,
}

/// Whether the rank is busy with something that does not count toward the watchdog's timeout.
pub(crate) type Busy = Box<dyn Fn() -> bool + Send + Sync>;

/// How often the watchdog asks whether the rank is busy (when it can be).
const BUSY_POLL: Duration = Duration::from_millis(100);

struct StopState {
    rank: usize,
    /// How long the ranks may take to agree after the first signal (busy time not counted).
    timeout: Duration,
    repeats: Repeats,
    busy: Option<Busy>,
    /// The watchdog stands down: the ranks agreed to stop, or the training loop returned.
    stand_down: Mutex<bool>,
    changed: Condvar,
    /// The watchdog's thread, once a first signal started it.
    watchdog: Mutex<Option<JoinHandle<()>>>,
}

impl std::fmt::Debug for StopState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StopState")
            .field("rank", &self.rank)
            .field("timeout", &self.timeout)
            .field("repeats", &self.repeats)
            .field("stand_down", &*crate::sync::lock(&self.stand_down))
            .finish_non_exhaustive()
    }
}

impl StopSignals {
    /// Listens for stop signals on behalf of `rank`'s training loop; an agreement must follow
    /// the first signal within `timeout`, or the process exits. Stops listening (and the
    /// watchdog stands down) when dropped.
    pub fn arm(rank: usize, timeout: Duration) -> io::Result<Self> {
        Self::arm_busy(rank, timeout, None)
    }

    /// [`StopSignals::arm`], where the time `busy` returns true (a checkpoint being written)
    /// does not count toward the timeout.
    pub(crate) fn arm_busy(rank: usize, timeout: Duration, busy: Option<Busy>) -> io::Result<Self> {
        let state = Arc::new(StopState {
            rank,
            timeout,
            repeats: Repeats::default(),
            busy,
            stand_down: Mutex::new(false),
            changed: Condvar::new(),
            watchdog: Mutex::new(None),
        });
        let listener = state.clone();
        let subscription = subscribe(move |signal| listener.on_signal(signal))?;
        Ok(StopSignals {
            state,
            subscription: Some(subscription),
        })
    }

    /// The signal that asked this process to stop, if one did.
    pub fn requested(&self) -> Option<i32> {
        self.state.repeats.first()
    }

    /// Records that every rank agreed to stop: from now on the collectives' timeouts bound the
    /// way out, and the agreement watchdog stands down.
    pub fn agreed(&self) {
        self.state.stand_down();
    }
}

impl Drop for StopSignals {
    /// Stops listening (a stop signal from now on has its default action), and the watchdog
    /// stands down: the training loop returned, nothing is left to agree on.
    fn drop(&mut self) {
        self.subscription.take();
        self.state.stand_down();
        // It wakes at once; joined, so that it holds nothing of the training loop's after this.
        let watchdog = crate::sync::lock(&self.state.watchdog).take();
        if let Some(watchdog) = watchdog {
            let _ = watchdog.join();
        }
    }
}

impl StopState {
    fn on_signal(self: &Arc<Self>, signal: i32) {
        let who = format!("rank {}", self.rank);
        match self.repeats.arrive(signal) {
            Arrival::First => {
                log::warn!(
                    "{who}: received {}: every rank stops at the next step boundary (a \
                     checkpoint is written if configured); a second signal stops at once",
                    signal_name(signal)
                );
                let state = self.clone();
                let spawned = std::thread::Builder::new()
                    .name("burn-ddp-stop-watchdog".into())
                    .spawn(move || state.watch(signal));
                match spawned {
                    Ok(watchdog) => *crate::sync::lock(&self.watchdog) = Some(watchdog),
                    Err(_) => exit_now(&who, signal, "cannot start the stop watchdog"),
                }
            }
            Arrival::Repeat => log::debug!(
                "{who}: {} again within {REPEAT_WINDOW:?}: the same request",
                signal_name(signal)
            ),
            Arrival::Second => exit_now(&who, signal, "second stop signal"),
        }
    }

    fn stand_down(&self) {
        *crate::sync::lock(&self.stand_down) = true;
        self.changed.notify_all();
    }

    /// The watchdog: exits the process unless it stands down before the ranks spent
    /// `timeout` (busy time not counted) without agreeing after `signal`.
    fn watch(&self, signal: i32) {
        let mut left = self.timeout;
        let mut since = Instant::now();
        loop {
            let wait = match self.busy {
                Some(_) => left.min(BUSY_POLL),
                None => left,
            };
            let deadline = Instant::now() + wait;
            let mut down = crate::sync::lock(&self.stand_down);
            while !*down && Instant::now() < deadline {
                let rest = deadline.saturating_duration_since(Instant::now());
                down = crate::sync::wait_timeout(&self.changed, down, rest).0;
            }
            if *down {
                return;
            }
            drop(down);
            let now = Instant::now();
            if !self.busy.as_ref().is_some_and(|busy| busy()) {
                left = left.saturating_sub(now - since);
            }
            since = now;
            // Deciding under the lock: a stand-down either came first or waits for the exit.
            let down = crate::sync::lock(&self.stand_down);
            if left.is_zero() && !*down {
                let why = format!("the ranks did not agree to stop within {:?}", self.timeout);
                exit_now(&format!("rank {}", self.rank), signal, &why);
            }
        }
    }
}

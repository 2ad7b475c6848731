//! A raw signal handler that holds the signals arriving while signal-hook's handlers are being
//! installed.
//!
//! signal-hook-registry installs its handler for a signal (`sigaction`) a moment before it
//! stores what that handler should do; a signal arriving in between finds nothing to do and
//! falls back to the previous action, but only when that action is a handler: with the
//! default action (`SIG_DFL`), the signal is dropped. [`hold`] installs this module's handler
//! first, so that it is the previous action the registry falls back to: it records the signal
//! in an atomic bit set, which [`release`] hands over once the registry's handlers are in
//! place. The registry keeps calling it before its own actions afterwards; once released it
//! does nothing.

use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// The signals recorded while held, one bit per signal number.
static RECORDED: AtomicU64 = AtomicU64::new(0);

/// Whether the handler records (until [`release`]).
static RECORDING: AtomicBool = AtomicBool::new(true);

/// The handler: records `signal` while holding. Only lock-free atomics, which are
/// async-signal-safe.
extern "C" fn record(signal: libc::c_int) {
    if RECORDING.load(Ordering::SeqCst) && (0..64).contains(&signal) {
        RECORDED.fetch_or(1 << signal, Ordering::SeqCst);
    }
}

/// Installs the recording handler for each of `signals` that has its default action, and
/// returns those; leaves any other action (a handler of the program's own, or `SIG_IGN`)
/// alone. On an error, the signals it installed the handler for get their default action back
/// (a handler nobody reads would swallow them). Must come before [`release`].
pub(crate) fn hold(signals: &[i32]) -> io::Result<Vec<i32>> {
    let mut held = Vec::new();
    for &signal in signals {
        match hold_one(signal) {
            Ok(true) => held.push(signal),
            Ok(false) => {}
            Err(e) => {
                give_back(&held, &[]);
                return Err(e);
            }
        }
    }
    Ok(held)
}

/// Gives the `held` signals their default action back, then raises those of them in `early`
/// (recorded while held) again, so that their default action happens (the process ends): for
/// when the handlers meant to follow [`hold`] could not be installed (this module's handler
/// alone would swallow the signals).
pub(crate) fn give_back(held: &[i32], early: &[i32]) {
    for &signal in held {
        // SAFETY: `SIG_DFL` is always a valid action; an invalid signal number only makes it
        // fail (EINVAL), which leaves nothing changed.
        unsafe { libc::signal(signal, libc::SIG_DFL) };
    }
    for signal in early.iter().filter(|s| held.contains(s)) {
        // SAFETY: sends a signal to the calling thread; its action is the default one now.
        unsafe { libc::raise(*signal) };
    }
}

/// [`hold`] for one signal; whether it installed the handler (only over the default action).
fn hold_one(signal: i32) -> io::Result<bool> {
    if !(1..64).contains(&signal) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("signal {signal} out of range"),
        ));
    }
    // SAFETY: `sigaction` is plain data for which all zeroes is a valid value (no handler, no
    // flags, an empty mask once `sigemptyset` ran on it).
    let mut current: libc::sigaction = unsafe { std::mem::zeroed() };
    // SAFETY: reads the signal's action into a live, writable value of this frame.
    if unsafe { libc::sigaction(signal, std::ptr::null(), &mut current) } != 0 {
        return Err(io::Error::last_os_error());
    }
    if current.sa_sigaction != libc::SIG_DFL {
        return Ok(false);
    }
    // SAFETY: as above.
    let mut action: libc::sigaction = unsafe { std::mem::zeroed() };
    action.sa_sigaction = record as extern "C" fn(libc::c_int) as libc::sighandler_t;
    action.sa_flags = libc::SA_RESTART;
    // SAFETY: the pointer is to a live `sigaction` of this frame; the handler is an
    // `extern "C" fn(c_int)` (no `SA_SIGINFO`) that touches only lock-free atomics.
    let installed = unsafe {
        libc::sigemptyset(&mut action.sa_mask) == 0
            && libc::sigaction(signal, &action, std::ptr::null_mut()) == 0
    };
    match installed {
        true => Ok(true),
        false => Err(io::Error::last_os_error()),
    }
}

/// Stops recording and returns the signals recorded since the first [`hold`], each once (in
/// increasing number: the order they arrived in is not kept).
pub(crate) fn release() -> Vec<i32> {
    RECORDING.store(false, Ordering::SeqCst);
    let recorded = RECORDED.swap(0, Ordering::SeqCst);
    (1..64).filter(|s| recorded & (1 << s) != 0).collect()
}

#[cfg(test)]
mod tests {
    use std::process::Command;

    /// Set in the child process [`held_signals_are_recorded_then_handed_over`] starts.
    const CHILD_VAR: &str = "BURN_DDP_SYS_SIGNAL_CHILD";

    /// In the child: SIGTERM held, raised, released; raised again (nothing recorded); then
    /// given back with what was recorded (which ends the child).
    #[test]
    fn held_signal_child() {
        if std::env::var_os(CHILD_VAR).is_none() {
            return;
        }
        let term = libc::SIGTERM;
        let held = super::hold(&[term]).unwrap();
        println!("HELD {held:?}");
        // `raise`: to this thread, handled before it returns (a signal to the process may go
        // to another thread, and later).
        // SAFETY: sends SIGTERM to this thread, whose action is the recording handler.
        unsafe { libc::raise(term) };
        let early = super::release();
        println!("RELEASED {early:?}");
        // SAFETY: as above (the handler no longer records).
        unsafe { libc::raise(term) };
        println!("RELEASED AGAIN {:?}", super::release());
        // The default action back, and the signal recorded while held raised again: the end.
        super::give_back(&held, &early);
        std::thread::sleep(std::time::Duration::from_secs(5));
        println!("STILL ALIVE");
    }

    /// A signal that arrives while held is recorded (not the default action: the process
    /// lives) and handed over once; after the release the handler records nothing; given back,
    /// the signal recorded while held has its default action (the process ends by it).
    #[test]
    fn held_signals_are_recorded_then_handed_over() {
        use std::os::unix::process::ExitStatusExt;
        let test = module_path!().split_once("::").map_or("", |(_, p)| p);
        let out = Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                &format!("{test}::held_signal_child"),
                "--nocapture",
            ])
            .args(["--test-threads", "1"])
            .env(CHILD_VAR, "1")
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            text.contains(&format!("RELEASED [{}]", libc::SIGTERM)),
            "{text}"
        );
        assert!(text.contains("RELEASED AGAIN []"), "{text}");
        assert!(!text.contains("STILL ALIVE"), "{text}");
        assert_eq!(out.status.signal(), Some(libc::SIGTERM), "{text}");
    }
}

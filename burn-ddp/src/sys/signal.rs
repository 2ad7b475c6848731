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

/// Installs the recording handler for each of `signals` that has its default action; leaves
/// any other action (a handler of the program's own, or `SIG_IGN`) in place. On an error, the
/// signals it installed the handler for get their default action back (a handler nobody reads
/// would swallow them). Must come before [`release`].
pub(crate) fn hold(signals: &[i32]) -> io::Result<()> {
    let mut held = Vec::new();
    for &signal in signals {
        match hold_one(signal) {
            Ok(true) => held.push(signal),
            Ok(false) => {}
            Err(e) => {
                restore_default(&held);
                return Err(e);
            }
        }
    }
    Ok(())
}

/// Gives `signals` their default action back: after [`hold`], when the handlers meant to
/// follow could not be installed (this module's handler alone would swallow the signals).
pub(crate) fn restore_default(signals: &[i32]) {
    for &signal in signals {
        // SAFETY: `SIG_DFL` is always a valid action; an invalid signal number only makes it
        // fail (EINVAL), which leaves nothing changed.
        unsafe { libc::signal(signal, libc::SIG_DFL) };
    }
}

/// [`hold`] for one signal; whether it installed the handler.
fn hold_one(signal: i32) -> io::Result<bool> {
    if !(1..64).contains(&signal) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("signal {signal} out of range"),
        ));
    }
    // SAFETY: `sigaction` is plain data for which all zeroes is a valid value (no handler, no
    // flags, an empty mask once `sigemptyset` ran on it).
    let mut action: libc::sigaction = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    let mut previous: libc::sigaction = unsafe { std::mem::zeroed() };
    action.sa_sigaction = record as extern "C" fn(libc::c_int) as libc::sighandler_t;
    action.sa_flags = libc::SA_RESTART;
    // SAFETY: both pointers are to live, writable `sigaction` values of this frame; the handler
    // is an `extern "C" fn(c_int)` (no `SA_SIGINFO`) that touches only lock-free atomics.
    let installed = unsafe {
        libc::sigemptyset(&mut action.sa_mask) == 0
            && libc::sigaction(signal, &action, &mut previous) == 0
    };
    if !installed {
        return Err(io::Error::last_os_error());
    }
    if previous.sa_sigaction == libc::SIG_DFL {
        return Ok(true);
    }
    // Someone else's action: theirs again (a signal in between was recorded, and is handed
    // over with the others).
    // SAFETY: `previous` is the action `sigaction` just returned for this signal.
    if unsafe { libc::sigaction(signal, &previous, std::ptr::null_mut()) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(false)
}

/// Stops recording and returns the signals recorded since the first [`hold`] (in increasing
/// number), each once.
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

    /// In the child: SIGTERM held, sent to itself, released; then its default action back and
    /// SIGTERM sent again (which ends the child).
    #[test]
    fn held_signal_child() {
        if std::env::var_os(CHILD_VAR).is_none() {
            return;
        }
        let term = libc::SIGTERM;
        super::hold(&[term]).unwrap();
        let me = rustix::process::getpid();
        // Delivered before `kill_process` returns (it is not blocked in this thread).
        rustix::process::kill_process(me, rustix::process::Signal::TERM).unwrap();
        println!("RELEASED {:?}", super::release());
        rustix::process::kill_process(me, rustix::process::Signal::TERM).unwrap();
        println!("RELEASED AGAIN {:?}", super::release());
        super::restore_default(&[term]);
        rustix::process::kill_process(me, rustix::process::Signal::TERM).unwrap();
        std::thread::sleep(std::time::Duration::from_secs(5));
        println!("STILL ALIVE");
    }

    /// A signal that arrives while held is recorded (not the default action: the process
    /// lives) and handed over once; after the release the handler records nothing; with the
    /// default action back, the signal ends the process.
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

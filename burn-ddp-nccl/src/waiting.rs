//! How the NCCL backend waits: polling, never blocking, so that every wait ends within its
//! deadline, within a poll of an abort asked from another thread, and within
//! [`WATCH_INTERVAL`] of the caller's watch reporting that the group failed elsewhere.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::TryRecvError;
use std::time::{Duration, Instant};

/// How often a wait asks the caller's watch whether the group failed elsewhere.
pub const WATCH_INTERVAL: Duration = Duration::from_millis(100);

/// How long a wait goes on polling after its watch reported a failure elsewhere, in case the
/// work finishes anyway: a peer that did its part of the last collective and exited without
/// leaving the group looks dead to the watch while this rank's part completes.
pub const GRACE: Duration = Duration::from_millis(500);

/// The longest sleep between two polls (the first are shorter, for short collectives).
const MAX_NAP: Duration = Duration::from_micros(500);

/// Why a wait ended without its work done (`E`: the polled work's error).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Stop<E> {
    /// The polled work failed.
    Failed(E),
    /// The deadline passed.
    TimedOut,
    /// The caller's watch reported a failure elsewhere: its words.
    Watched(String),
    /// Someone aborted the communicator.
    Aborted,
}

/// Polls `poll` (`Ok(true)`: done) until it is done, fails, `timeout` passes, `aborted` is set
/// or [`GRACE`] after `watch` returned a reason (asked every [`WATCH_INTERVAL`], and once before
/// giving up on the deadline, so that a failure elsewhere is named rather than a timeout).
pub(crate) fn poll_until<E>(
    timeout: Duration,
    aborted: &AtomicBool,
    watch: &mut dyn FnMut() -> Option<String>,
    mut poll: impl FnMut() -> Result<bool, E>,
) -> Result<(), Stop<E>> {
    let start = Instant::now();
    let mut watched = start;
    let mut nap = Duration::from_micros(10);
    let mut reported: Option<(Instant, String)> = None;
    loop {
        if poll().map_err(Stop::Failed)? {
            return Ok(());
        }
        if aborted.load(Ordering::Acquire) {
            return Err(Stop::Aborted);
        }
        let now = Instant::now();
        let late = now.duration_since(start) >= timeout;
        if let Some((since, reason)) = &reported {
            if late || now.duration_since(*since) >= GRACE {
                return Err(Stop::Watched(reason.clone()));
            }
        } else if late || now.duration_since(watched) >= WATCH_INTERVAL {
            watched = now;
            if let Some(reason) = watch() {
                if late {
                    return Err(Stop::Watched(reason));
                }
                reported = Some((now, reason));
            }
        }
        if late {
            return Err(Stop::TimedOut);
        }
        std::thread::sleep(nap);
        nap = (nap * 2).min(MAX_NAP);
    }
}

/// Waits for `blocking`, a wait that cannot be polled (CubeCL's fence on a stream: an event
/// synchronize), bounded like [`poll_until`]: it runs on a helper thread whose outcome is
/// polled. A wait that ends early leaves the helper blocked until `blocking` returns (it holds
/// nothing but what `blocking` captured).
pub(crate) fn wait_blocking(
    timeout: Duration,
    aborted: &AtomicBool,
    watch: &mut dyn FnMut() -> Option<String>,
    blocking: impl FnOnce() -> Result<(), String> + Send + 'static,
) -> Result<(), Stop<String>> {
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    std::thread::Builder::new()
        .name("burn-ddp-nccl-fence".into())
        .spawn(move || {
            // The waiter may have given up: nobody to tell then.
            let _ = tx.send(blocking());
        })
        .map_err(|e| Stop::Failed(format!("could not start a thread to wait on: {e}")))?;
    poll_until(timeout, aborted, watch, || match rx.try_recv() {
        Ok(outcome) => outcome.map(|()| true),
        Err(TryRecvError::Empty) => Ok(false),
        Err(TryRecvError::Disconnected) => Err("the thread waiting for it panicked".to_string()),
    })
}

/// Drops `keep` (buffers a stopped kernel may still use) only once `drained` says the work
/// that could touch it finished, asking for at most `limit`; leaks it otherwise, since memory a
/// kernel may still write must never be handed back for reuse. Returns whether it was dropped.
pub(crate) fn keep_until_drained<K>(
    keep: K,
    limit: Duration,
    mut drained: impl FnMut() -> bool,
) -> bool {
    let never = AtomicBool::new(false);
    let done = poll_until(limit, &never, &mut || None, || {
        Ok::<_, std::convert::Infallible>(drained())
    });
    if done.is_ok() {
        drop(keep);
        true
    } else {
        log::warn!(
            "NCCL's stream did not finish within {limit:?} of the abort: its buffers are leaked \
             rather than reused while a kernel may still write them"
        );
        std::mem::forget(keep);
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn never() -> Option<String> {
        None
    }

    /// [`poll_until`] of work whose failures are words.
    fn wait(
        timeout: Duration,
        aborted: &AtomicBool,
        watch: &mut dyn FnMut() -> Option<String>,
        poll: impl FnMut() -> Result<bool, String>,
    ) -> Result<(), Stop<String>> {
        poll_until(timeout, aborted, watch, poll)
    }

    #[test]
    fn done_work_returns_at_once() {
        let mut polls = 0;
        let r = wait(
            Duration::from_secs(5),
            &AtomicBool::new(false),
            &mut never,
            || {
                polls += 1;
                Ok(polls == 3)
            },
        );
        assert_eq!(r, Ok(()));
        assert_eq!(polls, 3);
    }

    #[test]
    fn a_failure_of_the_work_is_its_own() {
        let r = wait(
            Duration::from_secs(5),
            &AtomicBool::new(false),
            &mut never,
            || Err("ncclRemoteError: remote process exited".into()),
        );
        assert_eq!(
            r,
            Err(Stop::Failed(
                "ncclRemoteError: remote process exited".into()
            ))
        );
    }

    #[test]
    fn the_deadline_bounds_a_wait_that_never_ends() {
        let t = Instant::now();
        let r = wait(
            Duration::from_millis(150),
            &AtomicBool::new(false),
            &mut never,
            || Ok(false),
        );
        assert_eq!(r, Err(Stop::TimedOut));
        let took = t.elapsed();
        assert!(
            took >= Duration::from_millis(150) && took < Duration::from_secs(2),
            "{took:?}"
        );
    }

    /// A failure recorded elsewhere ends a wait of 300 s within the watch interval and the grace.
    #[test]
    fn the_watch_ends_a_long_wait_within_its_interval_and_the_grace() {
        let t = Instant::now();
        let mut asked = 0;
        let mut watch = || {
            asked += 1;
            (t.elapsed() > Duration::from_millis(250)).then(|| "rank 1 died".to_string())
        };
        let r = wait(
            Duration::from_secs(300),
            &AtomicBool::new(false),
            &mut watch,
            || Ok(false),
        );
        assert_eq!(r, Err(Stop::Watched("rank 1 died".into())));
        let took = t.elapsed();
        let reported = Duration::from_millis(250);
        assert!(took >= reported + GRACE, "{took:?}");
        assert!(took < reported + 2 * WATCH_INTERVAL + GRACE, "{took:?}");
        assert!((2..=6).contains(&asked), "asked {asked} times");
    }

    /// Work that finishes within the grace after the watch reported a failure succeeds: the
    /// peer did its part and left.
    #[test]
    fn work_that_finishes_within_the_grace_succeeds() {
        let t = Instant::now();
        let mut watch = || Some("rank 1 closed its connection".to_string());
        let r = wait(
            Duration::from_secs(300),
            &AtomicBool::new(false),
            &mut watch,
            || Ok(t.elapsed() > WATCH_INTERVAL + GRACE / 2),
        );
        assert_eq!(r, Ok(()));
    }

    /// An abort from another thread ends the wait within a poll.
    #[test]
    fn an_abort_from_another_thread_ends_the_wait() {
        let aborted = std::sync::Arc::new(AtomicBool::new(false));
        let flag = aborted.clone();
        let t = Instant::now();
        let aborter = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            flag.store(true, Ordering::Release);
        });
        let r = wait(Duration::from_secs(300), &aborted, &mut never, || Ok(false));
        aborter.join().unwrap();
        assert_eq!(r, Err(Stop::Aborted));
        assert!(
            t.elapsed() < Duration::from_millis(500),
            "{:?}",
            t.elapsed()
        );
    }

    /// A blocking wait (CubeCL's fence) that outlasts the timeout ends at the timeout.
    #[test]
    fn a_blocking_wait_is_bounded_by_the_timeout() {
        let t = Instant::now();
        let r = wait_blocking(
            Duration::from_millis(150),
            &AtomicBool::new(false),
            &mut never,
            || {
                std::thread::sleep(Duration::from_secs(3));
                Ok(())
            },
        );
        assert_eq!(r, Err(Stop::TimedOut));
        assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
    }

    /// ... by an abort from another thread and by the watch, and reports the wait's own
    /// outcome when it ends first.
    #[test]
    fn a_blocking_wait_is_bounded_by_an_abort_and_the_watch() {
        let blocked = || {
            std::thread::sleep(Duration::from_secs(3));
            Ok(())
        };
        let t = Instant::now();
        let r = wait_blocking(
            Duration::from_secs(300),
            &AtomicBool::new(true),
            &mut never,
            blocked,
        );
        assert_eq!(r, Err(Stop::Aborted));
        let r = wait_blocking(
            Duration::from_secs(300),
            &AtomicBool::new(false),
            &mut || Some("rank 1 died".into()),
            blocked,
        );
        assert_eq!(r, Err(Stop::Watched("rank 1 died".into())));
        assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
        let never_aborted = AtomicBool::new(false);
        let ok = wait_blocking(
            Duration::from_secs(5),
            &never_aborted,
            &mut never,
            || Ok(()),
        );
        assert_eq!(ok, Ok(()));
        let failed = wait_blocking(Duration::from_secs(5), &never_aborted, &mut never, || {
            Err("kernel failed".into())
        });
        assert_eq!(failed, Err(Stop::Failed("kernel failed".into())));
    }

    /// Records when it is dropped.
    struct Buffers(Arc<std::sync::Mutex<Option<Instant>>>);

    impl Drop for Buffers {
        fn drop(&mut self) {
            *self.0.lock().unwrap() = Some(Instant::now());
        }
    }

    /// Buffers are handed back only after the stream drained, and never while it still runs.
    #[test]
    fn buffers_are_kept_until_the_stream_drained() {
        let dropped = Arc::new(std::sync::Mutex::new(None));
        let t = Instant::now();
        let drains_at = Duration::from_millis(100);
        let gone = keep_until_drained(Buffers(dropped.clone()), Duration::from_secs(5), || {
            t.elapsed() >= drains_at
        });
        assert!(gone);
        let at = dropped.lock().unwrap().expect("dropped once drained");
        assert!(
            at.duration_since(t) >= drains_at,
            "dropped while the stream still ran"
        );

        let dropped = Arc::new(std::sync::Mutex::new(None));
        let t = Instant::now();
        let gone = keep_until_drained(Buffers(dropped.clone()), Duration::from_millis(100), || {
            false
        });
        assert!(!gone);
        assert_eq!(
            *dropped.lock().unwrap(),
            None,
            "a running kernel's buffers were freed"
        );
        assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    }
}

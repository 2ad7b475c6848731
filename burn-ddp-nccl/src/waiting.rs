//! How the NCCL backend waits: polling, never blocking, so that every wait ends within its
//! deadline, within a poll of an abort asked from another thread, and within
//! [`WATCH_INTERVAL`] of the caller's watch reporting that the group failed elsewhere.

use std::sync::atomic::{AtomicBool, Ordering};
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

#[cfg(test)]
mod tests {
    use super::*;

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
}

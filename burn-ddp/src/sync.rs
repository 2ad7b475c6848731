//! The crate's one way to take a lock.
//!
//! Every mutex here guards data that stays consistent when a thread panics while holding it (a
//! queue, a slot, a table written in one assignment), and a panic elsewhere must not turn into a
//! second panic in the thread that reports it (a failure record, a signal handler, a log file).
//! So a poisoned lock is taken over, never unwrapped.

use std::sync::{Condvar, LockResult, Mutex, MutexGuard, WaitTimeoutResult};
use std::time::Duration;

/// The guard of a lock, poisoned or not.
fn recover<G>(result: LockResult<G>) -> G {
    result.unwrap_or_else(|p| p.into_inner())
}

/// Locks `mutex`, taking it over if a thread panicked while holding it.
pub(crate) fn lock<T: ?Sized>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    recover(mutex.lock())
}

/// [`Condvar::wait_timeout`], taking the lock over if a thread panicked while holding it.
pub(crate) fn wait_timeout<'a, T>(
    changed: &Condvar,
    guard: MutexGuard<'a, T>,
    timeout: Duration,
) -> (MutexGuard<'a, T>, WaitTimeoutResult) {
    recover(changed.wait_timeout(guard, timeout))
}

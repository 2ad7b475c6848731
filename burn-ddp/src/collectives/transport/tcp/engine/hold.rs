//! Test support (feature `test-support`): a rank that holds back the last chunk of every
//! schedule it runs, so that the ranks that do not need that chunk finish the operation (and
//! may leave) while the ones that do still wait for it. Set per process, through
//! [`HOLD_VAR`]: the tests that use it run their ranks as processes, so it touches no other
//! test.

use std::sync::OnceLock;
use std::time::Duration;

/// Milliseconds a rank process waits before the last send of each schedule.
const HOLD_VAR: &str = "BURN_DDP_TEST_HOLD_LAST_SEND_MS";

/// How long this process holds back the last send of each schedule (zero where [`HOLD_VAR`]
/// is unset or not a number), read once.
pub(super) fn last_send_hold() -> Duration {
    static HOLD: OnceLock<Duration> = OnceLock::new();
    *HOLD.get_or_init(|| {
        let millis = std::env::var(HOLD_VAR).ok().and_then(|v| v.parse().ok());
        millis.map_or(Duration::ZERO, Duration::from_millis)
    })
}

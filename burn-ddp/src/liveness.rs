//! Dead-link detection by the kernel on every TCP connection of a job (data plane and store):
//! keepalive probes on idle connections and a bound on unacknowledged data (`TCP_USER_TIMEOUT`),
//! so a cut cable or a vanished host fails the connection, naming the peer, within about
//! [`link_timeout`], however long the collective timeout is. A peer that is merely slow (busy,
//! stopped, swapping) still acknowledges at the TCP level, so it gets the whole collective timeout.

use std::net::TcpStream;
use std::time::Duration;

/// Arms `stream` for [`link_timeout`]: keepalive probes after a third of it idle, every sixth,
/// three unanswered probes fail it; unacknowledged data fails it after the whole of it.
pub(crate) fn watch(stream: &TcpStream) {
    let t = link_timeout();
    let whole_secs = |d: Duration| Duration::from_secs(d.as_secs().max(1));
    let set = || -> rustix::io::Result<()> {
        use rustix::net::sockopt;
        sockopt::set_socket_keepalive(stream, true)?;
        sockopt::set_tcp_keepidle(stream, whole_secs(t / 3))?;
        sockopt::set_tcp_keepintvl(stream, whole_secs(t / 6))?;
        sockopt::set_tcp_keepcnt(stream, 3)?;
        sockopt::set_tcp_user_timeout(stream, t.as_millis().min(u32::MAX as u128) as u32)
    };
    if let Err(e) = set() {
        log::debug!("could not arm dead-link detection on a connection: {e}");
    }
}

/// How long a silent link may take to fail, in seconds (default 30; see [`link_timeout`]).
pub const LINK_TIMEOUT_VAR: &str = "BURN_DDP_LINK_TIMEOUT";

/// How long a link may stay silent (no acknowledgement of data or of keepalive probes) before
/// its connection fails: `BURN_DDP_LINK_TIMEOUT` seconds (at least 1), or 30.
pub fn link_timeout() -> Duration {
    std::env::var(LINK_TIMEOUT_VAR)
        .ok()
        .and_then(|v| v.trim().parse::<f64>().ok())
        .filter(|s| *s >= 1.0)
        .map(Duration::from_secs_f64)
        .unwrap_or(Duration::from_secs(30))
}

//! Security: only holders of the job secret get in, the secret never crosses the wire, and
//! hostile peers (fake stores, wrong secrets, replayed handshakes, malformed frames) meet named
//! errors while the job goes on.
//!
//! - `admission`: the store and the data plane admit the job's ranks only; the store listens
//!   on the master address only;
//! - `hostile`: fake stores, wrong secrets, replayed handshakes, malformed frames;
//! - `startup`: what admission costs when a world of 8 forms;
//! - `relay`, `watch`: a recording man in the middle and a fake store; the warnings this
//!   process logs and the sizes it allocates.

mod admission;
mod hostile;
mod relay;
mod startup;
pub(crate) mod watch;

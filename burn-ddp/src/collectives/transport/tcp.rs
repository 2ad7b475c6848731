//! The TCP transport (gloo-like): pipelined ring collectives over one connection per pair of
//! ranks, driven by a single thread with non-blocking sockets, so each rank sends to its
//! successor and receives from its predecessor at the same time.
//!
//! - [`mesh`] connects every pair of ranks once, at rendezvous;
//! - `engine` moves a schedule's bytes (the shared [`super::schedule`]: which byte ranges go to
//!   the successor and come from the predecessor, which are reduced) over the sockets, each
//!   chunk behind a header (`frame`) the receiver checks, and reads the peers' goodbyes.
//!
//! The collectives that build the schedules, number each operation and choose between these
//! sockets and shared memory are the host transport's ([`super::host`]).
//!
//! Failure handling: every wait is bounded by the group's timeout (measured as time without
//! progress). A failed schedule is reported as a [`PeerFailure`] naming the peer at fault. The
//! engine does not decide the root cause: the collective thread records it in the store (first
//! report wins) and only then closes the connections (see `collectives/worker.rs`); the
//! neighbours that notice the close find the cause already recorded, so every rank's error names
//! the rank that failed first, not merely the neighbour that hung up.

mod engine;
mod frame;
pub(crate) mod mesh;

pub(crate) use self::engine::{Engine, Neighbours, ReduceFn};
use crate::collectives::OpDesc;

/// What the transport saw fail: the peer at fault (it closed, reset, left, stalled or sent
/// something that does not fit), what happened, and the operation it happened in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PeerFailure {
    /// The peer at fault, as far as this rank can tell (the group's record may name another).
    pub culprit: usize,
    /// What happened, in words, naming the peer.
    pub detail: String,
    /// The operation that failed.
    pub op: OpDesc,
}

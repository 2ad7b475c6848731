//! The TCP transport (gloo-like): pipelined ring collectives over one connection per pair of
//! ranks, driven by a single thread with non-blocking sockets, so each rank sends to its
//! successor and receives from its predecessor at the same time.
//!
//! - [`mesh`] connects every pair of ranks once, at rendezvous;
//! - `ring` holds the collectives: it numbers each operation and builds its schedule
//!   (`schedule`: which byte ranges move, in which order, which are reduced);
//! - `engine` moves a schedule's bytes over the sockets, each chunk behind a header
//!   (`frame`) the receiver checks, and reads the peers' goodbyes.
//!
//! Failure handling: every wait is bounded by the group's timeout (measured as time without
//! progress). A failed operation is reported as a [`PeerFailure`] naming the peer at fault, and
//! the transport refuses every later operation. It does not decide the root cause: the group
//! records it in the store (first report wins) and only then closes the connections (see
//! `group/worker.rs`); the neighbours that notice the close find the cause already recorded, so
//! every rank's error names the rank that failed first, not merely the neighbour that hung up.

mod engine;
mod frame;
pub(crate) mod mesh;
mod ring;
mod schedule;

use std::time::Duration;

pub(crate) use self::ring::TcpTransport;
pub(crate) use self::schedule::balanced;
use super::OpDesc;

/// Tunables of the transport.
#[derive(Debug, Clone)]
pub(crate) struct TcpConfig {
    pub timeout: Duration,
    pub chunk_bytes: usize,
    pub max_gather_bytes: usize,
    pub spin: Duration,
}

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

/// Why the transport could not run an operation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum OpError {
    /// A peer failed during the operation; the transport refuses every later one.
    Peer(PeerFailure),
    /// The arguments cannot work (every rank sees the same, so the ranks stay in step).
    Invalid {
        /// The refused operation.
        op: OpDesc,
        /// What is wrong.
        reason: String,
    },
    /// An earlier operation failed, or the group closed the connections.
    Refused {
        /// The refused operation.
        op: OpDesc,
    },
}

/// Result of a transport operation.
pub(crate) type OpResult<T> = std::result::Result<T, OpError>;

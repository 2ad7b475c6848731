//! The network as the shared-memory collectives see it ([`shm::Peers`]): the engine's sockets
//! to notice a peer that dies or leaves, and for a hierarchical all-reduce the TCP ring across
//! hosts. This is where the two transports meet; neither imports the other.

use super::{Engine, Neighbours, OpDesc, ReduceFn, Schedule, balanced, shm};

/// The network as the shared-memory collectives see it: the engine's sockets, and for an
/// all-reduce on several hosts the ring across them and the reduction.
pub(super) struct Net<'a, 'r> {
    pub engine: &'a mut Engine,
    pub across: &'a [usize],
    pub rank: usize,
    pub op: OpDesc,
    pub chunk: usize,
    pub elem: usize,
    pub reduce: Option<&'a mut ReduceFn<'r>>,
}

impl shm::Peers for Net<'_, '_> {
    fn gone(&mut self, peer: usize) -> Option<String> {
        self.engine.peer_gone(peer)
    }

    fn across_hosts(&mut self, piece: &mut [u8]) -> Result<(), shm::Fault> {
        let Some(reduce) = self.reduce.as_deref_mut() else {
            return Err(shm::Fault {
                peer: self.rank,
                detail: "an all-reduce across hosts outside an all-reduce".to_string(),
            });
        };
        let n = self.across.len();
        let pos = self
            .across
            .iter()
            .position(|&r| r == self.rank)
            .unwrap_or(0);
        let segments = balanced(piece.len() / self.elem, n, self.elem);
        let sched = Schedule::ring(&segments, pos, n - 1, 2 * (n - 1), self.chunk);
        let ring = Neighbours::in_ring(self.across, pos);
        self.engine
            .run(&self.op, piece, &sched, ring, reduce)
            .map_err(|f| shm::Fault {
                peer: f.culprit,
                detail: f.detail,
            })
    }
}

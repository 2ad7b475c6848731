//! The host transport: the collectives of host buffers, for every rank of the group. It numbers
//! each operation and chooses, inside itself, how it travels:
//! - over TCP (`tcp`): ring algorithms turned into a [`Schedule`] (which byte ranges go to the
//!   successor and come from the predecessor, which are reduced) and run by the socket
//!   [`Engine`];
//! - over shared memory (`shm`) when the group chose it at rendezvous: every collective on one
//!   host, and on several hosts the hierarchical all-reduce (shared memory within each host, a
//!   TCP ring across hosts, see `net`).
//!
//! All-reduce is a ring reduce-scatter followed by a ring all-gather (reduce-scatter is its first
//! half alone); broadcast is a pipelined chain from the root; all-gather and barrier are ring
//! all-gathers (a barrier of empty blocks).
//!
//! It does not report the rank's status: whoever runs it (the collective thread) is told of
//! each operation as it starts and ends through a [`Progress`] hook.

mod net;

use std::ops::Range;
use std::time::Duration;

use self::net::Net;
use super::schedule::{Schedule, balanced};
use super::shm::{self, ShmChannel};
use super::tcp::{Engine, Neighbours, PeerFailure, ReduceFn};
use crate::collectives::{DType, Element, OpDesc, OpKind, Reduce, ReduceOp};
use crate::error::Result;

/// Tunables of the host transport.
#[derive(Debug, Clone)]
pub(crate) struct HostConfig {
    pub timeout: Duration,
    pub chunk_bytes: usize,
    pub max_gather_bytes: usize,
    pub spin: Duration,
}

/// Told of each operation as it starts (`Some`) and once it ended well (`None`). A failed
/// operation is not followed by `None`: it stays the rank's current collective, so that a
/// report of where the ranks were shows it.
pub(crate) type Progress = Box<dyn Fn(Option<&OpDesc>) + Send>;

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

/// One rank's end of the data plane.
pub(crate) struct HostTransport {
    rank: usize,
    world: usize,
    engine: Engine,
    chunk_bytes: usize,
    max_gather_bytes: usize,
    progress: Progress,
    next_seq: u64,
    /// An operation failed or the group closed the connections: every later one is refused.
    broken: bool,
    /// The shared-memory segment of this rank's host, when the group chose it: on one host
    /// every collective runs over it (the sockets stay, to notice peers that die or leave); on
    /// several, all-reduce does (hierarchical, with `across`).
    shm: Option<ShmChannel>,
    /// The ring across hosts of a hierarchical all-reduce: one rank per host, this one among
    /// them (empty on one host).
    across: Vec<usize>,
}

impl HostTransport {
    /// Takes over the connected streams from [`super::tcp::mesh::connect`].
    pub(crate) fn new(
        rank: usize,
        world: usize,
        streams: Vec<Option<std::net::TcpStream>>,
        config: HostConfig,
    ) -> Result<Self> {
        let engine = Engine::new(rank, world, streams, config.timeout, config.spin)?;
        Ok(HostTransport {
            rank,
            world,
            engine,
            chunk_bytes: config.chunk_bytes,
            max_gather_bytes: config.max_gather_bytes,
            progress: Box::new(|_| {}),
            next_seq: 0,
            broken: false,
            shm: None,
            across: Vec::new(),
        })
    }

    /// Tells `progress` of every later operation.
    pub(crate) fn report_to(&mut self, progress: Progress) {
        self.progress = progress;
    }

    /// Runs later collectives over shared memory: all of them on one host, all-reduce
    /// (hierarchically, across the ranks `across`) on several.
    pub(crate) fn use_shm(&mut self, setup: shm::setup::ShmSetup) {
        if let Some(pos) = setup.across.iter().position(|&r| r == self.rank) {
            self.engine
                .set_cross_prev(Neighbours::in_ring(&setup.across, pos).prev);
        }
        self.shm = Some(setup.channel);
        self.across = setup.across;
    }

    /// Whether all-reduce runs over shared memory.
    pub(crate) fn uses_shm(&self) -> bool {
        self.shm.is_some()
    }

    /// Whether every collective runs over shared memory (the group is on one host).
    fn all_on_shm(&self) -> bool {
        self.shm.as_ref().is_some_and(|c| !c.spans_hosts())
    }

    /// Runs `f` on the shared-memory channel (there must be one) as operation `op`, with the
    /// network at hand (the peers' sockets, and for an all-reduce of `elem`-byte elements on
    /// several hosts the ring across them with `reduce`); a failure breaks the transport as
    /// [`Self::execute`] does.
    fn on_shm<T>(
        &mut self,
        op: &OpDesc,
        across: Option<(usize, &mut ReduceFn<'_>)>,
        f: impl FnOnce(&mut ShmChannel, &mut dyn shm::Peers) -> Result<T, shm::Fault>,
    ) -> OpResult<T> {
        (self.progress)(Some(op));
        let chunk = self.chunk_bytes;
        let Some(channel) = self.shm.as_mut() else {
            return Err(OpError::Refused { op: *op });
        };
        let (elem, reduce) = match across {
            Some((elem, reduce)) => (elem, Some(reduce)),
            None => (1, None),
        };
        let mut net = Net {
            engine: &mut self.engine,
            across: &self.across,
            rank: self.rank,
            op: *op,
            chunk: (chunk / elem).max(1) * elem,
            elem,
            reduce,
        };
        match f(channel, &mut net) {
            Ok(v) => {
                (self.progress)(None);
                Ok(v)
            }
            Err(shm::Fault { peer, detail }) => {
                self.broken = true;
                Err(OpError::Peer(PeerFailure {
                    culprit: peer,
                    detail,
                    op: *op,
                }))
            }
        }
    }

    /// Numbers the next operation, or refuses it if the transport is broken.
    fn begin(&mut self, kind: OpKind, dtype: DType, bytes: usize) -> OpResult<OpDesc> {
        let op = OpDesc {
            kind,
            seq: self.next_seq,
            dtype,
            bytes: bytes as u64,
        };
        self.next_seq += 1;
        if self.broken {
            return Err(OpError::Refused { op });
        }
        Ok(op)
    }

    fn chunk_for(&self, elem: usize) -> usize {
        (self.chunk_bytes / elem).max(1) * elem
    }

    /// Ring all-reduce (reduce-scatter then all-gather). The reduction order is fixed by the
    /// ring, and each element is reduced on one rank only, so results are bit-identical.
    pub(crate) fn all_reduce<T: Reduce>(&mut self, data: &mut [T], op: ReduceOp) -> OpResult<()> {
        let bytes = std::mem::size_of_val(data);
        let desc = self.begin(OpKind::AllReduce, T::DTYPE, bytes)?;
        self.all_reduce_as(&desc, data, op)
    }

    /// The all-reduce of `data` as operation `desc`.
    fn all_reduce_as<T: Reduce>(
        &mut self,
        desc: &OpDesc,
        data: &mut [T],
        op: ReduceOp,
    ) -> OpResult<()> {
        let n = self.world;
        if n == 1 {
            return Ok(());
        }
        let elem = size_of::<T>();
        if self.shm.is_some() {
            // Across hosts an average is summed: the shared-memory side divides once.
            let cross_op = match op {
                ReduceOp::Avg => ReduceOp::Sum,
                op => op,
            };
            let mut across = |acc: &mut [u8], other: &[u8], _last: bool| {
                T::combine(
                    bytemuck::cast_slice_mut(acc),
                    bytemuck::cast_slice(other),
                    cross_op,
                );
            };
            return self.on_shm(desc, Some((elem, &mut across)), |c, net| {
                c.all_reduce(desc, data, op, net)
            });
        }
        let segments = balanced(data.len(), n, elem);
        let sched = Schedule::ring(
            &segments,
            self.rank,
            n - 1,
            2 * (n - 1),
            self.chunk_for(elem),
        );
        self.execute(
            desc,
            bytemuck::cast_slice_mut(data),
            &sched,
            &mut reducer::<T>(op, n),
        )
    }

    /// Reduce-scatter: every rank's `data` is cut into `parts` (element counts, by rank, that
    /// sum to its length) and this rank's part is reduced across the ranks, in place; the
    /// range of `data` it covers is returned (the rest holds partial results). The ring is the
    /// all-reduce's first half and shared memory reduces as its all-reduce does, so where the
    /// parts are the all-reduce's segments (equal parts, as [`crate::ProcessGroup`] asks for)
    /// the part has the all-reduce's bits. On several hosts sharing memory, it is the
    /// hierarchical all-reduce, of which this rank keeps its part.
    pub(crate) fn reduce_scatter<T: Reduce>(
        &mut self,
        data: &mut [T],
        parts: &[usize],
        op: ReduceOp,
    ) -> OpResult<Range<usize>> {
        let bytes = std::mem::size_of_val(data);
        let desc = self.begin(OpKind::ReduceScatter, T::DTYPE, bytes)?;
        let n = self.world;
        let total = parts.iter().try_fold(0usize, |a, p| a.checked_add(*p));
        if parts.len() != n || total != Some(data.len()) {
            let reason = format!(
                "{} parts of {parts:?} elements do not cut a buffer of {} elements among {n} ranks",
                parts.len(),
                data.len()
            );
            return Err(OpError::Invalid { op: desc, reason });
        }
        let elem = size_of::<T>();
        let mut bounds = Vec::with_capacity(n);
        let mut start = 0;
        for p in parts {
            bounds.push(start * elem..(start + p) * elem);
            start += p;
        }
        let mine = bounds[self.rank].start / elem..bounds[self.rank].end / elem;
        if n == 1 {
            return Ok(mine);
        }
        match &self.shm {
            Some(c) if c.spans_hosts() => self.all_reduce_as(&desc, data, op)?,
            Some(_) => self.on_shm(&desc, None, |c, net| {
                c.reduce_scatter(&desc, data, &bounds, op, net)
            })?,
            None => {
                let sched = Schedule::ring(&bounds, self.rank, n - 1, n - 1, self.chunk_for(elem));
                let buf = bytemuck::cast_slice_mut(data);
                self.execute(&desc, buf, &sched, &mut reducer::<T>(op, n))?;
            }
        }
        Ok(mine)
    }

    /// Pipelined broadcast from `root` along the ring.
    pub(crate) fn broadcast<T: Element>(&mut self, data: &mut [T], root: usize) -> OpResult<()> {
        let bytes = std::mem::size_of_val(data);
        let op = self.begin(OpKind::Broadcast, T::DTYPE, bytes)?;
        if root >= self.world {
            let reason = format!("root {root} >= world size {}", self.world);
            return Err(OpError::Invalid { op, reason });
        }
        if self.world == 1 {
            return Ok(());
        }
        if self.all_on_shm() {
            let data = bytemuck::cast_slice_mut(data);
            return self.on_shm(&op, None, |c, net| c.broadcast(&op, data, root, net));
        }
        let sched = Schedule::chain(bytes, self.rank, self.world, root, self.chunk_for(1));
        let buf = bytemuck::cast_slice_mut(data);
        self.execute(&op, buf, &sched, &mut |_, _, _| {})
    }

    /// Gathers every rank's bytes (lengths may differ) into a list indexed by rank.
    pub(crate) fn all_gather(&mut self, data: &[u8]) -> OpResult<Vec<Vec<u8>>> {
        let n = self.world;
        let mut sizes = vec![0u64; n];
        sizes[self.rank] = data.len() as u64;
        if self.all_on_shm() && n > 1 {
            let op = self.begin(OpKind::AllGatherSizes, DType::U8, n * 8)?;
            let own = data.len() as u64;
            sizes = self.on_shm(&op, None, |c, net| c.gather_sizes(&op, own, net))?;
        } else {
            self.ring_gather(OpKind::AllGatherSizes, &mut sizes, 1)?;
        }
        let total = sizes.iter().fold(0u64, |a, s| a.saturating_add(*s));
        let op = self.begin(
            OpKind::AllGather,
            DType::U8,
            total.min(usize::MAX as u64) as usize,
        )?;
        // Every rank sees the same sizes, so every rank refuses alike and stays in step.
        if total > self.max_gather_bytes as u64 {
            let reason = format!(
                "ranks send {total} bytes in all ({sizes:?}), above the limit of {} bytes",
                self.max_gather_bytes
            );
            return Err(OpError::Invalid { op, reason });
        }
        let mut out = vec![0u8; total as usize];
        let mut bounds = Vec::with_capacity(n);
        let mut start = 0usize;
        for s in &sizes {
            bounds.push(start..start + *s as usize);
            start += *s as usize;
        }
        out[bounds[self.rank].clone()].copy_from_slice(data);
        if n > 1 && self.all_on_shm() {
            let out = &mut out;
            self.on_shm(&op, None, |c, net| c.all_gather(&op, out, &bounds, net))?;
        } else if n > 1 {
            let sched = Schedule::ring(&bounds, self.rank, 0, n - 1, self.chunk_for(1));
            self.execute(&op, &mut out, &sched, &mut |_, _, _| {})?;
        }
        Ok(bounds.into_iter().map(|b| out[b].to_vec()).collect())
    }

    /// Returns once every rank has entered the barrier.
    pub(crate) fn barrier(&mut self) -> OpResult<()> {
        if self.all_on_shm() && self.world > 1 {
            let op = self.begin(OpKind::Barrier, DType::U8, 0)?;
            return self.on_shm(&op, None, |c, net| c.barrier(&op, net));
        }
        self.ring_gather(OpKind::Barrier, &mut [], 0)
    }

    /// All-gather of fixed-size blocks of `u64`s, `per_rank` each.
    fn ring_gather(&mut self, kind: OpKind, blocks: &mut [u64], per_rank: usize) -> OpResult<()> {
        let op = self.begin(kind, DType::U8, blocks.len() * 8)?;
        if self.world == 1 {
            return Ok(());
        }
        let bounds = balanced(self.world * per_rank, self.world, 8);
        let sched = Schedule::ring(&bounds, self.rank, 0, self.world - 1, self.chunk_for(8));
        let buf = bytemuck::cast_slice_mut(blocks);
        self.execute(&op, buf, &sched, &mut |_, _, _| {})
    }

    /// Runs a schedule, telling [`Progress`] of it. A failure breaks the transport (later
    /// operations are refused) but leaves the connections open: the collective thread records
    /// the root cause first, then calls [`HostTransport::close`].
    fn execute(
        &mut self,
        op: &OpDesc,
        buf: &mut [u8],
        sched: &Schedule,
        reduce: &mut ReduceFn<'_>,
    ) -> OpResult<()> {
        (self.progress)(Some(op));
        let ring = self.engine.ring();
        match self.engine.run(op, buf, sched, ring, reduce) {
            Ok(()) => {
                (self.progress)(None);
                Ok(())
            }
            Err(failure) => {
                self.broken = true;
                Err(OpError::Peer(failure))
            }
        }
    }

    /// The first peer whose connection closed without a goodbye: `(rank, what happened)`.
    #[cfg(feature = "nccl")]
    pub(crate) fn dead_peer(&self) -> Option<(usize, String)> {
        self.engine.dead_peer()
    }

    /// Closes every connection, so the peers notice at once, and refuses every later operation.
    pub(crate) fn close(&mut self) {
        self.broken = true;
        self.engine.close();
    }

    /// Tells every peer this rank leaves cleanly, then closes the connections (nothing to say
    /// when the transport is broken: the peers know already).
    pub(crate) fn leave(&mut self) {
        if !self.broken {
            self.engine.leave();
        }
    }
}

/// How the ring combines a received chunk of `T`s with the rank's own: `op`, and the division of
/// an average of `n` ranks once the last contribution is in.
fn reducer<T: Reduce>(op: ReduceOp, n: usize) -> impl FnMut(&mut [u8], &[u8], bool) {
    move |acc: &mut [u8], other: &[u8], last: bool| {
        let acc: &mut [T] = bytemuck::cast_slice_mut(acc);
        T::combine(acc, bytemuck::cast_slice(other), op);
        if last && op == ReduceOp::Avg {
            T::divide(acc, n);
        }
    }
}

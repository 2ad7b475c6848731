//! The collectives over the shared-memory segment: all-reduce (bit-identical to the TCP ring on
//! one host, hierarchical on several), reduce-scatter (on one host), broadcast, all-gather and
//! barrier, each in rounds of steps (see the module above).

use std::ops::Range;

use super::{Fault, Peers, ShmChannel};
use crate::collectives::transport::schedule::balanced;
use crate::collectives::{OpDesc, Reduce, ReduceOp};

/// Bytes reduced at a time: a peer's chunk of this size stays in the core's first-level cache.
const REDUCE_CHUNK: usize = 8 << 10;

/// Piece `round` (of `piece` bytes) of `range`, possibly empty.
fn piece_of(range: &Range<usize>, round: usize, piece: usize) -> Range<usize> {
    let start = (range.start + round * piece).min(range.end);
    start..(start + piece).min(range.end)
}

impl ShmChannel {
    /// All-reduce of `data` for `op`: every element is reduced by one rank of the host, in the
    /// TCP ring's order for its segment (segment `s` starts from rank `s + 1`'s value and adds
    /// ranks `s + 2`, `s + 3`, ..., `s` each on the left), so on one host every rank gets the
    /// bits the TCP transport gives. On several hosts each reduced piece is all-reduced across
    /// the hosts before it goes to the result area (an average is summed and divided once at
    /// the end).
    pub(crate) fn all_reduce<T: Reduce>(
        &mut self,
        desc: &OpDesc,
        data: &mut [T],
        op: ReduceOp,
        net: &mut dyn Peers,
    ) -> Result<(), Fault> {
        let segments = balanced(data.len(), self.world, size_of::<T>());
        self.reduce_rounds(desc, data, &segments, op, net, true)
    }

    /// Reduce-scatter of `data` for `op` on one host: rank `s` reduces byte range `parts[s]` of
    /// every rank's buffer into its own, as the all-reduce reduces its segment (so with the
    /// all-reduce's segments, the same bits); the rest of `data` is left as it was.
    pub(crate) fn reduce_scatter<T: Reduce>(
        &mut self,
        desc: &OpDesc,
        data: &mut [T],
        parts: &[Range<usize>],
        op: ReduceOp,
        net: &mut dyn Peers,
    ) -> Result<(), Fault> {
        debug_assert!(!self.spans_hosts(), "a reduce-scatter on one host only");
        self.reduce_rounds(desc, data, parts, op, net, false)
    }

    /// The rounds of an all-reduce (`share`: every rank gets every reduced segment) or a
    /// reduce-scatter (each rank keeps its own): in each round every rank copies a piece of each
    /// peer's segment into its slot, reduces the pieces of its own segment from every slot and,
    /// when sharing, publishes the result for the others to copy out.
    fn reduce_rounds<T: Reduce>(
        &mut self,
        desc: &OpDesc,
        data: &mut [T],
        segments: &[Range<usize>],
        op: ReduceOp,
        net: &mut dyn Peers,
        share: bool,
    ) -> Result<(), Fault> {
        let (n, me) = (self.world, self.rank);
        let local_op = match op {
            ReduceOp::Avg if self.spans_hosts() => ReduceOp::Sum,
            op => op,
        };
        let operand = op as u64 | fingerprint(segments) << 8;
        let piece = self.layout.piece;
        let longest = segments.iter().map(|s| s.len()).max().unwrap_or(0);
        let rounds = longest.div_ceil(piece).max(1);
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(data);
        let (slot, result) = (self.layout.slot(me), self.layout.result());
        self.scratch.resize(2 * REDUCE_CHUNK / 8, 0);
        for round in 0..rounds {
            for (s, seg) in segments.iter().enumerate() {
                if s != me {
                    let r = piece_of(seg, round, piece);
                    self.map.write(slot + s * piece, &bytes[r]);
                }
            }
            if round == 0 {
                self.publish(desc, operand);
            }
            self.step(net)?;
            if round == 0 {
                self.check_ops(desc, operand, true)?;
            }
            let mine = piece_of(&segments[me], round, piece);
            self.reduce_piece::<T>(&mut bytes[mine.clone()], local_op);
            if self.spans_hosts() {
                net.across_hosts(&mut bytes[mine.clone()])?;
            }
            if op == ReduceOp::Avg {
                T::divide(
                    bytemuck::cast_slice_mut(&mut bytes[mine.clone()]),
                    n * self.hosts,
                );
            }
            if share {
                self.map.write(result + me * piece, &bytes[mine]);
            }
            self.step(net)?;
            if !share {
                continue;
            }
            for (s, seg) in segments.iter().enumerate() {
                if s != me {
                    let r = piece_of(seg, round, piece);
                    self.map.read(result + s * piece, &mut bytes[r]);
                }
            }
        }
        Ok(())
    }

    /// Reduces this rank's piece of the round (`acc`, this rank's values) in place with the
    /// peers' copies in their slots, chunk by chunk, in the ring's order: the partial result
    /// starts from the next rank's chunk, each later peer's chunk comes into the cache-sized
    /// scratch and takes the partial result on its right, and this rank's own values come last,
    /// on the left.
    fn reduce_piece<T: Reduce>(&mut self, acc: &mut [u8], op: ReduceOp) {
        let (n, me, piece) = (self.world, self.rank, self.layout.piece);
        let scratch: &mut [u8] = bytemuck::cast_slice_mut(&mut self.scratch);
        let (part, other) = scratch.split_at_mut(REDUCE_CHUNK);
        let at = |peer: usize, off: usize| self.layout.slot(peer) + me * piece + off;
        let mut off = 0;
        while off < acc.len() {
            let len = (acc.len() - off).min(REDUCE_CHUNK);
            let (part, other) = (&mut part[..len], &mut other[..len]);
            self.map.read(at((me + 1) % n, off), part);
            for k in 2..n {
                self.map.read(at((me + k) % n, off), other);
                T::combine(
                    bytemuck::cast_slice_mut(other),
                    bytemuck::cast_slice(part),
                    op,
                );
                part.copy_from_slice(other);
            }
            T::combine(
                bytemuck::cast_slice_mut(&mut acc[off..off + len]),
                bytemuck::cast_slice(part),
                op,
            );
            off += len;
        }
    }

    /// Broadcast of `root`'s `data` to every rank, through the root's slot.
    pub(crate) fn broadcast(
        &mut self,
        desc: &OpDesc,
        data: &mut [u8],
        root: usize,
        net: &mut dyn Peers,
    ) -> Result<(), Fault> {
        let cap = self.layout.slot_len();
        let slot = self.layout.slot(root);
        let rounds = data.len().div_ceil(cap).max(1);
        for round in 0..rounds {
            let r = piece_of(&(0..data.len()), round, cap);
            if self.rank == root {
                self.map.write(slot, &data[r.clone()]);
            }
            if round == 0 {
                self.publish(desc, root as u64);
            }
            self.step(net)?;
            if round == 0 {
                self.check_ops(desc, root as u64, true)?;
            }
            if self.rank != root {
                self.map.read(slot, &mut data[r]);
            }
            self.step(net)?;
        }
        Ok(())
    }

    /// Every rank's byte count, for an all-gather (`desc` is the size exchange).
    pub(crate) fn gather_sizes(
        &mut self,
        desc: &OpDesc,
        own: u64,
        net: &mut dyn Peers,
    ) -> Result<Vec<u64>, Fault> {
        self.publish(desc, own);
        self.step(net)?;
        self.check_ops(desc, own, false)
    }

    /// Gathers every rank's bytes (of the agreed `sizes`) into `out`, laid out by rank.
    pub(crate) fn all_gather(
        &mut self,
        desc: &OpDesc,
        out: &mut [u8],
        bounds: &[Range<usize>],
        net: &mut dyn Peers,
    ) -> Result<(), Fault> {
        let cap = self.layout.slot_len();
        let own = self.layout.slot(self.rank);
        let longest = bounds.iter().map(|b| b.len()).max().unwrap_or(0);
        let rounds = longest.div_ceil(cap).max(1);
        for round in 0..rounds {
            let mine = piece_of(&bounds[self.rank], round, cap);
            self.map.write(own, &out[mine]);
            if round == 0 {
                self.publish(desc, 0);
            }
            self.step(net)?;
            if round == 0 {
                self.check_ops(desc, 0, true)?;
            }
            for (peer, b) in bounds.iter().enumerate() {
                if peer != self.rank {
                    let r = piece_of(b, round, cap);
                    self.map.read(self.layout.slot(peer), &mut out[r]);
                }
            }
            self.step(net)?;
        }
        Ok(())
    }

    /// Returns once every rank has reached the barrier.
    pub(crate) fn barrier(&mut self, desc: &OpDesc, net: &mut dyn Peers) -> Result<(), Fault> {
        self.publish(desc, 0);
        self.step(net)?;
        self.check_ops(desc, 0, true).map(|_| ())
    }
}

/// A 56-bit fingerprint of how a buffer is cut, compared across the ranks with the operation
/// (ranks that cut it differently would reduce unrelated bytes).
fn fingerprint(segments: &[Range<usize>]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for s in segments {
        for x in [s.start as u64, s.end as u64] {
            h = (h ^ x).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h >> 8
}

#[cfg(test)]
mod tests {
    use super::piece_of;

    #[test]
    fn pieces_cover_a_range_once() {
        let r = 10..45;
        let got: Vec<_> = (0..5).map(|k| piece_of(&r, k, 16)).collect();
        assert_eq!(got, vec![10..26, 26..42, 42..45, 45..45, 45..45]);
    }
}

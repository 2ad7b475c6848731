//! Ring schedules: which byte ranges a rank sends to its successor and receives from its
//! predecessor, in order, for each collective. Shared by the transports: the TCP engine runs
//! schedules, the host transport builds them (for TCP and for the ring across hosts of a
//! hierarchical all-reduce), and shared memory cuts its buffers into the same [`balanced`]
//! segments, so that both transports reduce in the same order.
//!
//! Both lists are cut into chunks so large buffers stream: a chunk is forwarded as soon as it
//! arrived (and was reduced), while later chunks are still in flight. Every segment yields at
//! least one chunk (possibly empty), so every operation exchanges at least one header per step
//! and ranks check each other's operation even for empty buffers.

use std::ops::Range;

/// What to do with a received chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Action {
    /// Write it into the buffer.
    Copy,
    /// Reduce it into the buffer.
    Reduce,
    /// Reduce it into the buffer; this completes the segment (apply the average's division).
    ReduceLast,
}

/// The send and receive lists of one operation on one rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Schedule {
    pub sends: Vec<Range<usize>>,
    pub recvs: Vec<(Range<usize>, Action)>,
    /// Send `i` may start once `recvs[..i + 1 - lag]` are done; `None`: sends never wait.
    pub lag: Option<usize>,
}

impl Schedule {
    /// Whether send `i` may start when `recvs_done` receives are complete.
    pub(crate) fn can_send(&self, i: usize, recvs_done: usize) -> bool {
        self.lag.is_none_or(|lag| recvs_done + lag > i)
    }

    /// The ring over `segments` (one per rank): `steps` steps in which rank r sends segment
    /// `r - t - o` and receives segment `r - t - o - 1` (mod n); the first `reduce_steps`
    /// receives reduce, the rest copy. A ring that reduces starts one segment back (`o = 1`),
    /// so that rank r completes segment r: reduce-scatter is `reduce_steps = steps = n - 1`
    /// (segment `s` starts from rank `s + 1`'s values and ends on rank `s`), all-reduce is
    /// `n - 1, 2(n - 1)` (reduce-scatter, then all-gather from there); all-gather is `0, n - 1`
    /// (`o = 0`: rank r starts with its own segment).
    pub(crate) fn ring(
        segments: &[Range<usize>],
        rank: usize,
        reduce_steps: usize,
        steps: usize,
        chunk: usize,
    ) -> Self {
        let n = segments.len();
        let o = usize::from(reduce_steps > 0);
        let seg = |t: usize, shift: usize| (rank + n * (steps + 2) - t - shift - o) % n;
        let sends: Vec<_> = (0..steps)
            .flat_map(|t| chunks(segments[seg(t, 0)].clone(), chunk))
            .collect();
        let recvs = (0..steps)
            .flat_map(|t| {
                let action = match t + 1 {
                    s if s < reduce_steps => Action::Reduce,
                    s if s == reduce_steps => Action::ReduceLast,
                    _ => Action::Copy,
                };
                chunks(segments[seg(t, 1)].clone(), chunk).map(move |r| (r, action))
            })
            .collect();
        let lag = Some(chunks(segments[seg(0, 0)].clone(), chunk).count());
        Schedule { sends, recvs, lag }
    }

    /// A pipelined chain from `root` around the ring (broadcast of `len` bytes).
    pub(crate) fn chain(len: usize, rank: usize, n: usize, root: usize, chunk: usize) -> Self {
        let units: Vec<_> = chunks(0..len, chunk).collect();
        let next = (rank + 1) % n;
        Schedule {
            sends: if next == root { vec![] } else { units.clone() },
            recvs: if rank == root {
                vec![]
            } else {
                units.into_iter().map(|r| (r, Action::Copy)).collect()
            },
            lag: (rank != root).then_some(0),
        }
    }
}

/// `n` balanced segments of `len` elements of `elem` bytes, as byte ranges.
pub(crate) fn balanced(len: usize, n: usize, elem: usize) -> Vec<Range<usize>> {
    (0..n)
        .map(|j| (j * len / n) * elem..((j + 1) * len / n) * elem)
        .collect()
}

/// Cuts `range` into pieces of at most `chunk` bytes; an empty range gives one empty piece.
fn chunks(range: Range<usize>, chunk: usize) -> impl Iterator<Item = Range<usize>> + Clone {
    let count = range.len().div_ceil(chunk).max(1);
    (0..count).map(move |c| {
        let start = range.start + c * chunk;
        start..(start + chunk).min(range.end)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Simulates the ring on `n` ranks, message by message, checking each send is allowed,
    /// that what rank r sends is what rank r+1 expects, and that the result is the full sum
    /// (everywhere after an all-reduce, on segment r of rank r after a reduce-scatter).
    fn simulate(segs: &[Range<usize>], n: usize, chunk_elems: usize, all_reduce: bool) {
        let len = segs.last().map_or(0, |s| s.end);
        let steps = if all_reduce { 2 * (n - 1) } else { n - 1 };
        let scheds: Vec<_> = (0..n)
            .map(|r| Schedule::ring(segs, r, n - 1, steps, chunk_elems))
            .collect();
        let mut data: Vec<Vec<u64>> = (0..n)
            .map(|r| (0..len).map(|i| (i * 10 + r) as u64).collect())
            .collect();
        let mut sent = vec![0usize; n];
        let mut recvd = vec![0usize; n];
        loop {
            let mut moved = false;
            for r in 0..n {
                let next = (r + 1) % n;
                let s = &scheds[r];
                let i = sent[r];
                // Rank `next` receives exactly in the order rank r sends.
                if i < s.sends.len() && s.can_send(i, recvd[r]) && recvd[next] == i {
                    let range = s.sends[i].clone();
                    let (expect, action) = scheds[next].recvs[i].clone();
                    assert_eq!(range, expect, "rank {r} -> {next} unit {i}");
                    let payload = data[r][range.clone()].to_vec();
                    for (k, x) in range.clone().enumerate() {
                        match action {
                            Action::Copy => data[next][x] = payload[k],
                            _ => data[next][x] += payload[k],
                        }
                    }
                    sent[r] += 1;
                    recvd[next] += 1;
                    moved = true;
                }
            }
            if !moved {
                break;
            }
        }
        for r in 0..n {
            assert_eq!(
                sent[r],
                scheds[r].sends.len(),
                "rank {r} stuck (len {len}, n {n})"
            );
            assert_eq!(recvd[r], scheds[r].recvs.len());
            for (i, x) in data[r].iter().enumerate() {
                if !all_reduce && !segs[r].contains(&i) {
                    continue;
                }
                let want: u64 = (0..n).map(|q| (i * 10 + q) as u64).sum();
                assert_eq!(*x, want, "rank {r} element {i}");
            }
        }
    }

    #[test]
    fn ring_all_reduce_and_reduce_scatter_schedules_are_consistent() {
        for n in 2..=5 {
            for len in [0, 1, 2, 7, 13, 64, 101] {
                for chunk in [1, 3, 64] {
                    for all_reduce in [true, false] {
                        simulate(&balanced(len, n, 1), n, chunk, all_reduce);
                    }
                }
            }
            // Segments of any lengths, empty ones too (a reduce-scatter's parts).
            let mut segs = Vec::new();
            let mut start = 0;
            for r in 0..n {
                let len = [5, 0, 17, 1, 9][r % 5];
                segs.push(start..start + len);
                start += len;
            }
            simulate(&segs, n, 4, false);
            simulate(&segs, n, 4, true);
        }
    }

    #[test]
    fn chain_ends_before_the_root() {
        let s = Schedule::chain(10, 2, 3, 0, 4);
        assert!(s.sends.is_empty());
        assert_eq!(s.recvs.len(), 3);
        let root = Schedule::chain(0, 0, 3, 0, 4);
        assert_eq!(root.sends, vec![0..0]);
        assert!(root.recvs.is_empty() && root.lag.is_none());
    }
}

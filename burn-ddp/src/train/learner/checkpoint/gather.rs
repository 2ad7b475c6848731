//! A sharded run's optimizer records gathered to rank 0 for a checkpoint, streamed in bounded
//! pieces. Every rank first says how long its record is; then each rank other than 0, in rank
//! order, sends its parameter ids (visit order) and its record in pieces of at most the agreed
//! piece size, one broadcast from itself per piece. Rank 0 keeps what it receives; the other
//! ranks drop each piece they relay, so a rank other than 0 never holds more than its own
//! record and one piece (the host transports have no point-to-point send: a chain broadcast
//! moves a piece through each link once, which takes about what the root's own link would
//! take for a gather to it). Rank 0 merges the records into one keyed by its own ids.
//!
//! The piece size is the smallest of the ranks' `GroupOptions::max_gather_bytes` and
//! [`PIECE_BYTES`], so no collective of a checkpoint gathers more than the group allows, and
//! no size of the state makes a checkpoint fail: the one gather of the whole state, which
//! failed above the limit after the work it was to keep, is gone. (The checkpoint's only
//! all-gather, the sizes, is smaller than the ranks' agreement at start.)

use burn::module::list_param_ids;
use burn::train::{Learner, LearnerModel};

use super::{Snapshot, SnapshotError};
use crate::ProcessGroup;
use crate::error::{DdpError, Result};
use crate::train::learner::checkpoint::optimizer_records::{self, Keyed};
use crate::wire::{Reader, Writer};

/// The largest piece a rank sends to rank 0 at once (16 MiB), if the group allows it.
pub(crate) const PIECE_BYTES: usize = 16 << 20;

/// What the last sharded checkpoint's gather moved through this rank (read by the tests
/// through `train::last_checkpoint_gather`, feature `test-support`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GatherStats {
    /// Bytes this rank sent: its parameter ids and its optimizer record.
    pub own: usize,
    /// The most bytes of other ranks' records this rank held at once (on rank 0, all of them).
    pub foreign_peak: usize,
    /// Bytes of every rank's ids and record together.
    pub total: usize,
    /// The agreed piece size.
    pub piece: usize,
    /// The pieces sent, by all ranks.
    pub pieces: usize,
}

/// The group's [`GatherStats`] of its last sharded checkpoint.
#[derive(Default)]
pub(crate) struct LastGather(std::sync::Mutex<GatherStats>);

impl LastGather {
    /// The stats of the last gather.
    #[cfg_attr(not(feature = "test-support"), allow(dead_code))]
    pub(crate) fn get(&self) -> GatherStats {
        *crate::sync::lock(&self.0)
    }
}

/// What the last sharded checkpoint moved through the `group` of this rank (feature
/// `test-support`; not API).
#[cfg(feature = "test-support")]
#[doc(hidden)]
pub fn last_gather(group: &ProcessGroup) -> GatherStats {
    group.attachment::<LastGather>().get()
}

/// What one rank says before the pieces move: its piece limit and its payload (or the reason
/// it has none).
struct Header {
    limit: usize,
    payload: std::result::Result<(usize, usize), String>,
}

/// The piece size this rank allows: its gather limit, at most [`PIECE_BYTES`].
fn own_limit(group: &ProcessGroup) -> usize {
    group.options().max_gather_bytes.min(PIECE_BYTES)
}

/// Gathers the ranks' optimizer records (each rank's `mine`, its state taken) to rank 0,
/// which merges them: on rank 0 the snapshot to write (or why there is none), on the others
/// `None`.
pub(crate) fn take_merged<M: LearnerModel>(
    group: &ProcessGroup,
    learner: &Learner<M>,
    mine: std::result::Result<Snapshot, SnapshotError>,
) -> Result<Option<std::result::Result<Snapshot, SnapshotError>>> {
    let ids: Vec<u64> = (list_param_ids(&learner.model()).iter())
        .map(|id| id.val())
        .collect();
    let others = gather_to_root(group, mine.as_ref().map(Snapshot::optim), &ids)?;
    Ok(others.map(|others| {
        let snapshot = mine?;
        let received = (others.iter().enumerate())
            .map(|(r, one)| {
                let what = |e: &String| SnapshotError::Encode(format!("rank {}: {e}", r + 1));
                one.as_ref().map_err(what)
            })
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let mut keyed = vec![Keyed {
            record: snapshot.optim(),
            ids: &ids,
        }];
        keyed.extend(received.iter().map(|(ids, record)| Keyed { record, ids }));
        let merged = optimizer_records::merge(&keyed, &ids)?;
        Ok(snapshot.with_optim(merged))
    }))
}

/// A rank's ids and record as rank 0 received them, or why it has none.
type Received = std::result::Result<(Vec<u64>, Vec<u8>), String>;

/// Every rank's `mine` (with its `ids`) streamed to rank 0: on rank 0 those of ranks 1.., on the
/// others `None`.
fn gather_to_root(
    group: &ProcessGroup,
    mine: std::result::Result<&[u8], &SnapshotError>,
    ids: &[u64],
) -> Result<Option<Vec<Received>>> {
    let id_bytes: Vec<u8> = ids.iter().flat_map(|id| id.to_le_bytes()).collect();
    let headers = exchange_headers(group, mine, id_bytes.len())?;
    let piece = headers.iter().map(|h| h.limit).min().unwrap_or(PIECE_BYTES);
    let length = |h: &Header| h.payload.as_ref().map_or(0, |(i, r)| i + r);
    let mut stats = GatherStats {
        own: length(&headers[group.rank()]),
        total: headers.iter().map(length).sum(),
        piece,
        ..GatherStats::default()
    };
    if piece == 0 {
        return Err(DdpError::Checkpoint {
            rank: group.rank(),
            reason: "a gather limit of 0 bytes carries no piece".into(),
        });
    }
    let mut received = Vec::new();
    for (from, header) in headers.iter().enumerate().skip(1) {
        let len = length(header);
        let mut kept = (group.rank() == 0).then(|| reserve(len));
        let mut offset = 0;
        while offset < len {
            let n = piece.min(len - offset);
            let data = match (group.rank() == from, &mine) {
                (true, Ok(record)) => span(&id_bytes, record, offset, n),
                _ => vec![0u8; n],
            };
            let data = group.broadcast(data, from).wait()?;
            if group.rank() != from {
                stats.foreign_peak = stats.foreign_peak.max(n);
            }
            if let Some(Ok(buffer)) = &mut kept {
                buffer.extend_from_slice(&data);
            }
            offset += n;
            stats.pieces += 1;
        }
        if let Some(kept) = kept {
            received.push(split(header, kept));
        }
    }
    if group.rank() == 0 {
        stats.foreign_peak = stats.total - stats.own;
    }
    *crate::sync::lock(&group.attachment::<LastGather>().0) = stats;
    Ok((group.rank() == 0).then_some(received))
}

/// Every rank's [`Header`], by rank.
fn exchange_headers(
    group: &ProcessGroup,
    mine: std::result::Result<&[u8], &SnapshotError>,
    id_len: usize,
) -> Result<Vec<Header>> {
    let mut w = Writer::default();
    w.u64(own_limit(group) as u64);
    match mine {
        Ok(record) => w.u8(1).u64(id_len as u64).u64(record.len() as u64),
        Err(e) => w.u8(0).bytes(e.to_string().as_bytes()),
    };
    let said = group.all_gather_object(w.buf)?;
    let size = |v: u64| usize::try_from(v).unwrap_or(usize::MAX);
    said.decode_each(
        "a checkpoint's optimizer record size",
        |r: &mut Reader<'_>| {
            let limit = size(r.u64()?);
            let payload = match r.u8()? {
                1 => Ok((size(r.u64()?), size(r.u64()?))),
                _ => Err(String::from_utf8_lossy(r.bytes()?).into_owned()),
            };
            Ok(Header { limit, payload })
        },
    )
}

/// A buffer for `len` bytes, or why rank 0 cannot hold them.
fn reserve(len: usize) -> std::result::Result<Vec<u8>, String> {
    let mut buffer = Vec::new();
    match buffer.try_reserve_exact(len) {
        Ok(()) => Ok(buffer),
        Err(e) => Err(format!("rank 0 cannot hold its {len} bytes: {e}")),
    }
}

/// Bytes `offset..offset + n` of `first` followed by `second`.
fn span(first: &[u8], second: &[u8], offset: usize, n: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(n);
    let end = offset + n;
    if offset < first.len() {
        out.extend_from_slice(&first[offset..end.min(first.len())]);
    }
    let (from, to) = (offset.max(first.len()), end);
    if from < to {
        out.extend_from_slice(&second[from - first.len()..to - first.len()]);
    }
    out
}

/// The ids and record in what rank 0 `kept` of a rank's payload.
fn split(header: &Header, kept: std::result::Result<Vec<u8>, String>) -> Received {
    let (id_len, _) = header.payload.clone()?;
    let mut payload = kept?;
    let record = payload.split_off(id_len.min(payload.len()));
    let ids = payload
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().unwrap_or_default()))
        .collect();
    Ok((ids, record))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::GroupOptions;
    use std::time::{Duration, Instant};

    /// `f` on `n` ranks, threads over loopback TCP, with `max_gather_bytes` set to `limit`.
    fn world<T: Send>(n: usize, limit: usize, f: impl Fn(ProcessGroup) -> T + Sync) -> Vec<T> {
        let options = GroupOptions {
            timeout: Duration::from_secs(60),
            rendezvous_timeout: Duration::from_secs(30),
            max_gather_bytes: limit,
            ..GroupOptions::default()
        };
        crate::group::thread_world(n, options, |_, group| f(group))
    }

    /// Rank `r`'s record in these tests: `r + 1` repeated over `2500 * r + 10` bytes.
    fn record(rank: usize) -> Vec<u8> {
        vec![rank as u8 + 1; 2500 * rank + 10]
    }

    /// Records several pieces long reach rank 0 whole, with their ids; the other ranks hold
    /// at most one piece of another rank's record at once, though they relay them all; a rank
    /// without a record sends its reason instead.
    #[test]
    fn records_stream_to_rank_0_in_bounded_pieces() {
        let out = world(3, 1000, |group| {
            let rank = group.rank();
            let ids = [10 * rank as u64, 10 * rank as u64 + 1];
            let failed = SnapshotError::Encode("no record here".into());
            let mine = record(rank);
            let mine = if rank == 2 {
                Err(&failed)
            } else {
                Ok(&mine[..])
            };
            let got = gather_to_root(&group, mine, &ids).unwrap();
            (got, group.attachment::<LastGather>().get())
        });
        let (got, stats) = (&out[0].0, out[0].1);
        let got = got.as_ref().unwrap();
        assert_eq!(got[0], Ok((vec![10, 11], record(1))));
        assert_eq!(got[1], Err("no record here".to_string()));
        assert_eq!(stats.foreign_peak, 16 + 2510, "rank 0 holds every record");
        assert_eq!(
            (stats.total, stats.piece, stats.pieces),
            (16 + 10 + 16 + 2510, 1000, 3)
        );
        for (rank, (got, stats)) in out.iter().enumerate().skip(1) {
            assert!(got.is_none(), "rank {rank} kept records");
            assert_eq!(stats.pieces, 3, "rank {rank}");
        }
        assert_eq!(out[1].1.foreign_peak, 0, "rank 1 only sends");
        assert_eq!(out[2].1.foreign_peak, 1000, "rank 2 relays rank 1's pieces");
    }

    /// What the stream costs next to the all-gather it replaces, 3 ranks of 24 MiB each over
    /// loopback (run with `--ignored`; the figures are printed).
    #[test]
    #[ignore]
    fn streaming_costs_about_what_an_all_gather_costs() {
        let times = world(3, 1 << 30, |group| {
            let mine = vec![group.rank() as u8; 24 << 20];
            group.barrier().wait().unwrap();
            let start = Instant::now();
            let all = group.all_gather(mine.clone()).wait().unwrap();
            let gathered = start.elapsed();
            assert_eq!(all.len(), 3);
            group.barrier().wait().unwrap();
            let start = Instant::now();
            gather_to_root(&group, Ok(&mine), &[1, 2]).unwrap();
            (gathered, start.elapsed())
        });
        eprintln!("3 ranks x 24 MiB, (all_gather, streamed to rank 0) per rank: {times:?}");
    }

    #[test]
    fn spans_cross_from_the_ids_into_the_record() {
        let (ids, record) = ([1u8, 2, 3], [4u8, 5, 6, 7]);
        let pieces: Vec<Vec<u8>> = (0..7)
            .step_by(2)
            .map(|o| span(&ids, &record, o, 2.min(7 - o)))
            .collect();
        assert_eq!(pieces, vec![vec![1, 2], vec![3, 4], vec![5, 6], vec![7]]);
        assert_eq!(span(&[], &record, 1, 3), vec![5, 6, 7]);
        assert_eq!(span(&ids, &[], 0, 3), vec![1, 2, 3]);
    }
}

//! The checkpoint file's format, written streaming (the records go to the file as they are, with
//! no second copy of them in memory) and checked streaming (in pieces of 1 MiB, never whole).
//!
//! Version 2, the one written (integers little-endian):
//!
//! | bytes | field |
//! |---|---|
//! | 8 | magic `BDDPCKPT` |
//! | 4 | format version, 2 (`u32`) |
//! | 32 | the position: epoch, batches, samples, world size (`u64` each) |
//! | 24 | the lengths of the model, optimizer and learning-rate schedule records (`u64` each) |
//! | ... | the three records, in that order |
//! | 8 | FNV-1a (64-bit) of every byte before it |
//!
//! The lengths come before the records, so the header alone tells how long the whole file must
//! be: a file cut short (or grown) is found before a byte of its records is read. Version 1,
//! still read, put a `u32` length in front of each record instead, so a record of 4 GiB or more
//! could not be told: it was written with a wrong length, as success, and could not be read.

use std::io::{self, Read, Seek, SeekFrom, Write};
use std::ops::Range;

use super::{Position, Snapshot, SnapshotError};
use crate::wire::{DecodeError, Reader, Writer};

const MAGIC: &[u8; 8] = b"BDDPCKPT";
/// The format version written.
pub(crate) const VERSION: u32 = 2;
/// The first format, with `u32` record lengths: read, no longer written.
const VERSION_1: u32 = 1;
/// Bytes of a version 2 header: magic, version, position, the three record lengths.
pub(crate) const HEADER_LEN: usize = 8 + 4 + 4 * 8 + 3 * 8;
/// Bytes of the checksum that ends every version.
const TRAILER_LEN: usize = 8;
/// The shortest file of any version: magic, version, checksum.
const MIN_LEN: usize = 8 + 4 + TRAILER_LEN;
/// Bytes hashed, written or read at once.
const CHUNK: usize = 1 << 20;

/// FNV-1a (64-bit) fed in pieces: the same result as [`checksum`] of the pieces joined.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Fnv(u64);

impl Fnv {
    /// The hash of no bytes.
    pub(crate) const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    /// The multiplier applied after each byte.
    pub(crate) const PRIME: u64 = 0x100_0000_01b3;

    pub(crate) fn new() -> Self {
        Fnv(Self::OFFSET)
    }

    /// Feeds `bytes`.
    pub(crate) fn update(&mut self, bytes: &[u8]) {
        self.0 = (bytes.iter()).fold(self.0, |h, b| (h ^ *b as u64).wrapping_mul(Self::PRIME));
    }

    /// The hash of the bytes fed so far.
    pub(crate) fn finish(self) -> u64 {
        self.0
    }
}

/// FNV-1a of `bytes`: the checkpoint file's checksum (to tell a damaged file from a valid one),
/// and the replicas' digest in the replica check.
pub(crate) fn checksum(bytes: &[u8]) -> u64 {
    let mut h = Fnv::new();
    h.update(bytes);
    h.finish()
}

/// What a version 2 header holds: the position and the records' lengths.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Header {
    pub position: Position,
    /// Bytes of the model, optimizer and learning-rate schedule records.
    pub lengths: [u64; 3],
}

impl Header {
    /// The header's [`HEADER_LEN`] bytes.
    pub(crate) fn encode(&self) -> Vec<u8> {
        let p = &self.position;
        let mut w = Writer::default();
        w.buf.extend_from_slice(MAGIC);
        w.u32(VERSION);
        let position = [p.epoch, p.batches, p.samples, p.world_size].map(|v| v as u64);
        for v in position.into_iter().chain(self.lengths) {
            w.u64(v);
        }
        w.buf
    }

    /// The header at the start of `head` (the first bytes of a version 2 file).
    pub(crate) fn decode(head: &[u8]) -> Result<Self, SnapshotError> {
        if head.len() < HEADER_LEN {
            return Err(SnapshotError::HeaderCut(head.len() as u64));
        }
        let mut r = Reader::new(&head[MAGIC.len()..HEADER_LEN]);
        match r.u32()? {
            VERSION => {}
            v => return Err(SnapshotError::Version(v)),
        }
        let position = position(&mut r)?;
        let lengths = [r.u64()?, r.u64()?, r.u64()?];
        Ok(Header { position, lengths })
    }

    /// Bytes of the whole file this header describes (`u64::MAX` if that overflows: no file
    /// is that long).
    pub(crate) fn file_len(&self) -> u64 {
        let fixed = (HEADER_LEN + TRAILER_LEN) as u64;
        (self.lengths.iter()).fold(fixed, |a, n| a.saturating_add(*n))
    }

    /// The header of a version 2 file of `len` bytes beginning with `head`, checked against
    /// that length.
    fn checked(head: &[u8], len: u64) -> Result<Self, SnapshotError> {
        let header = Header::decode(head)?;
        let (described, holds) = (header.file_len(), len);
        match described == holds {
            true => Ok(header),
            false => Err(SnapshotError::Size { described, holds }),
        }
    }
}

/// The four position fields.
fn position(r: &mut Reader<'_>) -> Result<Position, SnapshotError> {
    let mut size = || usize::try_from(r.u64()?).map_err(|_| SnapshotError::SizeOverflow);
    Ok(Position {
        epoch: size()?,
        batches: size()?,
        samples: size()?,
        world_size: size()?,
    })
}

/// The format version of a file of `len` bytes beginning with `head`.
fn version_of(head: &[u8], len: u64) -> Result<u32, SnapshotError> {
    if len < MIN_LEN as u64 || head.len() < 12 || &head[..MAGIC.len()] != MAGIC {
        return Err(SnapshotError::NotACheckpoint);
    }
    Ok(Reader::new(&head[MAGIC.len()..12]).u32()?)
}

/// Writes `snapshot` to `out` as a version 2 file: the header, the records as they are (no
/// copy of them is made) and the checksum computed on the way.
pub(crate) fn write(snapshot: &Snapshot, out: &mut impl Write) -> io::Result<()> {
    let records = [&snapshot.model[..], &snapshot.optim, &snapshot.scheduler];
    let header = Header {
        position: snapshot.position,
        lengths: records.map(|r| r.len() as u64),
    }
    .encode();
    let mut sum = Fnv::new();
    for piece in std::iter::once(&header[..]).chain(records) {
        for chunk in piece.chunks(CHUNK) {
            sum.update(chunk);
            out.write_all(chunk)?;
        }
    }
    out.write_all(&sum.finish().to_le_bytes())?;
    out.flush()
}

impl Snapshot {
    /// The snapshot as a version 2 file, in memory (the tests').
    #[cfg(test)]
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        write(self, &mut out).expect("writing to memory does not fail");
        out
    }

    /// Decodes a whole file of version 1 or 2, checking its size (version 2) and checksum.
    /// The largest record keeps the file's buffer (moved to its front, not copied) and the
    /// others are copied out of it: the file is never held twice.
    pub(crate) fn decode(raw: Vec<u8>) -> Result<Self, SnapshotError> {
        let (position, ranges) = records_in(&raw)?;
        let largest = (0..ranges.len())
            .max_by_key(|&i| ranges[i].len())
            .unwrap_or(0);
        let mut records = [0, 1, 2].map(|i| match i == largest {
            true => Vec::new(),
            false => raw[ranges[i].clone()].to_vec(),
        });
        let kept = ranges[largest].clone();
        let mut raw = raw;
        raw.truncate(kept.end);
        raw.drain(..kept.start);
        raw.shrink_to_fit();
        records[largest] = raw;
        let [model, optim, scheduler] = records;
        Ok(Snapshot {
            position,
            model,
            optim,
            scheduler,
        })
    }
}

/// The position a whole file of version 1 or 2 holds and where in it its three records are,
/// checking its size (version 2) and checksum.
fn records_in(raw: &[u8]) -> Result<(Position, [Range<usize>; 3]), SnapshotError> {
    let len = raw.len() as u64;
    let version = version_of(raw, len)?;
    let header = match version {
        VERSION => Some(Header::checked(raw, len)?),
        _ => None,
    };
    let (body, sum) = raw.split_at(raw.len() - TRAILER_LEN);
    if Reader::new(sum).u64()? != checksum(body) {
        return Err(SnapshotError::Damaged);
    }
    let (position, mut r, lengths) = match (version, header) {
        (_, Some(h)) => (
            h.position,
            Reader::new(&body[HEADER_LEN..]),
            Some(h.lengths),
        ),
        (VERSION_1, None) => {
            let mut r = Reader::new(&body[12..]);
            (position(&mut r)?, r, None)
        }
        (v, None) => return Err(SnapshotError::Version(v)),
    };
    // Every reader above ends where the body does.
    let mut record = |i: usize| -> Result<Range<usize>, SnapshotError> {
        let n = match lengths {
            Some(lengths) => lengths[i],
            None => r.u32()?.into(),
        };
        let start = body.len() - r.left();
        let piece = r.fixed(n)?;
        Ok(start..start + piece.len())
    };
    let ranges = [record(0)?, record(1)?, record(2)?];
    r.finish()?;
    Ok((position, ranges))
}

/// The position stored in a checkpoint file of `len` bytes, checking the file is whole and
/// undamaged while reading it in pieces of 1 MiB: its size against its header (version 2,
/// before any record is read), then its checksum.
pub(crate) fn inspect(file: &mut (impl Read + Seek), len: u64) -> Result<Position, SnapshotError> {
    let mut head = vec![0u8; (HEADER_LEN as u64).min(len) as usize];
    file.seek(SeekFrom::Start(0))?;
    file.read_exact(&mut head)?;
    let version = version_of(&head, len)?;
    let header = match version {
        VERSION => Some(Header::checked(&head, len)?),
        _ => None,
    };
    file.seek(SeekFrom::Start(0))?;
    let body = len - TRAILER_LEN as u64;
    let mut sum = Fnv::new();
    let mut buffer = vec![0u8; CHUNK];
    let mut left = body;
    while left > 0 {
        let n = CHUNK.min(usize::try_from(left).unwrap_or(CHUNK));
        file.read_exact(&mut buffer[..n])?;
        sum.update(&buffer[..n]);
        left -= n as u64;
    }
    let mut trailer = [0u8; TRAILER_LEN];
    file.read_exact(&mut trailer)?;
    if u64::from_le_bytes(trailer) != sum.finish() {
        return Err(SnapshotError::Damaged);
    }
    match (version, header) {
        (_, Some(h)) => Ok(h.position),
        (VERSION_1, None) => walk_version_1(file, body),
        (v, None) => Err(SnapshotError::Version(v)),
    }
}

/// The position in a version 1 file whose checksum matched, checking that its records (each
/// behind its `u32` length) end where the checksum begins, at `body`; the records are skipped.
fn walk_version_1(file: &mut (impl Read + Seek), body: u64) -> Result<Position, SnapshotError> {
    let mut at = 12u64;
    let position = position(&mut Reader::new(&read_at(file, &mut at, 32, body)?))?;
    for _ in 0..3 {
        let n = Reader::new(&read_at(file, &mut at, 4, body)?).u32()?;
        skip(&mut at, n.into(), body)?;
    }
    match body - at {
        0 => Ok(position),
        left => Err(DecodeError::Trailing(left as usize).into()),
    }
}

/// Moves `at` past `n` bytes, which must end by `body`; where they start.
fn skip(at: &mut u64, n: u64, body: u64) -> Result<u64, DecodeError> {
    match at.checked_add(n).filter(|end| *end <= body) {
        Some(end) => Ok(std::mem::replace(at, end)),
        None => Err(DecodeError::Truncated {
            needed: usize::try_from(n).unwrap_or(usize::MAX),
            left: (body - *at) as usize,
        }),
    }
}

/// The `n` bytes of `file` at `at` (which moves past them); they must end by `body`.
fn read_at(
    file: &mut (impl Read + Seek),
    at: &mut u64,
    n: usize,
    body: u64,
) -> Result<Vec<u8>, SnapshotError> {
    let from = skip(at, n as u64, body)?;
    file.seek(SeekFrom::Start(from))?;
    let mut field = vec![0u8; n];
    file.read_exact(&mut field)?;
    Ok(field)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Cursor;

    const AT: Position = Position {
        epoch: 3,
        batches: 7,
        samples: 56,
        world_size: 2,
    };

    fn snapshot() -> Snapshot {
        Snapshot {
            position: AT,
            model: vec![1, 2, 3],
            optim: vec![],
            scheduler: vec![9; 100],
        }
    }

    /// A version 1 file, as burn-ddp wrote them: a `u32` length in front of each record.
    fn version_1(s: &Snapshot) -> Vec<u8> {
        let mut w = Writer::default();
        w.buf.extend_from_slice(MAGIC);
        w.u32(1);
        let p = &s.position;
        for v in [p.epoch, p.batches, p.samples, p.world_size] {
            w.u64(v as u64);
        }
        for record in [&s.model, &s.optim, &s.scheduler] {
            w.u32(record.len() as u32).buf.extend_from_slice(record);
        }
        let sum = checksum(&w.buf);
        w.u64(sum).buf.clone()
    }

    fn inspect_bytes(raw: &[u8]) -> Result<Position, SnapshotError> {
        inspect(&mut Cursor::new(raw), raw.len() as u64)
    }

    /// `raw` with `edit` applied to its body and the checksum made to match again.
    fn resealed(raw: &[u8], edit: impl FnOnce(&mut Vec<u8>)) -> Vec<u8> {
        let mut body = raw[..raw.len() - TRAILER_LEN].to_vec();
        edit(&mut body);
        let sum = checksum(&body);
        body.extend_from_slice(&sum.to_le_bytes());
        body
    }

    /// The checksum fed in pieces is FNV-1a of the whole (the published test values).
    #[test]
    fn the_checksum_in_pieces_is_fnv_1a_of_the_whole() {
        assert_eq!(checksum(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(checksum(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(checksum(b"foobar"), 0x8594_4171_f739_67e8);
        let data: Vec<u8> = (0..10_000u32).map(|i| (i * 7 % 251) as u8).collect();
        for cut in [0, 1, 4096, 9999, 10_000] {
            let mut h = Fnv::new();
            h.update(&data[..cut]);
            h.update(&data[cut..]);
            assert_eq!(h.finish(), checksum(&data), "cut at {cut}");
        }
    }

    /// Record lengths on both sides of 4 GiB round-trip through the header, which gives the
    /// whole file's length (no record is allocated). The version 1 format could not tell them:
    /// its `u32` lengths saturated at 4 GiB - 1.
    #[test]
    fn header_lengths_round_trip_across_4_gib() {
        let max = u32::MAX as u64;
        for lengths in [
            [max - 1, max, 1 << 32],
            [(1 << 32) + 5, 0, max],
            [0, 0, 0],
            [1 << 40, (1 << 32) + 1, 3],
        ] {
            let header = Header {
                position: AT,
                lengths,
            };
            let raw = header.encode();
            assert_eq!(raw.len(), HEADER_LEN);
            assert_eq!(Header::decode(&raw).unwrap(), header);
            let told: u64 = lengths.iter().sum::<u64>() + (HEADER_LEN + TRAILER_LEN) as u64;
            assert_eq!(header.file_len(), told);
            let at_44: Vec<u8> = lengths.iter().flat_map(|n| n.to_le_bytes()).collect();
            assert_eq!(raw[44..], at_44, "the lengths are u64 at byte 44");
        }
        let absurd = Header {
            position: AT,
            lengths: [u64::MAX, 1, 0],
        };
        assert_eq!(absurd.file_len(), u64::MAX);
    }

    /// What is written streaming decodes and inspects; a file cut short by one byte, or whose
    /// header claims more than it holds, is a named error from the header alone.
    #[test]
    fn files_cut_short_or_claiming_more_are_named_from_the_header() {
        let raw = snapshot().encode();
        assert_eq!(raw.len(), HEADER_LEN + 103 + TRAILER_LEN);
        assert_eq!(inspect_bytes(&raw).unwrap(), AT);
        let back = Snapshot::decode(raw.clone()).unwrap();
        assert_eq!((back.model, back.scheduler), (vec![1, 2, 3], vec![9; 100]));

        let (cut, n) = (&raw[..raw.len() - 1], raw.len() as u64);
        for e in [
            inspect_bytes(cut),
            Snapshot::decode(cut.to_vec()).map(|s| s.position),
        ] {
            let e = e.unwrap_err();
            let size = matches!(e, SnapshotError::Size { described, holds } if (described, holds) == (n, n - 1));
            assert!(size && e.to_string().contains("cut short"), "{e}");
        }
        let mut claims_more = raw.clone();
        claims_more[44..52].copy_from_slice(&(1u64 << 40).to_le_bytes());
        let e = inspect_bytes(&claims_more).unwrap_err();
        let size = matches!(e, SnapshotError::Size { described, .. } if described > 1 << 40);
        assert!(size, "{e}");
        let e = inspect_bytes(&raw[..30]).unwrap_err();
        assert!(matches!(e, SnapshotError::HeaderCut(30)), "{e}");
        let mut damaged = raw.clone();
        damaged[HEADER_LEN + 50] ^= 1;
        let e = inspect_bytes(&damaged).unwrap_err();
        assert!(matches!(e, SnapshotError::Damaged), "{e}");
    }

    /// Files of version 1 still decode and inspect; one whose lengths do not add up is an
    /// error, and an unknown version with a valid checksum is named.
    #[test]
    fn version_1_files_are_still_read() {
        let s = snapshot();
        let raw = version_1(&s);
        let back = Snapshot::decode(raw.clone()).unwrap();
        assert_eq!(back.position, AT);
        assert_eq!(
            (back.model, back.optim, back.scheduler),
            (s.model.clone(), s.optim.clone(), s.scheduler.clone())
        );
        assert_eq!(inspect_bytes(&raw).unwrap(), AT);
        for cut in [0, 8, 20, raw.len() / 2, raw.len() - 1] {
            assert!(
                Snapshot::decode(raw[..cut].to_vec()).is_err(),
                "cut at {cut}"
            );
            assert!(inspect_bytes(&raw[..cut]).is_err(), "cut at {cut}");
        }
        // A model length one too long, checksum resealed: the records run into the trailer.
        let long = resealed(&raw, |body| body[44] += 1);
        let e = inspect_bytes(&long).unwrap_err();
        assert!(
            matches!(e, SnapshotError::Decode(DecodeError::Truncated { .. })),
            "{e}"
        );
        assert!(Snapshot::decode(long.clone()).is_err());
        let other = resealed(&raw, |body| body[8] = 3);
        for e in [
            inspect_bytes(&other).unwrap_err(),
            Snapshot::decode(other.clone()).err().unwrap(),
        ] {
            assert!(matches!(e, SnapshotError::Version(3)), "{e}");
        }
    }
}

//! The data-plane frame header: every chunk a rank sends carries what it belongs to, so a
//! receiver checks it before using a byte, and ranks that disagree stop with a clear error.

use crate::collectives::{DType, OpDesc, OpKind};
use crate::wire::{DecodeError, Reader};

/// Size of an encoded header.
pub(crate) const HEADER_LEN: usize = 32;
const MAGIC: u32 = u32::from_le_bytes(*b"BDDP");

/// What a frame is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum FrameKind {
    /// A chunk of a collective's data.
    Data = 1,
    /// The sender is leaving the group cleanly; a close after it is not a failure.
    Goodbye = 2,
}

/// A decoded header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Header {
    pub kind: FrameKind,
    pub op: OpKind,
    pub dtype: DType,
    pub seq: u64,
    /// The operation's total bytes.
    pub total: u64,
    /// Index of this chunk in the sender's schedule.
    pub unit: u32,
    /// Payload bytes after the header.
    pub len: u32,
}

impl Header {
    pub(crate) fn data(op: &OpDesc, unit: usize, len: usize) -> Self {
        Header {
            kind: FrameKind::Data,
            op: op.kind,
            dtype: op.dtype,
            seq: op.seq,
            total: op.bytes,
            unit: unit as u32,
            len: len as u32,
        }
    }

    pub(crate) fn goodbye() -> Self {
        Header {
            kind: FrameKind::Goodbye,
            op: OpKind::Barrier,
            dtype: DType::U8,
            seq: 0,
            total: 0,
            unit: 0,
            len: 0,
        }
    }

    pub(crate) fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        b[4] = self.kind as u8;
        b[5] = self.op as u8;
        b[6] = self.dtype as u8;
        b[8..16].copy_from_slice(&self.seq.to_le_bytes());
        b[16..24].copy_from_slice(&self.total.to_le_bytes());
        b[24..28].copy_from_slice(&self.unit.to_le_bytes());
        b[28..32].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    /// Decodes a header; garbage is an error that quotes what was wrong.
    pub(crate) fn decode(b: &[u8; HEADER_LEN]) -> Result<Self, DecodeError> {
        let mut r = Reader::new(b);
        if r.u32()? != MAGIC {
            return Err(DecodeError::Invalid(format!(
                "garbage on the connection (bad frame magic {:02x?})",
                &b[0..4]
            )));
        }
        let unknown = |what, code| DecodeError::UnknownCode { what, code };
        let kind = match r.u8()? {
            1 => FrameKind::Data,
            2 => FrameKind::Goodbye,
            k => return Err(unknown("frame kind", k)),
        };
        let code = r.u8()?;
        let op = OpKind::from_code(code).ok_or(unknown("operation", code))?;
        let code = r.u8()?;
        let dtype = DType::from_code(code).ok_or(unknown("dtype", code))?;
        r.u8()?; // padding
        Ok(Header {
            kind,
            op,
            dtype,
            seq: r.u64()?,
            total: r.u64()?,
            unit: r.u32()?,
            len: r.u32()?,
        })
    }

    /// Describes what the sender is doing, for desync messages.
    pub(crate) fn describe(&self) -> String {
        let op = OpDesc {
            kind: self.op,
            seq: self.seq,
            dtype: self.dtype,
            bytes: self.total,
        };
        format!("{op}, chunk {} of {} bytes", self.unit, self.len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    proptest::proptest! {
        /// Any 32 bytes decode to a header or an error, never a panic; a header that decodes
        /// re-encodes to the same bytes (so nothing is silently ignored but the padding byte).
        #[test]
        fn arbitrary_headers_never_panic(bytes in proptest::array::uniform32(0u8..)) {
            if let Ok(h) = Header::decode(&bytes) {
                let mut again = h.encode();
                again[7] = bytes[7];
                proptest::prop_assert_eq!(again, bytes);
            }
        }
    }

    #[test]
    fn header_round_trips_and_garbage_is_refused() {
        let op = OpDesc {
            kind: OpKind::AllReduce,
            seq: 7,
            dtype: DType::BF16,
            bytes: 1 << 33,
        };
        let h = Header::data(&op, 3, 4096);
        assert_eq!(Header::decode(&h.encode()).unwrap(), h);
        let mut bad = h.encode();
        bad[0] ^= 0xff;
        assert!(
            Header::decode(&bad)
                .unwrap_err()
                .to_string()
                .contains("garbage")
        );
        let mut bad = h.encode();
        bad[5] = 99;
        assert!(Header::decode(&bad).is_err());
    }
}

//! Bounded binary encoding shared by the store protocol and the data-plane handshake, and JSON
//! string literals for the files burn-ddp writes (torchrun's error file, Chrome traces).
//!
//! Messages are length-prefixed frames (`u32` little-endian length, then the body). A reader
//! never trusts a length it has not checked against the bytes actually present or a fixed
//! maximum, so garbage or absurd lengths become errors, never large allocations. Fields inside
//! a body carry `u32` lengths ([`Writer::bytes`]), or `u64` ones where they may reach 4 GiB
//! ([`Writer::long_bytes`]: metrics tensors gathered to rank 0).

use std::io::{self, Read, Write};

/// Appends little-endian fields to a frame body.
#[derive(Default)]
pub(crate) struct Writer {
    pub(crate) buf: Vec<u8>,
}

impl Writer {
    pub(crate) fn u8(&mut self, v: u8) -> &mut Self {
        self.buf.push(v);
        self
    }
    pub(crate) fn u32(&mut self, v: u32) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub(crate) fn u64(&mut self, v: u64) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub(crate) fn i64(&mut self, v: i64) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    #[cfg_attr(not(feature = "train"), allow(dead_code))]
    pub(crate) fn f64(&mut self, v: f64) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    /// A `u32` length followed by the bytes: for the fields of frames, which are far smaller
    /// than 4 GiB (a frame's own length is a `u32`). A field that may reach 4 GiB takes
    /// [`Self::long_bytes`]. A field of `u32::MAX` bytes or more is a bug of the caller: debug
    /// builds panic; release builds write the length `u32::MAX`, which [`Reader::bytes`]
    /// refuses, so the field is refused where it is read, never taken for a shorter one.
    pub(crate) fn bytes(&mut self, v: &[u8]) -> &mut Self {
        self.u32(short_len(v.len()));
        self.buf.extend_from_slice(v);
        self
    }
    /// A `u64` length followed by the bytes: a field of any size.
    #[cfg_attr(not(feature = "train"), allow(dead_code))]
    pub(crate) fn long_bytes(&mut self, v: &[u8]) -> &mut Self {
        self.u64(v.len() as u64);
        self.buf.extend_from_slice(v);
        self
    }
}

/// The `u32` length [`Writer::bytes`] writes for a field of `len` bytes (see there).
fn short_len(len: usize) -> u32 {
    debug_assert!(
        len < u32::MAX as usize,
        "a field of {len} bytes written with a u32 length: use long_bytes"
    );
    u32::try_from(len).unwrap_or(u32::MAX)
}

/// Reads fields from a received body, checking every length against what is left.
pub(crate) struct Reader<'a> {
    buf: &'a [u8],
}

impl<'a> Reader<'a> {
    pub(crate) fn new(buf: &'a [u8]) -> Self {
        Reader { buf }
    }
    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        if self.buf.len() < n {
            return Err(DecodeError::Truncated {
                needed: n,
                left: self.buf.len(),
            });
        }
        let (head, tail) = self.buf.split_at(n);
        self.buf = tail;
        Ok(head)
    }
    /// `N` bytes as an array.
    fn array<const N: usize>(&mut self) -> Result<[u8; N], DecodeError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }
    pub(crate) fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.take(1)?[0])
    }
    pub(crate) fn u32(&mut self) -> Result<u32, DecodeError> {
        self.array().map(u32::from_le_bytes)
    }
    pub(crate) fn u64(&mut self) -> Result<u64, DecodeError> {
        self.array().map(u64::from_le_bytes)
    }
    pub(crate) fn i64(&mut self) -> Result<i64, DecodeError> {
        self.array().map(i64::from_le_bytes)
    }
    #[cfg_attr(not(feature = "train"), allow(dead_code))]
    pub(crate) fn f64(&mut self) -> Result<f64, DecodeError> {
        self.array().map(f64::from_le_bytes)
    }
    /// A field written by [`Writer::bytes`]. The length `u32::MAX` is refused: it is what a
    /// field too long for a `u32` length was written with.
    pub(crate) fn bytes(&mut self) -> Result<&'a [u8], DecodeError> {
        match self.u32()? {
            u32::MAX => Err(DecodeError::Invalid(
                "a field of 4 GiB or more was written with a 32-bit length".into(),
            )),
            n => self.take(n as usize),
        }
    }
    /// A field written by [`Writer::long_bytes`].
    #[cfg_attr(not(feature = "train"), allow(dead_code))]
    pub(crate) fn long_bytes(&mut self) -> Result<&'a [u8], DecodeError> {
        let n = self.u64()?;
        self.fixed(n)
    }
    /// `n` bytes whose length was told elsewhere (a header); checked against what is left.
    #[cfg_attr(not(feature = "train"), allow(dead_code))]
    pub(crate) fn fixed(&mut self, n: u64) -> Result<&'a [u8], DecodeError> {
        match usize::try_from(n) {
            Ok(n) => self.take(n),
            Err(_) => Err(DecodeError::Truncated {
                needed: usize::MAX,
                left: self.buf.len(),
            }),
        }
    }
    pub(crate) fn string(&mut self) -> Result<String, DecodeError> {
        let b = self.bytes()?;
        String::from_utf8(b.to_vec()).map_err(|_| DecodeError::NotUtf8)
    }
    /// Bytes not read yet.
    #[cfg_attr(not(feature = "train"), allow(dead_code))]
    pub(crate) fn left(&self) -> usize {
        self.buf.len()
    }
    /// Fails unless every byte was consumed.
    pub(crate) fn finish(&self) -> Result<(), DecodeError> {
        if self.buf.is_empty() {
            Ok(())
        } else {
            Err(DecodeError::Trailing(self.buf.len()))
        }
    }
}

/// Why a received body could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum DecodeError {
    /// A field runs past the end of the body.
    #[error("truncated message: needed {needed} more bytes, {left} left")]
    Truncated {
        /// Bytes the field needs.
        needed: usize,
        /// Bytes left in the body.
        left: usize,
    },
    /// A string field holds bytes that are not UTF-8.
    #[error("string is not UTF-8")]
    NotUtf8,
    /// Bytes remain after the last field.
    #[error("{0} unexpected trailing bytes")]
    Trailing(usize),
    /// A code field holds no known value.
    #[error("unknown {what} code {code}")]
    UnknownCode {
        /// What the code stands for, as in `request`.
        what: &'static str,
        /// The value found.
        code: u8,
    },
    /// The fields decode but their values do not fit together (the reason in words).
    #[error("{0}")]
    Invalid(String),
}

/// Why reading a frame failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum FrameError {
    /// The peer closed the connection cleanly before a new frame started.
    #[error("connection closed")]
    Closed,
    /// The socket failed (including timeouts and a close in the middle of a frame).
    #[error("{0}")]
    Io(io::Error),
    /// The frame announced a length above the limit.
    #[error("frame of {0} bytes exceeds the limit")]
    TooLong(u64),
}

/// Why exchanging a message on a connection failed: the socket, the frame or its body.
#[derive(Debug, thiserror::Error)]
pub(crate) enum WireError {
    /// Writing or configuring the socket failed.
    #[error("{0}")]
    Io(#[from] io::Error),
    /// Reading a frame failed.
    #[error("{0}")]
    Frame(#[from] FrameError),
    /// The frame's body does not decode.
    #[error("{0}")]
    Decode(#[from] DecodeError),
}

/// Writes one frame (length prefix and body); a body of 4 GiB or more is refused.
pub(crate) fn write_frame(w: &mut impl Write, body: &[u8]) -> io::Result<()> {
    let len = u32::try_from(body.len()).map_err(|_| {
        let what = format!("a frame of {} bytes cannot be sent", body.len());
        io::Error::new(io::ErrorKind::InvalidInput, what)
    })?;
    let mut out = Vec::with_capacity(4 + body.len());
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(body);
    w.write_all(&out)?;
    w.flush()
}

/// Reads one frame of at most `max_len` bytes. The body buffer grows only as bytes arrive.
pub(crate) fn read_frame(r: &mut impl Read, max_len: usize) -> Result<Vec<u8>, FrameError> {
    let mut len = [0u8; 4];
    let mut got = 0;
    while got < 4 {
        match r.read(&mut len[got..]) {
            Ok(0) if got == 0 => return Err(FrameError::Closed),
            Ok(0) => {
                return Err(FrameError::Io(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "connection closed inside a frame header",
                )));
            }
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(FrameError::Io(e)),
        }
    }
    let len = u32::from_le_bytes(len) as usize;
    if len > max_len {
        return Err(FrameError::TooLong(len as u64));
    }
    let mut body = Vec::new();
    r.take(len as u64)
        .read_to_end(&mut body)
        .map_err(FrameError::Io)?;
    if body.len() != len {
        return Err(FrameError::Io(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            format!(
                "connection closed after {} of {len} frame bytes",
                body.len()
            ),
        )));
    }
    Ok(body)
}

/// `s` as a JSON string literal.
pub(crate) fn json_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 => {
                out.push_str(&format!("\\u{:04x}", c as u32));
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    proptest::proptest! {
        /// Arbitrary input gives a frame within the limit or an error.
        #[test]
        fn arbitrary_streams_give_bounded_frames_or_errors(input in proptest::collection::vec(0u8.., 0..300)) {
            let mut r: &[u8] = &input;
            if let Ok(body) = read_frame(&mut r, 64) {
                proptest::prop_assert!(body.len() <= 64);
            }
        }
    }

    #[test]
    fn absurd_length_is_refused_before_allocating() {
        let mut input: &[u8] = &[0xff, 0xff, 0xff, 0xff, 1, 2, 3];
        assert!(matches!(
            read_frame(&mut input, 1024),
            Err(FrameError::TooLong(0xffff_ffff))
        ));
    }

    #[test]
    fn truncated_frame_is_an_error() {
        let mut input: &[u8] = &[10, 0, 0, 0, 1, 2, 3];
        assert!(matches!(
            read_frame(&mut input, 1024),
            Err(FrameError::Io(_))
        ));
        let mut empty: &[u8] = &[];
        assert!(matches!(
            read_frame(&mut empty, 1024),
            Err(FrameError::Closed)
        ));
    }

    #[test]
    fn reader_checks_inner_lengths() {
        let mut w = Writer::default();
        w.u32(1_000_000).u8(1);
        let mut r = Reader::new(&w.buf);
        assert!(r.bytes().is_err());
        let mut w = Writer::default();
        w.bytes(b"key").i64(-5);
        let mut r = Reader::new(&w.buf);
        assert_eq!(r.string().unwrap(), "key");
        assert_eq!(r.i64().unwrap(), -5);
        r.finish().unwrap();
    }

    /// `long_bytes` fields round-trip; an absurd long length is refused before allocating;
    /// the `u32::MAX` that `bytes` writes for a field too long for it is refused, never read
    /// as a field of that length.
    #[test]
    fn long_fields_round_trip_and_a_saturated_length_is_refused() {
        let mut w = Writer::default();
        w.long_bytes(b"long").long_bytes(b"").u8(7);
        let mut r = Reader::new(&w.buf);
        assert_eq!(r.long_bytes().unwrap(), b"long");
        assert_eq!(r.long_bytes().unwrap(), b"");
        assert_eq!(r.u8().unwrap(), 7);
        r.finish().unwrap();
        let mut w = Writer::default();
        w.u64(u64::MAX).u8(1);
        assert!(matches!(
            Reader::new(&w.buf).long_bytes(),
            Err(DecodeError::Truncated { .. })
        ));
        let mut saturated = vec![0xff; 4];
        saturated.resize(4 + 64, 0);
        assert!(matches!(
            Reader::new(&saturated).bytes(),
            Err(DecodeError::Invalid(_))
        ));
    }

    /// A field of 4 GiB given a `u32` length is a bug caught in debug builds.
    #[test]
    #[cfg(debug_assertions)]
    #[should_panic(expected = "use long_bytes")]
    fn a_field_of_4_gib_with_a_u32_length_panics_in_debug_builds() {
        assert_eq!(short_len(u32::MAX as usize - 1), u32::MAX - 1);
        short_len(u32::MAX as usize);
    }
}

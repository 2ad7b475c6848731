//! Byte layout of PyTorch's c10d `TCPStore` queries and replies, as the server in
//! `torch/csrc/distributed/c10d/TCPStoreLibUvBackend.cpp` (and the older `TCPStoreBackend.cpp`)
//! parses them and the client in `TCPStore.cpp` writes them.
//!
//! - Integers are in the host's byte order, which is little-endian on every platform PyTorch
//!   ships for; we always write and read little-endian.
//! - A query is a `u8` query type followed by its arguments; a string or byte vector is a `u64`
//!   length followed by the bytes; key lists are a `u64` count followed by the keys.
//! - A connection starts with `VALIDATE` + the `u32` magic `0x3C85F7CE` (no reply).
//! - Replies: `GET` and `COMPARE_SET` answer a byte vector, `ADD` and `GETNUMKEYS` an `i64`,
//!   `CHECK` one byte (`READY` 0, `NOT_READY` 1), `WAIT` one byte (`STOP_WAITING` 0) when every
//!   key is set, `CANCEL_WAIT` one byte (`WAIT_CANCELED` 1). `SET` has no reply.

use std::io::{self, Read};

use crate::wire::Writer;

/// Magic number of the `VALIDATE` query that opens every connection.
pub(crate) const VALIDATION_MAGIC: u32 = 0x3C85_F7CE;

/// Query types (`enum class QueryType : uint8_t` in `TCPStoreBackend.hpp`).
pub(crate) mod query {
    pub const VALIDATE: u8 = 0;
    pub const SET: u8 = 1;
    pub const COMPARE_SET: u8 = 2;
    pub const GET: u8 = 3;
    pub const ADD: u8 = 4;
    pub const CHECK: u8 = 5;
    pub const WAIT: u8 = 6;
    pub const GETNUMKEYS: u8 = 7;
    pub const CANCEL_WAIT: u8 = 12;
}

/// `CheckResponseType::READY`: every key of a `CHECK` is set.
pub(crate) const READY: u8 = 0;
/// `CheckResponseType::NOT_READY`.
pub(crate) const NOT_READY: u8 = 1;
/// `WaitResponseType::STOP_WAITING`: every key of a `WAIT` is set.
pub(crate) const STOP_WAITING: u8 = 0;
/// `WaitResponseType::WAIT_CANCELED`: the answer to `CANCEL_WAIT`.
pub(crate) const WAIT_CANCELED: u8 = 1;

/// Longest key the libuv server accepts (`MAX_STRING_LEN`); it drops the connection otherwise.
pub(crate) const MAX_KEY_LEN: usize = 8 * 1024;
/// Largest value the libuv server accepts (`MAX_PAYLOAD_LEN`).
pub(crate) const MAX_VALUE_LEN: usize = 8 * 1024 * 1024;
/// Most keys in one `CHECK` or `WAIT` (`MAX_KEY_COUNT`).
pub(crate) const MAX_KEY_COUNT: usize = 128 * 1024;

/// One query to a c10d store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Query<'a> {
    /// Opens a connection.
    Validate,
    /// Stores `value` under `key` (no reply).
    Set { key: &'a str, value: &'a [u8] },
    /// Sets `key` to `desired` if it holds `expected` (see [`super::C10dClient::compare_set`]).
    CompareSet {
        key: &'a str,
        expected: &'a [u8],
        desired: &'a [u8],
    },
    /// The value of `key` (empty when absent on the libuv server; the old server drops the
    /// connection for an absent key, so ask only for keys known to be set).
    Get { key: &'a str },
    /// Adds `delta` to the decimal integer under `key` (absent: 0), answers the sum.
    Add { key: &'a str, delta: i64 },
    /// Whether every key is set, answered at once.
    Check { keys: &'a [&'a str] },
    /// Answered when every key is set (possibly never: cancel with `CancelWait`).
    Wait { keys: &'a [&'a str] },
    /// Number of keys in the store.
    NumKeys,
    /// Ends this connection's pending `Wait`.
    CancelWait,
}

/// A query the c10d server would answer by dropping the connection.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum LimitError {
    /// A key is too long (its length).
    #[error("key of {0} bytes exceeds the c10d store's limit of {MAX_KEY_LEN}")]
    Key(usize),
    /// A value is too long (its length).
    #[error("value of {0} bytes exceeds the c10d store's limit of {MAX_VALUE_LEN}")]
    Value(usize),
    /// Too many keys in one query (their number).
    #[error("{0} keys exceed the c10d store's limit of {MAX_KEY_COUNT}")]
    KeyCount(usize),
}

impl Query<'_> {
    /// Checks the limits the server enforces by dropping the connection.
    pub(crate) fn check_limits(&self) -> Result<(), LimitError> {
        let key = |k: &str| match k.len() {
            n if n > MAX_KEY_LEN => Err(LimitError::Key(n)),
            _ => Ok(()),
        };
        let value = |v: &[u8]| match v.len() {
            n if n > MAX_VALUE_LEN => Err(LimitError::Value(n)),
            _ => Ok(()),
        };
        match self {
            Query::Validate | Query::NumKeys | Query::CancelWait => Ok(()),
            Query::Set { key: k, value: v } => key(k).and(value(v)),
            Query::CompareSet {
                key: k,
                expected,
                desired,
            } => key(k).and(value(expected)).and(value(desired)),
            Query::Get { key: k } | Query::Add { key: k, .. } => key(k),
            Query::Check { keys } | Query::Wait { keys } => {
                if keys.len() > MAX_KEY_COUNT {
                    return Err(LimitError::KeyCount(keys.len()));
                }
                keys.iter().try_for_each(|k| key(k))
            }
        }
    }

    /// The query's bytes.
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut w = Writer::default();
        match self {
            Query::Validate => w.u8(query::VALIDATE).u32(VALIDATION_MAGIC),
            Query::Set { key, value } => {
                w.u8(query::SET);
                blob(blob(&mut w, key.as_bytes()), value)
            }
            Query::CompareSet {
                key,
                expected,
                desired,
            } => {
                w.u8(query::COMPARE_SET);
                let w = blob(&mut w, key.as_bytes());
                blob(blob(w, expected), desired)
            }
            Query::Get { key } => blob(w.u8(query::GET), key.as_bytes()),
            Query::Add { key, delta } => blob(w.u8(query::ADD), key.as_bytes()).i64(*delta),
            Query::Check { keys } => key_list(w.u8(query::CHECK), keys),
            Query::Wait { keys } => key_list(w.u8(query::WAIT), keys),
            Query::NumKeys => w.u8(query::GETNUMKEYS),
            Query::CancelWait => w.u8(query::CANCEL_WAIT),
        };
        w.buf
    }
}

/// A `u64` length followed by the bytes.
fn blob<'w>(w: &'w mut Writer, bytes: &[u8]) -> &'w mut Writer {
    w.u64(bytes.len() as u64);
    w.buf.extend_from_slice(bytes);
    w
}

fn key_list<'w>(w: &'w mut Writer, keys: &[&str]) -> &'w mut Writer {
    w.u64(keys.len() as u64);
    for k in keys {
        blob(w, k.as_bytes());
    }
    w
}

/// Reads one byte (a check or wait answer).
pub(crate) fn read_u8(r: &mut impl Read) -> io::Result<u8> {
    let mut b = [0u8; 1];
    r.read_exact(&mut b)?;
    Ok(b[0])
}

/// Reads an `i64` (an `ADD` or `GETNUMKEYS` answer).
pub(crate) fn read_i64(r: &mut impl Read) -> io::Result<i64> {
    let mut b = [0u8; 8];
    r.read_exact(&mut b)?;
    Ok(i64::from_le_bytes(b))
}

/// Reads a byte vector (a `GET` or `COMPARE_SET` answer), refusing lengths above
/// [`MAX_VALUE_LEN`] before allocating.
pub(crate) fn read_vec(r: &mut impl Read) -> io::Result<Vec<u8>> {
    let mut b = [0u8; 8];
    r.read_exact(&mut b)?;
    let len = u64::from_le_bytes(b);
    if len > MAX_VALUE_LEN as u64 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("the store announced a value of {len} bytes (limit {MAX_VALUE_LEN})"),
        ));
    }
    let mut v = vec![0u8; len as usize];
    r.read_exact(&mut v)?;
    Ok(v)
}

#[cfg(test)]
mod tests {
    //! The expected bytes were captured between a `torch.distributed.TCPStore` client and
    //! server of PyTorch 2.15 (keys carry the Python client's `/` prefix).

    use super::*;
    use std::io::Cursor;

    fn hex(s: &str) -> Vec<u8> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    #[test]
    fn queries_match_pytorch_byte_for_byte() {
        let cases: [(Query<'_>, &str); 9] = [
            (Query::Validate, "00cef7853c"),
            (
                Query::Set {
                    key: "/ab",
                    value: b"xyz",
                },
                "0103000000000000002f6162030000000000000078797a",
            ),
            (Query::Get { key: "/ab" }, "0303000000000000002f6162"),
            (
                Query::Add {
                    key: "/cnt",
                    delta: 5,
                },
                "0404000000000000002f636e740500000000000000",
            ),
            (
                Query::CompareSet {
                    key: "/cs",
                    expected: b"",
                    desired: b"v1",
                },
                "0203000000000000002f6373000000000000000002000000000000007631",
            ),
            (
                Query::Check {
                    keys: &["/ab", "/zz"],
                },
                "05020000000000000003000000000000002f616203000000000000002f7a7a",
            ),
            (
                Query::Wait { keys: &["/nokey"] },
                "06010000000000000006000000000000002f6e6f6b6579",
            ),
            (Query::NumKeys, "07"),
            (Query::CancelWait, "0c"),
        ];
        for (q, expected) in cases {
            assert_eq!(q.encode(), hex(expected), "{q:?}");
        }
    }

    #[test]
    fn replies_decode_as_pytorch_sends_them() {
        let mut get = Cursor::new(hex("030000000000000078797a"));
        assert_eq!(read_vec(&mut get).unwrap(), b"xyz");
        let mut add = Cursor::new(hex("0500000000000000"));
        assert_eq!(read_i64(&mut add).unwrap(), 5);
        let mut absent_compare_set = Cursor::new(hex("010000000000000065"));
        assert_eq!(read_vec(&mut absent_compare_set).unwrap(), b"e");
        // A cancelled wait whose keys arrived first: STOP_WAITING, then WAIT_CANCELED.
        let mut cancel = Cursor::new(vec![STOP_WAITING, WAIT_CANCELED]);
        assert_eq!(read_u8(&mut cancel).unwrap(), STOP_WAITING);
        assert_eq!(read_u8(&mut cancel).unwrap(), WAIT_CANCELED);
        assert_eq!((READY, NOT_READY), (0, 1));
    }

    #[test]
    fn truncated_or_absurd_replies_are_errors() {
        let full = hex("030000000000000078797a");
        for cut in 0..full.len() {
            assert!(
                read_vec(&mut Cursor::new(&full[..cut])).is_err(),
                "cut {cut}"
            );
        }
        let mut absurd = Cursor::new(u64::MAX.to_le_bytes().to_vec());
        let e = read_vec(&mut absurd).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData);
        assert!(read_i64(&mut Cursor::new(vec![1, 2, 3])).is_err());
    }

    #[test]
    fn limits_are_checked_before_sending() {
        let long = "k".repeat(MAX_KEY_LEN + 1);
        assert!(Query::Get { key: &long }.check_limits().is_err());
        let big = vec![0u8; MAX_VALUE_LEN + 1];
        let set = Query::Set {
            key: "k",
            value: &big,
        };
        assert!(
            set.check_limits()
                .unwrap_err()
                .to_string()
                .contains("limit")
        );
        assert!(
            Query::Wait {
                keys: &["a", &long]
            }
            .check_limits()
            .is_err()
        );
        assert!(
            Query::Set {
                key: "k",
                value: b"v"
            }
            .check_limits()
            .is_ok()
        );
    }
}

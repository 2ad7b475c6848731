//! The store's request and response messages and their encoding.
//!
//! A connection starts with admission (`secret::handshake`, domain store, no claims): hello
//! and challenge, each opening with [`HELLO`], then the client's answer and the server's
//! verdict; the job secret itself never crosses the wire. Then it carries one request frame and
//! one response frame at a time. Keys are UTF-8, at most [`MAX_KEY_LEN`]
//! bytes; whole frames are at most [`MAX_FRAME_LEN`] bytes.

use std::time::Duration;

use crate::wire::{DecodeError, Reader, Writer};

/// First bytes of every store connection, both directions (v3: challenge-response admission).
pub(crate) const HELLO: &[u8] = b"burn-ddp store v3";
/// Largest frame either side accepts.
pub(crate) const MAX_FRAME_LEN: usize = 64 << 20;
/// Longest key accepted.
pub(crate) const MAX_KEY_LEN: usize = 4096;
/// Most keys one wait may name (a job waits for one key per rank at a time): a wait's keys are
/// looked up under the store's lock when it begins (and each again as the keys before it arrive).
pub(crate) const MAX_WAIT_KEYS: usize = 1 << 16;

/// One request to the store.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Request {
    /// Stores `value` under `key`, replacing what was there.
    Set { key: String, value: Vec<u8> },
    /// Returns the value of `key`, waiting up to `timeout` for it to be set (zero: no wait).
    Get { key: String, timeout: Duration },
    /// Adds `delta` to the integer under `key` (absent counts as 0) and returns the sum.
    Add { key: String, delta: i64 },
    /// Sets `key` to `desired` if its current value is `expected` (absent counts as empty);
    /// returns the value after the call.
    CompareSet {
        key: String,
        expected: Vec<u8>,
        desired: Vec<u8>,
    },
    /// Waits up to `timeout` until every key is set.
    Wait {
        keys: Vec<String>,
        timeout: Duration,
    },
}

/// The store's answer.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Response {
    Ok,
    Value(Vec<u8>),
    Int(i64),
    /// The wait ended before the keys were set; lists the keys still missing.
    Timeout(Vec<String>),
    Error(String),
}

mod code {
    pub const SET: u8 = 1;
    pub const GET: u8 = 2;
    pub const ADD: u8 = 3;
    pub const COMPARE_SET: u8 = 4;
    pub const WAIT: u8 = 5;
    pub const OK: u8 = 100;
    pub const VALUE: u8 = 101;
    pub const INT: u8 = 102;
    pub const TIMEOUT: u8 = 103;
    pub const ERROR: u8 = 104;
}

fn millis(d: Duration) -> u64 {
    d.as_millis().min(u64::MAX as u128) as u64
}

fn key(r: &mut Reader<'_>) -> Result<String, DecodeError> {
    let k = r.string()?;
    if k.len() > MAX_KEY_LEN {
        let reason = format!("key of {} bytes exceeds {MAX_KEY_LEN}", k.len());
        return Err(DecodeError::Invalid(reason));
    }
    Ok(k)
}

impl Request {
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut w = Writer::default();
        match self {
            Request::Set { key, value } => w.u8(code::SET).bytes(key.as_bytes()).bytes(value),
            Request::Get { key, timeout } => {
                w.u8(code::GET).bytes(key.as_bytes()).u64(millis(*timeout))
            }
            Request::Add { key, delta } => w.u8(code::ADD).bytes(key.as_bytes()).i64(*delta),
            Request::CompareSet {
                key,
                expected,
                desired,
            } => w
                .u8(code::COMPARE_SET)
                .bytes(key.as_bytes())
                .bytes(expected)
                .bytes(desired),
            Request::Wait { keys, timeout } => {
                w.u8(code::WAIT).u32(keys.len() as u32);
                for k in keys {
                    w.bytes(k.as_bytes());
                }
                w.u64(millis(*timeout))
            }
        };
        w.buf
    }

    pub(crate) fn decode(body: &[u8]) -> Result<Self, DecodeError> {
        let mut r = Reader::new(body);
        let req = match r.u8()? {
            code::SET => Request::Set {
                key: key(&mut r)?,
                value: r.bytes()?.to_vec(),
            },
            code::GET => Request::Get {
                key: key(&mut r)?,
                timeout: Duration::from_millis(r.u64()?),
            },
            code::ADD => Request::Add {
                key: key(&mut r)?,
                delta: r.i64()?,
            },
            code::COMPARE_SET => Request::CompareSet {
                key: key(&mut r)?,
                expected: r.bytes()?.to_vec(),
                desired: r.bytes()?.to_vec(),
            },
            code::WAIT => {
                let n = r.u32()? as usize;
                if n > MAX_WAIT_KEYS {
                    let reason = format!("a wait for {n} keys exceeds {MAX_WAIT_KEYS}");
                    return Err(DecodeError::Invalid(reason));
                }
                // Each key takes at least 4 bytes, so `n` is bounded by the frame size.
                let mut keys = Vec::with_capacity(n.min(body.len() / 4));
                for _ in 0..n {
                    keys.push(key(&mut r)?);
                }
                Request::Wait {
                    keys,
                    timeout: Duration::from_millis(r.u64()?),
                }
            }
            other => {
                return Err(DecodeError::UnknownCode {
                    what: "request",
                    code: other,
                });
            }
        };
        r.finish()?;
        Ok(req)
    }
}

impl Response {
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut w = Writer::default();
        match self {
            Response::Ok => w.u8(code::OK),
            Response::Value(v) => w.u8(code::VALUE).bytes(v),
            Response::Int(i) => w.u8(code::INT).i64(*i),
            Response::Timeout(keys) => {
                w.u8(code::TIMEOUT).u32(keys.len() as u32);
                for k in keys {
                    w.bytes(k.as_bytes());
                }
                &mut w
            }
            Response::Error(e) => w.u8(code::ERROR).bytes(e.as_bytes()),
        };
        w.buf
    }

    pub(crate) fn decode(body: &[u8]) -> Result<Self, DecodeError> {
        let mut r = Reader::new(body);
        let resp = match r.u8()? {
            code::OK => Response::Ok,
            code::VALUE => Response::Value(r.bytes()?.to_vec()),
            code::INT => Response::Int(r.i64()?),
            code::TIMEOUT => {
                let n = r.u32()? as usize;
                let mut keys = Vec::with_capacity(n.min(body.len() / 4));
                for _ in 0..n {
                    keys.push(key(&mut r)?);
                }
                Response::Timeout(keys)
            }
            code::ERROR => Response::Error(String::from_utf8_lossy(r.bytes()?).into_owned()),
            other => {
                return Err(DecodeError::UnknownCode {
                    what: "response",
                    code: other,
                });
            }
        };
        r.finish()?;
        Ok(resp)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wait_for_too_many_keys_is_refused() {
        let wait = |n: usize| Request::Wait {
            keys: (0..n).map(|i| i.to_string()).collect(),
            timeout: Duration::from_secs(1),
        };
        assert_eq!(
            Request::decode(&wait(MAX_WAIT_KEYS).encode()),
            Ok(wait(MAX_WAIT_KEYS))
        );
        let refused = Request::decode(&wait(MAX_WAIT_KEYS + 1).encode()).unwrap_err();
        assert!(refused.to_string().contains("exceeds"), "{refused}");
    }

    #[test]
    fn requests_round_trip() {
        let reqs = [
            Request::Set {
                key: "a".into(),
                value: vec![1, 2],
            },
            Request::Get {
                key: "b".into(),
                timeout: Duration::from_millis(1500),
            },
            Request::Add {
                key: "c".into(),
                delta: -3,
            },
            Request::CompareSet {
                key: "d".into(),
                expected: vec![],
                desired: b"x".to_vec(),
            },
            Request::Wait {
                keys: vec!["e".into(), "f".into()],
                timeout: Duration::from_secs(2),
            },
        ];
        for req in reqs {
            assert_eq!(Request::decode(&req.encode()).unwrap(), req);
        }
    }

    #[test]
    fn every_truncation_of_a_request_is_an_error() {
        let body = Request::Wait {
            keys: vec!["key-one".into(), "key-two".into()],
            timeout: Duration::from_secs(1),
        }
        .encode();
        for cut in 0..body.len() {
            assert!(Request::decode(&body[..cut]).is_err(), "cut at {cut}");
        }
    }

    proptest::proptest! {
        /// Garbage never panics the decoder; valid requests survive a round trip.
        #[test]
        fn decoding_arbitrary_bytes_never_panics(body in proptest::collection::vec(0u8.., 0..512)) {
            let _ = Request::decode(&body);
            let _ = Response::decode(&body);
        }

        #[test]
        fn set_requests_round_trip(key in "[a-z/0-9]{0,64}", value in proptest::collection::vec(0u8.., 0..256)) {
            let req = Request::Set { key, value };
            proptest::prop_assert_eq!(Request::decode(&req.encode()).unwrap(), req);
        }
    }

    #[test]
    fn absurd_key_count_does_not_allocate() {
        let mut w = Writer::default();
        w.u8(code::WAIT).u32(u32::MAX);
        assert!(Request::decode(&w.buf).is_err());
    }
}

//! A client of PyTorch's c10d `TCPStore`: the store torchrun's agent serves at
//! `MASTER_ADDR:MASTER_PORT` when it sets `TORCHELASTIC_USE_AGENT_STORE=True`.
//!
//! It speaks the subset burn-ddp needs: `VALIDATE` (the magic that opens a connection), `SET`,
//! `GET` (after a `WAIT`, so it blocks up to a timeout), `ADD`, `CHECK` (non-blocking
//! existence), `WAIT` with a timeout (ended by `CANCEL_WAIT`, as PyTorch's own client does) and
//! `COMPARE_SET`; `GETNUMKEYS` answers the handshake. The byte layout is in [`wire`]. Keys get
//! the `/` prefix PyTorch's `TCPStore` client adds, so a Python `TCPStore` client reads what
//! this one writes under the same names. Every read has a timeout; a connection that failed
//! mid-exchange is never reused.

mod wire;

use std::io::{self, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Mutex;
use std::time::Duration;

use wire::{NOT_READY, Query, READY, STOP_WAITING, WAIT_CANCELED, read_i64, read_u8, read_vec};

use super::ANSWER_MARGIN;
use crate::error::{DdpError, Result};

/// A connection to a c10d `TCPStore`. Requests are serialised on the connection.
pub(crate) struct C10dClient {
    addr: String,
    conn: Mutex<Option<TcpStream>>,
}

fn protocol_error(what: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what)
}

fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

/// The key as PyTorch's `TCPStore` client sends it.
fn wire_key(key: &str) -> String {
    format!("/{key}")
}

fn send(stream: &mut TcpStream, q: Query<'_>) -> io::Result<()> {
    q.check_limits()
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    stream.write_all(&q.encode())
}

/// Sends `WAIT` for `keys` and reads the answer within `timeout`; on a timeout cancels the
/// wait. Returns whether every key was set.
fn wait_on(stream: &mut TcpStream, keys: &[&str], timeout: Duration) -> io::Result<bool> {
    if timeout.is_zero() {
        return check_on(stream, keys);
    }
    send(stream, Query::Wait { keys })?;
    stream.set_read_timeout(Some(timeout))?;
    match read_u8(stream) {
        Ok(STOP_WAITING) => return Ok(true),
        Ok(other) => return Err(protocol_error(format!("wait answered {other}"))),
        Err(e) if is_timeout(&e) => {}
        Err(e) => return Err(e),
    }
    send(stream, Query::CancelWait)?;
    stream.set_read_timeout(Some(ANSWER_MARGIN))?;
    match read_u8(stream)? {
        WAIT_CANCELED => Ok(false),
        // The keys arrived before the server saw the cancel: the cancel is answered next.
        STOP_WAITING => match read_u8(stream)? {
            WAIT_CANCELED => Ok(true),
            other => Err(protocol_error(format!("cancel_wait answered {other}"))),
        },
        other => Err(protocol_error(format!("cancel_wait answered {other}"))),
    }
}

fn check_on(stream: &mut TcpStream, keys: &[&str]) -> io::Result<bool> {
    send(stream, Query::Check { keys })?;
    stream.set_read_timeout(Some(ANSWER_MARGIN))?;
    match read_u8(stream)? {
        READY => Ok(true),
        NOT_READY => Ok(false),
        other => Err(protocol_error(format!("check answered {other}"))),
    }
}

impl C10dClient {
    /// Validates a fresh connection and checks that a c10d store answers on it within
    /// `timeout` (at least 1 s, at most 10 s).
    pub(crate) fn handshake(
        addr: &str,
        mut stream: TcpStream,
        timeout: Duration,
    ) -> Result<(Self, SocketAddr)> {
        let fail = |reason: String| DdpError::Store {
            addr: addr.to_string(),
            reason,
        };
        let _ = stream.set_nodelay(true);
        crate::liveness::watch(&stream);
        // VALIDATE has no answer; GETNUMKEYS (known to every c10d server version) proves that
        // the server parsed it.
        let answer = send(&mut stream, Query::Validate)
            .and_then(|_| send(&mut stream, Query::NumKeys))
            .and_then(|_| {
                stream.set_read_timeout(Some(timeout.clamp(Duration::from_secs(1), ANSWER_MARGIN)))
            })
            .and_then(|_| read_i64(&mut stream));
        match answer {
            Ok(n) if (0..1 << 40).contains(&n) => {}
            Ok(n) => {
                return Err(fail(format!(
                    "the server answered the handshake with {n}: not a PyTorch c10d TCPStore"
                )));
            }
            Err(e) => {
                return Err(fail(format!(
                    "no PyTorch c10d TCPStore answered ({e}); TORCHELASTIC_USE_AGENT_STORE=True \
                     says torchrun's agent serves one at MASTER_ADDR:MASTER_PORT"
                )));
            }
        }
        let local = stream.local_addr().map_err(|e| fail(e.to_string()))?;
        let client = C10dClient {
            addr: addr.to_string(),
            conn: Mutex::new(Some(stream)),
        };
        Ok((client, local))
    }

    /// Runs `exchange` on the connection; on an I/O error the connection is dropped (it may be
    /// mid-answer) and the error says what was being done.
    fn exchange<T>(
        &self,
        what: impl FnOnce() -> String,
        exchange: impl FnOnce(&mut TcpStream) -> io::Result<T>,
    ) -> Result<T> {
        let mut guard = crate::sync::lock(&self.conn);
        let Some(stream) = guard.as_mut() else {
            return Err(self.error("the connection was lost earlier".into()));
        };
        match exchange(stream) {
            Ok(v) => Ok(v),
            Err(e) if e.kind() == io::ErrorKind::InvalidInput => {
                // Refused before anything was sent: the connection is intact.
                Err(self.error(format!("{}: {e}", what())))
            }
            Err(e) => {
                *guard = None;
                Err(self.error(format!(
                    "{}: lost the connection ({e}); torchrun's agent hosts this store: did \
                     torchrun exit?",
                    what()
                )))
            }
        }
    }

    fn error(&self, reason: String) -> DdpError {
        DdpError::Store {
            addr: self.addr.clone(),
            reason,
        }
    }

    /// Stores `value` under `key`. The server does not answer a set.
    pub(crate) fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        let key = wire_key(key);
        self.exchange(
            || format!("set {key:?}"),
            |s| send(s, Query::Set { key: &key, value }),
        )
    }

    /// The value of `key`, waiting up to `timeout` for it; `None` when it was not set in time.
    pub(crate) fn get(&self, key: &str, timeout: Duration) -> Result<Option<Vec<u8>>> {
        let key = wire_key(key);
        self.exchange(
            || format!("get {key:?}"),
            |s| {
                // Never GET an absent key: the pre-libuv server drops the connection for one.
                if !wait_on(s, &[&key], timeout)? {
                    return Ok(None);
                }
                send(s, Query::Get { key: &key })?;
                s.set_read_timeout(Some(ANSWER_MARGIN))?;
                read_vec(s).map(Some)
            },
        )
    }

    /// Adds `delta` to the integer under `key` (absent: 0) and returns the sum.
    pub(crate) fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let key = wire_key(key);
        self.exchange(
            || format!("add to {key:?}"),
            |s| {
                send(s, Query::Add { key: &key, delta })?;
                s.set_read_timeout(Some(ANSWER_MARGIN))?;
                read_i64(s)
            },
        )
    }

    /// Sets `key` to `desired` if it holds `expected`, an absent key holding the empty value;
    /// returns the value after the call. The c10d server answers `expected` itself for an
    /// absent key and a non-empty `expected` (its code calls that "lying to the caller"): that
    /// answer is turned into the empty value here, so both stores mean the same.
    pub(crate) fn compare_set(
        &self,
        key: &str,
        expected: &[u8],
        desired: &[u8],
    ) -> Result<Vec<u8>> {
        let key = wire_key(key);
        self.exchange(
            || format!("compare_set {key:?}"),
            |s| {
                let q = Query::CompareSet {
                    key: &key,
                    expected,
                    desired,
                };
                send(s, q)?;
                s.set_read_timeout(Some(ANSWER_MARGIN))?;
                let after = read_vec(s)?;
                if expected.is_empty() || after != expected {
                    return Ok(after);
                }
                // `after == expected`, not empty: a present key that held `expected` would now
                // hold `desired`, so unless they are equal the key is absent.
                if expected != desired || !check_on(s, &[&key])? {
                    return Ok(Vec::new());
                }
                Ok(after)
            },
        )
    }

    /// Waits up to `timeout` for every key; returns the keys still missing (empty: all set).
    pub(crate) fn wait(&self, keys: &[String], timeout: Duration) -> Result<Vec<String>> {
        let wire: Vec<String> = keys.iter().map(|k| wire_key(k)).collect();
        let refs: Vec<&str> = wire.iter().map(String::as_str).collect();
        self.exchange(
            || format!("wait for {} keys", keys.len()),
            |s| {
                if wait_on(s, &refs, timeout)? {
                    return Ok(Vec::new());
                }
                let mut missing = Vec::new();
                for (key, w) in keys.iter().zip(&refs) {
                    if !check_on(s, &[w])? {
                        missing.push(key.clone());
                    }
                }
                Ok(missing)
            },
        )
    }
}

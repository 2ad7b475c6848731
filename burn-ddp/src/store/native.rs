//! Client side of burn-ddp's own store protocol (see `protocol`): one request frame and one
//! response frame at a time on one connection.

use std::net::{SocketAddr, TcpStream};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::ANSWER_MARGIN;
use super::protocol::{HELLO, MAX_FRAME_LEN, Request, Response};
use crate::error::{DdpError, Result};
use crate::secret::handshake::{self, Side};
use crate::secret::{Domain, JobSecret};
use crate::wire::{WireError, read_frame, write_frame};

/// A connection to a [`StoreServer`](super::StoreServer).
pub(crate) struct NativeClient {
    addr: String,
    conn: Mutex<Option<TcpStream>>,
}

impl NativeClient {
    /// Opens a connection's session: admission (`secret::handshake`), in which the store
    /// must prove it holds `secret` before this client proves it does.
    pub(crate) fn handshake(
        addr: &str,
        stream: TcpStream,
        timeout: Duration,
        secret: Option<&JobSecret>,
    ) -> Result<(Self, SocketAddr), Handshake> {
        let fail = |reason: String| {
            Handshake::Failed(DdpError::Store {
                addr: addr.to_string(),
                reason,
            })
        };
        let _ = stream.set_nodelay(true);
        crate::liveness::watch(&stream);
        let me = Side {
            domain: Domain::Store,
            magic: HELLO,
            secret,
            claims: &[],
        };
        let deadline = Instant::now() + timeout.min(Duration::from_secs(10));
        match handshake::initiate(&stream, &me, deadline) {
            Ok(_) => {}
            // The server closed this connection before its verdict (it sheds unadmitted
            // connections under a flood, see the server): worth dialling again.
            Err(e) if e.dropped_by_peer() => return Err(Handshake::Dropped(e.to_string())),
            Err(source) => {
                return Err(Handshake::Failed(DdpError::Admission {
                    connection: format!("store at {addr}"),
                    source,
                }));
            }
        }
        let local = stream.local_addr().map_err(|e| fail(e.to_string()))?;
        let client = NativeClient {
            addr: addr.to_string(),
            conn: Mutex::new(Some(stream)),
        };
        Ok((client, local))
    }

    fn request(&self, req: &Request, wait: Duration) -> Result<Response> {
        let mut guard = crate::sync::lock(&self.conn);
        let Some(stream) = guard.as_mut() else {
            return Err(self.error("the connection was lost earlier".into()));
        };
        let exchange = |stream: &mut TcpStream| -> std::result::Result<Response, WireError> {
            stream.set_read_timeout(Some(wait + ANSWER_MARGIN))?;
            write_frame(stream, &req.encode())?;
            let body = read_frame(stream, MAX_FRAME_LEN)?;
            Ok(Response::decode(&body)?)
        };
        match exchange(stream) {
            Ok(Response::Error(e)) => Err(self.error(format!("request refused: {e}"))),
            Ok(r) => Ok(r),
            Err(e) => {
                // The stream may be mid-frame: never reuse it.
                *guard = None;
                Err(self.error(format!(
                    "lost the connection ({e}); rank 0 hosts the store: did it exit?"
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

    fn unexpected(&self, r: Response) -> DdpError {
        self.error(format!("unexpected answer {r:?}"))
    }

    pub(crate) fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        let req = Request::Set {
            key: key.into(),
            value: value.into(),
        };
        match self.request(&req, Duration::ZERO)? {
            Response::Ok => Ok(()),
            r => Err(self.unexpected(r)),
        }
    }

    /// The value of `key`, waiting up to `timeout` for it; `None` when it was not set in time.
    pub(crate) fn get(&self, key: &str, timeout: Duration) -> Result<Option<Vec<u8>>> {
        let req = Request::Get {
            key: key.into(),
            timeout,
        };
        match self.request(&req, timeout)? {
            Response::Value(v) => Ok(Some(v)),
            Response::Timeout(_) => Ok(None),
            r => Err(self.unexpected(r)),
        }
    }

    pub(crate) fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let req = Request::Add {
            key: key.into(),
            delta,
        };
        match self.request(&req, Duration::ZERO)? {
            Response::Int(i) => Ok(i),
            r => Err(self.unexpected(r)),
        }
    }

    pub(crate) fn compare_set(
        &self,
        key: &str,
        expected: &[u8],
        desired: &[u8],
    ) -> Result<Vec<u8>> {
        let req = Request::CompareSet {
            key: key.into(),
            expected: expected.into(),
            desired: desired.into(),
        };
        match self.request(&req, Duration::ZERO)? {
            Response::Value(v) => Ok(v),
            r => Err(self.unexpected(r)),
        }
    }

    /// Waits up to `timeout` for every key; returns the keys still missing (empty: all set).
    pub(crate) fn wait(&self, keys: &[String], timeout: Duration) -> Result<Vec<String>> {
        let req = Request::Wait {
            keys: keys.to_vec(),
            timeout,
        };
        match self.request(&req, timeout)? {
            Response::Ok => Ok(Vec::new()),
            Response::Timeout(missing) => Ok(missing),
            r => Err(self.unexpected(r)),
        }
    }
}

/// Why a handshake did not complete.
pub(crate) enum Handshake {
    /// The server closed the connection before its hello: dial again.
    Dropped(String),
    /// Anything else (not a burn-ddp store, refused, unreadable): the error to report.
    Failed(DdpError),
}

//! Client side of burn-ddp's own store protocol (see `protocol`): one request frame and one
//! response frame at a time on one connection.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Mutex;
use std::time::Duration;

use super::ANSWER_MARGIN;
use super::protocol::{HELLO, MAX_FRAME_LEN, Request, Response};
use crate::error::{DdpError, Result};
use crate::secret::JobSecret;
use crate::wire::{WireError, read_frame, write_frame};

/// A connection to a [`StoreServer`](super::StoreServer).
pub(crate) struct NativeClient {
    addr: String,
    conn: Mutex<Option<TcpStream>>,
}

impl NativeClient {
    /// Exchanges hellos (and the job secret) on a fresh connection.
    /// Opens a connection's session: hello and secret out, the server's hello and verdict in.
    pub(crate) fn handshake(
        addr: &str,
        mut stream: TcpStream,
        timeout: Duration,
        secret: Option<&JobSecret>,
    ) -> Result<(Self, SocketAddr), Handshake> {
        let fail = |reason: String| {
            Handshake::Failed(DdpError::Store {
                addr: addr.to_string(),
                reason,
            })
        };
        // The server closed this connection before answering (it sheds unadmitted connections
        // under a flood, see the server): worth dialling again.
        let dropped = |e: &std::io::Error, what: &str| {
            use std::io::ErrorKind::*;
            matches!(
                e.kind(),
                UnexpectedEof | ConnectionReset | BrokenPipe | ConnectionAborted
            )
            .then(|| Handshake::Dropped(format!("{what}: {e}")))
        };
        let _ = stream.set_nodelay(true);
        stream
            .set_read_timeout(Some(timeout.min(Duration::from_secs(10))))
            .map_err(|e| fail(e.to_string()))?;
        stream
            .write_all(HELLO)
            .and_then(|_| write_frame(&mut stream, secret.map_or(&[][..], JobSecret::as_bytes)))
            .map_err(|e| {
                dropped(&e, "sending hello").unwrap_or_else(|| fail(format!("sending hello: {e}")))
            })?;
        let mut hello = vec![0u8; HELLO.len()];
        stream.read_exact(&mut hello).map_err(|e| {
            dropped(&e, "reading the store's hello").unwrap_or_else(|| {
                fail(format!(
                    "no burn-ddp store answered ({e}); is another program using this port?"
                ))
            })
        })?;
        if hello != HELLO {
            return Err(fail(
                "the server is not a burn-ddp store (bad hello); is another program using this port?"
                    .into(),
            ));
        }
        let verdict = read_frame(&mut stream, 4096)
            .map_err(|e| fail(format!("the store did not answer the hello: {e}")))?;
        if !verdict.is_empty() {
            return Err(fail(format!(
                "refused: {}",
                String::from_utf8_lossy(&verdict)
            )));
        }
        let local = stream.local_addr().map_err(|e| fail(e.to_string()))?;
        let client = NativeClient {
            addr: addr.to_string(),
            conn: Mutex::new(Some(stream)),
        };
        Ok((client, local))
    }

    fn request(&self, req: &Request, wait: Duration) -> Result<Response> {
        let mut guard = self.conn.lock().unwrap_or_else(|p| p.into_inner());
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

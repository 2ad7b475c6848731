//! Client side of burn-ddp's own store protocol (see `protocol`): one request frame and one
//! response frame at a time on a connection.
//!
//! A request that may wait long (a wait, a get with a timeout) must not hold up the client's
//! others: a rank's failure agreement and status reports share the store with the program's own
//! waits. So a client keeps up to [`MAX_CONNECTIONS`] connections, all admitted alike: a
//! request takes an idle one; when every open connection is held by a request that may wait,
//! it opens another; requests that may wait hold at most all but one, so the others always
//! find a connection within one short request. Most clients never open a second.

use std::net::{SocketAddr, TcpStream};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::ANSWER_MARGIN;
use super::protocol::{HELLO, MAX_FRAME_LEN, Request, Response};
use crate::error::{DdpError, Result};
use crate::secret::handshake::{self, Side};
use crate::secret::{Domain, JobSecret};
use crate::wire::{WireError, read_frame, write_frame};

/// Most connections one client opens to the store.
const MAX_CONNECTIONS: usize = 4;
/// Longest a client takes to open another connection (dial and admission).
const OPEN_TIMEOUT: Duration = Duration::from_secs(5);
/// After another connection could not be opened, how long the client makes do with those open.
const REOPEN_PAUSE: Duration = Duration::from_secs(10);

/// A client of a [`StoreServer`](super::StoreServer): its connections.
pub(crate) struct NativeClient {
    addr: String,
    /// The store's address, as the first connection reached it.
    peer: SocketAddr,
    secret: Option<JobSecret>,
    pool: Mutex<Pool>,
    /// Notified when a connection or a place for a waiting request is given back.
    freed: Condvar,
}

/// The client's connections.
struct Pool {
    idle: Vec<TcpStream>,
    /// Connections open (idle, in use, or being opened).
    open: usize,
    /// Connections held by requests that may wait.
    waiting: usize,
    /// Set once a connection was lost mid-request: the store is gone (or the stream is
    /// mid-frame), so no later request is tried.
    lost: bool,
    /// No other connection is opened before then (opening one failed).
    reopen_at: Option<Instant>,
}

/// A connection lent to one request.
struct Lease<'a> {
    client: &'a NativeClient,
    stream: Option<TcpStream>,
    /// Set when the request failed mid-exchange: the stream may be mid-frame.
    broken: bool,
    /// Whether the request may wait (else it asks for no wait).
    waits: bool,
}

impl Drop for Lease<'_> {
    fn drop(&mut self) {
        let mut pool = self.client.pool();
        match self.stream.take() {
            Some(stream) if !self.broken => pool.idle.push(stream),
            _ => {
                pool.open -= 1;
                pool.lost = true;
            }
        }
        if self.waits {
            pool.waiting -= 1;
        }
        drop(pool);
        self.client.freed.notify_all();
    }
}

/// Runs admission (`secret::handshake`) on `stream` within `timeout` (at most 10 s), in which
/// the store must prove it holds `secret` before this client proves it does.
fn admit(
    addr: &str,
    stream: &TcpStream,
    timeout: Duration,
    secret: Option<&JobSecret>,
) -> Result<(), Handshake> {
    let _ = stream.set_nodelay(true);
    crate::liveness::watch(stream);
    let me = Side {
        domain: Domain::Store,
        magic: HELLO,
        secret,
        claims: &[],
    };
    let deadline = Instant::now() + timeout.min(Duration::from_secs(10));
    match handshake::initiate(stream, &me, deadline) {
        Ok(_) => Ok(()),
        // The server closed this connection before its verdict (it sheds unadmitted
        // connections under a flood, see the server): worth dialling again.
        Err(e) if e.dropped_by_peer() => Err(Handshake::Dropped(e.to_string())),
        Err(source) => Err(Handshake::Failed(DdpError::Admission {
            connection: format!("store at {addr}"),
            source,
        })),
    }
}

impl NativeClient {
    /// Opens a client's session on `stream`: admission (`secret::handshake`), in which the
    /// store must prove it holds `secret` before this client proves it does.
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
        admit(addr, &stream, timeout, secret)?;
        let local = stream.local_addr().map_err(|e| fail(e.to_string()))?;
        let peer = stream.peer_addr().map_err(|e| fail(e.to_string()))?;
        let client = NativeClient {
            addr: addr.to_string(),
            peer,
            secret: secret.cloned(),
            pool: Mutex::new(Pool {
                idle: vec![stream],
                open: 1,
                waiting: 0,
                lost: false,
                reopen_at: None,
            }),
            freed: Condvar::new(),
        };
        Ok((client, local))
    }

    /// A connection of this client (see `Store::into_admitted_stream`).
    #[cfg(feature = "test-support")]
    pub(crate) fn into_stream(self) -> Option<TcpStream> {
        self.pool
            .into_inner()
            .unwrap_or_else(|p| p.into_inner())
            .idle
            .pop()
    }

    fn pool(&self) -> MutexGuard<'_, Pool> {
        crate::sync::lock(&self.pool)
    }

    /// Another admitted connection to the store, or why not.
    fn open_another(&self) -> std::result::Result<TcpStream, String> {
        let stream = TcpStream::connect_timeout(&self.peer, OPEN_TIMEOUT)
            .map_err(|e| format!("connecting: {e}"))?;
        match admit(&self.addr, &stream, OPEN_TIMEOUT, self.secret.as_ref()) {
            Ok(()) => Ok(stream),
            Err(Handshake::Dropped(why)) => Err(why),
            Err(Handshake::Failed(e)) => Err(e.to_string()),
        }
    }

    /// A connection for a request; `may_wait` for one that may wait until `deadline`. Such a
    /// request that finds no place among those that may wait before `deadline` gets a
    /// connection as a request that does not wait.
    fn lease(&self, may_wait: bool, deadline: Instant) -> Result<Lease<'_>> {
        let mut pool = self.pool();
        let mut waits = may_wait;
        loop {
            if pool.lost {
                return Err(self.error("the connection was lost earlier".into()));
            }
            let now = Instant::now();
            if waits && pool.waiting + 1 >= MAX_CONNECTIONS {
                // Every connection but one is held by a wait already.
                if now >= deadline {
                    waits = false;
                } else {
                    pool = crate::sync::wait_timeout(&self.freed, pool, deadline - now).0;
                }
                continue;
            }
            let lease = |stream| Lease {
                client: self,
                stream: Some(stream),
                broken: false,
                waits,
            };
            if let Some(stream) = pool.idle.pop() {
                pool.waiting += usize::from(waits);
                return Ok(lease(stream));
            }
            if pool.open > pool.waiting
                || pool.open >= MAX_CONNECTIONS
                || pool.reopen_at.is_some_and(|at| now < at)
            {
                // A short request gives its connection back soon (or a wait, at its end).
                pool = crate::sync::wait_timeout(&self.freed, pool, Duration::from_secs(1)).0;
                continue;
            }
            // Every open connection is held by a wait: open another.
            pool.open += 1;
            pool.waiting += usize::from(waits);
            drop(pool);
            let opened = self.open_another();
            pool = self.pool();
            match opened {
                Ok(stream) => {
                    log::debug!("store at {}: opened another connection", self.addr);
                    return Ok(lease(stream));
                }
                Err(why) => {
                    log::debug!(
                        "store at {}: cannot open another connection ({why}); waiting for one \
                         in use",
                        self.addr
                    );
                    pool.open -= 1;
                    pool.waiting -= usize::from(waits);
                    pool.reopen_at = Some(Instant::now() + REOPEN_PAUSE);
                    self.freed.notify_all();
                }
            }
        }
    }

    /// Sends the request `make(wait)` and reads its answer: `wait` is what is left of `wait`
    /// once a connection is lent, or zero if the request had to go without waiting.
    fn request(&self, wait: Duration, make: impl FnOnce(Duration) -> Request) -> Result<Response> {
        let now = Instant::now();
        // A wait of centuries ends with the process: never past what `Instant` can hold.
        let deadline = now
            .checked_add(wait)
            .unwrap_or(now + Duration::from_secs(1 << 32));
        let mut lease = self.lease(!wait.is_zero(), deadline)?;
        let wait = match lease.waits {
            true => deadline.saturating_duration_since(Instant::now()),
            false => Duration::ZERO,
        };
        let req = make(wait);
        let Some(stream) = lease.stream.as_mut() else {
            return Err(self.error("the connection was lost earlier".into()));
        };
        let exchange = |stream: &mut TcpStream| -> std::result::Result<Response, WireError> {
            stream.set_read_timeout(Some(wait.saturating_add(ANSWER_MARGIN)))?;
            write_frame(stream, &req.encode())?;
            let body = read_frame(stream, MAX_FRAME_LEN)?;
            Ok(Response::decode(&body)?)
        };
        match exchange(stream) {
            Ok(Response::Error(e)) => Err(self.error(format!("request refused: {e}"))),
            Ok(r) => Ok(r),
            Err(e) => {
                // The stream may be mid-frame: never reuse it.
                lease.broken = true;
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
        let req = |_| Request::Set {
            key: key.into(),
            value: value.into(),
        };
        match self.request(Duration::ZERO, req)? {
            Response::Ok => Ok(()),
            r => Err(self.unexpected(r)),
        }
    }

    /// The value of `key`, waiting up to `timeout` for it; `None` when it was not set in time.
    pub(crate) fn get(&self, key: &str, timeout: Duration) -> Result<Option<Vec<u8>>> {
        let req = |timeout| Request::Get {
            key: key.into(),
            timeout,
        };
        match self.request(timeout, req)? {
            Response::Value(v) => Ok(Some(v)),
            Response::Timeout(_) => Ok(None),
            r => Err(self.unexpected(r)),
        }
    }

    pub(crate) fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let req = |_| Request::Add {
            key: key.into(),
            delta,
        };
        match self.request(Duration::ZERO, req)? {
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
        let req = |_| Request::CompareSet {
            key: key.into(),
            expected: expected.into(),
            desired: desired.into(),
        };
        match self.request(Duration::ZERO, req)? {
            Response::Value(v) => Ok(v),
            r => Err(self.unexpected(r)),
        }
    }

    /// Waits up to `timeout` for every key; returns the keys still missing (empty: all set).
    pub(crate) fn wait(&self, keys: &[String], timeout: Duration) -> Result<Vec<String>> {
        let req = |timeout| Request::Wait {
            keys: keys.to_vec(),
            timeout,
        };
        match self.request(timeout, req)? {
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

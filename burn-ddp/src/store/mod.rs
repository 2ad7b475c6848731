//! Rendezvous key-value store: rank 0 serves it at `MASTER_ADDR:MASTER_PORT`, every rank is a
//! client. Ranks publish their data-plane addresses through it, agree on failures through it
//! and (with the NCCL backend) pass the NCCL unique id through it, as with PyTorch's `TCPStore`.

mod protocol;
mod server;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::Mutex;
use std::time::{Duration, Instant};

pub use server::StoreServer;

use crate::error::{DdpError, Result};
use crate::secret::JobSecret;
use crate::wire::{read_frame, write_frame};
use protocol::{HELLO, MAX_FRAME_LEN, Request, Response};

/// Extra time a client waits for an answer beyond the wait it asked the server for.
const ANSWER_MARGIN: Duration = Duration::from_secs(10);

/// A client connection to a [`StoreServer`]. Safe to share between threads (requests are
/// serialised on one connection).
pub struct Store {
    addr: String,
    local: SocketAddr,
    conn: Mutex<Option<TcpStream>>,
    timeout: Duration,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store").field("addr", &self.addr).finish()
    }
}

impl Store {
    /// Connects to the store at `addr` (`host:port`), retrying until `timeout` passes, so
    /// clients may start before the server. `timeout` is also the default wait of [`Store::get`].
    pub fn connect(addr: &str, timeout: Duration) -> Result<Self> {
        Self::connect_with_secret(addr, timeout, None)
    }

    /// As [`Store::connect`], presenting the job secret to a server that requires one.
    pub fn connect_with_secret(
        addr: &str,
        timeout: Duration,
        secret: Option<&JobSecret>,
    ) -> Result<Self> {
        let start = Instant::now();
        let deadline = start + timeout;
        let mut backoff = Duration::from_millis(20);
        let mut last_error = String::from("no address resolved");
        loop {
            let now = Instant::now();
            if now >= deadline {
                return Err(DdpError::Store {
                    addr: addr.to_string(),
                    reason: format!(
                        "not reachable within {timeout:?} (last error: {last_error}); is rank 0 \
                         running, and are MASTER_ADDR/MASTER_PORT the same on every rank?"
                    ),
                });
            }
            match addr.to_socket_addrs() {
                Err(e) => last_error = format!("cannot resolve {addr}: {e}"),
                Ok(candidates) => {
                    for sa in candidates {
                        let budget = (deadline - now).min(Duration::from_secs(2));
                        match TcpStream::connect_timeout(&sa, budget) {
                            Ok(stream) => return Self::handshake(addr, stream, timeout, secret),
                            Err(e) => last_error = e.to_string(),
                        }
                    }
                }
            }
            std::thread::sleep(backoff.min(deadline.saturating_duration_since(Instant::now())));
            backoff = (backoff * 2).min(Duration::from_millis(500));
        }
    }

    fn handshake(
        addr: &str,
        mut stream: TcpStream,
        timeout: Duration,
        secret: Option<&JobSecret>,
    ) -> Result<Self> {
        let fail = |reason: String| DdpError::Store {
            addr: addr.to_string(),
            reason,
        };
        let _ = stream.set_nodelay(true);
        stream
            .set_read_timeout(Some(timeout.min(Duration::from_secs(10))))
            .map_err(|e| fail(e.to_string()))?;
        stream
            .write_all(HELLO)
            .and_then(|_| write_frame(&mut stream, secret.map_or(&[][..], JobSecret::as_bytes)))
            .map_err(|e| fail(format!("sending hello: {e}")))?;
        let mut hello = vec![0u8; HELLO.len()];
        stream.read_exact(&mut hello).map_err(|e| {
            fail(format!(
                "no burn-ddp store answered ({e}); is another program using this port?"
            ))
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
        Ok(Store {
            addr: addr.to_string(),
            local,
            conn: Mutex::new(Some(stream)),
            timeout,
        })
    }

    /// Address of the store, as given to [`Store::connect`].
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// This side's address of the connection: the local interface that reaches rank 0.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// Default wait of [`Store::get`] and [`Store::barrier`].
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    fn request(&self, req: &Request, wait: Duration) -> Result<Response> {
        let mut guard = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        let Some(stream) = guard.as_mut() else {
            return Err(self.error("the connection was lost earlier".into()));
        };
        let exchange = |stream: &mut TcpStream| -> std::result::Result<Response, String> {
            stream
                .set_read_timeout(Some(wait + ANSWER_MARGIN))
                .map_err(|e| e.to_string())?;
            write_frame(stream, &req.encode()).map_err(|e| e.to_string())?;
            let body = read_frame(stream, MAX_FRAME_LEN).map_err(|e| e.to_string())?;
            Response::decode(&body)
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

    /// Stores `value` under `key`.
    pub fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        let req = Request::Set {
            key: key.into(),
            value: value.into(),
        };
        match self.request(&req, Duration::ZERO)? {
            Response::Ok => Ok(()),
            r => Err(self.unexpected(r)),
        }
    }

    /// Returns the value of `key`, waiting up to the store's default timeout for it.
    pub fn get(&self, key: &str) -> Result<Vec<u8>> {
        self.get_timeout(key, self.timeout)
    }

    /// Returns the value of `key`, waiting up to `timeout` for it.
    pub fn get_timeout(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        match self.try_get_timeout(key, timeout)? {
            Some(v) => Ok(v),
            None => Err(DdpError::StoreTimeout {
                addr: self.addr.clone(),
                timeout,
                what: format!("key {key:?}"),
            }),
        }
    }

    /// Returns the value of `key` if it is set now.
    pub fn try_get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        self.try_get_timeout(key, Duration::ZERO)
    }

    fn try_get_timeout(&self, key: &str, timeout: Duration) -> Result<Option<Vec<u8>>> {
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

    /// Atomically adds `delta` to the integer under `key` (absent: 0) and returns the new value.
    pub fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let req = Request::Add {
            key: key.into(),
            delta,
        };
        match self.request(&req, Duration::ZERO)? {
            Response::Int(i) => Ok(i),
            r => Err(self.unexpected(r)),
        }
    }

    /// Atomically sets `key` to `desired` if it holds `expected` (an absent key holds the empty
    /// value). Returns the value after the call: `desired` if this call won.
    pub fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>> {
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

    /// Waits until every key is set; the error lists the keys still missing.
    pub fn wait(&self, keys: &[String], timeout: Duration) -> Result<()> {
        let req = Request::Wait {
            keys: keys.to_vec(),
            timeout,
        };
        match self.request(&req, timeout)? {
            Response::Ok => Ok(()),
            Response::Timeout(missing) => Err(DdpError::StoreTimeout {
                addr: self.addr.clone(),
                timeout,
                what: format!("keys {missing:?}"),
            }),
            r => Err(self.unexpected(r)),
        }
    }

    /// Blocks until `world_size` callers have entered the barrier `name`, or `timeout` passes;
    /// the error says how many arrived. Each name is for one use.
    pub fn barrier(&self, name: &str, world_size: usize, timeout: Duration) -> Result<()> {
        let count_key = format!("barrier/{name}/count");
        let done_key = format!("barrier/{name}/done");
        if self.add(&count_key, 1)? >= world_size as i64 {
            self.set(&done_key, b"1")?;
        }
        self.wait(std::slice::from_ref(&done_key), timeout)
            .map_err(|e| match e {
                DdpError::StoreTimeout { addr, timeout, .. } => {
                    let arrived = self.add(&count_key, 0).unwrap_or(-1);
                    DdpError::StoreTimeout {
                        addr,
                        timeout,
                        what: format!("barrier {name:?}: {arrived} of {world_size} ranks arrived"),
                    }
                }
                other => other,
            })
    }
}

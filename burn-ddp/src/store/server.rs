//! The store server rank 0 hosts: a thread per client, one map, each wait registered under the
//! keys it misses (`entries`), so that a write wakes only the waits for its key.
//!
//! Connections that are not yet admitted (challenge and response, `secret::handshake`, not
//! complete) are bounded in time and number: each gets [`StoreServer::HELLO_TIMEOUT`] in all,
//! however slowly it sends, and at most [`StoreServer::MAX_PENDING`] wait at once; a newer one
//! closes the oldest.
//! Evicting the oldest rather than refusing the newest keeps the store open to real ranks
//! during a flood of silent connections (a port scan, a stray client): a rank sends its hello
//! as soon as it is connected, so it is evicted only if `MAX_PENDING` newer connections arrive
//! before the server has read it, whereas refusing the newest would shut ranks out for as
//! long as the flood lasts.

use std::collections::{HashMap, VecDeque};
use std::io::{self, BufReader, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::entries::Entries;
use super::protocol::{HELLO, MAX_FRAME_LEN, Request, Response};
use crate::error::{DdpError, Result};
use crate::secret::handshake::{self, Side};
use crate::secret::{AdmissionError, Domain, JobSecret};
use crate::wire::{DecodeError, FrameError, read_frame, write_frame};

const HELLO_TIMEOUT: Duration = StoreServer::HELLO_TIMEOUT;
const MAX_PENDING: usize = StoreServer::MAX_PENDING;

/// A running key-value store, as PyTorch's `TCPStore` server. Stops when dropped.
///
/// ```
/// use burn_ddp::store::{Store, StoreServer};
/// use std::time::Duration;
/// let server = StoreServer::bind("127.0.0.1:0").unwrap();
/// let store = Store::connect(&server.local_addr().to_string(), Duration::from_secs(5)).unwrap();
/// store.set("k", b"v").unwrap();
/// assert_eq!(store.add("n", 2).unwrap(), 2);
/// assert_eq!(store.get("k").unwrap(), b"v");
/// ```
pub struct StoreServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    accept: Option<JoinHandle<()>>,
}

struct Shared {
    map: Mutex<Entries>,
    shutdown: AtomicBool,
    conns: Mutex<Conns>,
    secret: Option<JobSecret>,
    /// Set once the pending bound was first reached (warned about once).
    flooded: AtomicBool,
}

/// The open connections (each shared with its thread, to close it from outside: one file
/// descriptor per connection) and which of them are not yet admitted, oldest first.
#[derive(Default)]
struct Conns {
    next: u64,
    open: HashMap<u64, Arc<TcpStream>>,
    pending: VecDeque<u64>,
}

impl Conns {
    /// Registers a new connection as pending; closes the oldest pending ones beyond the bound
    /// and returns how many it closed.
    fn add(&mut self, stream: &Arc<TcpStream>) -> (u64, usize) {
        let id = self.next;
        self.next += 1;
        self.open.insert(id, stream.clone());
        self.pending.push_back(id);
        let mut evicted = 0;
        while self.pending.len() > MAX_PENDING {
            if let Some(old) = self.pending.pop_front()
                && let Some(s) = self.open.get(&old)
            {
                let _ = s.shutdown(std::net::Shutdown::Both);
                evicted += 1;
            }
        }
        (id, evicted)
    }

    /// Marks `id` admitted; `false` when it was closed as the oldest pending one meanwhile.
    fn admitted(&mut self, id: u64) -> bool {
        let before = self.pending.len();
        self.pending.retain(|p| *p != id);
        self.pending.len() < before
    }

    fn closed(&mut self, id: u64) {
        self.pending.retain(|p| *p != id);
        self.open.remove(&id);
    }
}

impl Shared {
    fn conns(&self) -> MutexGuard<'_, Conns> {
        crate::sync::lock(&self.conns)
    }

    fn map(&self) -> MutexGuard<'_, Entries> {
        // A handler thread that panicked cannot leave the map half-written (every update is a
        // single insert), so a poisoned lock is still usable.
        crate::sync::lock(&self.map)
    }

    /// Waits until every one of `keys` is set (`true`), the deadline passes or the server
    /// stops; refused (a named error) when the store has too many waits open.
    fn wait_for(
        &self,
        keys: &Arc<[String]>,
        timeout: Duration,
    ) -> std::result::Result<(MutexGuard<'_, Entries>, bool), String> {
        let deadline = Instant::now() + timeout;
        let mut map = self.map();
        if timeout.is_zero() || self.shutdown.load(Ordering::Acquire) {
            let all = keys.iter().all(|k| map.contains_key(k));
            return Ok((map, all));
        }
        let wake = Arc::new(Condvar::new());
        let Some(id) = map.watch(keys, &wake)? else {
            return Ok((map, true));
        };
        loop {
            let now = Instant::now();
            if map.arrived(&id) || now >= deadline || self.shutdown.load(Ordering::Acquire) {
                break;
            }
            map = crate::sync::wait_timeout(&wake, map, deadline - now).0;
        }
        let arrived = map.arrived(&id);
        map.unwatch(id);
        Ok((map, arrived))
    }
}

impl StoreServer {
    /// How long a new connection has to complete admission (hello, then its answer to the
    /// store's challenge), in all, however slowly it sends.
    pub const HELLO_TIMEOUT: Duration = Duration::from_secs(3);
    /// Most connections waiting to be admitted at once; a newer one closes the oldest.
    pub const MAX_PENDING: usize = 64;

    /// Listens on `addr` (use port 0 for an ephemeral port) and serves every client.
    pub fn bind(addr: impl ToSocketAddrs + std::fmt::Debug) -> Result<Self> {
        Self::bind_with_secret(addr, None)
    }

    /// Listens on `addr` and serves only clients that present `secret` (everyone when `None`).
    pub fn bind_with_secret(
        addr: impl ToSocketAddrs + std::fmt::Debug,
        secret: Option<JobSecret>,
    ) -> Result<Self> {
        let shown = format!("{addr:?}").trim_matches('"').to_string();
        let listener = TcpListener::bind(&addr).map_err(|source| DdpError::Bind {
            hint: if source.kind() == std::io::ErrorKind::AddrInUse {
                " (the port is already in use: another job or a stale process holds it; \
                 choose another MASTER_PORT)"
                    .to_string()
            } else {
                String::new()
            },
            addr: shown,
            what: "rendezvous store",
            source,
        })?;
        let addr = listener
            .local_addr()
            .map_err(|e| DdpError::io("reading the store's address", e))?;
        let shared = Arc::new(Shared {
            map: Mutex::new(Entries::default()),
            shutdown: AtomicBool::new(false),
            conns: Mutex::new(Conns::default()),
            secret,
            flooded: AtomicBool::new(false),
        });
        let accept_shared = shared.clone();
        let accept = std::thread::Builder::new()
            .name("burn-ddp-store".into())
            .spawn(move || accept_loop(listener, accept_shared))
            .map_err(|e| DdpError::io("starting the store thread", e))?;
        log::debug!("store listening on {addr}");
        Ok(StoreServer {
            addr,
            shared,
            accept: Some(accept),
        })
    }

    /// The address the server listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The value of `key` now, read in this process (the launcher reads the ranks' status
    /// reports this way after a rank failed).
    pub fn value(&self, key: &str) -> Option<Vec<u8>> {
        self.shared.map().get(key).cloned()
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::Release);
        self.shared.map().wake_all();
        for (_, client) in self.shared.conns().open.drain() {
            let _ = client.shutdown(std::net::Shutdown::Both);
        }
        // Wake the accept loop with a connection of our own.
        let mut wake = self.addr;
        if wake.ip().is_unspecified() {
            wake.set_ip(std::net::Ipv4Addr::LOCALHOST.into());
        }
        if TcpStream::connect_timeout(&wake, Duration::from_secs(1)).is_ok()
            && let Some(handle) = self.accept.take()
        {
            let _ = handle.join();
        }
    }
}

/// Longest pause of the accept loop after failed accepts (out of file descriptors, say).
const MAX_ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    let mut backoff = Duration::ZERO;
    for conn in listener.incoming() {
        if shared.shutdown.load(Ordering::Acquire) {
            return;
        }
        let stream = match conn {
            Ok(s) => s,
            Err(e) => {
                // Retrying at once would spin a core while the cause (no file descriptor left,
                // no memory) lasts: back off, 1 ms doubling to 100 ms; warn once per spell.
                if backoff.is_zero() {
                    log::warn!("store: accept failed: {e}; retrying with a growing pause");
                }
                backoff = (backoff * 2).clamp(Duration::from_millis(1), MAX_ACCEPT_BACKOFF);
                std::thread::sleep(backoff);
                continue;
            }
        };
        backoff = Duration::ZERO;
        let stream = Arc::new(stream);
        let (id, evicted) = shared.conns().add(&stream);
        if evicted > 0 && !shared.flooded.swap(true, Ordering::Relaxed) {
            log::warn!(
                "store: more than {MAX_PENDING} connections have not sent a hello; closing the \
                 oldest (is something other than this job's ranks connecting to the store?)"
            );
        }
        let worker = shared.clone();
        let spawned = std::thread::Builder::new()
            .name("burn-ddp-store-client".into())
            .spawn(move || {
                let shared = worker;
                let peer = stream
                    .peer_addr()
                    .map_or_else(|_| "?".to_string(), |a| a.to_string());
                match admit(&stream, &shared, id) {
                    Err(e) if e.lacks_the_secret() => {
                        log::warn!("store: refused the connection from {peer}: {e}")
                    }
                    Err(e) => log::debug!("store: connection from {peer} not admitted: {e}"),
                    Ok(()) => {
                        if let Err(e) = serve_client(&stream, &shared) {
                            log::warn!("store: client {peer} dropped: {e}");
                        }
                    }
                }
                shared.conns().closed(id);
                let _ = stream.shutdown(std::net::Shutdown::Both);
            });
        if let Err(e) = spawned {
            log::warn!("store: cannot start a client thread: {e}");
            shared.conns().closed(id);
        }
    }
}

/// Why a connection was not admitted.
#[derive(Debug, thiserror::Error)]
enum Refusal {
    /// The handshake failed or the client does not hold the job secret.
    #[error("{0}")]
    Admission(#[from] AdmissionError),
    /// Answering the client failed.
    #[error("{0}")]
    Io(#[from] io::Error),
    /// Closed to make room for newer connections.
    #[error("closed as one of more than {MAX_PENDING} pending connections")]
    Evicted,
}

impl Refusal {
    /// Whether the client does not hold the job secret (worth a warning), rather than a
    /// connection that is not a store client at all, or was too slow.
    fn lacks_the_secret(&self) -> bool {
        matches!(
            self,
            Refusal::Admission(
                AdmissionError::NoSecret | AdmissionError::WrongProof | AdmissionError::Distrusted
            )
        )
    }
}

/// Why serving an admitted client ended other than by its close.
#[derive(Debug, thiserror::Error)]
enum ServeError {
    /// Reading a request failed.
    #[error("{0}")]
    Frame(#[from] FrameError),
    /// Writing the answer failed.
    #[error("{0}")]
    Io(#[from] io::Error),
    /// The client sent a request that does not decode (it was answered with an error).
    #[error("bad request: {0}")]
    BadRequest(DecodeError),
}

/// Runs admission (`secret::handshake`) within [`HELLO_TIMEOUT`]; `Ok` when the client
/// (connection `id`) is admitted.
fn admit(stream: &TcpStream, shared: &Shared, id: u64) -> std::result::Result<(), Refusal> {
    let _ = stream.set_nodelay(true);
    crate::liveness::watch(stream);
    let me = Side {
        domain: Domain::Store,
        magic: HELLO,
        secret: shared.secret.as_ref(),
        claims: &[],
    };
    let verified = handshake::respond(stream, &me, Instant::now() + HELLO_TIMEOUT)?;
    if !shared.conns().admitted(id) {
        return Err(Refusal::Evicted);
    }
    // Clients may stay idle for a whole training run: `admit` leaves no timeouts.
    verified.admit(stream)?;
    Ok(())
}

/// Answers an admitted client's requests until it closes the connection. Requests are read
/// through a buffer; the answers to those a client sent ahead (pipelined) go out together, once
/// no whole request is left in the buffer (or [`ANSWERS_AHEAD`] bytes of answers wait).
fn serve_client(stream: &TcpStream, shared: &Shared) -> std::result::Result<(), ServeError> {
    let (mut requests, mut out) = (BufReader::new(stream), stream);
    let mut answers = Vec::new();
    loop {
        let body = match read_frame(&mut requests, MAX_FRAME_LEN) {
            Ok(b) => b,
            Err(FrameError::Closed) => return Ok(()),
            Err(FrameError::TooLong(n)) => {
                let why = format!("bad request: frame of {n} bytes exceeds {MAX_FRAME_LEN}");
                let _ = write_frame(&mut out, &Response::Error(why).encode());
                return Err(FrameError::TooLong(n).into());
            }
            Err(e) => return Err(e.into()),
        };
        let (response, fatal) = match Request::decode(&body) {
            Ok(req) => (handle(req, shared).unwrap_or_else(Response::Error), None),
            Err(e) => (Response::Error(format!("bad request: {e}")), Some(e)),
        };
        write_frame(&mut answers, &response.encode())?;
        let ahead = requests.buffer();
        let whole = ahead.len() >= 4
            && ahead.len() - 4
                >= u32::from_le_bytes([ahead[0], ahead[1], ahead[2], ahead[3]]) as usize;
        if fatal.is_some() || !whole || answers.len() >= ANSWERS_AHEAD {
            out.write_all(&answers)?;
            answers.clear();
        }
        if let Some(e) = fatal {
            return Err(ServeError::BadRequest(e));
        }
    }
}

/// Most bytes of answers held back while a client's next request is already buffered.
const ANSWERS_AHEAD: usize = 64 << 10;

/// The answer to `req`, or why it is refused.
fn handle(req: Request, shared: &Shared) -> std::result::Result<Response, String> {
    Ok(match req {
        Request::Set { key, value } => {
            shared.map().insert(key, value)?;
            Response::Ok
        }
        Request::Get { key, timeout } => {
            let keys: Arc<[String]> = Arc::new([key]);
            let (map, ok) = shared.wait_for(&keys, timeout)?;
            match map.get(&keys[0]) {
                Some(v) if ok => Response::Value(v.clone()),
                _ => Response::Timeout(keys.to_vec()),
            }
        }
        Request::Add { key, delta } => {
            let mut map = shared.map();
            let current = match map.get(&key) {
                None => 0,
                Some(v) => std::str::from_utf8(v)
                    .ok()
                    .and_then(|s| s.parse::<i64>().ok())
                    .ok_or_else(|| format!("key {key:?} does not hold an integer"))?,
            };
            let sum = current.saturating_add(delta);
            map.insert(key, sum.to_string().into_bytes())?;
            Response::Int(sum)
        }
        Request::CompareSet {
            key,
            expected,
            desired,
        } => {
            let mut map = shared.map();
            let current = map.get(&key).cloned().unwrap_or_default();
            if current == expected {
                map.insert(key, desired.clone())?;
                Response::Value(desired)
            } else {
                Response::Value(current)
            }
        }
        Request::Wait { keys, timeout } => {
            let keys: Arc<[String]> = keys.into();
            let (map, ok) = shared.wait_for(&keys, timeout)?;
            match ok {
                true => Response::Ok,
                false => {
                    let missing = keys.iter().filter(|k| !map.contains_key(k));
                    Response::Timeout(missing.cloned().collect())
                }
            }
        }
    })
}

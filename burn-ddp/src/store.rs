//! Rendezvous key-value store: rank 0 (or `burn-ddp-run`) serves burn-ddp's own store at
//! `MASTER_ADDR:MASTER_PORT`, every rank is a client. Under torchrun the ranks instead join the
//! PyTorch c10d `TCPStore` torchrun's agent serves there ([`StoreKind::C10d`]). Ranks publish
//! their data-plane addresses through it and agree on failures through it, as with PyTorch's
//! `TCPStore` (the NCCL unique id travels over the group's own transport instead).
//!
//! The module is public because programs may use the store too, as PyTorch programs use
//! `TCPStore`: [`ProcessGroup::store`](crate::ProcessGroup::store) gives every rank the same
//! store, on which a program may set, get, add and wait for keys of its own (to pass a run id
//! from rank 0, count finished ranks, and so on). burn-ddp's own keys all start with `bddp/`;
//! keep yours out of that prefix.

mod c10d;
mod entries;
pub(crate) mod keys;
mod native;
mod protocol;
mod server;

use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

pub use server::StoreServer;

use crate::error::{DdpError, Result};
use crate::secret::JobSecret;
use c10d::C10dClient;
use native::{Handshake, NativeClient};

/// Extra time a client waits for an answer beyond the wait it asked the server for.
const ANSWER_MARGIN: Duration = Duration::from_secs(10);

/// Which kind of store a process group joins.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum StoreKind {
    /// burn-ddp's own store (served by rank 0 or `burn-ddp-run`), which checks the job secret.
    #[default]
    BurnDdp,
    /// A PyTorch c10d `TCPStore`, such as the one torchrun's agent serves. Every key is put
    /// under `namespace` (for example `burn_ddp/attempt_0/`), so that the keys of one attempt
    /// of a job restarted by torchrun never meet those of another.
    C10d {
        /// Prefix of every key.
        namespace: String,
    },
}

/// The connection a [`Store`] speaks over: burn-ddp's own protocol or PyTorch's.
enum Client {
    BurnDdp(NativeClient),
    C10d(C10dClient),
}

/// A client connection to a store: a [`StoreServer`] or a PyTorch c10d `TCPStore`. Safe to
/// share between threads: requests are serialised on one connection, except that on
/// burn-ddp's own store a request that may wait (a wait, a get with a timeout) does not hold up
/// the others (the client opens up to three more connections while such requests are pending).
pub struct Store {
    addr: String,
    local: SocketAddr,
    timeout: Duration,
    namespace: String,
    client: Client,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self.client {
            Client::BurnDdp(_) => "burn-ddp",
            Client::C10d(_) => "c10d",
        };
        f.debug_struct("Store")
            .field("addr", &self.addr)
            .field("kind", &kind)
            .field("namespace", &self.namespace)
            .finish()
    }
}

/// Pause before dialling again a store that closed a connection before its hello.
const RETRY_PAUSE: Duration = Duration::from_millis(50);

/// Opens a TCP connection to `addr`, retrying until `timeout` passes, so clients may start
/// before the server. `who` names the server in the error.
fn dial(addr: &str, timeout: Duration, who: &str) -> Result<TcpStream> {
    let deadline = Instant::now() + timeout;
    let mut backoff = Duration::from_millis(20);
    let mut last_error = String::from("no address resolved");
    loop {
        let now = Instant::now();
        if now >= deadline {
            return Err(DdpError::Store {
                addr: addr.to_string(),
                reason: format!(
                    "not reachable within {timeout:?} (last error: {last_error}); is {who} \
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
                        Ok(stream) => return Ok(stream),
                        Err(e) => last_error = e.to_string(),
                    }
                }
            }
        }
        std::thread::sleep(backoff.min(deadline.saturating_duration_since(Instant::now())));
        backoff = (backoff * 2).min(Duration::from_millis(500));
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
        let deadline = Instant::now() + timeout;
        let (client, local) = loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let stream = dial(addr, left, "rank 0")?;
            match NativeClient::handshake(addr, stream, timeout, secret) {
                Ok(session) => break session,
                Err(Handshake::Failed(e)) => return Err(e),
                Err(Handshake::Dropped(why)) if Instant::now() + RETRY_PAUSE < deadline => {
                    log::debug!("store at {addr} closed a new connection ({why}); dialling again");
                    std::thread::sleep(RETRY_PAUSE);
                }
                Err(Handshake::Dropped(why)) => {
                    return Err(DdpError::Store {
                        addr: addr.to_string(),
                        reason: format!("closed every connection until the timeout ({why})"),
                    });
                }
            }
        };
        Ok(Store {
            addr: addr.to_string(),
            local,
            timeout,
            namespace: String::new(),
            client: Client::BurnDdp(client),
        })
    }

    /// Connects to a PyTorch c10d `TCPStore` at `addr` (torchrun's agent store), putting every
    /// key under `namespace`. A Python `TCPStore` client reads key `k` as `namespace + k`.
    pub fn connect_c10d(addr: &str, timeout: Duration, namespace: &str) -> Result<Self> {
        let stream = dial(addr, timeout, "torchrun's agent store")?;
        let (client, local) = C10dClient::handshake(addr, stream, timeout)?;
        Ok(Store {
            addr: addr.to_string(),
            local,
            timeout,
            namespace: namespace.to_string(),
            client: Client::C10d(client),
        })
    }

    /// Connects to the store of `kind` at `addr`.
    pub fn connect_kind(
        kind: &StoreKind,
        addr: &str,
        timeout: Duration,
        secret: Option<&JobSecret>,
    ) -> Result<Self> {
        match kind {
            StoreKind::BurnDdp => Self::connect_with_secret(addr, timeout, secret),
            StoreKind::C10d { namespace } => Self::connect_c10d(addr, timeout, namespace),
        }
    }

    /// Address of the store, as given to [`Store::connect`].
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// This side's address of the connection: the local interface that reaches the store.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// Default wait of [`Store::get`] and [`Store::barrier`].
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The prefix of every key this client uses (empty for burn-ddp's own store).
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    fn key(&self, key: &str) -> String {
        format!("{}{key}", self.namespace)
    }

    /// Stores `value` under `key`. A key and value together above the store's frame limit
    /// (64 MiB) are refused here, before anything is sent.
    pub fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        let key = self.key(key);
        // The request frame's own fields (code, lengths) take a few bytes more.
        if key.len() + value.len() + 16 > protocol::MAX_FRAME_LEN {
            return Err(DdpError::Store {
                addr: self.addr.clone(),
                reason: format!(
                    "{key:?} with a value of {} bytes exceeds the store's limit of {} bytes per \
                     message",
                    value.len(),
                    protocol::MAX_FRAME_LEN
                ),
            });
        }
        match &self.client {
            Client::BurnDdp(c) => c.set(&key, value),
            Client::C10d(c) => c.set(&key, value),
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
        let key = self.key(key);
        match &self.client {
            Client::BurnDdp(c) => c.get(&key, timeout),
            Client::C10d(c) => c.get(&key, timeout),
        }
    }

    /// Atomically adds `delta` to the integer under `key` (absent: 0) and returns the new value.
    pub fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let key = self.key(key);
        match &self.client {
            Client::BurnDdp(c) => c.add(&key, delta),
            Client::C10d(c) => c.add(&key, delta),
        }
    }

    /// Atomically sets `key` to `desired` if it holds `expected` (an absent key holds the empty
    /// value). Returns the value after the call: `desired` if this call won.
    pub fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>> {
        let key = self.key(key);
        match &self.client {
            Client::BurnDdp(c) => c.compare_set(&key, expected, desired),
            Client::C10d(c) => c.compare_set(&key, expected, desired),
        }
    }

    /// Waits until every key is set; the error lists the keys still missing.
    pub fn wait(&self, keys: &[String], timeout: Duration) -> Result<()> {
        if keys.is_empty() {
            return Ok(());
        }
        let full: Vec<String> = keys.iter().map(|k| self.key(k)).collect();
        let missing = match &self.client {
            Client::BurnDdp(c) => c.wait(&full, timeout)?,
            Client::C10d(c) => c.wait(&full, timeout)?,
        };
        if missing.is_empty() {
            return Ok(());
        }
        let missing: Vec<&str> = missing
            .iter()
            .map(|k| k.strip_prefix(&self.namespace).unwrap_or(k))
            .collect();
        Err(DdpError::StoreTimeout {
            addr: self.addr.clone(),
            timeout,
            what: format!("keys {missing:?}"),
        })
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

    /// Not API (feature `test-support`): the connection of this admitted client, for tests
    /// that speak the store's wire protocol themselves, as a hostile client would; `None` for
    /// a c10d store or a lost connection.
    #[cfg(feature = "test-support")]
    #[doc(hidden)]
    pub fn into_admitted_stream(self) -> Option<TcpStream> {
        match self.client {
            Client::BurnDdp(c) => c.into_stream(),
            Client::C10d(_) => None,
        }
    }

    /// The secret of a group joining through this store: `given` if any; else, on a c10d
    /// store (which cannot check one), a secret the ranks agree on through it
    /// ([`Store::agree_on_secret`]); else none.
    pub(crate) fn secret_for_group(&self, given: Option<JobSecret>) -> Result<Option<JobSecret>> {
        match (given, &self.client) {
            (Some(s), _) => Ok(Some(s)),
            (None, Client::C10d(_)) => self.agree_on_secret().map(Some),
            (None, Client::BurnDdp(_)) => Ok(None),
        }
    }

    /// The job secret every rank of a group agrees on through this store: each proposes a
    /// fresh one with [`Store::compare_set`], the first proposal wins and every rank reads it.
    /// For stores that cannot check a secret themselves (c10d), so that the data plane still
    /// admits only processes that reached the store.
    pub(crate) fn agree_on_secret(&self) -> Result<JobSecret> {
        let proposal = JobSecret::generate()?;
        let agreed = self.compare_set(keys::SECRET, b"", proposal.as_bytes())?;
        JobSecret::new(agreed).map_err(|e| DdpError::Store {
            addr: self.addr.clone(),
            reason: format!(
                "the store holds an unusable job secret under {:?}: {e}",
                keys::SECRET
            ),
        })
    }
}

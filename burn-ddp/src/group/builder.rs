//! Forming a group: [`GroupOptions`] and [`ProcessGroupBuilder`], whose `build` is the
//! rendezvous (store served or joined, job secret settled, data-plane mesh connected, the
//! collective thread started).

use std::net::ToSocketAddrs;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::{Duration, Instant};

use super::ProcessGroup;
use crate::collectives::backends::Backends;
use crate::collectives::transport::host::{HostConfig, HostTransport};
use crate::collectives::transport::shm::setup::{ShmRequest, negotiate};
use crate::collectives::transport::tcp::mesh;
use crate::collectives::worker::{Limits, Queue};
use crate::env::DEFAULT_MASTER_PORT;
use crate::env::Transport;
use crate::error::{DdpError, Result};
use crate::secret::JobSecret;
use crate::status::StatusBoard;
use crate::store::{Store, StoreKind, StoreServer};

/// Options of a process group. The defaults suit training; tests shorten the timeouts.
#[derive(Debug, Clone)]
pub struct GroupOptions {
    /// Longest a collective may go without progress before it fails (default 5 minutes).
    pub timeout: Duration,
    /// Longest forming the group may take (default 5 minutes).
    pub rendezvous_timeout: Duration,
    /// Pipelining chunk of the TCP transport in bytes (default 512 KiB).
    pub chunk_bytes: usize,
    /// Largest total an `all_gather` may produce (default 1 GiB).
    pub max_gather_bytes: usize,
    /// How long a collective retries its sockets before sleeping in the poller (default 20 µs).
    /// Longer spins cut small-message latency but take a core from computation.
    pub spin: Duration,
    /// The transport of collectives (default [`Transport::Auto`]: shared memory between the
    /// ranks of a host, TCP between hosts); `BURN_DDP_TRANSPORT` from the environment.
    pub transport: Transport,
    /// Bytes of each rank's slot in the shared-memory segment (default 1 MiB); larger buffers
    /// move in rounds. A host's segment holds one slot per rank on it, plus one.
    pub shm_slot_bytes: usize,
    /// This rank's host as the transport groups ranks: ranks with the same host identity
    /// share memory, the others talk over TCP (default `None`: detected from the host name,
    /// the boot id and the network namespace). Setting it makes one machine act as several
    /// hosts, for tests and benchmarks of the hierarchical all-reduce.
    pub host_id: Option<String>,
}

impl Default for GroupOptions {
    fn default() -> Self {
        GroupOptions {
            timeout: Duration::from_secs(300),
            rendezvous_timeout: Duration::from_secs(300),
            chunk_bytes: 512 << 10,
            max_gather_bytes: 1 << 30,
            spin: Duration::from_micros(20),
            transport: Transport::Auto,
            shm_slot_bytes: 1 << 20,
            host_id: None,
        }
    }
}

/// Builds a [`ProcessGroup`] from explicit settings (for tests and self-configuring programs).
///
/// ```no_run
/// use burn_ddp::ProcessGroup;
/// use std::time::Duration;
/// let group = ProcessGroup::builder(1, 2)
///     .master_addr("127.0.0.1")
///     .master_port(29500)
///     .timeout(Duration::from_secs(30))
///     .build()
///     .unwrap();
/// ```
#[derive(Debug, Clone)]
pub struct ProcessGroupBuilder {
    rank: usize,
    world_size: usize,
    local_rank: Option<usize>,
    local_world_size: Option<usize>,
    master_addr: Option<String>,
    master_port: u16,
    host_store: Option<bool>,
    store_bind: Option<String>,
    secret: Option<JobSecret>,
    store_kind: StoreKind,
    socket_ifname: Option<String>,
    options: GroupOptions,
    /// Host tensors take the NCCL backend's plans (tests only, see `nccl_plans_on_host`).
    #[cfg(all(feature = "train", feature = "test-support"))]
    nccl_plans_on_host: bool,
}

impl ProcessGroupBuilder {
    /// A builder for rank `rank` of `world_size` with every other setting at its default.
    pub(super) fn new(rank: usize, world_size: usize) -> Self {
        ProcessGroupBuilder {
            rank,
            world_size,
            local_rank: None,
            local_world_size: None,
            master_addr: None,
            master_port: DEFAULT_MASTER_PORT,
            host_store: None,
            store_bind: None,
            secret: None,
            store_kind: StoreKind::default(),
            socket_ifname: None,
            options: GroupOptions::default(),
            #[cfg(all(feature = "train", feature = "test-support"))]
            nccl_plans_on_host: false,
        }
    }

    /// Rank among the node's processes (default: the rank).
    pub fn local_rank(mut self, local_rank: usize) -> Self {
        self.local_rank = Some(local_rank);
        self
    }
    /// Number of processes on this node (default: the world size).
    pub fn local_world_size(mut self, n: usize) -> Self {
        self.local_world_size = Some(n);
        self
    }
    /// Host of the store (required when the world size is above 1).
    pub fn master_addr(mut self, addr: impl Into<String>) -> Self {
        self.master_addr = Some(addr.into());
        self
    }
    /// Port of the store (default 29500).
    pub fn master_port(mut self, port: u16) -> Self {
        self.master_port = port;
        self
    }
    /// Whether this process serves the store. Default: rank 0 does. Set `false` on every rank
    /// when the launcher serves it (as torchrun's agent store does).
    pub fn host_store(mut self, host: bool) -> Self {
        self.host_store = Some(host);
        self
    }
    /// The host the store listens on when this process serves it (default: the interface of
    /// `master_addr`, never all interfaces unless asked, e.g. with `"0.0.0.0"`).
    pub fn store_bind(mut self, host: impl Into<String>) -> Self {
        self.store_bind = Some(host.into());
        self
    }
    /// The job secret: the store and the data plane admit only processes that prove they hold
    /// it (a challenge and response; the secret itself never crosses the wire).
    pub fn secret(mut self, secret: JobSecret) -> Self {
        self.secret = Some(secret);
        self
    }
    /// The kind of store to join (default burn-ddp's own). With [`StoreKind::C10d`] (torchrun's
    /// agent store) no rank serves one, and without a [`secret`](Self::secret) the ranks agree
    /// on one through the store before the data plane forms.
    pub fn store_kind(mut self, kind: StoreKind) -> Self {
        self.store_kind = kind;
        self
    }
    /// Collective timeout (time without progress).
    pub fn timeout(mut self, t: Duration) -> Self {
        self.options.timeout = t;
        self
    }
    /// Rendezvous timeout.
    pub fn rendezvous_timeout(mut self, t: Duration) -> Self {
        self.options.rendezvous_timeout = t;
        self
    }
    /// The network interface the data plane listens on and advertises, e.g. `"ib0"` (default:
    /// the interface whose address reaches the store; `BURN_DDP_SOCKET_IFNAME` from the env).
    pub fn socket_ifname(mut self, name: impl Into<String>) -> Self {
        self.socket_ifname = Some(name.into());
        self
    }
    /// The transport of collectives (default TCP; `Auto`: shared memory when every rank is on
    /// one host).
    pub fn transport(mut self, transport: Transport) -> Self {
        self.options.transport = transport;
        self
    }
    /// All options at once.
    pub fn options(mut self, options: GroupOptions) -> Self {
        self.options = options;
        self
    }
    /// Not API (feature `test-support`): tensors on host devices travel by the NCCL backend's
    /// plans (agreement, padding, cutting) with the host collectives in place of NCCL's calls,
    /// so that CI tests everything of the NCCL backend but those calls.
    #[cfg(all(feature = "train", feature = "test-support"))]
    #[doc(hidden)]
    pub fn nccl_plans_on_host(mut self) -> Self {
        self.nccl_plans_on_host = true;
        self
    }

    /// Forms the group: blocks until every rank has joined or the rendezvous timeout passes.
    pub fn build(self) -> Result<ProcessGroup> {
        let (rank, world_size) = (self.rank, self.world_size);
        crate::limits::raise_open_files();
        let (local_rank, local_world_size) = self.check()?;
        let deadline = Instant::now() + self.options.rendezvous_timeout;
        let (server, store_addr) = self.serve_store()?;
        let kind = if server.is_some() {
            &StoreKind::BurnDdp
        } else {
            &self.store_kind
        };
        let timeout = self.options.rendezvous_timeout;
        let store = Store::connect_kind(kind, &store_addr, timeout, self.secret.as_ref())?;
        let secret = store.secret_for_group(self.secret.clone())?;
        let (store, secret) = (Arc::new(store), secret.as_ref());
        let streams = if world_size > 1 {
            let ifname = self.socket_ifname.as_deref();
            mesh::connect(rank, world_size, &store, secret, ifname, deadline)?
        } else {
            vec![None]
        };
        let status = StatusBoard::start(rank, world_size, store.clone());
        let transport = self.host_transport(streams, &store, secret, deadline)?;
        let in_use = if transport.uses_shm() {
            Transport::Shm
        } else {
            Transport::Tcp
        };
        let limits = Limits {
            timeout: self.options.timeout,
            max_gather_bytes: self.options.max_gather_bytes,
            #[cfg(all(feature = "train", feature = "test-support"))]
            nccl_plans_on_host: self.nccl_plans_on_host,
        };
        let queue = Queue::start(
            rank,
            world_size,
            transport,
            store.clone(),
            status.cell(),
            limits,
        )?;
        let backends = Backends::new(queue);
        log::info!("rank {rank}: joined a group of {world_size} through the store at {store_addr}");
        Ok(ProcessGroup {
            rank,
            world_size,
            local_rank,
            local_world_size,
            backends,
            store,
            status,
            options: self.options,
            all_reduces: AtomicU64::new(0),
            #[cfg(feature = "train")]
            fsdp_blocks: std::sync::atomic::AtomicUsize::new(0),
            transport: in_use,
            attachments: Default::default(),
            _server: server,
        })
    }

    /// Checks the ranks and options; the local rank and local world size.
    fn check(&self) -> Result<(usize, usize)> {
        let (rank, world_size, options) = (self.rank, self.world_size, &self.options);
        if world_size == 0 || rank >= world_size {
            return Err(DdpError::InvalidConfig(format!(
                "rank {rank} is not in a world of size {world_size}"
            )));
        }
        let local_world_size = self.local_world_size.unwrap_or(world_size);
        let local_rank = self.local_rank.unwrap_or(rank % local_world_size.max(1));
        if local_rank >= local_world_size {
            return Err(DdpError::InvalidConfig(format!(
                "local rank {local_rank} is not below the local world size {local_world_size}"
            )));
        }
        if options.chunk_bytes < 8 || options.timeout.is_zero() || options.shm_slot_bytes < 64 {
            return Err(DdpError::InvalidConfig(
                "chunk_bytes must be at least 8, shm_slot_bytes at least 64 and the timeout \
                 positive"
                    .into(),
            ));
        }
        Ok((local_rank, local_world_size))
    }

    /// The store this rank serves, if it hosts it, and the address every rank connects to. A
    /// world of one needs no master: it serves itself on an ephemeral loopback port.
    fn serve_store(&self) -> Result<(Option<StoreServer>, String)> {
        let (rank, world_size, master_port) = (self.rank, self.world_size, self.master_port);
        let c10d = matches!(self.store_kind, StoreKind::C10d { .. });
        let host_store = self.host_store.unwrap_or(rank == 0 && !c10d);
        match (&self.master_addr, world_size) {
            (None, 1) => {
                let server = StoreServer::bind_with_secret("127.0.0.1:0", self.secret.clone())?;
                let addr = server.local_addr().to_string();
                Ok((Some(server), addr))
            }
            (None, _) => Err(DdpError::InvalidConfig(format!(
                "a world of size {world_size} needs master_addr (MASTER_ADDR)"
            ))),
            (Some(host), _) => {
                let addr = host_port(host, master_port);
                let server = match host_store {
                    true => Some(self.bind_store(host)?),
                    false => None,
                };
                Ok((server, addr))
            }
        }
    }

    /// Serves the store on `master_host` (or `BURN_DDP_STORE_BIND`'s host) and the master port.
    fn bind_store(&self, master_host: &String) -> Result<StoreServer> {
        let (var, bind_host) = match &self.store_bind {
            Some(b) => (crate::env::STORE_BIND_VAR, b),
            None => ("MASTER_ADDR", master_host),
        };
        let resolved = host_port(bind_host, self.master_port)
            .to_socket_addrs()
            .map_err(|e| DdpError::InvalidEnv {
                var,
                value: bind_host.clone(),
                expected: format!("a host name or address that resolves ({e})"),
            })?;
        let candidates: Vec<_> = resolved.collect();
        let server = StoreServer::bind_with_secret(&candidates[..], self.secret.clone());
        server.map_err(|e| match e {
            DdpError::Bind {
                addr,
                what,
                source,
                hint,
            } => DdpError::Bind {
                addr,
                what,
                source,
                hint: format!("{hint} (set by MASTER_ADDR/MASTER_PORT)"),
            },
            other => other,
        })
    }

    /// The host transport over the connected `streams`, on shared memory where the ranks
    /// agree it serves them.
    fn host_transport(
        &self,
        streams: Vec<Option<std::net::TcpStream>>,
        store: &Store,
        secret: Option<&JobSecret>,
        deadline: Instant,
    ) -> Result<HostTransport> {
        let (rank, world_size, options) = (self.rank, self.world_size, &self.options);
        let mut transport = HostTransport::new(
            rank,
            world_size,
            streams,
            HostConfig {
                timeout: options.timeout,
                chunk_bytes: options.chunk_bytes,
                max_gather_bytes: options.max_gather_bytes,
                spin: options.spin,
            },
        )?;
        if world_size > 1 {
            let request = ShmRequest {
                rank,
                world: world_size,
                mode: options.transport,
                port: self.master_port,
                slot_bytes: options.shm_slot_bytes,
                timeout: options.timeout,
                spin: options.spin,
                host: options.host_id.clone(),
                secret: secret.cloned(),
            };
            if let Some(setup) = negotiate(&request, store, deadline)? {
                transport.use_shm(setup);
            }
        }
        Ok(transport)
    }
}

fn host_port(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

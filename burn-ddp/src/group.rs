//! The process group: who this process is, who its peers are, and the collectives between them.
//!
//! Forming a group is the rendezvous: rank 0 serves the store at `MASTER_ADDR:MASTER_PORT`,
//! every rank connects to it (retrying until the rendezvous timeout, so rank 0 may start last),
//! the ranks exchange data-plane addresses through it and connect to each other. Collectives
//! then run on a background thread, one at a time, in the order they were issued; each call
//! returns a [`Work`] to wait on.

use std::net::ToSocketAddrs;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Sender};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::collectives::tcp::{TcpConfig, TcpTransport, mesh};
use crate::collectives::{DataType, Reduce, ReduceOp, Work};
use crate::env::{DEFAULT_MASTER_PORT, LaunchEnv};
use crate::error::{DdpError, Result};
use crate::failure::FailureRecord;
use crate::secret::JobSecret;
use crate::status::StatusBoard;
use crate::store::{Store, StoreKind, StoreServer};

mod init;
pub use init::{init_process_group, init_process_group_with};

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
}

impl Default for GroupOptions {
    fn default() -> Self {
        GroupOptions {
            timeout: Duration::from_secs(300),
            rendezvous_timeout: Duration::from_secs(300),
            chunk_bytes: 512 << 10,
            max_gather_bytes: 1 << 30,
            spin: Duration::from_micros(20),
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
}

impl ProcessGroupBuilder {
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
    /// The job secret: the store and the data plane admit only processes that present it.
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
    /// All options at once.
    pub fn options(mut self, options: GroupOptions) -> Self {
        self.options = options;
        self
    }

    /// Forms the group: blocks until every rank has joined or the rendezvous timeout passes.
    pub fn build(self) -> Result<ProcessGroup> {
        let ProcessGroupBuilder {
            rank,
            world_size,
            master_port,
            options,
            ..
        } = self;
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
        if options.chunk_bytes < 8 || options.timeout.is_zero() {
            return Err(DdpError::InvalidConfig(
                "chunk_bytes must be at least 8 and the timeout positive".into(),
            ));
        }
        let c10d = matches!(self.store_kind, StoreKind::C10d { .. });
        let host_store = self.host_store.unwrap_or(rank == 0 && !c10d);
        let deadline = Instant::now() + options.rendezvous_timeout;

        // A world of one needs no master: it serves itself on an ephemeral loopback port.
        let (server, store_addr) = match (&self.master_addr, world_size) {
            (None, 1) => {
                let server = StoreServer::bind_with_secret("127.0.0.1:0", self.secret.clone())?;
                let addr = server.local_addr().to_string();
                (Some(server), addr)
            }
            (None, _) => {
                return Err(DdpError::InvalidConfig(format!(
                    "a world of size {world_size} needs master_addr (MASTER_ADDR)"
                )));
            }
            (Some(host), _) => {
                let addr = host_port(host, master_port);
                let server = if host_store {
                    let (var, bind_host) = match &self.store_bind {
                        Some(b) => (crate::env::STORE_BIND_VAR, b),
                        None => ("MASTER_ADDR", host),
                    };
                    let resolved = host_port(bind_host, master_port)
                        .to_socket_addrs()
                        .map_err(|e| DdpError::InvalidEnv {
                            var,
                            value: bind_host.clone(),
                            expected: format!("a host name or address that resolves ({e})"),
                        })?;
                    let candidates: Vec<_> = resolved.collect();
                    let server =
                        StoreServer::bind_with_secret(&candidates[..], self.secret.clone());
                    Some(server.map_err(|e| match e {
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
                    })?)
                } else {
                    None
                };
                (server, addr)
            }
        };

        let kind = if server.is_some() {
            &StoreKind::BurnDdp
        } else {
            &self.store_kind
        };
        let timeout = options.rendezvous_timeout;
        let store = Store::connect_kind(kind, &store_addr, timeout, self.secret.as_ref())?;
        let secret = store.secret_for_group(self.secret)?;
        let (store, secret) = (Arc::new(store), secret.as_ref());
        let streams = if world_size > 1 {
            let ifname = self.socket_ifname.as_deref();
            mesh::connect(rank, world_size, &store, secret, ifname, deadline)?
        } else {
            vec![None]
        };
        let status = StatusBoard::start(rank, world_size, store.clone());
        let transport = TcpTransport::new(
            rank,
            world_size,
            streams,
            store.clone(),
            status.cell(),
            TcpConfig {
                timeout: options.timeout,
                chunk_bytes: options.chunk_bytes,
                max_gather_bytes: options.max_gather_bytes,
                spin: options.spin,
            },
        )?;
        let (jobs, rx) = mpsc::channel::<Job>();
        let worker = std::thread::Builder::new()
            .name(format!("burn-ddp-rank{rank}"))
            .spawn(move || {
                let mut transport = transport;
                for job in rx {
                    job(&mut transport);
                }
                transport.leave();
            })
            .map_err(|e| DdpError::io("starting the collective thread", e))?;
        log::info!("rank {rank}: joined a group of {world_size} through the store at {store_addr}");
        Ok(ProcessGroup {
            rank,
            world_size,
            local_rank,
            local_world_size,
            store,
            status,
            options,
            jobs: Some(jobs),
            worker: Some(worker),
            all_reduces: AtomicU64::new(0),
            _server: server,
        })
    }
}

fn host_port(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

type Job = Box<dyn FnOnce(&mut TcpTransport) + Send>;

/// A connected group of ranks, as PyTorch's default process group. In a world of one,
/// collectives complete at once on the calling thread.
///
/// ```no_run
/// // Run under `burn-ddp-run --nproc 2 ...`, torchrun, srun or mpirun:
/// let group = burn_ddp::init_process_group().unwrap();
/// let summed = group
///     .all_reduce(vec![group.rank() as f32; 4], burn_ddp::ReduceOp::Sum)
///     .wait()
///     .unwrap();
/// println!("rank {} of {}: {summed:?}", group.rank(), group.world_size());
/// ```
pub struct ProcessGroup {
    rank: usize,
    world_size: usize,
    local_rank: usize,
    local_world_size: usize,
    store: Arc<Store>,
    status: StatusBoard,
    options: GroupOptions,
    jobs: Option<Sender<Job>>,
    worker: Option<JoinHandle<()>>,
    all_reduces: AtomicU64,
    _server: Option<StoreServer>,
}

impl std::fmt::Debug for ProcessGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProcessGroup")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("local_rank", &self.local_rank)
            .finish()
    }
}

impl ProcessGroup {
    /// A builder for rank `rank` of `world_size`.
    pub fn builder(rank: usize, world_size: usize) -> ProcessGroupBuilder {
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
        }
    }

    /// Forms the group described by the process environment. A failure is also written to
    /// torchrun's error file, when there is one ([`crate::elastic::record_error`]).
    pub fn from_env() -> Result<Self> {
        Self::from_env_with(GroupOptions::default())
    }

    /// Forms the group described by `env`.
    pub fn from_launch_env(env: &LaunchEnv) -> Result<Self> {
        Self::builder_from_env(env, GroupOptions::default()).build()
    }

    /// The builder of the group `env` describes, with `options` under the environment's
    /// settings (`BURN_DDP_TIMEOUT` and `BURN_DDP_RENDEZVOUS_TIMEOUT` replace their timeouts).
    /// The one mapping from launcher variables to a group: every way of forming a group from
    /// the environment goes through it.
    pub fn builder_from_env(env: &LaunchEnv, options: GroupOptions) -> ProcessGroupBuilder {
        let mut b = Self::builder(env.rank, env.world_size)
            .options(options)
            .local_rank(env.local_rank)
            .local_world_size(env.local_world_size)
            .master_port(env.master_port);
        if let Some(addr) = &env.master_addr {
            b = b.master_addr(addr.clone());
        }
        if let Some(t) = env.timeout {
            b = b.timeout(t);
        }
        if let Some(t) = env.rendezvous_timeout {
            b = b.rendezvous_timeout(t);
        }
        if let Some(s) = &env.secret {
            b = b.secret(s.clone());
        }
        if let Some(host) = &env.store_bind {
            b = b.store_bind(host.clone());
        }
        if env.agent_store {
            b = b.host_store(false);
        }
        b = b.store_kind(env.store_kind.clone());
        if let Some(name) = &env.socket_ifname {
            b = b.socket_ifname(name.clone());
        }
        b
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }
    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.world_size
    }
    /// Rank on this node (selects the GPU).
    pub fn local_rank(&self) -> usize {
        self.local_rank
    }
    /// Ranks on this node.
    pub fn local_world_size(&self) -> usize {
        self.local_world_size
    }
    /// The rendezvous store (shared by all ranks).
    pub fn store(&self) -> &Arc<Store> {
        &self.store
    }
    /// This rank's status (phase, epoch, step, activity), published for failure reports.
    pub fn status(&self) -> &StatusBoard {
        &self.status
    }
    /// How many all-reduces this rank has issued (for checking communication volume).
    pub fn all_reduce_count(&self) -> u64 {
        self.all_reduces.load(Ordering::Relaxed)
    }

    /// The options the group was formed with.
    pub fn options(&self) -> &GroupOptions {
        &self.options
    }

    fn submit<T: Send + 'static>(
        &self,
        job: impl FnOnce(&mut TcpTransport) -> Result<T> + Send + 'static,
    ) -> Work<T> {
        let (tx, rx) = mpsc::sync_channel(1);
        let boxed: Job = Box::new(move |t| {
            let _ = tx.send(job(t));
        });
        match self.jobs.as_ref().map(|j| j.send(boxed)) {
            Some(Ok(())) => Work::pending(self.rank, rx),
            _ => Work::done(self.rank, Err(DdpError::WorkerGone { rank: self.rank })),
        }
    }

    /// Starts an all-reduce of `data`; [`Work::wait`] returns the reduced buffer, identical on
    /// every rank. Every rank must pass a buffer of the same length and type.
    pub fn all_reduce<T: Reduce>(&self, mut data: Vec<T>, op: ReduceOp) -> Work<Vec<T>> {
        self.all_reduces.fetch_add(1, Ordering::Relaxed);
        if self.world_size == 1 {
            return Work::done(self.rank, Ok(data));
        }
        self.submit(move |t| t.all_reduce(&mut data, op).map(|()| data))
    }

    /// Starts a broadcast: every rank's buffer becomes `root`'s. Lengths must match.
    pub fn broadcast<T: DataType>(&self, mut data: Vec<T>, root: usize) -> Work<Vec<T>> {
        if self.world_size == 1 && root == 0 {
            return Work::done(self.rank, Ok(data));
        }
        self.submit(move |t| t.broadcast(&mut data, root).map(|()| data))
    }

    /// Starts an all-gather of byte buffers (lengths may differ); the result is indexed by rank.
    pub fn all_gather(&self, data: Vec<u8>) -> Work<Vec<Vec<u8>>> {
        if self.world_size == 1 && data.len() <= self.options.max_gather_bytes {
            return Work::done(self.rank, Ok(vec![data]));
        }
        self.submit(move |t| t.all_gather(&data))
    }

    /// Starts a barrier: completes once every rank has reached it.
    pub fn barrier(&self) -> Work<()> {
        if self.world_size == 1 {
            return Work::done(self.rank, Ok(()));
        }
        self.submit(|t| t.barrier())
    }
}

impl ProcessGroup {
    /// Stops the group on every rank for `reason` (for failures found above the collectives,
    /// such as ranks reducing different steps): the reason becomes the group's recorded failure
    /// unless another was recorded first, this rank's connections close, and the peers' next
    /// collectives fail with it. Returns the agreed cause.
    pub fn abort(&self, reason: &str) -> String {
        let record = FailureRecord {
            culprit: None,
            cause: reason.to_string(),
        };
        let cause = self
            .submit(move |t| Ok(t.abort(record)))
            .wait()
            .unwrap_or_else(|e| e.to_string());
        crate::elastic::record_error_with(|| {
            format!(
                "rank {}: stopped the group: {cause}; where the ranks were: {}",
                self.rank,
                self.status.report()
            )
        });
        cause
    }

    /// The group's recorded failure, if any rank recorded one (read from the store).
    pub fn recorded_failure(&self) -> Option<String> {
        FailureRecord::read(&self.store).map(|r| r.cause)
    }
}

impl Drop for ProcessGroup {
    /// Lets queued collectives finish (each bounded by the timeout), tells the peers this rank
    /// leaves, and stops the store if this rank serves it. Dropped while the thread panics, the
    /// group is aborted instead, and the peers learn that this rank panicked and where.
    fn drop(&mut self) {
        if std::thread::panicking() && self.world_size > 1 {
            let record = FailureRecord {
                culprit: Some(self.rank),
                cause: format!(
                    "rank {} panicked while {}",
                    self.rank,
                    self.status.current()
                ),
            };
            crate::elastic::record_error(&record.cause);
            let _ = self.submit(move |t| Ok(t.abort(record)));
        }
        self.jobs.take();
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}

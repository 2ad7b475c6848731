//! Connects every pair of ranks once: each rank listens on an ephemeral port of the interface
//! that reaches rank 0 (or of the interface named by `BURN_DDP_SOCKET_IFNAME`), publishes it
//! through the store, connects to lower ranks and accepts higher ones. Each connection opens
//! with admission (`secret::handshake`, domain data plane) whose claims are the rank and the
//! world size of each side: both prove they hold the job secret without sending it, and a
//! connection is used only once both are admitted and the ranks are the expected ones.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use crate::error::{DdpError, Result};
use crate::secret::handshake::{self, Side};
use crate::secret::{Domain, JobSecret};
use crate::status::name_ranks;
use crate::store::Store;
use crate::wire::{Reader, Writer};

mod accept;
mod iface;

/// First bytes of every data-plane connection, both directions (`3`: challenge-response).
const MAGIC: &[u8; 8] = b"BDDPMSH3";
/// Kernel socket buffers of data-plane connections (the kernel may cap or double it).
const SOCKET_BUFFER: usize = 4 << 20;
/// Longest a single admission may take (a silent connection holds the accepting rank this long).
const ADMISSION_TIMEOUT: Duration = Duration::from_secs(10);

/// This side of a data-plane admission: claims `rank` of `world`.
fn side<'a>(claims: &'a [u8], secret: Option<&'a JobSecret>) -> Side<'a> {
    Side {
        domain: Domain::DataPlane,
        magic: MAGIC,
        secret,
        claims,
    }
}

fn claims(rank: usize, world: usize) -> Vec<u8> {
    let mut w = Writer::default();
    w.u32(rank as u32).u32(world as u32);
    w.buf
}

/// The rank and world size a peer claims; `None` when its claims do not decode.
fn parse_claims(b: &[u8]) -> Option<(usize, usize)> {
    let mut r = Reader::new(b);
    let parsed = (r.u32().ok()? as usize, r.u32().ok()? as usize);
    r.finish().ok()?;
    Some(parsed)
}

fn addr_key(rank: usize) -> String {
    crate::store::keys::mesh_addr(rank)
}

/// Claims `rank` in the store, so that a second process started with the same rank stops at
/// once with an error naming the rank and the process that has it.
fn claim_rank(rank: usize, world: usize, store: &Store) -> Result<()> {
    static CLAIMS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = CLAIMS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let me = format!(
        "process {} at {} (claim {n})",
        std::process::id(),
        store.local_addr().ip()
    );
    let owner = store.compare_set(&crate::store::keys::mesh_claim(rank), b"", me.as_bytes())?;
    if owner != me.as_bytes() {
        return Err(DdpError::Rendezvous {
            rank,
            reason: format!(
                "rank {rank} is already taken by {}: two processes were started with RANK={rank} \
                 (each of the {world} ranks must be given once)",
                String::from_utf8_lossy(&owner)
            ),
        });
    }
    Ok(())
}

/// Listens on `addr` with the longest accept queue the kernel allows (`somaxconn`), so a flood
/// of connections fills no queue in which a rank's connection would be dropped (and dialled
/// again only after the kernel's one-second retransmission).
fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    use socket2::{Domain, Socket, Type};
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, None)?;
    socket.bind(&addr.into())?;
    socket.listen(i32::MAX)?;
    Ok(socket.into())
}

/// Returns one connected stream per peer (`None` at `rank`), ready for the data plane.
/// `ifname` names the network interface to listen on and advertise (default: the one whose
/// address reaches the store).
pub(crate) fn connect(
    rank: usize,
    world: usize,
    store: &Store,
    secret: Option<&JobSecret>,
    ifname: Option<&str>,
    deadline: Instant,
) -> Result<Vec<Option<TcpStream>>> {
    let mesh = Mesh {
        rank,
        world,
        store,
        secret,
        deadline,
        mine: claims(rank, world),
    };
    let listener = mesh.listen(ifname)?;
    mesh.wait_for_addresses()?;
    let mut peers: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
    for (peer, slot) in peers.iter_mut().enumerate().take(rank) {
        *slot = Some(mesh.connect_to(peer)?);
    }
    mesh.accept_higher(&listener, &mut peers)?;
    for stream in peers.iter().flatten() {
        crate::liveness::watch(stream);
        let sock = socket2::SockRef::from(stream);
        stream
            .set_nodelay(true)
            .and_then(|_| stream.set_read_timeout(None))
            .and_then(|_| sock.set_send_buffer_size(SOCKET_BUFFER))
            .and_then(|_| sock.set_recv_buffer_size(SOCKET_BUFFER))
            .map_err(|e| DdpError::io("configuring a data-plane socket", e))?;
    }
    Ok(peers)
}

/// One rank's part of connecting the mesh.
struct Mesh<'a> {
    rank: usize,
    world: usize,
    store: &'a Store,
    secret: Option<&'a JobSecret>,
    deadline: Instant,
    /// This rank's claims (its rank and the world size).
    mine: Vec<u8>,
}

impl Mesh<'_> {
    fn fail(&self, reason: String) -> DdpError {
        DdpError::Rendezvous {
            rank: self.rank,
            reason,
        }
    }

    /// Claims the rank, listens on the interface's address and publishes it.
    fn listen(&self, ifname: Option<&str>) -> Result<TcpListener> {
        let (rank, store) = (self.rank, self.store);
        let ip = match ifname {
            Some(name) => iface::interface_addr(name, store.local_addr().ip())?,
            None => store.local_addr().ip(),
        };
        claim_rank(rank, self.world, store)?;
        let listener = bind(SocketAddr::new(ip, 0)).map_err(|source| DdpError::Bind {
            addr: format!("{ip}:0"),
            what: "data plane",
            hint: String::new(),
            source,
        })?;
        let own = listener
            .local_addr()
            .map_err(|e| DdpError::io("reading the data-plane address", e))?;
        store.set(&addr_key(rank), own.to_string().as_bytes())?;
        Ok(listener)
    }

    /// Waits until every rank published its address, naming those that did not.
    fn wait_for_addresses(&self) -> Result<()> {
        let (world, store) = (self.world, self.store);
        let keys: Vec<String> = (0..world).map(addr_key).collect();
        let remaining = self.deadline.saturating_duration_since(Instant::now());
        store.wait(&keys, remaining).map_err(|e| match e {
            DdpError::StoreTimeout { .. } => {
                let missing: Vec<usize> = (0..world)
                    .filter(|r| store.try_get(&addr_key(*r)).ok().flatten().is_none())
                    .collect();
                self.fail(format!(
                    "{} did not join within {remaining:?}; did they start, with the same \
                     MASTER_ADDR, MASTER_PORT and WORLD_SIZE={world}?",
                    name_ranks(&missing)
                ))
            }
            other => other,
        })
    }

    /// Connects to lower rank `peer` at its published address, through admission. A peer
    /// that closes the connection before its verdict (it sheds connections under a flood, see
    /// `accept`) is dialled again, with a growing pause, until the deadline.
    fn connect_to(&self, peer: usize) -> Result<TcpStream> {
        let raw = self.store.get(&addr_key(peer))?;
        let addr: SocketAddr = String::from_utf8_lossy(&raw)
            .parse()
            .map_err(|_| self.fail(format!("rank {peer} published a bad address {raw:?}")))?;
        let mut pause = Duration::from_millis(1);
        let mut dropped = 0usize;
        loop {
            match self.dial(peer, addr)? {
                Ok(stream) => {
                    if dropped > 0 {
                        log::info!(
                            "rank {}: admitted by rank {peer} after {dropped} connections it \
                             dropped (it was shedding connections)",
                            self.rank
                        );
                    }
                    return Ok(stream);
                }
                Err(e) if Instant::now() + pause < self.deadline => {
                    dropped += 1;
                    log::debug!(
                        "rank {}: rank {peer} dropped the connection: {e}",
                        self.rank
                    );
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(Duration::from_millis(50));
                }
                Err(e) => {
                    return Err(DdpError::Admission {
                        connection: format!(
                            "rank {}: data plane of rank {peer} at {addr} (dropped {} times)",
                            self.rank,
                            dropped + 1
                        ),
                        source: e,
                    });
                }
            }
        }
    }

    /// One connection to `peer` at `addr` through admission: the stream, `Ok(Err)` when the
    /// peer dropped it before its verdict (worth dialling again), or the error that stops.
    fn dial(
        &self,
        peer: usize,
        addr: SocketAddr,
    ) -> Result<std::result::Result<TcpStream, handshake::AdmissionError>> {
        let (rank, world) = (self.rank, self.world);
        let left = (self.deadline)
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(1));
        let stream = TcpStream::connect_timeout(&addr, left)
            .map_err(|e| self.fail(format!("cannot connect to rank {peer} at {addr}: {e}")))?;
        let _ = stream.set_nodelay(true);
        let until = self.deadline.min(Instant::now() + ADMISSION_TIMEOUT);
        let side = side(&self.mine, self.secret);
        let answer = match handshake::initiate(&stream, &side, until) {
            Ok(answer) => answer,
            Err(e) if e.dropped_by_peer() => return Ok(Err(e)),
            Err(source) => {
                return Err(DdpError::Admission {
                    connection: format!("rank {rank}: data plane of rank {peer} at {addr}"),
                    source,
                });
            }
        };
        match parse_claims(&answer) {
            Some((r, w)) if r == peer && w == world => Ok(Ok(stream)),
            Some((r, w)) => Err(self.fail(format!(
                "{addr} answered as rank {r} of {w}, expected rank {peer} of {world}"
            ))),
            None => Err(self.fail(format!("{addr} (rank {peer}) sent malformed claims"))),
        }
    }
}

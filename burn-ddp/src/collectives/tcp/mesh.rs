//! Connects every pair of ranks once: each rank listens on an ephemeral port of the interface
//! that reaches rank 0 (or of the interface named by `BURN_DDP_SOCKET_IFNAME`), publishes it
//! through the store, connects to lower ranks and accepts higher ones. Each connection opens
//! with admission (`secret::handshake`, domain data plane) whose claims are the rank and the
//! world size of each side: both prove they hold the job secret without sending it, and a
//! connection is used only once both are admitted and the ranks are the expected ones.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::mpsc::Sender;
use std::time::{Duration, Instant};

use crate::error::{DdpError, Result};
use crate::secret::handshake::{self, Side};
use crate::secret::{Domain, JobSecret};
use crate::status::name_ranks;
use crate::store::Store;
use crate::wire::{Reader, Writer};

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

/// A connection that passed admission, with where it came from.
type Admitted = (TcpStream, SocketAddr, handshake::Verified);

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
        let listener = TcpListener::bind((ip, 0)).map_err(|source| DdpError::Bind {
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

    /// Connects to lower rank `peer` at its published address, through admission.
    fn connect_to(&self, peer: usize) -> Result<TcpStream> {
        let (rank, world) = (self.rank, self.world);
        let raw = self.store.get(&addr_key(peer))?;
        let addr: SocketAddr = String::from_utf8_lossy(&raw)
            .parse()
            .map_err(|_| self.fail(format!("rank {peer} published a bad address {raw:?}")))?;
        let left = (self.deadline)
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(1));
        let stream = TcpStream::connect_timeout(&addr, left)
            .map_err(|e| self.fail(format!("cannot connect to rank {peer} at {addr}: {e}")))?;
        let _ = stream.set_nodelay(true);
        let until = self.deadline.min(Instant::now() + ADMISSION_TIMEOUT);
        let side = side(&self.mine, self.secret);
        let answer =
            handshake::initiate(&stream, &side, until).map_err(|source| DdpError::Admission {
                connection: format!("rank {rank}: data plane of rank {peer} at {addr}"),
                source,
            })?;
        match parse_claims(&answer) {
            Some((r, w)) if r == peer && w == world => Ok(stream),
            Some((r, w)) => Err(self.fail(format!(
                "{addr} answered as rank {r} of {w}, expected rank {peer} of {world}"
            ))),
            None => Err(self.fail(format!("{addr} (rank {peer}) sent malformed claims"))),
        }
    }

    /// Accepts the higher ranks until each is connected. Each connection's admission runs on
    /// a thread of its own, so silent or slow connections (a port scan, a stray) cannot hold
    /// up the ranks behind them; connections that fail admission are refused without stopping
    /// the group, an admitted peer that does not fit stops it.
    fn accept_higher(&self, listener: &TcpListener, peers: &mut [Option<TcpStream>]) -> Result<()> {
        let (rank, world) = (self.rank, self.world);
        listener
            .set_nonblocking(true)
            .map_err(|e| DdpError::io("configuring the data-plane listener", e))?;
        let (done, admitted) = std::sync::mpsc::channel();
        // A clone of each connection still in admission, to close it once no longer needed.
        let mut pending: Vec<TcpStream> = Vec::new();
        let mut expected = world - 1 - rank;
        let outcome = loop {
            if expected == 0 {
                break Ok(());
            }
            match listener.accept() {
                Ok((stream, from)) => {
                    if let Ok(clone) = stream.try_clone() {
                        pending.push(clone);
                    }
                    self.start_admission(stream, from, done.clone());
                    continue;
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) => break Err(DdpError::io("accepting a peer", e)),
            }
            match admitted.recv_timeout(Duration::from_millis(1)) {
                Ok((stream, from, verified)) => match self.place(&stream, from, verified, peers) {
                    Ok(Some(peer)) => {
                        peers[peer] = Some(stream);
                        expected -= 1;
                    }
                    Ok(None) => {}
                    Err(e) => break Err(e),
                },
                Err(_) if Instant::now() >= self.deadline => {
                    let missing: Vec<usize> =
                        (rank + 1..world).filter(|r| peers[*r].is_none()).collect();
                    break Err(self.fail(format!(
                        "{} published an address but never connected",
                        name_ranks(&missing)
                    )));
                }
                Err(_) => {}
            }
        };
        // Connections still in admission are not the job's ranks (or no longer needed).
        for stream in pending {
            let admitted_peer = peers.iter().flatten().any(|p| {
                p.peer_addr().ok() == stream.peer_addr().ok() && stream.peer_addr().is_ok()
            });
            if !admitted_peer {
                let _ = stream.shutdown(std::net::Shutdown::Both);
            }
        }
        outcome
    }

    /// Runs admission on a connection from `from` on a thread of its own (bounded by
    /// [`ADMISSION_TIMEOUT`]); an admitted connection is sent to `done`, a refused one logged.
    fn start_admission(&self, stream: TcpStream, from: SocketAddr, done: Sender<Admitted>) {
        let (rank, mine, secret) = (self.rank, self.mine.clone(), self.secret.cloned());
        let until = self.deadline.min(Instant::now() + ADMISSION_TIMEOUT);
        let spawned = std::thread::Builder::new()
            .name(format!("burn-ddp-admit{rank}"))
            .spawn(move || {
                let admission = stream
                    .set_nonblocking(false)
                    .map_err(|source| handshake::AdmissionError::Io {
                        step: "configuring the socket",
                        source,
                    })
                    .and_then(|_| {
                        handshake::respond(&stream, &side(&mine, secret.as_ref()), until)
                    });
                match admission {
                    Ok(verified) => {
                        let _ = done.send((stream, from, verified));
                    }
                    Err(e) => {
                        log::warn!("rank {rank}: refused a data-plane connection from {from}: {e}")
                    }
                }
            });
        if let Err(e) = spawned {
            log::warn!("rank {rank}: cannot admit a data-plane connection from {from}: {e}");
        }
    }

    /// Places an admitted connection: the peer it turned out to be, `None` when its claims do
    /// not decode (refused), or the error of a peer that does not fit.
    fn place(
        &self,
        stream: &TcpStream,
        from: SocketAddr,
        verified: handshake::Verified,
        peers: &[Option<TcpStream>],
    ) -> Result<Option<usize>> {
        let (rank, world) = (self.rank, self.world);
        // Only an admitted peer's claims can stop the group.
        let Some((peer, w)) = parse_claims(&verified.claims) else {
            log::warn!("rank {rank}: refused a data-plane connection from {from}: bad claims");
            verified.refuse(stream, "malformed claims");
            return Ok(None);
        };
        let problem = if w != world {
            Some(format!(
                "a peer at {from} believes WORLD_SIZE={w}, this rank has {world}"
            ))
        } else if peer <= rank || peer >= world {
            Some(format!("unexpected connection from rank {peer} at {from}"))
        } else if peers[peer].is_some() {
            Some(format!(
                "rank {peer} joined twice (second time from {from}): two processes have \
                 RANK={peer}"
            ))
        } else {
            None
        };
        if let Some(reason) = problem {
            verified.refuse(stream, &format!("rank {rank}: {reason}"));
            return Err(self.fail(reason));
        }
        verified
            .admit(stream)
            .map_err(|e| self.fail(format!("cannot answer rank {peer}: {e}")))?;
        Ok(Some(peer))
    }
}

//! Connects every pair of ranks once: each rank listens on an ephemeral port of the interface
//! that reaches rank 0 (or of the interface named by `BURN_DDP_SOCKET_IFNAME`), publishes it
//! through the store, connects to lower ranks and accepts higher ones. Each connection starts
//! with a hello naming the rank and world size, followed by the job secret; both sides check
//! the other's.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use crate::error::{DdpError, Result};
use crate::secret::{JobSecret, MAX_SECRET_LEN, admits};
use crate::store::Store;
use crate::wire::{DecodeError, FrameError, Reader, Writer, read_frame, write_frame};

mod iface;

const HELLO_MAGIC: &[u8; 8] = b"BDDPMESH";
const HELLO_LEN: usize = 16;
/// Kernel socket buffers of data-plane connections (the kernel may cap or double it).
const SOCKET_BUFFER: usize = 4 << 20;

/// Sends this rank's hello: magic, rank, world size, then the secret as a frame.
fn send_hello(
    stream: &mut TcpStream,
    rank: usize,
    world: usize,
    secret: Option<&JobSecret>,
) -> std::io::Result<()> {
    let mut w = Writer::default();
    w.buf.extend_from_slice(HELLO_MAGIC);
    w.u32(rank as u32).u32(world as u32);
    stream.write_all(&w.buf)?;
    write_frame(stream, secret.map_or(&[][..], JobSecret::as_bytes))
}

/// Why a connection's hello was refused.
#[derive(Debug, thiserror::Error)]
enum HelloError {
    /// The socket failed.
    #[error("{0}")]
    Io(#[from] std::io::Error),
    /// The secret's frame could not be read.
    #[error("{0}")]
    Frame(#[from] FrameError),
    /// The hello does not start with burn-ddp's magic.
    #[error("not a burn-ddp peer (bad hello)")]
    NotAPeer,
    /// The hello's fields do not decode.
    #[error("{0}")]
    Decode(#[from] DecodeError),
    /// The peer does not present the job secret.
    #[error("it claims to be rank {rank} but does not present the job secret (BURN_DDP_SECRET)")]
    NoSecret {
        /// The rank it claims to be.
        rank: usize,
    },
}

/// Reads a peer's hello; refuses it unless it presents `secret`.
fn read_hello(
    stream: &mut TcpStream,
    secret: Option<&JobSecret>,
) -> std::result::Result<(usize, usize), HelloError> {
    let mut buf = [0u8; HELLO_LEN];
    stream.read_exact(&mut buf)?;
    let (rank, world) = parse_hello(&buf)?;
    let presented = read_frame(stream, MAX_SECRET_LEN)?;
    if !admits(secret, &presented) {
        return Err(HelloError::NoSecret { rank });
    }
    Ok((rank, world))
}

fn parse_hello(b: &[u8]) -> std::result::Result<(usize, usize), HelloError> {
    if &b[..8] != HELLO_MAGIC {
        return Err(HelloError::NotAPeer);
    }
    let mut r = Reader::new(&b[8..]);
    Ok((r.u32()? as usize, r.u32()? as usize))
}

fn addr_key(rank: usize) -> String {
    format!("bddp/mesh/addr/{rank}")
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
    let owner = store.compare_set(&format!("bddp/mesh/rank/{rank}"), b"", me.as_bytes())?;
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
    let fail = |reason: String| DdpError::Rendezvous { rank, reason };
    let ip = match ifname {
        Some(name) => iface::interface_addr(name, store.local_addr().ip())?,
        None => store.local_addr().ip(),
    };
    claim_rank(rank, world, store)?;
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

    let keys: Vec<String> = (0..world).map(addr_key).collect();
    let remaining = deadline.saturating_duration_since(Instant::now());
    store.wait(&keys, remaining).map_err(|e| match e {
        DdpError::StoreTimeout { .. } => {
            let missing: Vec<usize> = (0..world)
                .filter(|r| store.try_get(&addr_key(*r)).ok().flatten().is_none())
                .collect();
            fail(format!(
                "ranks {missing:?} did not join within {remaining:?}; did they start, with the \
                 same MASTER_ADDR, MASTER_PORT and WORLD_SIZE={world}?"
            ))
        }
        other => other,
    })?;

    let mut peers: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
    for (peer, slot) in peers.iter_mut().enumerate().take(rank) {
        let raw = store.get(&addr_key(peer))?;
        let addr: SocketAddr = String::from_utf8_lossy(&raw)
            .parse()
            .map_err(|_| fail(format!("rank {peer} published a bad address {raw:?}")))?;
        let left = deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(1));
        let mut stream = TcpStream::connect_timeout(&addr, left)
            .map_err(|e| fail(format!("cannot connect to rank {peer} at {addr}: {e}")))?;
        stream
            .set_read_timeout(Some(left))
            .and_then(|_| send_hello(&mut stream, rank, world, secret))
            .map_err(|e| fail(format!("cannot greet rank {peer} at {addr}: {e}")))?;
        match read_hello(&mut stream, secret) {
            Ok((r, w)) if r == peer && w == world => {}
            Ok((r, w)) => {
                return Err(fail(format!(
                    "{addr} answered as rank {r} of {w}, expected rank {peer} of {world}"
                )));
            }
            Err(e) => return Err(fail(format!("{addr} (rank {peer}): {e}"))),
        }
        *slot = Some(stream);
    }

    listener
        .set_nonblocking(true)
        .map_err(|e| DdpError::io("configuring the data-plane listener", e))?;
    let mut expected = world - 1 - rank;
    while expected > 0 {
        let (mut stream, from) = match listener.accept() {
            Ok(s) => s,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    let missing: Vec<usize> =
                        (rank + 1..world).filter(|r| peers[*r].is_none()).collect();
                    return Err(fail(format!(
                        "ranks {missing:?} published an address but never connected"
                    )));
                }
                std::thread::sleep(Duration::from_millis(1));
                continue;
            }
            Err(e) => return Err(DdpError::io("accepting a peer", e)),
        };
        let left = deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(1));
        let greeting = stream
            .set_nonblocking(false)
            .and_then(|_| stream.set_read_timeout(Some(left.min(Duration::from_secs(10)))))
            .map_err(HelloError::Io)
            .and_then(|_| read_hello(&mut stream, secret));
        let peer = match greeting {
            Err(e) => {
                log::warn!("rank {rank}: ignoring a connection from {from}: {e}");
                continue;
            }
            Ok((_, w)) if w != world => {
                return Err(fail(format!(
                    "a peer at {from} believes WORLD_SIZE={w}, this rank has {world}"
                )));
            }
            Ok((r, _)) if r <= rank || r >= world => {
                return Err(fail(format!(
                    "unexpected connection from rank {r} at {from}"
                )));
            }
            Ok((r, _)) if peers[r].is_some() => {
                return Err(fail(format!(
                    "rank {r} joined twice (second time from {from}): two processes have RANK={r}"
                )));
            }
            Ok((r, _)) => r,
        };
        send_hello(&mut stream, rank, world, secret)
            .map_err(|e| fail(format!("cannot answer rank {peer}: {e}")))?;
        peers[peer] = Some(stream);
        expected -= 1;
    }

    for stream in peers.iter().flatten() {
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

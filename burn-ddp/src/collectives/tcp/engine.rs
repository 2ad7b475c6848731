//! The socket engine of the TCP transport: it owns the connections to the peers and runs one
//! [`Schedule`] at a time over them, with non-blocking sockets polled by mio, so a rank sends to
//! its successor and receives from its predecessor at the same time. It also reads the control
//! frames of peers that send it no data (a goodbye, or the close of a dead peer), says goodbye
//! when the group is dropped, and closes every connection when the group stops.
//!
//! The engine knows nothing of collectives (the ring algorithms build the schedules) nor of the
//! group's failure record: a failure is reported as a [`PeerFailure`] naming the peer at fault.

use std::io::{self, IoSlice, Read, Write};
use std::net::Shutdown;
use std::time::{Duration, Instant};

use mio::net::TcpStream;
use mio::{Events, Interest, Poll, Token};

use super::PeerFailure;
use super::frame::{FrameKind, HEADER_LEN, Header};
use crate::collectives::OpDesc;
use crate::collectives::schedule::{Action, Schedule};
use crate::error::{DdpError, Result};

/// Reduces a received chunk (second argument) into the buffer's bytes (first); the flag marks
/// the last reduction of a segment.
pub(crate) type ReduceFn<'a> = dyn FnMut(&mut [u8], &[u8], bool) + 'a;

/// The two ranks a schedule runs between: it sends to `next` and receives from `prev` (the
/// whole group's ring, or the ring of one local rank per host in a hierarchical all-reduce).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Neighbours {
    pub next: usize,
    pub prev: usize,
}

impl Neighbours {
    /// The neighbours of the member at `pos` of the ring `members` (global ranks, in order).
    pub(crate) fn in_ring(members: &[usize], pos: usize) -> Self {
        let n = members.len();
        Neighbours {
            next: members[(pos + 1) % n],
            prev: members[(pos + n - 1) % n],
        }
    }
}

/// A failure before the operation is attached: the peer at fault and what happened.
struct Fault {
    peer: usize,
    detail: String,
}

type Faulty<T = ()> = std::result::Result<T, Fault>;

struct Peer {
    stream: TcpStream,
    /// The peer said goodbye: its close is not a failure.
    departed: bool,
}

/// One rank's connections and the loop that moves a schedule's bytes over them.
pub(crate) struct Engine {
    rank: usize,
    world: usize,
    peers: Vec<Option<Peer>>,
    poll: Poll,
    events: Events,
    /// Receive buffer of reduced chunks, `u64` to be aligned for every element type.
    scratch: Vec<u64>,
    /// Longest a schedule may go without progress.
    timeout: Duration,
    /// How long to retry the sockets before sleeping in the poller.
    spin: Duration,
    /// This rank's predecessor in its ring across hosts, in a hierarchical group.
    cross_prev: Option<usize>,
}

fn is_would_block(e: &io::Error) -> bool {
    e.kind() == io::ErrorKind::WouldBlock
}

impl Engine {
    /// Takes over the connected streams from [`super::mesh::connect`] (`None` for this rank).
    pub(crate) fn new(
        rank: usize,
        world: usize,
        streams: Vec<Option<std::net::TcpStream>>,
        timeout: Duration,
        spin: Duration,
    ) -> Result<Self> {
        let poll = Poll::new().map_err(|e| DdpError::io("creating the poller", e))?;
        let mut peers = Vec::with_capacity(world);
        for (r, s) in streams.into_iter().enumerate() {
            let Some(s) = s else {
                peers.push(None);
                continue;
            };
            s.set_nonblocking(true)
                .map_err(|e| DdpError::io("configuring a data-plane socket", e))?;
            let mut stream = TcpStream::from_std(s);
            poll.registry()
                .register(
                    &mut stream,
                    Token(r),
                    Interest::READABLE | Interest::WRITABLE,
                )
                .map_err(|e| DdpError::io("registering a data-plane socket", e))?;
            peers.push(Some(Peer {
                stream,
                departed: false,
            }));
        }
        Ok(Engine {
            rank,
            world,
            peers,
            poll,
            events: Events::with_capacity(64),
            scratch: Vec::new(),
            timeout,
            spin,
            cross_prev: None,
        })
    }

    /// Sets this rank's predecessor in its ring across hosts (hierarchical all-reduce), a peer
    /// that sends it data besides the group ring's predecessor.
    pub(crate) fn set_cross_prev(&mut self, prev: usize) {
        self.cross_prev = Some(prev);
    }

    /// The peers that send this rank data: the group ring's predecessor and the one across
    /// hosts (the same twice without one).
    fn senders(&self) -> [usize; 2] {
        let prev = self.ring().prev;
        [prev, self.cross_prev.unwrap_or(prev)]
    }

    /// The group's ring: this rank's successor and predecessor by rank.
    pub(crate) fn ring(&self) -> Neighbours {
        let n = self.world;
        Neighbours {
            next: (self.rank + 1) % n,
            prev: (self.rank + n - 1) % n,
        }
    }

    /// Runs `sched` for `op` over `buf`: sends to `ring.next` and receives from `ring.prev`
    /// until both lists are done, reducing received chunks with `reduce` as the schedule says.
    /// Fails when a peer closes, leaves, stalls for the whole timeout or sends something that
    /// does not fit.
    pub(crate) fn run(
        &mut self,
        op: &OpDesc,
        buf: &mut [u8],
        sched: &Schedule,
        ring: Neighbours,
        reduce: &mut ReduceFn<'_>,
    ) -> std::result::Result<(), PeerFailure> {
        self.run_schedule(op, buf, sched, ring, reduce)
            .map_err(|Fault { peer, detail }| PeerFailure {
                culprit: peer,
                detail,
                op: *op,
            })
    }

    fn run_schedule(
        &mut self,
        op: &OpDesc,
        buf: &mut [u8],
        sched: &Schedule,
        ring: Neighbours,
        reduce: &mut ReduceFn<'_>,
    ) -> Faulty {
        let longest = sched
            .recvs
            .iter()
            .filter(|(_, a)| *a != Action::Copy)
            .map(|(r, _)| r.len())
            .max()
            .unwrap_or(0);
        if self.scratch.len() * 8 < longest {
            self.scratch.resize(longest.div_ceil(8), 0);
        }
        let Neighbours { next, prev } = ring;
        let senders = self.senders();
        let timeout = self.timeout;
        let scratch: &mut [u8] = bytemuck::cast_slice_mut(&mut self.scratch);
        let (mut sent, mut send_off) = (0usize, 0usize);
        let (mut recvd, mut recv_off) = (0usize, 0usize);
        let mut header = [0u8; HEADER_LEN];
        let mut last_progress = Instant::now();

        loop {
            let mut progressed = false;
            let out = &self.peers[next]
                .as_ref()
                .expect("peer of another rank")
                .stream;
            while sent < sched.sends.len() && sched.can_send(sent, recvd) {
                let range = sched.sends[sent].clone();
                let payload = &buf[range.clone()];
                let total = HEADER_LEN + payload.len();
                let res = if send_off < HEADER_LEN {
                    let h = Header::data(op, sent, payload.len()).encode();
                    (&*out).write_vectored(&[IoSlice::new(&h[send_off..]), IoSlice::new(payload)])
                } else {
                    (&*out).write(&payload[send_off - HEADER_LEN..])
                };
                match res {
                    Ok(0) => {
                        let e = io::ErrorKind::WriteZero.into();
                        return Err(send_failed(&mut self.peers, (prev, senders), next, e));
                    }
                    Ok(k) => {
                        send_off += k;
                        progressed = true;
                        if send_off == total {
                            sent += 1;
                            send_off = 0;
                        }
                    }
                    Err(e) if is_would_block(&e) => break,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => {
                        return Err(send_failed(&mut self.peers, (prev, senders), next, e));
                    }
                }
            }

            let inp = &self.peers[prev]
                .as_ref()
                .expect("peer of another rank")
                .stream;
            while recvd < sched.recvs.len() {
                let (range, action) = sched.recvs[recvd].clone();
                let len = range.len();
                let res = if recv_off < HEADER_LEN {
                    (&*inp).read(&mut header[recv_off..])
                } else {
                    let got = recv_off - HEADER_LEN;
                    match action {
                        Action::Copy => (&*inp).read(&mut buf[range.start + got..range.end]),
                        _ => (&*inp).read(&mut scratch[got..len]),
                    }
                };
                match res {
                    Ok(0) if len + HEADER_LEN > recv_off => {
                        return Err(Fault {
                            peer: prev,
                            detail: closed_message(prev),
                        });
                    }
                    Ok(k) => {
                        let was_header = recv_off < HEADER_LEN;
                        recv_off += k;
                        progressed = true;
                        if was_header && recv_off == HEADER_LEN {
                            check_header(&header, op, recvd, len, prev)?;
                        }
                    }
                    Err(e) if is_would_block(&e) => break,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(connection_failed(prev, &e)),
                }
                if recv_off == HEADER_LEN + len {
                    match action {
                        Action::Copy => {}
                        Action::Reduce => reduce(&mut buf[range], &scratch[..len], false),
                        Action::ReduceLast => reduce(&mut buf[range], &scratch[..len], true),
                    }
                    recvd += 1;
                    recv_off = 0;
                }
            }

            if sent == sched.sends.len() && recvd == sched.recvs.len() {
                return Ok(());
            }
            if progressed {
                last_progress = Instant::now();
                continue;
            }
            let waited = last_progress.elapsed();
            if waited < self.spin {
                std::hint::spin_loop();
                continue;
            }
            if waited >= timeout {
                let (peer, what) = if recvd < sched.recvs.len() {
                    (prev, "to receive from")
                } else {
                    (next, "to send to")
                };
                return Err(Fault {
                    peer,
                    detail: format!(
                        "rank {} waited {timeout:?} {what} rank {peer} without progress \
                         (chunk {}/{} received, {}/{} sent)",
                        self.rank,
                        recvd,
                        sched.recvs.len(),
                        sent,
                        sched.sends.len()
                    ),
                });
            }
            match self.poll.poll(&mut self.events, Some(timeout - waited)) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    return Err(Fault {
                        peer: prev,
                        detail: format!("polling failed ({e})"),
                    });
                }
            }
            let woken: Vec<usize> = self.events.iter().map(|e| e.token().0).collect();
            for peer in woken {
                if peer != prev {
                    check_control(&mut self.peers, peer, senders)?;
                }
            }
        }
    }

    /// Whether `peer` closed its connection or left the group (for transports that wait on it
    /// elsewhere, as shared memory does): what happened, in words.
    pub(crate) fn peer_gone(&mut self, peer: usize) -> Option<String> {
        let senders = self.senders();
        if let Err(fault) = check_control(&mut self.peers, peer, senders) {
            return Some(fault.detail);
        }
        let left = self.peers.get(peer)?.as_ref()?.departed;
        left.then(|| {
            format!("rank {peer} left the group (dropped its process group) while this rank waits for it")
        })
    }

    /// The first peer whose connection closed without a goodbye (its process died, its host
    /// is gone), for waits that run outside this transport (NCCL's). Only looks: data and
    /// goodbyes stay in the socket for the operations that read them, so a peer that ran ahead
    /// or left cleanly is not taken for dead.
    #[cfg(feature = "nccl")]
    pub(crate) fn dead_peer(&self) -> Option<(usize, String)> {
        self.peers.iter().enumerate().find_map(|(peer, p)| {
            let p = p.as_ref().filter(|p| !p.departed)?;
            let mut byte = [0u8; 1];
            match p.stream.peek(&mut byte) {
                Ok(0) => Some((peer, closed_message(peer))),
                Ok(_) => None,
                Err(e) if is_would_block(&e) || e.kind() == io::ErrorKind::Interrupted => None,
                Err(e) => Some((peer, connection_failed(peer, &e).detail)),
            }
        })
    }

    /// Closes every connection at once, so the peers notice this rank stopped.
    pub(crate) fn close(&mut self) {
        for p in self.peers.iter().flatten() {
            let _ = p.stream.shutdown(Shutdown::Both);
        }
    }

    /// Tells every peer this rank leaves cleanly, then closes the connections for writing.
    pub(crate) fn leave(&mut self) {
        let goodbye = Header::goodbye().encode();
        let deadline = Instant::now() + Duration::from_secs(1);
        for p in self.peers.iter().flatten() {
            let mut off = 0;
            while off < HEADER_LEN && Instant::now() < deadline {
                match (&p.stream).write(&goodbye[off..]) {
                    Ok(k) => off += k,
                    Err(e) if is_would_block(&e) => std::thread::sleep(Duration::from_millis(1)),
                    Err(_) => break,
                }
            }
            let _ = p.stream.shutdown(Shutdown::Write);
        }
    }
}

/// Explains a failed send to `next`: a goodbye waiting on the same connection says the peer
/// left; otherwise the socket error says how it went.
/// `prev` is the schedule's predecessor, `senders` the peers that send this rank data.
fn send_failed(
    peers: &mut [Option<Peer>],
    (prev, senders): (usize, [usize; 2]),
    next: usize,
    e: io::Error,
) -> Fault {
    if next != prev {
        if let Err(specific) = check_control(peers, next, senders) {
            return specific;
        }
        if peers[next].as_ref().is_some_and(|p| p.departed) {
            return Fault {
                peer: next,
                detail: format!(
                    "rank {next} left the group (dropped its process group) while this rank \
                     sends to it"
                ),
            };
        }
    }
    connection_failed(next, &e)
}

fn closed_message(peer: usize) -> String {
    format!("rank {peer} closed its connection without leaving the group (process died or aborted)")
}

/// A socket error on the connection to `peer`, worded by what it means.
fn connection_failed(peer: usize, e: &io::Error) -> Fault {
    use io::ErrorKind::*;
    let detail = match e.kind() {
        BrokenPipe | ConnectionReset | ConnectionAborted | UnexpectedEof | WriteZero => {
            format!("{} ({e})", closed_message(peer))
        }
        _ => format!("connection to rank {peer} failed ({e})"),
    };
    Fault { peer, detail }
}

/// Checks a received header against what this rank expects next.
fn check_header(
    raw: &[u8; HEADER_LEN],
    op: &OpDesc,
    unit: usize,
    len: usize,
    peer: usize,
) -> Faulty {
    let h = Header::decode(raw).map_err(|e| Fault {
        peer,
        detail: format!("rank {peer} sent {e}"),
    })?;
    if h.kind == FrameKind::Goodbye {
        return Err(Fault {
            peer,
            detail: format!(
                "rank {peer} left the group (dropped its process group) while this rank waits \
                 for it"
            ),
        });
    }
    let expected = Header::data(op, unit, len);
    if h != expected {
        return Err(Fault {
            peer,
            detail: format!(
                "ranks disagree on the collective (desync): rank {peer} sent {} while this rank \
                 expects {}",
                h.describe(),
                expected.describe()
            ),
        });
    }
    Ok(())
}

/// Reads what `peer` wrote while this rank does not receive from it: a goodbye, or the close of
/// a dead peer. Data headers are left in the socket: from `senders` (the predecessors of this
/// rank in the group's ring and in its ring across hosts, which may run ahead into the next
/// operation while this rank finishes the other ring) they wait for that operation; from any
/// other peer they mean the ranks disagree on the ring.
fn check_control(peers: &mut [Option<Peer>], peer: usize, senders: [usize; 2]) -> Faulty {
    let Some(p) = peers.get_mut(peer).and_then(Option::as_mut) else {
        return Ok(());
    };
    let mut head = [0u8; HEADER_LEN];
    loop {
        match p.stream.peek(&mut head) {
            Ok(0) if p.departed => return Ok(()),
            Ok(0) => {
                return Err(Fault {
                    peer,
                    detail: closed_message(peer),
                });
            }
            Ok(k) if k < HEADER_LEN => return Ok(()),
            Ok(_) => match Header::decode(&head) {
                Ok(h) if h.kind == FrameKind::Goodbye => {
                    // The header is there whole: this read takes exactly it.
                    if let Err(e) = (&p.stream).read_exact(&mut head) {
                        return Err(connection_failed(peer, &e));
                    }
                    p.departed = true;
                }
                Ok(_) if senders.contains(&peer) => return Ok(()),
                Ok(h) => {
                    return Err(Fault {
                        peer,
                        detail: format!(
                            "rank {peer} sent data ({}) on a connection that carries none: \
                             ranks disagree on the ring",
                            h.describe()
                        ),
                    });
                }
                Err(e) => {
                    return Err(Fault {
                        peer,
                        detail: e.to_string(),
                    });
                }
            },
            Err(e) if is_would_block(&e) => return Ok(()),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) if p.departed => return Ok(()),
            Err(e) => return Err(connection_failed(peer, &e)),
        }
    }
}

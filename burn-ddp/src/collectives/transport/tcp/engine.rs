//! The socket engine of the TCP transport: it owns the connections to the peers and runs one
//! [`Schedule`] at a time over them, with non-blocking sockets polled by mio, so a rank sends to
//! its successor and receives from its predecessor at the same time. It also reads the control
//! frames of peers that send it no data (a goodbye, or a close without one: a failure only
//! where this rank still needs that peer, see `faults`), says goodbye when the group is
//! dropped, and closes every connection when the group stops.
//!
//! The engine knows nothing of collectives (the ring algorithms build the schedules) nor of the
//! group's failure record: a failure is reported as a [`PeerFailure`] naming the peer at fault.

use std::io::{self, IoSlice, Read, Write};
use std::net::Shutdown;
use std::time::{Duration, Instant};

use mio::net::TcpStream;
use mio::{Events, Interest, Poll, Token};

use super::PeerFailure;
use super::frame::{HEADER_LEN, Header};
use crate::collectives::OpDesc;
use crate::collectives::transport::schedule::{Action, Schedule};
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

mod faults;
#[cfg(feature = "test-support")]
mod hold;

use faults::{
    check_control, check_header, check_woken, closed_before, closed_message, connection_failed,
    send_failed, stalled,
};

type Faulty<T = ()> = std::result::Result<T, Fault>;

/// Where a schedule's run stands: chunks sent and received, bytes of the chunk in flight each
/// way, and the header being received.
#[derive(Default)]
struct Cursor {
    sent: usize,
    send_off: usize,
    recvd: usize,
    recv_off: usize,
    header: [u8; HEADER_LEN],
    /// The last send was held back (tests, see `hold`).
    #[cfg(feature = "test-support")]
    held: bool,
}

struct Peer {
    stream: TcpStream,
    /// The peer said goodbye: its close is not a failure.
    departed: bool,
    /// The peer closed its connection without a goodbye: what happened, in words.
    closed: Option<String>,
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
                closed: None,
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
        closed_before(&self.peers)?;
        let longest = (sched.recvs.iter())
            .filter(|(_, a)| *a != Action::Copy)
            .map(|(r, _)| r.len())
            .max()
            .unwrap_or(0);
        if self.scratch.len() * 8 < longest {
            self.scratch.resize(longest.div_ceil(8), 0);
        }
        let mut at = Cursor::default();
        let mut last_progress = Instant::now();
        loop {
            let sent_some = self.send_ready(op, buf, sched, &mut at, ring)?;
            let got_some = self.receive_ready(op, buf, sched, &mut at, ring.prev, reduce)?;
            if at.sent == sched.sends.len() && at.recvd == sched.recvs.len() {
                return Ok(());
            }
            if sent_some || got_some {
                last_progress = Instant::now();
                continue;
            }
            let waited = last_progress.elapsed();
            if waited < self.spin {
                std::hint::spin_loop();
                continue;
            }
            if waited >= self.timeout {
                return Err(stalled((self.rank, self.timeout), &at, sched, ring));
            }
            let sending = at.sent < sched.sends.len();
            self.wait_for_io(self.timeout - waited, ring, sending)?;
        }
    }

    /// Sends what the schedule allows to `ring.next` until the socket would block; whether any
    /// byte went.
    fn send_ready(
        &mut self,
        op: &OpDesc,
        buf: &[u8],
        sched: &Schedule,
        at: &mut Cursor,
        Neighbours { next, prev }: Neighbours,
    ) -> Faulty<bool> {
        let senders = self.senders();
        let out = &self.peers[next]
            .as_ref()
            .expect("peer of another rank")
            .stream;
        let mut progressed = false;
        while at.sent < sched.sends.len() && sched.can_send(at.sent, at.recvd) {
            #[cfg(feature = "test-support")]
            if at.sent + 1 == sched.sends.len() && !at.held {
                at.held = true;
                std::thread::sleep(hold::last_send_hold());
            }
            let payload = &buf[sched.sends[at.sent].clone()];
            let total = HEADER_LEN + payload.len();
            let res = if at.send_off < HEADER_LEN {
                let h = Header::data(op, at.sent, payload.len()).encode();
                let parts = [IoSlice::new(&h[at.send_off..]), IoSlice::new(payload)];
                (&*out).write_vectored(&parts)
            } else {
                (&*out).write(&payload[at.send_off - HEADER_LEN..])
            };
            match res {
                Ok(0) => {
                    let e = io::ErrorKind::WriteZero.into();
                    return Err(send_failed(&mut self.peers, (prev, senders), next, e));
                }
                Ok(k) => {
                    at.send_off += k;
                    progressed = true;
                    if at.send_off == total {
                        at.sent += 1;
                        at.send_off = 0;
                    }
                }
                Err(e) if is_would_block(&e) => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(send_failed(&mut self.peers, (prev, senders), next, e)),
            }
        }
        Ok(progressed)
    }

    /// Receives from `prev` what the schedule expects until the socket would block, checking
    /// each header and reducing or copying each complete chunk; whether any byte came.
    fn receive_ready(
        &mut self,
        op: &OpDesc,
        buf: &mut [u8],
        sched: &Schedule,
        at: &mut Cursor,
        prev: usize,
        reduce: &mut ReduceFn<'_>,
    ) -> Faulty<bool> {
        let scratch: &mut [u8] = bytemuck::cast_slice_mut(&mut self.scratch);
        let inp = &self.peers[prev]
            .as_ref()
            .expect("peer of another rank")
            .stream;
        let mut progressed = false;
        while at.recvd < sched.recvs.len() {
            let (range, action) = sched.recvs[at.recvd].clone();
            let len = range.len();
            let res = if at.recv_off < HEADER_LEN {
                (&*inp).read(&mut at.header[at.recv_off..])
            } else {
                let got = at.recv_off - HEADER_LEN;
                match action {
                    Action::Copy => (&*inp).read(&mut buf[range.start + got..range.end]),
                    _ => (&*inp).read(&mut scratch[got..len]),
                }
            };
            match res {
                Ok(0) if len + HEADER_LEN > at.recv_off => {
                    let detail = closed_message(prev);
                    return Err(Fault { peer: prev, detail });
                }
                Ok(k) => {
                    let was_header = at.recv_off < HEADER_LEN;
                    at.recv_off += k;
                    progressed = true;
                    if was_header && at.recv_off == HEADER_LEN {
                        check_header(&at.header, op, at.recvd, len, prev)?;
                    }
                }
                Err(e) if is_would_block(&e) => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(connection_failed(prev, &e)),
            }
            if at.recv_off == HEADER_LEN + len {
                match action {
                    Action::Copy => {}
                    Action::Reduce => reduce(&mut buf[range], &scratch[..len], false),
                    Action::ReduceLast => reduce(&mut buf[range], &scratch[..len], true),
                }
                at.recvd += 1;
                at.recv_off = 0;
            }
        }
        Ok(progressed)
    }

    /// Sleeps in the poller until a socket is ready or `left` passes; reads the control frames
    /// of peers other than `ring.prev` that woke it: a goodbye, or a close without one, which
    /// fails the schedule if the peer is `ring.next` and this rank is still `sending` to it, and
    /// is recorded otherwise (see `faults`).
    fn wait_for_io(&mut self, left: Duration, ring: Neighbours, sending: bool) -> Faulty {
        let prev = ring.prev;
        match self.poll.poll(&mut self.events, Some(left)) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => {
                let detail = format!("polling failed ({e})");
                return Err(Fault { peer: prev, detail });
            }
        }
        let senders = self.senders();
        let woken: Vec<usize> = self.events.iter().map(|e| e.token().0).collect();
        for peer in woken {
            if peer != prev {
                check_woken(
                    &mut self.peers,
                    peer,
                    senders,
                    (self.rank, ring.next, sending),
                )?;
            }
        }
        Ok(())
    }

    /// Whether `peer` closed its connection or left the group (for transports that wait on it
    /// elsewhere, as shared memory does): what happened, in words.
    pub(crate) fn peer_gone(&mut self, peer: usize) -> Option<String> {
        let senders = self.senders();
        if let Err(fault) = check_control(&mut self.peers, peer, senders) {
            return Some(fault.detail);
        }
        let p = self.peers.get(peer)?.as_ref()?;
        if let Some(detail) = &p.closed {
            return Some(detail.clone());
        }
        p.departed.then(|| {
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

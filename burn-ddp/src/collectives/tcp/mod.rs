//! The TCP transport (gloo-like): pipelined ring collectives over one connection per pair of
//! ranks, driven by a single thread with non-blocking sockets, so each rank sends to its
//! successor and receives from its predecessor at the same time.
//!
//! Failure handling: every wait is bounded by the group's timeout (measured as time without
//! progress). A rank that sees a peer fail records the root cause in the store (first report
//! wins) and closes its connections; its neighbours then find the cause there, so every rank's
//! error names the rank that failed first, not merely the neighbour that hung up.

mod frame;
pub(crate) mod mesh;
mod schedule;

use std::io::{self, IoSlice, Read, Write};
use std::net::Shutdown;
use std::sync::Arc;
use std::time::{Duration, Instant};

use mio::net::TcpStream;
use mio::{Events, Interest, Poll, Token};

use self::frame::{FrameKind, HEADER_LEN, Header};
use self::schedule::{Action, Schedule, balanced};
use super::{DType, DataType, OpDesc, OpKind, Reduce, ReduceOp};
use crate::error::{DdpError, Result};
use crate::failure::FailureRecord;
use crate::status::StatusCell;
use crate::store::Store;

/// Reduces a received chunk (second argument) into the buffer's bytes (first); the flag marks
/// the last reduction of a segment.
type ReduceFn<'a> = dyn FnMut(&mut [u8], &[u8], bool) + 'a;

/// Tunables of the transport.
#[derive(Debug, Clone)]
pub(crate) struct TcpConfig {
    pub timeout: Duration,
    pub chunk_bytes: usize,
    pub max_gather_bytes: usize,
    pub spin: Duration,
}

struct Peer {
    stream: TcpStream,
    /// The peer said goodbye: its close is not a failure.
    departed: bool,
    /// Bytes of a control frame read so far (from peers that send us no data).
    ctl: [u8; HEADER_LEN],
    ctl_len: usize,
}

/// Why an operation could not finish (before the root cause is looked up).
enum Failure {
    /// The peer closed, reset or left.
    Lost { peer: usize, detail: String },
    /// No progress for the whole timeout.
    Stalled { peer: usize, detail: String },
    /// The peer sent something that does not fit.
    Protocol { peer: usize, detail: String },
}

/// One rank's end of the data plane.
pub(crate) struct TcpTransport {
    rank: usize,
    world: usize,
    peers: Vec<Option<Peer>>,
    poll: Poll,
    events: Events,
    /// Receive buffer of reduced chunks, `u64` to be aligned for every element type.
    scratch: Vec<u64>,
    config: TcpConfig,
    store: Arc<Store>,
    status: Arc<StatusCell>,
    next_seq: u64,
    failed: Option<String>,
}

fn is_would_block(e: &io::Error) -> bool {
    e.kind() == io::ErrorKind::WouldBlock
}

impl TcpTransport {
    /// Takes over the connected streams from [`mesh::connect`].
    pub(crate) fn new(
        rank: usize,
        world: usize,
        streams: Vec<Option<std::net::TcpStream>>,
        store: Arc<Store>,
        status: Arc<StatusCell>,
        config: TcpConfig,
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
                ctl: [0; HEADER_LEN],
                ctl_len: 0,
            }));
        }
        Ok(TcpTransport {
            rank,
            world,
            peers,
            poll,
            events: Events::with_capacity(64),
            scratch: Vec::new(),
            config,
            store,
            status,
            next_seq: 0,
            failed: None,
        })
    }

    /// Numbers the next operation, or refuses it if the group failed.
    fn begin(&mut self, kind: OpKind, dtype: DType, bytes: usize) -> Result<OpDesc> {
        let op = OpDesc {
            kind,
            seq: self.next_seq,
            dtype,
            bytes: bytes as u64,
        };
        self.next_seq += 1;
        match &self.failed {
            Some(cause) => Err(DdpError::Aborted {
                rank: self.rank,
                op: op.to_string(),
                cause: cause.clone(),
            }),
            None => Ok(op),
        }
    }

    fn chunk_for(&self, elem: usize) -> usize {
        (self.config.chunk_bytes / elem).max(1) * elem
    }

    /// Ring all-reduce (reduce-scatter then all-gather). The reduction order is fixed by the
    /// ring, and each element is reduced on one rank only, so results are bit-identical.
    pub(crate) fn all_reduce<T: Reduce>(&mut self, data: &mut [T], op: ReduceOp) -> Result<()> {
        let bytes = std::mem::size_of_val(data);
        let desc = self.begin(OpKind::AllReduce, T::DTYPE, bytes)?;
        let n = self.world;
        if n == 1 {
            return Ok(());
        }
        let elem = size_of::<T>();
        let segments = balanced(data.len(), n, elem);
        let sched = Schedule::ring(
            &segments,
            self.rank,
            n - 1,
            2 * (n - 1),
            self.chunk_for(elem),
        );
        let mut reduce = |acc: &mut [u8], other: &[u8], last: bool| {
            let acc: &mut [T] = bytemuck::cast_slice_mut(acc);
            T::combine(acc, bytemuck::cast_slice(other), op);
            if last && op == ReduceOp::Avg {
                T::divide(acc, n);
            }
        };
        self.execute(&desc, bytemuck::cast_slice_mut(data), &sched, &mut reduce)
    }

    /// Pipelined broadcast from `root` along the ring.
    pub(crate) fn broadcast<T: DataType>(&mut self, data: &mut [T], root: usize) -> Result<()> {
        let bytes = std::mem::size_of_val(data);
        let desc = self.begin(OpKind::Broadcast, T::DTYPE, bytes)?;
        if root >= self.world {
            return Err(self.invalid(&desc, format!("root {root} >= world size {}", self.world)));
        }
        if self.world == 1 {
            return Ok(());
        }
        let sched = Schedule::chain(bytes, self.rank, self.world, root, self.chunk_for(1));
        self.execute(
            &desc,
            bytemuck::cast_slice_mut(data),
            &sched,
            &mut |_, _, _| {},
        )
    }

    /// Gathers every rank's bytes (lengths may differ) into a list indexed by rank.
    pub(crate) fn all_gather(&mut self, data: &[u8]) -> Result<Vec<Vec<u8>>> {
        let n = self.world;
        let mut sizes = vec![0u64; n];
        sizes[self.rank] = data.len() as u64;
        self.ring_gather(OpKind::AllGatherSizes, &mut sizes, 1)?;
        let total = sizes.iter().fold(0u64, |a, s| a.saturating_add(*s));
        let desc = self.begin(
            OpKind::AllGather,
            DType::U8,
            total.min(usize::MAX as u64) as usize,
        )?;
        // Every rank sees the same sizes, so every rank refuses alike and stays in step.
        if total > self.config.max_gather_bytes as u64 {
            return Err(self.invalid(
                &desc,
                format!(
                    "ranks send {total} bytes in all ({sizes:?}), above the limit of {} bytes",
                    self.config.max_gather_bytes
                ),
            ));
        }
        let mut out = vec![0u8; total as usize];
        let mut bounds = Vec::with_capacity(n);
        let mut start = 0usize;
        for s in &sizes {
            bounds.push(start..start + *s as usize);
            start += *s as usize;
        }
        out[bounds[self.rank].clone()].copy_from_slice(data);
        if n > 1 {
            let sched = Schedule::ring(&bounds, self.rank, 0, n - 1, self.chunk_for(1));
            self.execute(&desc, &mut out, &sched, &mut |_, _, _| {})?;
        }
        Ok(bounds.into_iter().map(|b| out[b].to_vec()).collect())
    }

    /// Returns once every rank has entered the barrier.
    pub(crate) fn barrier(&mut self) -> Result<()> {
        self.ring_gather(OpKind::Barrier, &mut [], 0)
    }

    /// All-gather of fixed-size blocks of `u64`s, `per_rank` each.
    fn ring_gather(&mut self, kind: OpKind, blocks: &mut [u64], per_rank: usize) -> Result<()> {
        let desc = self.begin(kind, DType::U8, blocks.len() * 8)?;
        if self.world == 1 {
            return Ok(());
        }
        let bounds = balanced(self.world * per_rank, self.world, 8);
        let sched = Schedule::ring(&bounds, self.rank, 0, self.world - 1, self.chunk_for(8));
        self.execute(
            &desc,
            bytemuck::cast_slice_mut(blocks),
            &sched,
            &mut |_, _, _| {},
        )
    }

    fn invalid(&self, desc: &OpDesc, reason: String) -> DdpError {
        DdpError::InvalidArgument {
            rank: self.rank,
            op: desc.to_string(),
            reason,
        }
    }

    /// Runs a schedule; a failure is turned into the group's agreed root cause.
    fn execute(
        &mut self,
        op: &OpDesc,
        buf: &mut [u8],
        sched: &Schedule,
        reduce: &mut ReduceFn<'_>,
    ) -> Result<()> {
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
        self.status.update(|s| s.collective = Some(op.to_string()));
        let result = self
            .run(op, buf, sched, reduce)
            .map_err(|failure| self.fail(op, failure));
        self.status.update(|s| s.collective = None);
        result
    }

    fn run(
        &mut self,
        op: &OpDesc,
        buf: &mut [u8],
        sched: &Schedule,
        reduce: &mut ReduceFn<'_>,
    ) -> std::result::Result<(), Failure> {
        let n = self.world;
        let (next, prev) = ((self.rank + 1) % n, (self.rank + n - 1) % n);
        let timeout = self.config.timeout;
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
                    Ok(0) => return Err(self.send_failed(next, io::ErrorKind::WriteZero.into())),
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
                    Err(e) => return Err(self.send_failed(next, e)),
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
                        return Err(Failure::Lost {
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
            if waited < self.config.spin {
                std::hint::spin_loop();
                continue;
            }
            if waited >= timeout {
                let (peer, what) = if recvd < sched.recvs.len() {
                    (prev, "to receive from")
                } else {
                    (next, "to send to")
                };
                return Err(Failure::Stalled {
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
                    return Err(Failure::Lost {
                        peer: prev,
                        detail: format!("polling failed ({e})"),
                    });
                }
            }
            let woken: Vec<usize> = self.events.iter().map(|e| e.token().0).collect();
            for peer in woken {
                if peer != prev {
                    check_control(&mut self.peers, peer)?;
                }
            }
        }
    }

    /// Explains a failed send to `next`: a goodbye waiting on the same connection says the
    /// peer left; otherwise the socket error says how it went.
    fn send_failed(&mut self, next: usize, e: io::Error) -> Failure {
        let prev = (self.rank + self.world - 1) % self.world;
        if next != prev {
            if let Err(specific) = check_control(&mut self.peers, next) {
                return specific;
            }
            if self.peers[next].as_ref().is_some_and(|p| p.departed) {
                return Failure::Lost {
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

    /// Agrees on the root cause through the store, closes every connection so the neighbours
    /// notice at once, and marks the group failed.
    fn fail(&mut self, op: &OpDesc, failure: Failure) -> DdpError {
        let (culprit, detail) = match failure {
            Failure::Lost { peer, detail }
            | Failure::Stalled { peer, detail }
            | Failure::Protocol { peer, detail } => (peer, detail),
        };
        let record = FailureRecord {
            culprit: Some(culprit),
            cause: format!("{detail}; seen by rank {} in {op}", self.rank),
        };
        let cause = self.stop(record, |own, e| {
            format!(
                "{own}; the store is unreachable too ({e}), so rank 0, which hosts it, has \
                 probably failed{}",
                if culprit == 0 { "" } else { " as well" }
            )
        });
        let ranks = self.status.report();
        log::error!("rank {}: {op} failed: {cause}; ranks: {ranks}", self.rank);
        let error = DdpError::Collective {
            rank: self.rank,
            op: op.to_string(),
            cause,
            ranks,
        };
        crate::elastic::record_error(&error);
        error
    }

    /// Stops the group on this rank for a failure found above the transport (a desync, a
    /// panic): records it as the group's failure unless one is recorded already, and closes
    /// every connection so the peers stop too. Returns the agreed cause.
    pub(crate) fn abort(&mut self, record: FailureRecord) -> String {
        self.stop(record, |own, _| own.to_string())
    }

    /// Records `record` as the group's failure unless one is recorded already (first report
    /// wins), closes every connection so the peers notice at once, and marks the group failed
    /// on this rank. Returns the agreed cause; `unreachable` words it from this rank's own cause
    /// when the store cannot be reached.
    fn stop(
        &mut self,
        record: FailureRecord,
        unreachable: impl FnOnce(&str, DdpError) -> String,
    ) -> String {
        let own = record.cause.clone();
        let cause = match record.agree(&self.store) {
            Ok(agreed) => agreed.cause,
            Err(e) => unreachable(&own, e),
        };
        for p in self.peers.iter().flatten() {
            let _ = p.stream.shutdown(Shutdown::Both);
        }
        self.failed.get_or_insert_with(|| cause.clone());
        cause
    }

    /// Tells every peer this rank leaves cleanly, then closes the connections.
    pub(crate) fn leave(&mut self) {
        if self.failed.is_some() {
            return;
        }
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

fn closed_message(peer: usize) -> String {
    format!("rank {peer} closed its connection without leaving the group (process died or aborted)")
}

/// A socket error on the connection to `peer`, worded by what it means.
fn connection_failed(peer: usize, e: &io::Error) -> Failure {
    use io::ErrorKind::*;
    let detail = match e.kind() {
        BrokenPipe | ConnectionReset | ConnectionAborted | UnexpectedEof | WriteZero => {
            format!("{} ({e})", closed_message(peer))
        }
        _ => format!("connection to rank {peer} failed ({e})"),
    };
    Failure::Lost { peer, detail }
}

/// Checks a received header against what this rank expects next.
fn check_header(
    raw: &[u8; HEADER_LEN],
    op: &OpDesc,
    unit: usize,
    len: usize,
    peer: usize,
) -> std::result::Result<(), Failure> {
    let h = Header::decode(raw).map_err(|e| Failure::Protocol {
        peer,
        detail: format!("rank {peer} sent {e}"),
    })?;
    if h.kind == FrameKind::Goodbye {
        return Err(Failure::Lost {
            peer,
            detail: format!(
                "rank {peer} left the group (dropped its process group) while this rank waits \
                 for it"
            ),
        });
    }
    let expected = Header::data(op, unit, len);
    if h != expected {
        return Err(Failure::Protocol {
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

/// Reads what a peer that sends us no data wrote: goodbyes, or the close of a dead peer.
fn check_control(peers: &mut [Option<Peer>], peer: usize) -> std::result::Result<(), Failure> {
    let Some(p) = peers.get_mut(peer).and_then(Option::as_mut) else {
        return Ok(());
    };
    loop {
        match (&p.stream).read(&mut p.ctl[p.ctl_len..]) {
            Ok(0) if p.departed => return Ok(()),
            Ok(0) => {
                return Err(Failure::Lost {
                    peer,
                    detail: closed_message(peer),
                });
            }
            Ok(k) => {
                p.ctl_len += k;
                if p.ctl_len == HEADER_LEN {
                    p.ctl_len = 0;
                    match Header::decode(&p.ctl) {
                        Ok(h) if h.kind == FrameKind::Goodbye => p.departed = true,
                        Ok(h) => {
                            return Err(Failure::Protocol {
                                peer,
                                detail: format!(
                                    "rank {peer} sent data ({}) on a connection that carries \
                                     none: ranks disagree on the ring",
                                    h.describe()
                                ),
                            });
                        }
                        Err(e) => return Err(Failure::Protocol { peer, detail: e }),
                    }
                }
            }
            Err(e) if is_would_block(&e) => return Ok(()),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) if p.departed => return Ok(()),
            Err(e) => return Err(connection_failed(peer, &e)),
        }
    }
}

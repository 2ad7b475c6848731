//! A rank's side of the mesh that accepts the higher ranks, bounded against floods: anyone who
//! can reach the port can connect, so every connection's admission runs on a thread of its own
//! (a silent one holds up no one behind it), at most [`MAX_PENDING`] are in admission at once
//! (a newer one closes the oldest, as the store does: the job's ranks, whose handshakes take
//! milliseconds, dial again), a connection that fails admission is closed at once, a failing
//! `accept` (no file descriptor left) pauses the loop instead of ending the rendezvous, and the
//! deadline and the admitted peers are looked at on every turn, however fast connections come.

use std::collections::VecDeque;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::mpsc::{Receiver, Sender};
use std::time::{Duration, Instant};

use super::{ADMISSION_TIMEOUT, Mesh, parse_claims, side};
use crate::error::{DdpError, Result};
use crate::secret::handshake;
use crate::status::name_ranks;

/// Most connections in admission at once; a newer one closes the oldest.
pub(crate) const MAX_PENDING: usize = 64;
/// Most connections accepted in one turn before the loop looks at admitted peers and the
/// deadline again.
const ACCEPTS_PER_TURN: usize = 256;
/// Longest pause after failed accepts (out of file descriptors, say).
const MAX_ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// What an admission thread reports: connection `id`, admitted (with its stream) or not.
type Outcome = (u64, Option<(TcpStream, handshake::Verified)>);

/// The connections in admission, oldest first: a duplicate of each, to close it from here.
#[derive(Default)]
struct Pending {
    next: u64,
    queue: VecDeque<(u64, SocketAddr, TcpStream)>,
}

impl Pending {
    /// Registers a new connection; closes the oldest beyond [`MAX_PENDING`] and returns the
    /// new one's id and how many it closed.
    fn add(&mut self, stream: &TcpStream, from: SocketAddr) -> (u64, usize) {
        let id = self.next;
        self.next += 1;
        if let Ok(dup) = stream.try_clone() {
            self.queue.push_back((id, from, dup));
        }
        let mut evicted = 0;
        while self.queue.len() > MAX_PENDING {
            if let Some((_, _, oldest)) = self.queue.pop_front() {
                let _ = oldest.shutdown(std::net::Shutdown::Both);
                evicted += 1;
            }
        }
        (id, evicted)
    }

    /// Forgets connection `id` (its duplicate closes); `false` when it was closed as the oldest
    /// meanwhile.
    fn finish(&mut self, id: u64) -> bool {
        let before = self.queue.len();
        self.queue.retain(|(p, _, _)| *p != id);
        self.queue.len() < before
    }

    /// Closes every connection still in admission.
    fn close_all(&mut self) {
        for (_, _, stream) in self.queue.drain(..) {
            let _ = stream.shutdown(std::net::Shutdown::Both);
        }
    }
}

impl Mesh<'_> {
    /// Accepts the higher ranks until each is connected (see the module documentation);
    /// connections that fail admission are refused without stopping the group, an admitted
    /// peer that does not fit stops it.
    pub(super) fn accept_higher(
        &self,
        listener: &TcpListener,
        peers: &mut [Option<TcpStream>],
    ) -> Result<()> {
        listener
            .set_nonblocking(true)
            .map_err(|e| DdpError::io("configuring the data-plane listener", e))?;
        let (done, outcomes) = std::sync::mpsc::channel();
        let mut pending = Pending::default();
        let outcome = self.accept_until_connected(listener, peers, &mut pending, done, &outcomes);
        // Connections still in admission are not the job's ranks.
        pending.close_all();
        outcome
    }

    fn accept_until_connected(
        &self,
        listener: &TcpListener,
        peers: &mut [Option<TcpStream>],
        pending: &mut Pending,
        done: Sender<Outcome>,
        outcomes: &Receiver<Outcome>,
    ) -> Result<()> {
        let (rank, world) = (self.rank, self.world);
        let mut expected = world - 1 - rank;
        let mut backoff = Duration::ZERO;
        let mut flooded = false;
        while expected > 0 {
            if Instant::now() >= self.deadline {
                let missing: Vec<usize> =
                    (rank + 1..world).filter(|r| peers[*r].is_none()).collect();
                return Err(self.fail(format!(
                    "{} published an address but never connected",
                    name_ranks(&missing)
                )));
            }
            let mut busy = false;
            for _ in 0..ACCEPTS_PER_TURN {
                match listener.accept() {
                    Ok((stream, from)) => {
                        busy = true;
                        backoff = Duration::ZERO;
                        let (id, evicted) = pending.add(&stream, from);
                        if evicted > 0 && !std::mem::replace(&mut flooded, true) {
                            log::warn!(
                                "rank {rank}: more than {MAX_PENDING} data-plane connections \
                                 are in admission; closing the oldest (is something other than \
                                 this job's ranks connecting to {}?)",
                                listener.local_addr().map_or("?".into(), |a| a.to_string())
                            );
                        }
                        self.start_admission(id, stream, from, done.clone());
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                    Err(e) => {
                        // Retrying at once would spin while the cause lasts (no descriptor
                        // left): pause, 1 ms doubling to 100 ms; warn once per spell.
                        if backoff.is_zero() {
                            log::warn!(
                                "rank {rank}: accepting a data-plane connection failed: {e}; \
                                 retrying with a growing pause"
                            );
                        }
                        backoff = (backoff * 2).clamp(Duration::from_millis(1), MAX_ACCEPT_BACKOFF);
                        break;
                    }
                }
            }
            while let Ok((id, admitted)) = outcomes.try_recv() {
                busy = true;
                // A connection closed as the oldest meanwhile is not used: its peer, if a
                // rank, dials again.
                if pending.finish(id)
                    && let Some((stream, verified)) = admitted
                    && let Some(peer) = self.place(&stream, verified, peers)?
                {
                    peers[peer] = Some(stream);
                    expected -= 1;
                }
            }
            if !busy {
                std::thread::sleep(backoff.max(Duration::from_millis(1)));
            }
        }
        Ok(())
    }

    /// Runs admission on connection `id` from `from` on a thread of its own (bounded by
    /// [`ADMISSION_TIMEOUT`]) and reports the outcome to `done`; a refused connection is
    /// logged and closed by the thread.
    fn start_admission(&self, id: u64, stream: TcpStream, from: SocketAddr, done: Sender<Outcome>) {
        let (rank, mine, secret) = (self.rank, self.mine.clone(), self.secret.cloned());
        let until = self.deadline.min(Instant::now() + ADMISSION_TIMEOUT);
        let report = done.clone();
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
                        let _ = done.send((id, Some((stream, verified))));
                    }
                    Err(e) => {
                        log::warn!("rank {rank}: refused a data-plane connection from {from}: {e}");
                        drop(stream);
                        let _ = done.send((id, None));
                    }
                }
            });
        if let Err(e) = spawned {
            log::warn!("rank {rank}: cannot admit a data-plane connection from {from}: {e}");
            let _ = report.send((id, None));
        }
    }

    /// Places an admitted connection: the peer it turned out to be, `None` when its claims do
    /// not decode (refused), or the error of a peer that does not fit.
    fn place(
        &self,
        stream: &TcpStream,
        verified: handshake::Verified,
        peers: &[Option<TcpStream>],
    ) -> Result<Option<usize>> {
        let (rank, world) = (self.rank, self.world);
        let from = stream
            .peer_addr()
            .map_or_else(|_| "?".to_string(), |a| a.to_string());
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

//! The engine's failures in words: a failed send or receive, a closed connection, a header that
//! does not fit, and the control frames (goodbyes, closes) of peers that send no data.
//!
//! A peer that closes its connection without a goodbye (its process exited or died, or its
//! goodbye could not be written) is a failure of the running schedule only where this rank
//! still needs it: its predecessor while chunks are due (the receive notices), its successor
//! while chunks remain to send. Any other peer may have finished the operation before it went
//! (its part was done and forwarded), so its close is recorded and the schedule goes on: if
//! the peer did not finish, the ranks that need it fail and close in turn, and this rank's
//! predecessor or successor is among them. A close recorded before a schedule starts fails it
//! at once, since the peer takes part in no later operation.

use std::io::{self, Read};
use std::time::Duration;

use super::{Cursor, Fault, Faulty, Neighbours, Peer, is_would_block};
use crate::collectives::OpDesc;
use crate::collectives::transport::schedule::Schedule;
use crate::collectives::transport::tcp::frame::{FrameKind, HEADER_LEN, Header};

/// Explains a failed send to `next`: a goodbye waiting on the same connection says the peer
/// left; otherwise the socket error says how it went.
/// `prev` is the schedule's predecessor, `senders` the peers that send this rank data.
pub(super) fn send_failed(
    peers: &mut [Option<Peer>],
    (prev, senders): (usize, [usize; 2]),
    next: usize,
    e: io::Error,
) -> Fault {
    if next != prev {
        if let Err(specific) = check_control(peers, next, senders) {
            return specific;
        }
        match peers[next].as_ref() {
            Some(p) if p.departed => {
                return Fault {
                    peer: next,
                    detail: format!(
                        "rank {next} left the group (dropped its process group) while this \
                         rank sends to it"
                    ),
                };
            }
            Some(Peer {
                closed: Some(detail),
                ..
            }) => {
                return Fault {
                    peer: next,
                    detail: detail.clone(),
                };
            }
            _ => {}
        }
    }
    connection_failed(next, &e)
}

/// The first peer whose close without a goodbye was recorded (during an earlier schedule, when
/// asked as one starts), as the failure it is now.
pub(super) fn closed_before(peers: &[Option<Peer>]) -> Faulty {
    let closed = peers.iter().enumerate().find_map(|(peer, p)| {
        let detail = p.as_ref()?.closed.clone()?;
        Some(Fault { peer, detail })
    });
    closed.map_or(Ok(()), Err)
}

/// The failure of a schedule that made no progress for the whole `timeout` on rank `me`, at
/// `at`, naming the peer it waited for.
pub(super) fn stalled(
    (me, timeout): (usize, Duration),
    at: &Cursor,
    sched: &Schedule,
    Neighbours { next, prev }: Neighbours,
) -> Fault {
    let (peer, what) = if at.recvd < sched.recvs.len() {
        (prev, "to receive from")
    } else {
        (next, "to send to")
    };
    Fault {
        peer,
        detail: format!(
            "rank {me} waited {timeout:?} {what} rank {peer} without progress (chunk {}/{} \
             received, {}/{} sent)",
            at.recvd,
            sched.recvs.len(),
            at.sent,
            sched.sends.len()
        ),
    }
}

pub(super) fn closed_message(peer: usize) -> String {
    format!("rank {peer} closed its connection without leaving the group (process died or aborted)")
}

/// A socket error on the connection to `peer`, worded by what it means.
pub(super) fn connection_failed(peer: usize, e: &io::Error) -> Fault {
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
pub(super) fn check_header(
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

/// Reads the control frames of `peer`, which woke this rank (`me`) while it waits in a schedule
/// that does not receive from it (see [`check_control`]). Its close without a goodbye fails the
/// schedule if it is this schedule's successor `next` and this rank is still `sending` to it;
/// otherwise the close is recorded, and the schedule goes on.
pub(super) fn check_woken(
    peers: &mut [Option<Peer>],
    peer: usize,
    senders: [usize; 2],
    (me, next, sending): (usize, usize, bool),
) -> Faulty {
    let Some(p) = peers.get(peer).and_then(Option::as_ref) else {
        return Ok(());
    };
    if p.closed.is_some() {
        return Ok(());
    }
    check_control(peers, peer, senders)?;
    let Some(detail) = peers[peer].as_ref().and_then(|p| p.closed.clone()) else {
        return Ok(());
    };
    if peer == next && sending {
        return Err(Fault { peer, detail });
    }
    log::info!(
        "rank {me}: {detail}, while this rank needs nothing more from it in this operation \
         (it may have finished its part): going on"
    );
    Ok(())
}

/// Reads what `peer` wrote while this rank does not receive from it: a goodbye (the peer is
/// marked departed), or a close without one (marked closed, with what happened: whether that
/// fails an operation is the caller's call, see the module's doc). Data headers are left in the
/// socket: from `senders` (the predecessors of this rank in the group's ring and in its ring
/// across hosts, which may run ahead into the next operation while this rank finishes the other
/// ring) they wait for that operation; from any other peer they mean the ranks disagree on the
/// ring.
pub(super) fn check_control(
    peers: &mut [Option<Peer>],
    peer: usize,
    senders: [usize; 2],
) -> Faulty {
    let Some(p) = peers.get_mut(peer).and_then(Option::as_mut) else {
        return Ok(());
    };
    if p.closed.is_some() {
        return Ok(());
    }
    let mut head = [0u8; HEADER_LEN];
    loop {
        match p.stream.peek(&mut head) {
            Ok(0) if p.departed => return Ok(()),
            Ok(0) => {
                p.closed = Some(closed_message(peer));
                return Ok(());
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
            Err(e) => {
                p.closed = Some(connection_failed(peer, &e).detail);
                return Ok(());
            }
        }
    }
}

//! The engine's failures in words: a failed send or receive, a closed connection, a header that
//! does not fit, and the control frames (goodbyes, closes) of peers that send no data.

use std::io::{self, Read};

use super::{Fault, Faulty, Peer, is_would_block};
use crate::collectives::OpDesc;
use crate::collectives::tcp::frame::{FrameKind, HEADER_LEN, Header};

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

/// Reads what `peer` wrote while this rank does not receive from it: a goodbye, or the close of
/// a dead peer. Data headers are left in the socket: from `senders` (the predecessors of this
/// rank in the group's ring and in its ring across hosts, which may run ahead into the next
/// operation while this rank finishes the other ring) they wait for that operation; from any
/// other peer they mean the ranks disagree on the ring.
pub(super) fn check_control(
    peers: &mut [Option<Peer>],
    peer: usize,
    senders: [usize; 2],
) -> Faulty {
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

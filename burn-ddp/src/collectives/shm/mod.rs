//! The shared-memory transport, for groups whose ranks all run on one host: collectives move
//! through one POSIX shared-memory segment instead of sockets.
//!
//! - `setup` decides at rendezvous whether the group uses it (every rank on the same host, by
//!   host name and boot id, and `BURN_DDP_TRANSPORT` allowing it) and sets the segment up;
//! - `segment` lays the segment out (a control block and a data slot per rank, a result area)
//!   and creates, opens and unlinks it;
//! - `mapping` holds all of burn-ddp's `unsafe`: the mapping and raw copies in and out of it.
//!
//! Synchronisation: each rank's control block holds a step counter. A rank finishes a step by
//! storing its counter (release) and waits until every peer's counter reached it (acquire): a
//! barrier without locks. The first step of every operation also publishes the operation (kind,
//! sequence number, dtype, size, operand), which every rank checks against its own, so ranks in
//! different collectives stop with a desync error. Waiting spins, then yields, then sleeps
//! briefly while checking the peers' TCP connections (still open from the rendezvous), so a
//! peer that dies or leaves is named at once; one that merely stops is named after the timeout.
//!
//! All-reduce: the buffer is cut into one segment per rank as by the TCP ring, and processed in
//! rounds of one piece per segment. Each rank copies its pieces into its slot; rank `s` reduces
//! piece `s` over every rank's copy in the ring's order (so results are bit-identical to the TCP
//! transport's) into the result area; every rank copies the results out.

mod mapping;
mod ops;
mod segment;
pub(crate) mod setup;

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use self::mapping::Mapping;
use self::segment::{Field, Layout};
use crate::collectives::OpDesc;

/// Longest the wait yields the core before it starts to sleep and check the peers' sockets.
const YIELD_FOR: Duration = Duration::from_millis(1);
/// Sleep between checks once waiting is long.
const NAP: Duration = Duration::from_micros(50);

/// A peer this rank found at fault, and what happened.
#[derive(Debug)]
pub(crate) struct Fault {
    pub peer: usize,
    pub detail: String,
}

/// Checks the connection to a peer this rank waits for: `Some(what happened)` when it closed or
/// said goodbye.
pub(crate) type PeerCheck<'a> = dyn FnMut(usize) -> Option<String> + 'a;

/// One rank's end of the shared-memory segment.
pub(crate) struct ShmChannel {
    rank: usize,
    world: usize,
    map: Mapping,
    layout: Layout,
    /// Steps this rank completed (the value of its counter).
    step: u64,
    timeout: Duration,
    spin: Duration,
    /// Two chunk buffers for the reduction chain (`u64` to be aligned for every element type).
    scratch: [Vec<u64>; 2],
}

impl ShmChannel {
    fn new(rank: usize, map: Mapping, layout: Layout, timeout: Duration, spin: Duration) -> Self {
        debug_assert!(map.len() >= layout.len());
        ShmChannel {
            rank,
            world: layout.world,
            map,
            layout,
            step: 0,
            timeout,
            spin,
            scratch: [Vec::new(), Vec::new()],
        }
    }

    /// Reads `rank`'s `field`; operation fields from the bank of this rank's last step.
    fn load(&self, rank: usize, field: Field) -> u64 {
        let order = match field {
            Field::Step => Ordering::Acquire,
            _ => Ordering::Relaxed,
        };
        let at = self.layout.field(rank, field, self.step);
        self.map.counter(at).load(order)
    }

    /// Publishes `op` (with `aux`) as this rank's operation, in the bank of its next step, with
    /// which the peers see it.
    fn publish(&self, op: &OpDesc, aux: u64) {
        let fields = [
            (Field::Kind, op.kind as u64),
            (Field::Seq, op.seq),
            (Field::DType, op.dtype as u64),
            (Field::Bytes, op.bytes),
            (Field::Aux, aux),
        ];
        for (field, value) in fields {
            let at = self.layout.field(self.rank, field, self.step + 1);
            self.map.counter(at).store(value, Ordering::Relaxed);
        }
    }

    /// Checks every peer published the same operation as this rank (`aux` too when `same_aux`);
    /// returns every rank's operand.
    fn check_ops(&self, op: &OpDesc, aux: u64, same_aux: bool) -> Result<Vec<u64>, Fault> {
        let mut auxes = Vec::with_capacity(self.world);
        for peer in 0..self.world {
            let theirs = (
                self.load(peer, Field::Kind),
                self.load(peer, Field::Seq),
                self.load(peer, Field::DType),
                self.load(peer, Field::Bytes),
            );
            let peer_aux = self.load(peer, Field::Aux);
            let mine = (op.kind as u64, op.seq, op.dtype as u64, op.bytes);
            if peer != self.rank && (theirs != mine || (same_aux && peer_aux != aux)) {
                return Err(Fault {
                    peer,
                    detail: format!(
                        "ranks disagree on the collective (desync): rank {peer} runs {} while \
                         rank {} runs {}",
                        describe(theirs, peer_aux),
                        self.rank,
                        describe(mine, aux)
                    ),
                });
            }
            auxes.push(peer_aux);
        }
        Ok(auxes)
    }

    /// Ends this rank's step and waits until every peer ended it too.
    fn step(&mut self, check: &mut PeerCheck<'_>) -> Result<(), Fault> {
        self.step += 1;
        let target = self.step;
        self.map
            .counter(self.layout.field(self.rank, Field::Step, 0))
            .store(target, Ordering::Release);
        let start = Instant::now();
        let mut last_check = start;
        loop {
            let behind = (0..self.world)
                .filter(|&r| r != self.rank)
                .map(|r| (self.load(r, Field::Step), r))
                .filter(|&(s, _)| s < target)
                .min();
            let Some((theirs, peer)) = behind else {
                return Ok(());
            };
            let waited = start.elapsed();
            if waited < self.spin {
                std::hint::spin_loop();
                continue;
            }
            if last_check.elapsed() >= YIELD_FOR || waited >= self.timeout {
                last_check = Instant::now();
                if let Some(detail) = check(peer) {
                    return Err(Fault { peer, detail });
                }
            }
            if waited >= self.timeout {
                return Err(Fault {
                    peer,
                    detail: format!(
                        "rank {} waited {:?} in shared memory for rank {peer} without progress \
                         (it completed {theirs} steps, this rank {target})",
                        self.rank, self.timeout
                    ),
                });
            }
            if waited < YIELD_FOR {
                std::thread::yield_now();
            } else {
                std::thread::sleep(NAP);
            }
        }
    }
}

/// An operation as published in a control block, for desync messages.
fn describe((kind, seq, dtype, bytes): (u64, u64, u64, u64), aux: u64) -> String {
    use crate::collectives::{DType, OpKind};
    let known = (
        u8::try_from(kind).ok().and_then(OpKind::from_code),
        u8::try_from(dtype).ok().and_then(DType::from_code),
    );
    match known {
        (Some(kind), Some(dtype)) => {
            let op = OpDesc {
                kind,
                seq,
                dtype,
                bytes,
            };
            match kind {
                OpKind::Broadcast => format!("{op} from root {aux}"),
                _ => op.to_string(),
            }
        }
        _ => format!("an unknown operation (codes {kind:?}, {dtype:?}, #{seq})"),
    }
}

//! The shared-memory transport, for the ranks of a group that run on one host: collectives move
//! through one shared-memory segment per host instead of sockets.
//!
//! - `setup` decides at rendezvous whether the group uses it (ranks grouped by host: host name,
//!   boot id and network namespace; `BURN_DDP_TRANSPORT` allowing it) and sets the segments up;
//! - `segment` lays the segment out (a control block and a data slot per rank, a result area)
//!   and creates (an anonymous memory file, sealed against resizing) and opens it;
//! - `handoff` passes the segment's descriptor from its creator to the host's other ranks over
//!   a Unix socket;
//! - the mapping itself and the raw copies in and out of it are in `crate::sys::mapping` (where
//!   all of burn-ddp's `unsafe` is).
//!
//! Synchronisation: each rank's control block holds a step counter. A rank finishes a step by
//! storing its counter (release) and waits until every peer's counter reached it (acquire): a
//! barrier without locks. The first step of every operation also publishes the operation (kind,
//! sequence number, dtype, size, operand), which every rank checks against its own, so ranks in
//! different collectives stop with a desync error. Waiting spins, then yields, then sleeps
//! briefly while checking the peers' TCP connections (still open from the rendezvous), so a
//! peer that dies or leaves is named at once; one that merely stops is named after the timeout.
//!
//! All-reduce: the buffer is cut into one segment per rank of the host as by the TCP ring, and
//! processed in rounds of one piece per segment. Each rank copies its pieces into its slot; rank
//! `s` reduces piece `s` over every rank's copy in the ring's order (so on one host results are
//! bit-identical to the TCP transport's) into the result area; every rank copies the results
//! out. On several hosts (hierarchical all-reduce), between the reduction and the result area
//! local rank `s` all-reduces its piece with the local ranks `s` of the other hosts, over TCP
//! ([`Peers::across_hosts`]): every byte crosses between hosts once per direction, and the ranks
//! of a host share the work.

mod handoff;
mod ops;
mod segment;
pub(crate) mod setup;

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use self::segment::{Field, Layout};
use crate::collectives::OpDesc;
use crate::sys::mapping::Mapping;

/// Longest the wait yields the core before it starts to sleep and check the peers' sockets.
const YIELD_FOR: Duration = Duration::from_millis(1);
/// Sleep between checks once waiting is long.
const NAP: Duration = Duration::from_micros(50);

/// A peer this rank found at fault (its rank in the group), and what happened.
#[derive(Debug)]
pub(crate) struct Fault {
    pub peer: usize,
    pub detail: String,
}

/// What the shared-memory collectives need of the network (the TCP transport provides it).
pub(crate) trait Peers {
    /// Checks the connection to `peer` (a rank of the group) this rank waits for:
    /// `Some(what happened)` when it closed or said goodbye.
    fn gone(&mut self, peer: usize) -> Option<String>;

    /// All-reduces this rank's reduced `piece` with the same piece on the other hosts (the
    /// ranks of the same local rank), summing for an average: the middle of a hierarchical
    /// all-reduce. Only called on channels of several hosts.
    fn across_hosts(&mut self, piece: &mut [u8]) -> Result<(), Fault>;
}

/// One rank's end of its host's shared-memory segment.
pub(crate) struct ShmChannel {
    /// This rank's index among the ranks of its host.
    rank: usize,
    /// Ranks on this host.
    world: usize,
    /// The group ranks of the host's ranks, by local index.
    ranks: Vec<usize>,
    /// Hosts of the group (each with `world` ranks): 1, or more for a hierarchical all-reduce.
    hosts: usize,
    map: Mapping,
    layout: Layout,
    /// Steps this rank completed (the value of its counter).
    step: u64,
    timeout: Duration,
    spin: Duration,
    /// A peer's chunk during the reduction (`u64` to be aligned for every element type).
    scratch: Vec<u64>,
    /// A pause between reading a peer's counter and checking its connection: zero, but for
    /// the tests that widen that window (`testing::widen_leave_window`, feature
    /// `test-support`).
    leave_window: Duration,
}

impl ShmChannel {
    /// The channel of local rank `rank` among the host's `ranks` (group ranks), in a group of
    /// `hosts` such hosts.
    fn new(
        rank: usize,
        ranks: Vec<usize>,
        hosts: usize,
        map: Mapping,
        layout: Layout,
        timeouts: (Duration, Duration),
    ) -> Self {
        debug_assert!(map.len() >= layout.len() && ranks.len() == layout.world);
        let (timeout, spin) = timeouts;
        ShmChannel {
            rank,
            world: layout.world,
            ranks,
            hosts,
            map,
            layout,
            step: 0,
            timeout,
            spin,
            scratch: Vec::new(),
            leave_window: Duration::ZERO,
        }
    }

    /// Pauses `pause` between reading a peer's counter and checking its connection in every
    /// wait (a test's wide window).
    #[cfg(feature = "test-support")]
    pub(crate) fn widen_leave_window(&mut self, pause: Duration) {
        self.leave_window = pause;
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

    /// Whether the group spans several hosts (a hierarchical all-reduce).
    pub(crate) fn spans_hosts(&self) -> bool {
        self.hosts > 1
    }

    /// A fault of local rank `peer`, named by its group rank.
    fn fault(&self, peer: usize, detail: String) -> Fault {
        Fault {
            peer: self.ranks[peer],
            detail,
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
                return Err(self.fault(
                    peer,
                    format!(
                        "ranks disagree on the collective (desync): rank {} runs {} while \
                         rank {} runs {}",
                        self.ranks[peer],
                        describe(theirs, peer_aux),
                        self.ranks[self.rank],
                        describe(mine, aux)
                    ),
                ));
            }
            // This rank's own operand is the one it holds, not one read back from the segment
            // (which another process of the same user could have written).
            auxes.push(if peer == self.rank { aux } else { peer_aux });
        }
        Ok(auxes)
    }

    /// Ends this rank's step and waits until every peer ended it too.
    fn step(&mut self, net: &mut dyn Peers) -> Result<(), Fault> {
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
                if !self.leave_window.is_zero() {
                    std::thread::sleep(self.leave_window);
                }
                if let Some(detail) = net.gone(self.ranks[peer]) {
                    // Its counter was read before the check: since then it may have ended
                    // this step, returned and left the group. Only a peer that left before
                    // ending the step is a failure.
                    if self.load(peer, Field::Step) >= target {
                        continue;
                    }
                    return Err(self.fault(peer, detail));
                }
            }
            if waited >= self.timeout {
                return Err(self.fault(
                    peer,
                    format!(
                        "rank {} waited {:?} in shared memory for rank {} without progress \
                         (it completed {theirs} steps, this rank {target})",
                        self.ranks[self.rank], self.timeout, self.ranks[peer]
                    ),
                ));
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
            let reduce = ["sum", "avg", "max", "min"]
                .get((aux & 0xff) as usize)
                .unwrap_or(&"an unknown reduction");
            match kind {
                OpKind::Broadcast => format!("{op} from root {aux}"),
                OpKind::AllReduce => format!("{op} ({reduce})"),
                OpKind::ReduceScatter => format!("{op} ({reduce}, parts {:014x})", aux >> 8),
                _ => op.to_string(),
            }
        }
        _ => format!("an unknown operation (codes {kind:?}, {dtype:?}, #{seq})"),
    }
}

#[cfg(test)]
mod tests {
    use super::segment::{self, Layout};
    use super::*;

    /// Local ranks 0 and 1 of one segment, in this process.
    fn pair() -> (ShmChannel, ShmChannel) {
        let layout = Layout::new(2, 4096);
        let (fd, a) = segment::create(layout.len()).unwrap();
        let b = segment::open(&fd, layout.len()).unwrap();
        let timeouts = (Duration::from_secs(10), Duration::ZERO);
        let channel = |rank, map| ShmChannel::new(rank, vec![0, 1], 1, map, layout, timeouts);
        (channel(0, a), channel(1, b))
    }

    /// Rank 0's network while it waits for rank 1 at the end of a step: when rank 0 checks the
    /// connection, rank 1 has just (`ended`) or not ended the step, and left the group. This is
    /// the window of a rank descheduled between reading its peer's counter and checking its
    /// connection, made as wide as it gets.
    struct LeavesDuringTheCheck<'a> {
        peer: &'a mut ShmChannel,
        ended: bool,
    }

    impl Peers for LeavesDuringTheCheck<'_> {
        fn gone(&mut self, peer: usize) -> Option<String> {
            assert_eq!(peer, 1);
            if std::mem::take(&mut self.ended) {
                // Rank 0's counter is already at the step: rank 1 does not wait.
                self.peer.step(&mut Quiet).unwrap();
            }
            Some("rank 1 left the group (dropped its process group)".into())
        }

        fn across_hosts(&mut self, _: &mut [u8]) -> Result<(), Fault> {
            unreachable!("one host")
        }
    }

    /// A network where every peer is there.
    struct Quiet;

    impl Peers for Quiet {
        fn gone(&mut self, _: usize) -> Option<String> {
            None
        }

        fn across_hosts(&mut self, _: &mut [u8]) -> Result<(), Fault> {
            unreachable!("one host")
        }
    }

    #[test]
    fn a_peer_that_ended_the_step_and_left_is_no_failure() {
        let (mut a, mut b) = pair();
        let mut net = LeavesDuringTheCheck {
            peer: &mut b,
            ended: true,
        };
        assert_eq!(a.step(&mut net).map_err(|f| f.detail), Ok(()));
    }

    #[test]
    fn a_peer_that_left_before_ending_the_step_is_named() {
        let (mut a, mut b) = pair();
        let mut net = LeavesDuringTheCheck {
            peer: &mut b,
            ended: false,
        };
        let fault = a.step(&mut net).unwrap_err();
        assert_eq!(fault.peer, 1);
        assert!(
            fault.detail.contains("rank 1 left the group"),
            "{}",
            fault.detail
        );
    }
}

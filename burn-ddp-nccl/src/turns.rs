//! `Turns`: the order in which one communicator's collectives are enqueued.
//!
//! NCCL matches collectives across ranks by the order each rank enqueues them on a
//! communicator. A collective is started on one thread ([`crate::NcclComm::start_all_reduce`]
//! and the others) and enqueued when [`crate::Pending::wait`] runs, perhaps on another thread:
//! two waits on two threads could enqueue in either order, a different one on each rank. So
//! every start takes a [`Ticket`], numbered in start order, and a wait enqueues only once every
//! earlier ticket is finished: enqueued, or given up (dropped). The order across ranks is then
//! the start order, which the caller keeps the same on every rank, as NCCL asks.

use std::collections::BTreeSet;
use std::convert::Infallible;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::waiting::{Stop, poll_until};

/// The tickets of one communicator.
#[derive(Debug, Default)]
pub(crate) struct Turns {
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// The number the next ticket gets.
    issued: u64,
    /// The oldest ticket not finished: its turn.
    serving: u64,
    /// Tickets finished out of turn (a dropped one behind an unfinished one).
    finished: BTreeSet<u64>,
}

/// A collective's place in its communicator's start order. Finishing it (dropping it, after
/// the enqueue or instead of it) gives the turn to the next ticket.
#[derive(Debug)]
pub(crate) struct Ticket {
    turns: Arc<Turns>,
    number: u64,
}

impl Turns {
    /// A new ticket, after every one taken so far.
    pub(crate) fn take(self: &Arc<Self>) -> Ticket {
        let mut state = self.lock();
        let number = state.issued;
        state.issued += 1;
        Ticket {
            turns: self.clone(),
            number,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Ticket `number` is finished: the turn moves past it and past every later one finished.
    fn finish(&self, number: u64) {
        let mut guard = self.lock();
        let state = &mut *guard;
        state.finished.insert(number);
        while state.finished.remove(&state.serving) {
            state.serving += 1;
        }
    }
}

impl Ticket {
    /// Whether every earlier ticket is finished.
    pub(crate) fn is_turn(&self) -> bool {
        self.turns.lock().serving == self.number
    }

    /// Waits until [`Ticket::is_turn`], bounded like every wait here: by `timeout`, by
    /// `aborted` and by `watch` (see [`poll_until`]).
    pub(crate) fn wait_turn(
        &self,
        timeout: Duration,
        aborted: &AtomicBool,
        watch: &mut dyn FnMut() -> Option<String>,
    ) -> Result<(), Stop<Infallible>> {
        poll_until(timeout, aborted, watch, || {
            Ok::<_, Infallible>(self.is_turn())
        })
    }

    /// What a wait for this ticket's turn is waiting for, in words (for an error).
    pub(crate) fn waiting_for(&self) -> String {
        let serving = self.turns.lock().serving;
        if serving == self.number {
            return format!(
                "collective #{} of this communicator had its turn",
                self.number
            );
        }
        format!(
            "collective #{} of this communicator, waiting for its turn behind collective \
             #{serving}, which was started earlier and is neither waited for nor dropped: a \
             communicator enqueues its collectives in the order they are started",
            self.number
        )
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.turns.finish(self.number);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    fn never() -> Option<String> {
        None
    }

    /// Waits for `ticket`'s turn (for at most 10 s), then records it as enqueued.
    fn enqueue(ticket: Ticket, enqueued: &Mutex<Vec<u64>>) -> Result<(), Stop<Infallible>> {
        ticket.wait_turn(Duration::from_secs(10), &AtomicBool::new(false), &mut never)?;
        enqueued.lock().unwrap().push(ticket.number);
        Ok(())
    }

    /// Collectives waited on four threads in the reverse of their start order are enqueued in
    /// start order.
    #[test]
    fn out_of_order_waits_are_enqueued_in_start_order() {
        let turns = Arc::new(Turns::default());
        let tickets: Vec<Ticket> = (0..4).map(|_| turns.take()).collect();
        let enqueued = Arc::new(Mutex::new(Vec::new()));
        let threads: Vec<_> = tickets
            .into_iter()
            .map(|ticket| {
                let enqueued = enqueued.clone();
                // The last started waits first.
                let delay = Duration::from_millis(30 * (4 - ticket.number));
                std::thread::spawn(move || {
                    std::thread::sleep(delay);
                    enqueue(ticket, &enqueued)
                })
            })
            .collect();
        for t in threads {
            assert_eq!(t.join().unwrap(), Ok(()));
        }
        assert_eq!(*enqueued.lock().unwrap(), vec![0, 1, 2, 3]);
    }

    /// A ticket dropped without its collective (a `Pending` never waited) gives up its turn:
    /// the ones after it are not stuck behind it, whichever finishes first.
    #[test]
    fn a_dropped_ticket_releases_its_turn() {
        let turns = Arc::new(Turns::default());
        let (first, second, third) = (turns.take(), turns.take(), turns.take());
        assert!(first.is_turn() && !second.is_turn() && !third.is_turn());
        drop(second);
        assert!(!third.is_turn(), "the first is not finished yet");
        let enqueued = Arc::new(Mutex::new(Vec::new()));
        let waiter = {
            let enqueued = enqueued.clone();
            std::thread::spawn(move || enqueue(third, &enqueued))
        };
        std::thread::sleep(Duration::from_millis(50));
        assert!(
            enqueued.lock().unwrap().is_empty(),
            "third went before first"
        );
        enqueue(first, &enqueued).unwrap();
        assert_eq!(waiter.join().unwrap(), Ok(()));
        assert_eq!(*enqueued.lock().unwrap(), vec![0, 2]);
        assert!(turns.take().is_turn(), "every earlier ticket is finished");
    }

    /// A wait whose turn never comes (an earlier collective held, never waited) ends at its
    /// timeout, and says which collective it was waiting behind.
    #[test]
    fn a_turn_that_never_comes_times_out_with_the_reason() {
        let turns = Arc::new(Turns::default());
        let held = turns.take();
        let late = turns.take();
        let t = Instant::now();
        let r = late.wait_turn(
            Duration::from_millis(200),
            &AtomicBool::new(false),
            &mut never,
        );
        assert_eq!(r, Err(Stop::TimedOut));
        assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
        let why = late.waiting_for();
        assert!(
            why.contains("collective #1") && why.contains("behind collective #0"),
            "{why}"
        );
        assert_eq!(held.number, 0);
    }

    /// An abort from another thread and the watch end a wait for a turn too.
    #[test]
    fn an_abort_or_the_watch_ends_a_wait_for_a_turn() {
        let turns = Arc::new(Turns::default());
        let _held = turns.take();
        let late = turns.take();
        let aborted = AtomicBool::new(true);
        let r = late.wait_turn(Duration::from_secs(300), &aborted, &mut never);
        assert_eq!(r, Err(Stop::Aborted));
        let r = late.wait_turn(
            Duration::from_secs(300),
            &AtomicBool::new(false),
            &mut || Some("rank 1 died".into()),
        );
        assert_eq!(r, Err(Stop::Watched("rank 1 died".into())));
    }
}

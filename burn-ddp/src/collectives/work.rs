//! [`Work`]: a collective that was started and is waited for later (PyTorch's `async_op=True`).

use std::sync::mpsc::{Receiver, TryRecvError};

use crate::error::{DdpError, Result};

/// Handle of a started collective. Operations run in the order they were issued, the same order
/// on every rank; [`Work::wait`] returns the result (the reduced buffer, the gathered data).
///
/// Dropping a `Work` without waiting does not cancel the operation: it still runs, so ranks stay
/// in step.
#[must_use = "a collective's result (and error) is only seen through wait()"]
pub struct Work<T> {
    rank: usize,
    state: State<T>,
}

enum State<T> {
    Pending(Receiver<Result<T>>),
    Done(Result<T>),
    Taken,
}

impl<T> Work<T> {
    pub(crate) fn pending(rank: usize, rx: Receiver<Result<T>>) -> Self {
        Work {
            rank,
            state: State::Pending(rx),
        }
    }

    pub(crate) fn done(rank: usize, result: Result<T>) -> Self {
        Work {
            rank,
            state: State::Done(result),
        }
    }

    /// Blocks until the operation finished and returns its result. Bounded by the group's
    /// timeout: a peer that stops answering turns into an error, not a hang.
    pub fn wait(mut self) -> Result<T> {
        match std::mem::replace(&mut self.state, State::Taken) {
            State::Pending(rx) => rx
                .recv()
                .unwrap_or(Err(DdpError::WorkerGone { rank: self.rank })),
            State::Done(r) => r,
            State::Taken => Err(DdpError::WorkerGone { rank: self.rank }),
        }
    }

    /// Whether the operation has finished (then [`Work::wait`] returns at once).
    pub fn is_completed(&mut self) -> bool {
        if let State::Pending(rx) = &self.state {
            match rx.try_recv() {
                Ok(r) => self.state = State::Done(r),
                Err(TryRecvError::Empty) => return false,
                Err(TryRecvError::Disconnected) => {
                    self.state = State::Done(Err(DdpError::WorkerGone { rank: self.rank }))
                }
            }
        }
        true
    }
}

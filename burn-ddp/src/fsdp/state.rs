//! A model's full state (PyTorch FSDP's `FULL_STATE_DICT`): the record of the model as if no
//! block were wrapped, gathered to rank 0 one block at a time, and loading such a record into
//! a wrapped model at any world size (each rank keeps its piece) or into the unwrapped model
//! (burn's own `load_record`).
//!
//! Both go through burn's record machinery with [`Fsdp`](super::Fsdp)'s visit and map switched,
//! for the current thread, to the whole block ([`mode`]); a listing mode has each block say
//! what its optimizer state is keyed by ([`listing`]).

use std::cell::{Cell, RefCell};
use std::sync::Arc;

use burn::module::Module;
use burn::store::ModuleRecord;

use super::Shared;
use crate::ProcessGroup;
use crate::error::{DdpError, Result};

/// What a wrapped block shows burn's visitors and mappers on this thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(super) enum Mode {
    /// The shard (training, the optimizer, ordinary records).
    #[default]
    Sharded,
    /// The whole block, gathered; visited only when `keep` (rank 0 of a full record).
    Save { keep: bool },
    /// The whole block, loaded from a record and cut to this rank's piece.
    Load,
    /// Nothing: the data-parallel machinery's view of a model ([`replicated`]).
    Replicated,
    /// The shard, each block also listing itself ([`super::optim_state`]).
    List,
}

/// One wrapped block as its optimizer entries see it ([`super::optim_state`]).
pub(super) struct Listed {
    pub(super) shared: Arc<Shared>,
    /// The shard's parameter id on this rank.
    pub(super) shard: u64,
    /// The block's parameters' ids (those its whole record carries), in layout order.
    pub(super) params: Vec<u64>,
}

thread_local! {
    static MODE: Cell<Mode> = const { Cell::new(Mode::Sharded) };
    static FAILED: RefCell<Option<DdpError>> = const { RefCell::new(None) };
    static LISTED: RefCell<Vec<Listed>> = const { RefCell::new(Vec::new()) };
}

/// Called by a wrapped block visited in [`Mode::List`].
pub(super) fn list(block: Listed) {
    LISTED.with(|l| l.borrow_mut().push(block));
}

/// Runs `visit` (a visit of a model) in [`Mode::List`]: the wrapped blocks it met, in order.
pub(super) fn listing(visit: impl FnOnce()) -> Vec<Listed> {
    LISTED.with(|l| l.borrow_mut().clear());
    switched(Mode::List, visit);
    LISTED.with(|l| std::mem::take(&mut *l.borrow_mut()))
}

/// The mode on this thread.
pub(super) fn mode() -> Mode {
    MODE.with(Cell::get)
}

/// Records the first failure of a visit or map (which cannot return one).
pub(super) fn fail(e: DdpError) {
    FAILED.with(|f| {
        f.borrow_mut().get_or_insert(e);
    });
}

/// Runs `f` with every wrapped block hidden from visitors and left as it is by mappers, on
/// this thread: what the data-parallel machinery (the gradient reducer, the start-up broadcast
/// and agreement, the sharded optimizer) sees of a model. Shards differ between ranks by
/// design and their gradients are already reduced inside backward.
pub(crate) fn replicated<T>(f: impl FnOnce() -> T) -> T {
    switched(Mode::Replicated, f)
}

/// Runs `f` with wrapped blocks showing their shards (the default), whatever the caller's mode.
pub(super) fn sharded<T>(f: impl FnOnce() -> T) -> T {
    switched(Mode::Sharded, f)
}

/// Runs `f` with the mode `mode` on this thread, the caller's mode restored after it (also
/// when `f` panics).
fn switched<T>(mode: Mode, f: impl FnOnce() -> T) -> T {
    struct Restore(Mode);
    impl Drop for Restore {
        fn drop(&mut self) {
            MODE.with(|m| m.set(self.0));
        }
    }
    let _restore = Restore(MODE.with(|m| m.replace(mode)));
    f()
}

/// Runs `f` with the mode `mode` on this thread; the first failure recorded meanwhile is the
/// error.
fn with_mode<T>(mode: Mode, f: impl FnOnce() -> T) -> Result<T> {
    FAILED.with(|f| f.borrow_mut().take());
    let out = switched(mode, f);
    match FAILED.with(|f| f.borrow_mut().take()) {
        Some(e) => Err(e),
        None => Ok(out),
    }
}

/// Runs `f` (which takes `model`'s record) with every wrapped block showing its whole
/// parameters, gathered (kept on rank 0 only): a collective, every rank of `group` runs it.
pub(crate) fn saving_whole<T>(group: &ProcessGroup, f: impl FnOnce() -> T) -> Result<T> {
    with_mode(
        Mode::Save {
            keep: group.rank() == 0,
        },
        f,
    )
}

/// Runs `f` (which loads a whole model's record) with every wrapped block taking its whole
/// parameters from the record and keeping this rank's piece.
pub(crate) fn loading_whole<T>(f: impl FnOnce() -> T) -> Result<T> {
    with_mode(Mode::Load, f)
}

/// The record of `model` with every wrapped block whole, as the unwrapped model's record
/// (same module paths, so burn's `load_record` of the unwrapped model takes it): `Some` on
/// rank 0, `None` on the others. A collective: every rank of `group` calls it, and each
/// block is gathered in turn, so no rank holds more than one whole block at once besides
/// rank 0's record.
///
/// # Errors
///
/// A gather's error.
pub fn full_record<M: Module>(model: &M, group: &ProcessGroup) -> Result<Option<ModuleRecord>> {
    let keep = group.rank() == 0;
    let record = with_mode(Mode::Save { keep }, || model.clone().into_record())?;
    Ok(keep.then_some(record))
}

/// `model` with `record` loaded, where `record` is a whole model's record ([`full_record`], or
/// burn's `into_record` of the unwrapped model): each wrapped block takes its parameters from
/// the record and keeps this rank's piece, whatever the world size the record was saved at.
/// Every rank loads the same record (no collective).
///
/// # Errors
///
/// [`DdpError::Checkpoint`] if the record does not fit the model (burn's reason).
pub fn load_full_record<M: Module>(
    model: M,
    record: ModuleRecord,
    group: &ProcessGroup,
) -> Result<M> {
    let loaded = with_mode(Mode::Load, || model.try_load_record(record))?;
    loaded.map_err(|e| DdpError::Checkpoint {
        rank: group.rank(),
        reason: format!("the record does not fit the model: {e}"),
    })
}

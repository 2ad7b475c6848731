//! Layers whose statistics span the whole process group, as PyTorch's `torch.nn.SyncBatchNorm`.
//!
//! Data parallelism gives each rank a slice of the global batch. Most layers do not care, but
//! batch normalisation does: burn's [`BatchNorm`](burn::nn::BatchNorm) normalises with the
//! statistics of the rank's own slice, which is noisy when the per-rank batch is small (detection
//! and segmentation train with 1 to 4 images per GPU) and makes every rank's running statistics
//! different. [`SyncBatchNorm`] computes the mean and variance of the *global* batch in training
//! (one small all-reduce in the forward pass, one in the backward pass) and so trains exactly as
//! one process with the whole batch would.
//!
//! The layer finds its process group through a thread-local scope: [`scope`] sets the group for
//! the current thread until the returned [`GroupScope`] is dropped, and [`current_group`] reads
//! it. The training loop enters the scope on its training thread; without one (a single
//! process, a world of one, or evaluation) `SyncBatchNorm` is burn's `BatchNorm` and
//! communicates nothing.
//!
//! ```no_run
//! use std::sync::Arc;
//! use burn::nn::BatchNormConfig;
//! use burn::tensor::{Device, Tensor};
//! use burn_ddp::nn::{self, SyncBatchNorm};
//!
//! let group = Arc::new(burn_ddp::init_process_group()?);
//! let device = Device::flex().autodiff();
//! let bn = SyncBatchNorm::new(&BatchNormConfig::new(8), &device);
//! let _scope = nn::scope(group); // this thread's SyncBatchNorm layers now use `group`
//! let x = Tensor::<2>::ones([4, 8], &device);
//! let y = bn.forward(x); // normalised with the statistics of every rank's batch
//! # Ok::<(), burn_ddp::DdpError>(())
//! ```

use std::cell::RefCell;
use std::marker::PhantomData;
use std::sync::Arc;

use crate::ProcessGroup;

mod sync_batch_norm;

pub use sync_batch_norm::{BatchNormSyncExt, SyncBatchNorm};

thread_local! {
    static CURRENT: RefCell<Option<Arc<ProcessGroup>>> = const { RefCell::new(None) };
}

/// Makes `group` the current group of this thread until the returned guard is dropped, which
/// restores the group that was current before (scopes nest).
///
/// ```
/// # fn demo(group: std::sync::Arc<burn_ddp::ProcessGroup>) {
/// use burn_ddp::nn;
/// assert!(nn::current_group().is_none());
/// {
///     let _scope = nn::scope(group);
///     assert!(nn::current_group().is_some());
/// }
/// assert!(nn::current_group().is_none());
/// # }
/// ```
pub fn scope(group: Arc<ProcessGroup>) -> GroupScope {
    let previous = CURRENT.with(|c| c.replace(Some(group)));
    GroupScope {
        previous,
        _same_thread: PhantomData,
    }
}

/// The group [`scope`] made current on this thread, if any.
///
/// ```
/// assert!(burn_ddp::nn::current_group().is_none()); // no scope entered on this thread
/// ```
pub fn current_group() -> Option<Arc<ProcessGroup>> {
    CURRENT.with(|c| c.borrow().clone())
}

/// The guard of [`scope`]: restores the previous current group when dropped. It stays on the
/// thread that created it (it is not `Send`).
#[must_use = "the scope ends when the guard is dropped"]
pub struct GroupScope {
    previous: Option<Arc<ProcessGroup>>,
    /// Not `Send`: the thread-local it restores belongs to the creating thread.
    _same_thread: PhantomData<*const ()>,
}

impl std::fmt::Debug for GroupScope {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GroupScope")
            .field("previous", &self.previous)
            .finish()
    }
}

impl Drop for GroupScope {
    fn drop(&mut self) {
        let previous = self.previous.take();
        CURRENT.with(|c| *c.borrow_mut() = previous);
    }
}

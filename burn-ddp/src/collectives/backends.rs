//! The backends of a group (c10d's Backend layer): what moves the bytes of a collective, one per
//! kind of memory a buffer lives in, looked up in one place.
//!
//! - Host buffers (`Vec<T>`) go to the host transport (the TCP ring, shared memory or the
//!   hierarchical schedule, chosen inside it at rendezvous) through the collective thread's
//!   [`Queue`], one at a time, in issue order.
//! - Burn tensors (feature `train`) go to the backend of their device kind
//!   ([`super::backend::DeviceBackend`], chosen on the first tensor of a kind and agreed across
//!   the ranks): NCCL for CUDA, host staging (device -> host transport -> device) for the rest.
//!
//! [`Backends`] is what a process group holds. The group hands it every operation through the
//! buffer traits ([`super::Reducible`] and its siblings); nothing below this layer knows the
//! group, and no backend calls back into this table.

use std::sync::Arc;

#[cfg(feature = "train")]
use burn::tensor::{DType, Device, Tensor};

#[cfg(feature = "train")]
use super::Work;
#[cfg(feature = "train")]
use super::backend::{DeviceBackends, Request};
use super::queue::{Limits, Queue};
use super::transport::host::HostTransport;
use crate::error::Result;
use crate::failure::FailureRecord;
use crate::status::StatusCell;
use crate::store::Store;

/// A group's backends: the collective thread's queue with its host transport, and (feature
/// `train`) the device backends chosen so far. (Nominally `pub` because the buffer traits'
/// hidden methods take it; it is not reachable from outside the crate.)
pub struct Backends {
    /// Dropped first (fields drop in order): the collective thread finishes its queue before
    /// the device communicators go.
    queue: Queue,
    #[cfg(feature = "train")]
    devices: DeviceBackends,
}

impl Backends {
    /// Starts the collective thread of `rank` of `world` over `transport`; the thread reports
    /// each operation in `status` and agrees on failures through `store`.
    pub(crate) fn start(
        rank: usize,
        world: usize,
        transport: HostTransport,
        store: Arc<Store>,
        status: Arc<StatusCell>,
        limits: Limits,
    ) -> Result<Self> {
        let queue = Queue::start(rank, world, transport, store, status, limits)?;
        Ok(Backends {
            #[cfg(feature = "train")]
            devices: DeviceBackends::new(queue.limits()),
            queue,
        })
    }

    /// The host transport's backend: the collective thread's queue.
    pub(crate) fn host(&self) -> &Queue {
        &self.queue
    }

    /// The one routing point of tensors: starts `request` on `tensor` by the backend of its
    /// device kind (agreed across the ranks on first use); `finish` turns the result's tensors
    /// (with the input's device and element type) into what the caller returns.
    #[cfg(feature = "train")]
    pub(crate) fn start_tensor<T: Send + 'static>(
        &self,
        tensor: Tensor<1>,
        request: Request,
        finish: fn(Vec<Tensor<1>>, &Device, DType) -> T,
    ) -> Work<T> {
        let queue = &self.queue;
        if queue.world() == 1 && request.is_identity_alone(tensor.shape().num_elements()) {
            let (device, dtype) = (tensor.device(), tensor.dtype());
            return Work::done(queue.rank(), Ok(finish(vec![tensor], &device, dtype)));
        }
        self.devices.start(queue, tensor, request, finish)
    }

    /// Stops every backend for `record` (already agreed in the store by the caller, so that a
    /// device collective the abort stops reports it): device communicators are aborted, then
    /// the collective thread closes the connections. Returns the agreed cause.
    pub(crate) fn abort(&self, record: FailureRecord) -> Result<String> {
        #[cfg(feature = "train")]
        self.devices.abort();
        self.queue.on_worker(move |w| Ok(w.abort(record))).wait()
    }

    /// Queues an abort for `record` without waiting for it (a rank that panics).
    pub(crate) fn abort_later(&self, record: FailureRecord) {
        let _ = self.queue.on_worker(move |w| Ok(w.abort(record)));
    }
}

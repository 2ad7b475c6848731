//! The backends of a group (c10d's Backend layer) and the one place a buffer finds its own:
//! what collectives accept (the buffer traits, sealed), what a process group holds
//! ([`Backends`]), and the routing of each buffer to the backend that moves it.
//!
//! - Host buffers (`Vec<T>`) go to the host transport (the TCP ring, shared memory or the
//!   hierarchical schedule, chosen inside it at rendezvous) through the collective thread's
//!   [`Queue`], one at a time, in issue order.
//! - Burn tensors (feature `train`) go to the backend of their device kind ([`DeviceBackend`],
//!   chosen on the first tensor of a kind and agreed across the ranks, then looked up in
//!   [`DeviceBackends::start`]): NCCL for CUDA, host staging (device -> host transport ->
//!   device) for the rest.
//!
//! [`crate::ProcessGroup::all_reduce`] and its siblings are generic over the buffer traits, so
//! one call serves every kind of buffer, as `torch.distributed` does. Nothing below this layer
//! knows the group, and no backend calls back into this table.

#[cfg(feature = "train")]
use std::sync::Mutex;

#[cfg(feature = "train")]
use burn::tensor::{DType, Device, Tensor};

#[cfg(all(feature = "train", feature = "test-support"))]
use super::backend::emulated;
#[cfg(all(feature = "train", feature = "nccl"))]
use super::backend::nccl;
#[cfg(feature = "train")]
use super::backend::{DeviceBackend, Kind, Request, one, staged};
#[cfg(feature = "train")]
use super::worker::Limits;
use super::worker::Queue;
#[cfg(feature = "train")]
use super::worker::Worker;
use super::{Element, Reduce, ReduceOp, Work};
#[cfg(feature = "train")]
use crate::error::DdpError;
use crate::error::Result;
use crate::failure::FailureRecord;
#[cfg(feature = "train")]
use crate::wire::{Reader, Writer};

pub(crate) mod sealed {
    /// Keeps the buffer traits closed: the group knows how to move each of them.
    pub trait Sealed {}
}

/// A buffer [`ProcessGroup::all_reduce`](crate::ProcessGroup::all_reduce) and [`ProcessGroup::reduce_scatter`](crate::ProcessGroup::reduce_scatter) can reduce:
/// `Vec<T>` of a [`Reduce`] element type, or (feature `train`) a flat burn `Tensor<1>` of floats
/// on any device.
pub trait Reducible: sealed::Sealed + Sized + Send + 'static {
    /// Starts the all-reduce of `self` by its backend (use [`ProcessGroup::all_reduce`](crate::ProcessGroup::all_reduce)).
    #[doc(hidden)]
    fn start_all_reduce(self, backends: &Backends, op: ReduceOp) -> Work<Self>;
    /// Starts the reduce-scatter of `self` cut into `parts` (element counts by rank, checked
    /// to sum to its length by the backend); the result is this rank's part (use
    /// [`ProcessGroup::reduce_scatter`](crate::ProcessGroup::reduce_scatter)).
    #[doc(hidden)]
    fn start_reduce_scatter(
        self,
        backends: &Backends,
        parts: Vec<usize>,
        op: ReduceOp,
    ) -> Work<Self>;
    /// Its length in elements.
    #[doc(hidden)]
    fn elements(&self) -> usize;
}

/// A buffer [`ProcessGroup::broadcast`](crate::ProcessGroup::broadcast) can send: `Vec<T>` of an element type, or (feature
/// `train`) a flat burn `Tensor<1>` on any device.
pub trait Broadcastable: sealed::Sealed + Sized + Send + 'static {
    /// Starts the broadcast of `self` from `root` (use [`ProcessGroup::broadcast`](crate::ProcessGroup::broadcast)).
    #[doc(hidden)]
    fn start_broadcast(self, backends: &Backends, root: usize) -> Work<Self>;
}

/// A buffer [`ProcessGroup::all_gather`](crate::ProcessGroup::all_gather) can gather: `Vec<u8>` (lengths may differ between
/// ranks), or (feature `train`) a flat burn `Tensor<1>` (the same length on every rank).
pub trait Gatherable: sealed::Sealed + Sized + Send + 'static {
    /// What the gather returns: every rank's buffer, indexed by rank.
    type Gathered: Send + 'static;
    /// Starts the all-gather of `self` (use [`ProcessGroup::all_gather`](crate::ProcessGroup::all_gather)).
    #[doc(hidden)]
    fn start_all_gather(self, backends: &Backends) -> Work<Self::Gathered>;
}

impl<T: Element> sealed::Sealed for Vec<T> {}

impl<T: Reduce> Reducible for Vec<T> {
    fn start_all_reduce(mut self, backends: &Backends, op: ReduceOp) -> Work<Self> {
        if backends.host().world() == 1 {
            return Work::done(backends.host().rank(), Ok(self));
        }
        backends
            .host()
            .submit(move |t| t.all_reduce(&mut self, op).map(|()| self))
    }

    fn start_reduce_scatter(
        mut self,
        backends: &Backends,
        parts: Vec<usize>,
        op: ReduceOp,
    ) -> Work<Self> {
        backends.host().submit(move |t| {
            let mine = t.reduce_scatter(&mut self, &parts, op)?;
            self.truncate(mine.end);
            self.drain(..mine.start);
            Ok(self)
        })
    }

    fn elements(&self) -> usize {
        self.len()
    }
}

impl<T: Element> Broadcastable for Vec<T> {
    fn start_broadcast(mut self, backends: &Backends, root: usize) -> Work<Self> {
        if backends.host().world() == 1 && root == 0 {
            return Work::done(backends.host().rank(), Ok(self));
        }
        backends
            .host()
            .submit(move |t| t.broadcast(&mut self, root).map(|()| self))
    }
}

impl Gatherable for Vec<u8> {
    type Gathered = Vec<Vec<u8>>;

    fn start_all_gather(self, backends: &Backends) -> Work<Vec<Vec<u8>>> {
        if backends.host().world() == 1 && self.len() <= backends.host().limits().max_gather_bytes {
            return Work::done(backends.host().rank(), Ok(vec![self]));
        }
        backends.host().submit(move |t| t.all_gather(&self))
    }
}

#[cfg(feature = "train")]
impl sealed::Sealed for Tensor<1> {}

#[cfg(feature = "train")]
impl Reducible for Tensor<1> {
    fn start_all_reduce(self, backends: &Backends, op: ReduceOp) -> Work<Self> {
        backends.start_tensor(self, Request::AllReduce(op), one)
    }

    fn start_reduce_scatter(
        self,
        backends: &Backends,
        parts: Vec<usize>,
        op: ReduceOp,
    ) -> Work<Self> {
        backends.start_tensor(self, Request::ReduceScatter(parts, op), one)
    }

    fn elements(&self) -> usize {
        self.shape().num_elements()
    }
}

#[cfg(feature = "train")]
impl Broadcastable for Tensor<1> {
    fn start_broadcast(self, backends: &Backends, root: usize) -> Work<Self> {
        backends.start_tensor(self, Request::Broadcast(root), one)
    }
}

#[cfg(feature = "train")]
impl Gatherable for Tensor<1> {
    type Gathered = Vec<Tensor<1>>;

    fn start_all_gather(self, backends: &Backends) -> Work<Vec<Tensor<1>>> {
        backends.start_tensor(self, Request::AllGather, |pieces, _, _| pieces)
    }
}

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
    /// The backends of a group whose collective thread is `queue`; device backends are chosen
    /// as tensors of each kind arrive.
    pub(crate) fn new(queue: Queue) -> Self {
        Backends {
            #[cfg(feature = "train")]
            devices: DeviceBackends::new(queue.limits()),
            queue,
        }
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

/// The backends chosen so far, one per device kind (a process group's per-device state).
#[cfg(feature = "train")]
#[derive(Default)]
pub(crate) struct DeviceBackends {
    /// Host tensors travel by [`DeviceBackend::NcclPlansOnHost`] instead of host staging.
    #[cfg(feature = "test-support")]
    nccl_plans_on_host: bool,
    chosen: Mutex<Vec<(Kind, DeviceBackend)>>,
    /// Held while a collective is issued: its backend's part on the caller's thread (NCCL takes
    /// the collective's turn there) and its job queued on the collective thread happen together,
    /// so two threads issuing at once cannot queue jobs in another order than their turns.
    issuing: Mutex<()>,
    /// Held while a backend is agreed and joined, so that two threads do not join twice; not
    /// `chosen`'s lock, so an abort never waits for a join.
    joining: Mutex<()>,
}

#[cfg(feature = "train")]
impl DeviceBackends {
    /// No backend chosen yet; with `limits.nccl_plans_on_host` (tests only) host tensors will
    /// take the NCCL backend's plans ([`DeviceBackend::NcclPlansOnHost`]).
    pub(crate) fn new(limits: &Limits) -> Self {
        let _ = limits;
        DeviceBackends {
            #[cfg(feature = "test-support")]
            nccl_plans_on_host: limits.nccl_plans_on_host,
            ..Default::default()
        }
    }

    /// Aborts every device communicator (after the group failed): a collective waiting on one
    /// ends within a poll, and none waits for ranks that will not come.
    pub(crate) fn abort(&self) {
        #[cfg(feature = "nccl")]
        for (_, chosen) in crate::sync::lock(&self.chosen).iter() {
            if let DeviceBackend::Nccl(comm) = chosen {
                comm.abort();
            }
        }
    }

    /// The one routing point of tensors: starts `request` on `tensor` by the backend of its
    /// device kind (agreed on first use); `finish` turns the result's tensors (with the
    /// input's device and element type) into what the caller returns.
    pub(crate) fn start<T: Send + 'static>(
        &self,
        queue: &Queue,
        tensor: Tensor<1>,
        request: Request,
        finish: fn(Vec<Tensor<1>>, &Device, DType) -> T,
    ) -> Work<T> {
        let (device, dtype) = (tensor.device(), tensor.dtype());
        let _issuing = crate::sync::lock(&self.issuing);
        let chosen = self.route(queue, &device);
        let done = move |pieces: Vec<Tensor<1>>| finish(pieces, &device, dtype);
        match chosen {
            Ok(DeviceBackend::Staged) => staged::start(queue, tensor, request, done),
            #[cfg(feature = "nccl")]
            Ok(DeviceBackend::Nccl(comm)) => nccl::start(queue, &comm, tensor, request, done),
            #[cfg(feature = "test-support")]
            Ok(DeviceBackend::NcclPlansOnHost) => emulated::start(queue, tensor, request, done),
            Err(e) => Work::done(queue.rank(), Err(e)),
        }
    }

    /// The backend of tensors on `device`, agreed with the other ranks on first use of its
    /// kind.
    fn route(&self, queue: &Queue, device: &Device) -> Result<DeviceBackend> {
        let kind = Kind::of(device);
        if let Some(chosen) = self.get(kind) {
            return Ok(chosen);
        }
        let _joining = crate::sync::lock(&self.joining);
        if let Some(chosen) = self.get(kind) {
            return Ok(chosen);
        }
        let described = format!("{device:?}");
        queue
            .on_worker(move |w| agree(w, kind, &described))
            .wait()?;
        let chosen = match kind {
            #[cfg(feature = "nccl")]
            Kind::Cuda => DeviceBackend::Nccl(nccl::join(queue, device)?),
            #[cfg(feature = "test-support")]
            _ if self.nccl_plans_on_host => DeviceBackend::NcclPlansOnHost,
            _ => DeviceBackend::Staged,
        };
        log::info!(
            "rank {}: collectives of tensors on {device:?} travel by {}",
            queue.rank(),
            chosen.name()
        );
        crate::sync::lock(&self.chosen).push((kind, chosen.clone()));
        Ok(chosen)
    }

    fn get(&self, kind: Kind) -> Option<DeviceBackend> {
        crate::sync::lock(&self.chosen)
            .iter()
            .find(|(k, _)| *k == kind)
            .map(|(_, r)| r.clone())
    }
}

#[cfg(feature = "train")]
/// Every rank's kind of device, gathered (one small host gather): a rank on another kind than
/// the others is an error that names it on every rank, not a hang between two transports.
fn agree(w: &mut Worker, kind: Kind, device: &str) -> Result<()> {
    let mine = Writer::default()
        .u8(kind.code())
        .bytes(device.as_bytes())
        .buf
        .clone();
    let said = w.all_gather_object(&mine)?;
    let described = |r: usize| {
        let mut reader = Reader::new(&said.all[r]);
        let code = reader.u8().ok();
        let kind = [Kind::Cuda, Kind::Host]
            .into_iter()
            .find(|k| Some(k.code()) == code)
            .map_or("unknown", Kind::name);
        let device = reader
            .bytes()
            .map(String::from_utf8_lossy)
            .unwrap_or_default();
        (kind, device.into_owned())
    };
    let (kind_0, device_0) = described(0);
    let differ = said
        .differing()
        .into_iter()
        .find(|&r| described(r).0 != kind_0);
    let Some(other) = differ else {
        return Ok(());
    };
    let (kind, device) = described(other);
    Err(DdpError::Disagreement(format!(
        "rank 0 has its tensors on a device of kind \"{kind_0}\" ({device_0}) but rank {other} \
         on one of kind \"{kind}\" ({device}): every rank must train on the same kind of device"
    )))
}

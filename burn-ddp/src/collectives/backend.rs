//! Collectives on burn tensors, with the backend chosen once per device kind
//! ([`DeviceBackend`], as PyTorch's c10d picks a backend per device type):
//! - CUDA devices (feature `nccl`): NCCL on the tensor's CubeCL buffer, on NCCL's own stream
//!   ([`nccl`]), around each call a plan of what the ranks agree on and how unequal or empty
//!   parts are padded and cut (`plan.rs`, which CI runs with host collectives in NCCL's place:
//!   `emulated.rs`, feature `test-support`);
//! - every other burn device (CPU's `flex`, wgpu on Vulkan, Metal or DX12, ...): host staging,
//!   device -> host -> TCP ring -> device ([`staged`]); on `flex` the "staging" is the tensor's
//!   own memory.
//!
//! Every collective is routed in one place ([`Request`] by device kind, `start`). Either way the
//! collective is one job on the group's collective thread, in issue order with
//! every other collective, returning a [`Work`]: the caller packs its next bucket while this one
//! travels. The first tensor collective of a device kind checks that every rank uses the same
//! kind (one small gather), so that a rank on the CPU among ranks on GPUs is an error that names
//! it, not a hang between two transports.

#[cfg(feature = "test-support")]
mod emulated;
#[cfg(feature = "nccl")]
mod nccl;
#[cfg(any(feature = "nccl", feature = "test-support"))]
mod plan;
pub(crate) mod slices;
mod staged;

use std::sync::Mutex;

use burn::tensor::{DType, Device, Tensor};

use super::queue::{Limits, Queue};
use super::worker::Worker;
use super::{ReduceOp, Work};
use crate::error::{DdpError, Result};
use crate::wire::{Reader, Writer};

/// The kinds of device a rank's tensors can be on, as far as the choice of transport goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// A CUDA GPU (with the `nccl` feature): NCCL.
    Cuda,
    /// Any other device (or CUDA without the `nccl` feature): host staging.
    Host,
}

impl Kind {
    /// The kind of `device`, decided from the device value alone (no driver is touched): a
    /// CUDA device is one whose CubeCL device says CUDA, not every CubeCL device (wgpu shares
    /// CubeCL's backend type).
    fn of(device: &Device) -> Kind {
        #[cfg(feature = "nccl")]
        if burn_ddp_nccl::cuda_ordinal(device).is_some() {
            return Kind::Cuda;
        }
        let _ = device;
        Kind::Host
    }

    fn name(self) -> &'static str {
        match self {
            Kind::Cuda => "cuda",
            Kind::Host => "host",
        }
    }

    fn code(self) -> u8 {
        match self {
            Kind::Cuda => 1,
            Kind::Host => 2,
        }
    }
}

/// How tensors of one device kind travel: the backend of a device kind.
///
/// One enum, not a trait: the set is closed (the buffer traits are sealed, and each variant is
/// a module here), the operations are generic over element types (a trait of them would not be
/// object-safe), and NCCL is a cargo feature, which a `#[cfg]` on one variant states plainly.
#[derive(Clone)]
pub(crate) enum DeviceBackend {
    /// Device -> host -> TCP ring or shared memory -> device.
    Staged,
    /// NCCL on the device buffers.
    #[cfg(feature = "nccl")]
    Nccl(burn_ddp_nccl::NcclComm),
    /// NCCL's plans (agreement, padding, cutting) with the equal-part host collectives in
    /// NCCL's place: how CI runs everything of the NCCL backend but the NCCL calls (feature
    /// `test-support`, chosen by the group builder's hidden `nccl_plans_on_host`).
    #[cfg(feature = "test-support")]
    NcclPlansOnHost,
}

impl DeviceBackend {
    fn name(&self) -> &'static str {
        match self {
            DeviceBackend::Staged => "host staging (TCP or shared memory)",
            #[cfg(feature = "nccl")]
            DeviceBackend::Nccl(_) => "NCCL",
            #[cfg(feature = "test-support")]
            DeviceBackend::NcclPlansOnHost => "NCCL's plans on the host collectives (tests)",
        }
    }
}

/// The backends chosen so far, one per device kind (a process group's per-device state).
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

/// A tensor collective as the group asks for it, before a backend plans it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Request {
    /// All-reduce with a reduction.
    AllReduce(ReduceOp),
    /// Reduce-scatter into parts by rank (summing to the tensor's length), with a reduction.
    ReduceScatter(Vec<usize>, ReduceOp),
    /// Broadcast from a root.
    Broadcast(usize),
    /// All-gather of tensors of one length on every rank: every rank's, by rank.
    AllGather,
    /// All-gather of tensors of the given lengths by rank, concatenated.
    AllGatherParts(Vec<usize>),
}

impl Request {
    /// Whether, alone in a world of one, the collective returns a tensor of `elements`
    /// elements as it is (a broadcast from another root, or parts that are not the whole, go
    /// to the backend, which refuses them).
    pub(crate) fn is_identity_alone(&self, elements: usize) -> bool {
        match self {
            Request::AllReduce(_) | Request::AllGather | Request::AllGatherParts(_) => true,
            Request::ReduceScatter(parts, _) => parts[..] == [elements],
            Request::Broadcast(root) => *root == 0,
        }
    }

    /// The collective's name in errors.
    fn name(&self) -> &'static str {
        match self {
            Request::AllReduce(_) => "all_reduce",
            Request::ReduceScatter(..) => "reduce_scatter",
            Request::Broadcast(_) => "broadcast",
            Request::AllGather | Request::AllGatherParts(_) => "all_gather",
        }
    }
}

/// A result of one tensor: its pieces concatenated.
pub(crate) fn one(pieces: Vec<Tensor<1>>, device: &Device, dtype: DType) -> Tensor<1> {
    slices::concat(pieces, device, dtype)
}

/// The error of a tensor that cannot take part in a collective.
fn invalid(rank: usize, op: &str, reason: String) -> DdpError {
    DdpError::InvalidArgument {
        rank,
        op: format!("{op} of a tensor"),
        reason,
    }
}

#[cfg(all(test, feature = "nccl"))]
mod tests {
    use super::*;

    /// CUDA devices (autodiff or not) go to NCCL, the CPU through the host; decided without a
    /// GPU or a driver (wgpu, which shares CubeCL's backend type with CUDA, is told apart in
    /// burn-ddp-nccl's `cuda_ordinal` tests).
    #[test]
    fn cuda_devices_and_only_they_go_to_nccl() {
        assert_eq!(Kind::of(&Device::cuda(0)), Kind::Cuda);
        assert_eq!(Kind::of(&Device::cuda(1).autodiff()), Kind::Cuda);
        assert_eq!(Kind::of(&Device::flex()), Kind::Host);
        assert_eq!(Kind::of(&Device::flex().autodiff()), Kind::Host);
    }
}

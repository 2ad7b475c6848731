//! Collectives on burn tensors, with the backend chosen once per device kind
//! ([`DeviceBackend`], as PyTorch's c10d picks a backend per device type):
//! - CUDA devices (feature `nccl`): NCCL on the tensor's CubeCL buffer, on NCCL's own stream
//!   ([`nccl`]);
//! - every other burn device (CPU's `flex`, wgpu on Vulkan, Metal or DX12, ...): host staging,
//!   device -> host -> TCP ring -> device ([`staged`]); on `flex` the "staging" is the tensor's
//!   own memory.
//!
//! Either way the collective is one job on the group's collective thread, in issue order with
//! every other collective, returning a [`Work`]: the caller packs its next bucket while this one
//! travels. The first tensor collective of a device kind checks that every rank uses the same
//! kind (one small gather), so that a rank on the CPU among ranks on GPUs is an error that names
//! it, not a hang between two transports.

#[cfg(feature = "nccl")]
mod nccl;
mod staged;

use std::sync::Mutex;

use burn::tensor::{Device, Tensor};

use super::backend::Backends;
use super::buffer::{Broadcastable, Gatherable, Reducible, sealed};
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
}

impl DeviceBackend {
    fn name(&self) -> &'static str {
        match self {
            DeviceBackend::Staged => "host staging (TCP or shared memory)",
            #[cfg(feature = "nccl")]
            DeviceBackend::Nccl(_) => "NCCL",
        }
    }
}

/// The backends chosen so far, one per device kind (a process group's per-device state).
#[derive(Default)]
pub(crate) struct DeviceBackends {
    chosen: Mutex<Vec<(Kind, DeviceBackend)>>,
    /// Held while a backend is agreed and joined, so that two threads do not join twice; not
    /// `chosen`'s lock, so an abort never waits for a join.
    joining: Mutex<()>,
}

impl DeviceBackends {
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

    fn get(&self, kind: Kind) -> Option<DeviceBackend> {
        crate::sync::lock(&self.chosen)
            .iter()
            .find(|(k, _)| *k == kind)
            .map(|(_, r)| r.clone())
    }
}

/// The backend of tensors on `device`, agreed with the other ranks on first use of its kind.
fn backend(group: &Backends, device: &Device) -> Result<DeviceBackend> {
    let kind = Kind::of(device);
    let backends = group.devices();
    if let Some(chosen) = backends.get(kind) {
        return Ok(chosen);
    }
    let _joining = crate::sync::lock(&backends.joining);
    if let Some(chosen) = backends.get(kind) {
        return Ok(chosen);
    }
    let described = format!("{device:?}");
    group
        .on_worker(move |w| agree(w, kind, &described))
        .wait()?;
    let chosen = match kind {
        #[cfg(feature = "nccl")]
        Kind::Cuda => DeviceBackend::Nccl(nccl::join(group, device)?),
        _ => DeviceBackend::Staged,
    };
    log::info!(
        "rank {}: collectives of tensors on {device:?} travel by {}",
        group.rank(),
        chosen.name()
    );
    crate::sync::lock(&backends.chosen).push((kind, chosen.clone()));
    Ok(chosen)
}

/// Every rank's kind of device, gathered (one small host gather): a rank on another kind than
/// the others is an error that names it on every rank, not a hang between two transports.
fn agree(w: &mut Worker, kind: Kind, device: &str) -> Result<()> {
    let mine = Writer::default()
        .u8(kind.code())
        .bytes(device.as_bytes())
        .buf
        .clone();
    let said = w.gather_said(&mine)?;
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

impl sealed::Sealed for Tensor<1> {}

impl Reducible for Tensor<1> {
    fn start_all_reduce(self, group: &Backends, op: ReduceOp) -> Work<Self> {
        if group.world() == 1 {
            return Work::done(group.rank(), Ok(self));
        }
        match backend(group, &self.device()) {
            Ok(DeviceBackend::Staged) => staged::all_reduce(group, self, op),
            #[cfg(feature = "nccl")]
            Ok(DeviceBackend::Nccl(comm)) => nccl::all_reduce(group, &comm, self, op),
            Err(e) => Work::done(group.rank(), Err(e)),
        }
    }

    fn start_reduce_scatter(self, group: &Backends, parts: Vec<usize>, op: ReduceOp) -> Work<Self> {
        if group.world() == 1 && parts == [self.elements()] {
            return Work::done(group.rank(), Ok(self));
        }
        match backend(group, &self.device()) {
            Ok(DeviceBackend::Staged) => staged::reduce_scatter(group, self, parts, op),
            #[cfg(feature = "nccl")]
            Ok(DeviceBackend::Nccl(comm)) => nccl::reduce_scatter(group, &comm, self, parts, op),
            Err(e) => Work::done(group.rank(), Err(e)),
        }
    }

    fn elements(&self) -> usize {
        self.shape().num_elements()
    }
}

impl Broadcastable for Tensor<1> {
    fn start_broadcast(self, group: &Backends, root: usize) -> Work<Self> {
        if group.world() == 1 && root == 0 {
            return Work::done(group.rank(), Ok(self));
        }
        match backend(group, &self.device()) {
            Ok(DeviceBackend::Staged) => staged::broadcast(group, self, root),
            #[cfg(feature = "nccl")]
            Ok(DeviceBackend::Nccl(comm)) => nccl::broadcast(group, &comm, self, root),
            Err(e) => Work::done(group.rank(), Err(e)),
        }
    }
}

impl Gatherable for Tensor<1> {
    type Gathered = Vec<Tensor<1>>;

    fn start_all_gather(self, group: &Backends) -> Work<Vec<Tensor<1>>> {
        if group.world() == 1 {
            return Work::done(group.rank(), Ok(vec![self]));
        }
        match backend(group, &self.device()) {
            Ok(DeviceBackend::Staged) => staged::all_gather(group, self),
            #[cfg(feature = "nccl")]
            Ok(DeviceBackend::Nccl(comm)) => nccl::all_gather(group, &comm, self),
            Err(e) => Work::done(group.rank(), Err(e)),
        }
    }
}

/// Starts an all-gather of tensors of the lengths `parts` (rank `r`'s has `parts[r]`
/// elements, the same list on every rank): every rank's, concatenated in rank order, on this
/// rank's device.
pub(crate) fn all_gather_parts(
    group: &Backends,
    tensor: Tensor<1>,
    parts: Vec<usize>,
) -> Work<Tensor<1>> {
    if group.world() == 1 {
        return Work::done(group.rank(), Ok(tensor));
    }
    match backend(group, &tensor.device()) {
        Ok(DeviceBackend::Staged) => staged::all_gather_parts(group, tensor, parts),
        #[cfg(feature = "nccl")]
        Ok(DeviceBackend::Nccl(comm)) => nccl::all_gather_parts(group, &comm, tensor, parts),
        Err(e) => Work::done(group.rank(), Err(e)),
    }
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

//! Collectives on burn tensors, with the backend chosen once per device kind (as PyTorch's
//! c10d picks a backend per device type):
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

use super::buffer::{Broadcastable, Gatherable, Reducible, sealed};
use super::{ReduceOp, Work};
use crate::ProcessGroup;
use crate::error::{DdpError, Result};

/// How tensors of one device kind travel.
#[derive(Clone)]
enum Backend {
    /// Device -> host -> TCP ring -> device.
    Staged,
    /// NCCL on the device buffers.
    #[cfg(feature = "nccl")]
    Nccl(burn_ddp_nccl::NcclComm),
}

impl Backend {
    fn name(&self) -> &'static str {
        match self {
            Backend::Staged => "host-staged TCP",
            #[cfg(feature = "nccl")]
            Backend::Nccl(_) => "NCCL",
        }
    }
}

/// The backends chosen so far, by device (a process group's per-device state).
#[derive(Default)]
pub(crate) struct DeviceBackends {
    chosen: Mutex<Vec<(Device, Backend)>>,
}

impl DeviceBackends {
    /// Aborts every device communicator (after the group failed), so no collective waits for
    /// ranks that will not come.
    pub(crate) fn abort(&self) {
        #[cfg(feature = "nccl")]
        for (_, backend) in self.chosen.lock().unwrap_or_else(|p| p.into_inner()).iter() {
            if let Backend::Nccl(comm) = backend {
                comm.abort();
            }
        }
    }
}

/// The kind of `device` as this rank chooses its backend: `"cuda"` or `"staged"`.
fn kind_of(device: &Device) -> &'static str {
    #[cfg(feature = "nccl")]
    if burn_ddp_nccl::is_cuda(device) {
        return "cuda";
    }
    let _ = device;
    "staged"
}

/// The backend for tensors on `device`, chosen (with the other ranks) on first use.
fn backend(group: &ProcessGroup, device: &Device) -> Result<Backend> {
    let backends = group.device_backends();
    let mut chosen = backends.chosen.lock().unwrap_or_else(|p| p.into_inner());
    if let Some((_, b)) = chosen.iter().find(|(d, _)| d == device) {
        return Ok(b.clone());
    }
    let kind = kind_of(device);
    let kinds = group.all_gather(kind.as_bytes().to_vec()).wait()?;
    if let Some((other, theirs)) = kinds
        .iter()
        .enumerate()
        .find(|(_, k)| k.as_slice() != kind.as_bytes())
    {
        return Err(DdpError::Disagreement(format!(
            "rank {} has its tensors on a device of kind \"{kind}\" ({device:?}) but rank {other} \
             on one of kind \"{}\": every rank must train on the same kind of device",
            group.rank(),
            String::from_utf8_lossy(theirs)
        )));
    }
    let backend = match kind {
        #[cfg(feature = "nccl")]
        "cuda" => Backend::Nccl(nccl::join(group)?),
        _ => Backend::Staged,
    };
    log::info!(
        "rank {}: collectives of tensors on {device:?} travel by {}",
        group.rank(),
        backend.name()
    );
    chosen.push((device.clone(), backend.clone()));
    Ok(backend)
}

impl sealed::Sealed for Tensor<1> {}

impl Reducible for Tensor<1> {
    fn start_all_reduce(self, group: &ProcessGroup, op: ReduceOp) -> Work<Self> {
        if group.world_size() == 1 {
            return Work::done(group.rank(), Ok(self));
        }
        match backend(group, &self.device()) {
            Ok(Backend::Staged) => staged::all_reduce(group, self, op),
            #[cfg(feature = "nccl")]
            Ok(Backend::Nccl(comm)) => nccl::all_reduce(group, &comm, self, op),
            Err(e) => Work::done(group.rank(), Err(e)),
        }
    }
}

impl Broadcastable for Tensor<1> {
    fn start_broadcast(self, group: &ProcessGroup, root: usize) -> Work<Self> {
        if group.world_size() == 1 && root == 0 {
            return Work::done(group.rank(), Ok(self));
        }
        match backend(group, &self.device()) {
            Ok(Backend::Staged) => staged::broadcast(group, self, root),
            #[cfg(feature = "nccl")]
            Ok(Backend::Nccl(comm)) => nccl::broadcast(group, &comm, self, root),
            Err(e) => Work::done(group.rank(), Err(e)),
        }
    }
}

impl Gatherable for Tensor<1> {
    type Gathered = Vec<Tensor<1>>;

    fn start_all_gather(self, group: &ProcessGroup) -> Work<Vec<Tensor<1>>> {
        if group.world_size() == 1 {
            return Work::done(group.rank(), Ok(vec![self]));
        }
        match backend(group, &self.device()) {
            Ok(Backend::Staged) => staged::all_gather(group, self),
            #[cfg(feature = "nccl")]
            Ok(Backend::Nccl(comm)) => nccl::all_gather(group, &comm, self),
            Err(e) => Work::done(group.rank(), Err(e)),
        }
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

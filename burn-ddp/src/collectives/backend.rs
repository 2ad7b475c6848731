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
//! This module names the backends ([`DeviceBackend`]), the device kinds ([`Kind`]) and the
//! requests ([`Request`]) they serve; [`super::backends`] chooses one per kind and routes every
//! tensor collective to it. Either way the collective is one job on the group's collective
//! thread, in issue order with every other collective, returning a [`Work`](super::Work): the
//! caller packs its next bucket while this one travels.

#[cfg(feature = "test-support")]
pub(crate) mod emulated;
#[cfg(feature = "nccl")]
pub(crate) mod nccl;
#[cfg(any(feature = "nccl", feature = "test-support"))]
mod plan;
pub(crate) mod slices;
pub(crate) mod staged;

use burn::tensor::{DType, Device, Tensor};

use super::ReduceOp;
use crate::error::DdpError;

/// The kinds of device a rank's tensors can be on, as far as the choice of transport goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// A CUDA GPU (with the `nccl` feature): NCCL.
    Cuda,
    /// Any other device (or CUDA without the `nccl` feature): host staging.
    Host,
}

impl Kind {
    /// The kind of `device`, decided from the device value alone (no driver is touched): a
    /// CUDA device is one whose CubeCL device says CUDA, not every CubeCL device (wgpu shares
    /// CubeCL's backend type).
    pub(crate) fn of(device: &Device) -> Kind {
        #[cfg(feature = "nccl")]
        if burn_ddp_nccl::cuda_ordinal(device).is_some() {
            return Kind::Cuda;
        }
        let _ = device;
        Kind::Host
    }

    pub(crate) fn name(self) -> &'static str {
        match self {
            Kind::Cuda => "cuda",
            Kind::Host => "host",
        }
    }

    pub(crate) fn code(self) -> u8 {
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
    pub(crate) fn name(&self) -> &'static str {
        match self {
            DeviceBackend::Staged => "host staging (TCP or shared memory)",
            #[cfg(feature = "nccl")]
            DeviceBackend::Nccl(_) => "NCCL",
            #[cfg(feature = "test-support")]
            DeviceBackend::NcclPlansOnHost => "NCCL's plans on the host collectives (tests)",
        }
    }
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
    #[cfg(any(feature = "nccl", feature = "test-support"))]
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

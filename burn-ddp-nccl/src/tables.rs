//! The decisions of the NCCL backend that need no GPU, kept apart so that they are tested
//! everywhere: which burn devices are CUDA GPUs (and which GPU), which element types and
//! reductions NCCL takes, and the advice added to NCCL's errors.

use burn::backend::DispatchDevice;
use burn::tensor::{DType as BurnDType, Device};
use burn_cubecl::CubeDevice;
use cudarc::nccl::sys;

use crate::error::NcclError;
use crate::library::NCCL_DIR_VAR;

/// The element types NCCL moves here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DType {
    F64,
    F32,
    F16,
    BF16,
}

impl DType {
    /// NCCL's type for burn's, if NCCL reduces it here.
    pub(crate) fn of(dtype: BurnDType) -> Option<DType> {
        match dtype {
            BurnDType::F64 => Some(DType::F64),
            BurnDType::F32 => Some(DType::F32),
            BurnDType::F16 => Some(DType::F16),
            BurnDType::BF16 => Some(DType::BF16),
            _ => None,
        }
    }
}

/// Reductions offered by [`crate::NcclComm::start_all_reduce`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceOp {
    /// Sum.
    Sum,
    /// Average (`ncclAvg`).
    Avg,
    /// Maximum.
    Max,
    /// Minimum.
    Min,
}

/// The CUDA GPU (its ordinal among the GPUs this process sees) that `device` names, or `None`
/// for any other device: the CPU, wgpu (which shares CubeCL's backend type with CUDA but not
/// its devices), ROCm... Decided from the device value alone: no driver is loaded, no GPU
/// touched, so it answers the same on a machine without CUDA.
pub fn cuda_ordinal(device: &Device) -> Option<usize> {
    match device.clone().inner().as_dispatch() {
        DispatchDevice::Cube(CubeDevice::Cuda(gpu)) => Some(gpu.index),
        _ => None,
    }
}

/// Why a tensor on GPU `tensor` cannot go through a communicator on GPU `comm`.
pub(crate) fn wrong_gpu(tensor: usize, comm: usize) -> String {
    format!(
        "the tensor is on GPU {tensor} but this rank's NCCL communicator is on GPU {comm} (the \
         GPU of its first CUDA tensor): a rank keeps all its tensors on one GPU"
    )
}

/// NCCL's message for a failed join, with what to do about it when NCCL's words alone would
/// leave a user guessing.
pub(crate) fn join_advice(message: &str) -> String {
    if message.contains("Duplicate GPU") {
        format!(
            "{message}: two ranks of the group use the same GPU; give each rank its own, by \
             putting its model on Device::cuda(local_rank) or by starting each rank with its \
             own CUDA_VISIBLE_DEVICES (torchrun and burn-ddp-run export LOCAL_RANK)"
        )
    } else {
        message.to_string()
    }
}

/// The oldest NCCL this crate takes, as `ncclGetVersion` codes it (2.14.0:
/// `ncclCommInitRankConfig`, `ncclCommFinalize` and non-blocking communicators came with it).
pub(crate) const NCCL_NEEDED: i32 = 21_400;

/// `ncclGetVersion`'s code as `major.minor.patch`: `major * 10000 + minor * 100 + patch` since
/// NCCL 2.9, `major * 1000 + minor * 100 + patch` before.
pub(crate) fn nccl_version_words(code: i32) -> String {
    let (major, rest) = if code >= 10_000 {
        (code / 10_000, code % 10_000)
    } else {
        (code / 1_000, code % 1_000)
    };
    format!("{major}.{}.{}", rest / 100, rest % 100)
}

/// Refuses an NCCL older than [`NCCL_NEEDED`], or one whose version could not be read (`Err`:
/// why), with the versions in words and how to fix it.
pub(crate) fn check_nccl_version(version: Result<i32, String>) -> Result<(), NcclError> {
    let (found, code) = match version {
        Ok(code) if code >= NCCL_NEEDED => return Ok(()),
        Ok(code) => (nccl_version_words(code), code),
        Err(why) => (format!("of unknown version ({why})"), 0),
    };
    Err(NcclError::UnsupportedNccl {
        found,
        code,
        needed: "2.14.0 (21400)",
        fix: format!(
            "install a newer NCCL (for example `pip install nvidia-nccl-cu13`) and put its \
             directory first on LD_LIBRARY_PATH (or in {NCCL_DIR_VAR} for burn-ddp's launcher)"
        ),
    })
}

impl DType {
    /// NCCL's enumerator for it.
    pub(crate) fn raw(self) -> sys::ncclDataType_t {
        match self {
            DType::F64 => sys::ncclDataType_t::ncclFloat64,
            DType::F32 => sys::ncclDataType_t::ncclFloat32,
            DType::F16 => sys::ncclDataType_t::ncclFloat16,
            DType::BF16 => sys::ncclDataType_t::ncclBfloat16,
        }
    }
}

impl ReduceOp {
    /// NCCL's enumerator for it.
    pub(crate) fn raw(self) -> sys::ncclRedOp_t {
        match self {
            ReduceOp::Sum => sys::ncclRedOp_t::ncclSum,
            ReduceOp::Avg => sys::ncclRedOp_t::ncclAvg,
            ReduceOp::Max => sys::ncclRedOp_t::ncclMax,
            ReduceOp::Min => sys::ncclRedOp_t::ncclMin,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The table maps every type and reduction to NCCL's own enumerators (their values are
    /// NCCL's ABI: nccl.h's ncclDataType_t and ncclRedOp_t).
    #[test]
    fn types_and_reductions_are_nccls() {
        let types = [
            (DType::F64, sys::ncclDataType_t::ncclFloat64, 8),
            (DType::F32, sys::ncclDataType_t::ncclFloat32, 7),
            (DType::F16, sys::ncclDataType_t::ncclFloat16, 6),
            (DType::BF16, sys::ncclDataType_t::ncclBfloat16, 9),
        ];
        for (ours, theirs, abi) in types {
            assert_eq!(ours.raw(), theirs);
            assert_eq!(ours.raw() as i32, abi, "{ours:?}");
        }
        let ops = [
            (ReduceOp::Sum, 0),
            (ReduceOp::Max, 2),
            (ReduceOp::Min, 3),
            (ReduceOp::Avg, 4),
        ];
        for (ours, abi) in ops {
            assert_eq!(ours.raw() as i32, abi, "{ours:?}");
        }
    }

    use burn_cubecl::cubecl::device::{CpuDevice, CudaDevice, WgpuDevice};

    #[test]
    fn cuda_devices_are_told_apart_from_every_other_cubecl_device() {
        assert_eq!(cuda_ordinal(&Device::cuda(0)), Some(0));
        assert_eq!(cuda_ordinal(&Device::cuda(3)), Some(3));
        let cpu = Device::new(DispatchDevice::Cube(CubeDevice::Cpu(CpuDevice)));
        assert_eq!(cuda_ordinal(&cpu), None);
        // wgpu shares CubeCL's backend type with CUDA: told apart by the device, not the type.
        let wgpu = Device::new(DispatchDevice::Cube(
            CubeDevice::Wgpu(WgpuDevice::default()),
        ));
        assert_eq!(cuda_ordinal(&wgpu), None);
        let cuda = Device::new(DispatchDevice::Cube(CubeDevice::Cuda(CudaDevice {
            index: 5,
        })));
        assert_eq!(cuda_ordinal(&cuda), Some(5));
    }

    #[test]
    fn nccl_takes_every_float_type_and_nothing_else() {
        assert_eq!(DType::of(BurnDType::F64), Some(DType::F64));
        assert_eq!(DType::of(BurnDType::F32), Some(DType::F32));
        assert_eq!(DType::of(BurnDType::F16), Some(DType::F16));
        assert_eq!(DType::of(BurnDType::BF16), Some(DType::BF16));
        assert_eq!(DType::of(BurnDType::I32), None);
        assert_eq!(DType::of(BurnDType::U8), None);
    }

    #[test]
    fn a_tensor_on_another_gpu_names_both() {
        let msg = wrong_gpu(1, 0);
        assert!(
            msg.starts_with("the tensor is on GPU 1 but this rank's NCCL communicator is on GPU 0"),
            "{msg}"
        );
    }

    #[test]
    fn a_duplicate_gpu_gets_advice() {
        let nccl = "ncclInvalidUsage: invalid usage (Duplicate GPU detected : rank 1 and rank 0 \
                    both on CUDA device 1a000)";
        let advice = join_advice(nccl);
        assert!(advice.starts_with(nccl), "{advice}");
        assert!(
            advice.contains("CUDA_VISIBLE_DEVICES") && advice.contains("Device::cuda(local_rank)"),
            "{advice}"
        );
        assert_eq!(join_advice("ncclSystemError"), "ncclSystemError");
    }

    #[test]
    fn nccl_versions_are_decoded_in_both_encodings() {
        assert_eq!(nccl_version_words(21_400), "2.14.0");
        assert_eq!(nccl_version_words(22_703), "2.27.3");
        assert_eq!(nccl_version_words(21_300), "2.13.0");
        // NCCL before 2.9: major * 1000 + minor * 100 + patch.
        assert_eq!(nccl_version_words(2_804), "2.8.4");
    }

    /// An NCCL older than 2.14 (or one whose version cannot be read) is refused with both
    /// versions named; 2.14 and later pass.
    #[test]
    fn an_nccl_older_than_2_14_is_refused_naming_both_versions() {
        assert!(check_nccl_version(Ok(21_400)).is_ok());
        assert!(check_nccl_version(Ok(22_703)).is_ok());
        let msg = check_nccl_version(Ok(21_300)).unwrap_err().to_string();
        assert!(
            msg.starts_with("libnccl 2.13.0 (ncclGetVersion says 21300) is too old")
                && msg.contains("needs NCCL 2.14.0 (21400) or newer")
                && msg.contains("pip install"),
            "{msg}"
        );
        let old = check_nccl_version(Ok(2_804)).unwrap_err().to_string();
        assert!(old.starts_with("libnccl 2.8.4 "), "{old}");
        let unread = check_nccl_version(Err("no ncclGetVersion".into()));
        let unread = unread.unwrap_err().to_string();
        assert!(
            unread.contains("unknown version (no ncclGetVersion)"),
            "{unread}"
        );
    }
}

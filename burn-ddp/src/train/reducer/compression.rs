//! Gradient compression: buckets travel in a 16-bit float format (PyTorch's fp16/bf16
//! communication hooks, Horovod's `Compression.fp16`), halving the bytes each step sends.
//!
//! A bucket's gradients are divided by the world size on the device (so the sum of the ranks'
//! values is already the average, and f16's range of ±65504 holds it as it holds each rank's
//! gradient), cast to the format, summed by the group's all-reduce, and cast back to `f32`.
//! Where the transport reduces on the host (TCP), each addition is done in `f32` and rounded once
//! to the format. The presence flags and desync fingerprints stay exact: they travel apart, in
//! `f32`, in one small all-reduce per step for all buckets.
//!
//! The cast is done on the device when the device has the format (CPU, CUDA); otherwise (wgpu:
//! WGSL has no bfloat16) the bucket is read to the host and cast there, and still travels in 16
//! bits.

use burn::tensor::{DType, Device, Tensor, TensorData};
use half::{bf16, f16};

use crate::ProcessGroup;
use crate::collectives::{ReduceOp, Reducible, Work};
use crate::error::{DdpError, Result};

/// The format gradient buckets travel in.
///
/// ```
/// # use burn::train::LearnerModel;
/// use burn_ddp::train::{Compression, DdpLearner};
/// # fn configure<M: LearnerModel>(learner: DdpLearner<M>) -> DdpLearner<M> {
/// let learner = learner.compression(Compression::Bf16);
/// # learner }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Compression {
    /// `f32`, as the gradients are (the default).
    #[default]
    None,
    /// bfloat16: `f32`'s range, 8 bits of mantissa (relative precision about 4e-3).
    Bf16,
    /// IEEE half precision: 11 bits of mantissa (about 5e-4), range ±65504.
    Fp16,
}

impl Compression {
    /// The element type buckets travel in, when compressed.
    pub(crate) fn dtype(self) -> Option<DType> {
        match self {
            Compression::None => None,
            Compression::Bf16 => Some(DType::BF16),
            Compression::Fp16 => Some(DType::F16),
        }
    }

    /// Bytes of one gradient value on the wire.
    pub fn bytes_per_value(self) -> usize {
        match self {
            Compression::None => 4,
            Compression::Bf16 | Compression::Fp16 => 2,
        }
    }

    /// Starts the all-reduce of a bucket's gradients (`f32`, on `device`) in this format, or
    /// with `parts` their reduce-scatter (this rank gets its part): divided by the world size,
    /// cast (on the device if it has the format, else on the host), summed across `group`.
    pub(crate) fn start(
        self,
        group: &ProcessGroup,
        grads: Tensor<1>,
        parts: Option<&[usize]>,
        device: &Device,
    ) -> Result<Compressed> {
        fn sum<B: Reducible>(group: &ProcessGroup, buf: B, parts: Option<&[usize]>) -> Work<B> {
            match parts {
                Some(parts) => group.reduce_scatter_parts(buf, parts, ReduceOp::Sum),
                None => group.all_reduce(buf, ReduceOp::Sum),
            }
        }
        let Some(dtype) = self.dtype() else {
            let work = sum(group, grads, parts);
            return Ok(Compressed::Device(Box::new(work)));
        };
        let grads = grads.div_scalar(group.world_size() as f64);
        if device.supports_dtype(dtype) {
            let work = sum(group, grads.cast(dtype), parts);
            return Ok(Compressed::Device(Box::new(work)));
        }
        let values = grads
            .into_data()
            .convert::<f32>()
            .try_into_vec::<f32>()
            .map_err(|e| DdpError::Tensor(format!("{e:?}")))?;
        let device = device.clone();
        Ok(match self {
            Compression::Fp16 => {
                let values: Vec<f16> = values.into_iter().map(f16::from_f32).collect();
                Compressed::HostF16(sum(group, values, parts), device)
            }
            _ => {
                let values: Vec<bf16> = values.into_iter().map(bf16::from_f32).collect();
                Compressed::HostBf16(sum(group, values, parts), device)
            }
        })
    }
}

/// A bucket's all-reduce in flight (see [`Compression::start`]).
pub(crate) enum Compressed {
    /// On the device: the format's tensor (or `f32` without compression).
    Device(Box<Work<Tensor<1>>>),
    /// Cast on the host, for a device without the format.
    HostBf16(Work<Vec<bf16>>, Device),
    /// Cast on the host, for a device without the format.
    HostF16(Work<Vec<f16>>, Device),
}

impl Compressed {
    /// The summed bucket, as `f32` on the device.
    pub(crate) fn wait(self) -> Result<Tensor<1>> {
        let upload = |values: Vec<f32>, device: &Device| {
            let n = values.len();
            Tensor::from_data(TensorData::new(values, [n]), device)
        };
        Ok(match self {
            Compressed::Device(work) => work.wait()?.cast(DType::F32),
            Compressed::HostBf16(work, device) => {
                upload(work.wait()?.into_iter().map(f32::from).collect(), &device)
            }
            Compressed::HostF16(work, device) => {
                upload(work.wait()?.into_iter().map(f32::from).collect(), &device)
            }
        })
    }
}

impl std::fmt::Display for Compression {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Compression::None => "none",
            Compression::Bf16 => "bf16",
            Compression::Fp16 => "fp16",
        })
    }
}

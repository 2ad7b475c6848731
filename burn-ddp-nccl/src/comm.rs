//! `NcclComm`: one NCCL communicator per process group, device = local rank; all-reduce of a
//! burn CUDA tensor in place on its CubeCL buffer, on a stream of our own, with no host copy.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use burn::backend::Cuda;
use burn::tensor::{DType, Tensor};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use cubecl_cuda::CudaRuntime;
use cubecl_runtime::runtime::Runtime;
use cudarc::driver::{CudaContext, CudaStream};

use crate::error::NcclError;
use crate::ffi::{self, RawComm, RedOp};
use crate::library::Located;

type CudaServer = <CudaRuntime as Runtime>::Server;

/// How [`NcclComm::all_reduce`] combines the ranks' tensors (as burn-ddp's `ReduceOp`,
/// without `Min`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceOp {
    /// Sum.
    Sum,
    /// Average (`ncclAvg`).
    Avg,
    /// Maximum.
    Max,
}

/// Whether `device` is served by burn's CUDA backend (the NCCL path's devices).
pub fn is_cuda(device: &burn::tensor::Device) -> bool {
    // Without libcuda no device can be CUDA, and touching one would panic in the loader.
    if !ffi::libraries_present().0 {
        return false;
    }
    Tensor::<1>::zeros([1], &device.clone().inner())
        .try_into_primitive::<Cuda>()
        .is_ok()
}

/// Checks that libcuda and libnccl can be loaded, so that nothing later panics in a loader.
pub fn check_libraries() -> Result<(), NcclError> {
    match ffi::libraries_present() {
        (true, true) => Ok(()),
        (false, _) => Err(Located::from_env().missing("libcuda")),
        (true, false) => Err(Located::from_env().missing("libnccl")),
    }
}

/// A fresh NCCL unique id, created on rank 0 and passed to the others (through the store).
/// Needs libnccl but no GPU.
pub fn unique_id(rank: usize) -> Result<[u8; 128], NcclError> {
    if !ffi::libraries_present().1 {
        return Err(Located::from_env().missing("libnccl"));
    }
    ffi::unique_id().map_err(|message| NcclError::Nccl {
        rank,
        call: "ncclGetUniqueId",
        message,
    })
}

/// An NCCL communicator on this rank's GPU.
pub struct NcclComm {
    rank: usize,
    world: usize,
    raw: Mutex<RawComm>,
    stream: Arc<CudaStream>,
    timeout: Duration,
}

impl NcclComm {
    /// Joins the communicator `id` as `rank` of `world` on GPU `device` (the local rank).
    /// Every rank must call it with the same id.
    pub fn new(
        rank: usize,
        world: usize,
        device: usize,
        id: &[u8; 128],
        timeout: Duration,
    ) -> Result<Self, NcclError> {
        check_libraries()?;
        let cuda = |call: &'static str| {
            move |e: cudarc::driver::DriverError| NcclError::Cuda {
                rank,
                call,
                message: e.to_string(),
            }
        };
        // The device's primary context: the one cubecl-cuda uses for burn's buffers.
        let ctx = CudaContext::new(device).map_err(cuda("cuCtxRetain (CudaContext::new)"))?;
        let stream = ctx.new_stream().map_err(cuda("cuStreamCreate"))?;
        let raw = RawComm::init(world, id, rank).map_err(|message| NcclError::Nccl {
            rank,
            call: "ncclCommInitRank",
            message,
        })?;
        Ok(NcclComm {
            rank,
            world,
            raw: Mutex::new(raw),
            stream,
            timeout,
        })
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.world
    }

    /// All-reduces a flat CUDA tensor (f32, f16 or bf16) in place and returns it.
    pub fn all_reduce(&self, tensor: Tensor<1>, op: ReduceOp) -> Result<Tensor<1>, NcclError> {
        let buffer = self.buffer(tensor)?;
        self.reduce(&buffer, &buffer, op)?;
        Ok(buffer.into_tensor())
    }

    /// All-reduces `input` into `output` (same length and type) and returns `output`; `input`
    /// is left as it was.
    pub fn all_reduce_into(
        &self,
        input: Tensor<1>,
        output: Tensor<1>,
        op: ReduceOp,
    ) -> Result<Tensor<1>, NcclError> {
        let (send, recv) = (self.buffer(input)?, self.buffer(output)?);
        if (send.count, send.dtype) != (recv.count, recv.dtype) {
            return Err(self.tensor_error(format!(
                "input has {} x {:?}, output {} x {:?}",
                send.count, send.dtype, recv.count, recv.dtype
            )));
        }
        self.reduce(&send, &recv, op)?;
        Ok(recv.into_tensor())
    }

    fn tensor_error(&self, reason: String) -> NcclError {
        NcclError::Tensor {
            rank: self.rank,
            reason,
        }
    }

    /// The tensor's CubeCL buffer, contiguous, finished and pinned.
    fn buffer(&self, tensor: Tensor<1>) -> Result<DeviceBuffer<impl Sized>, NcclError> {
        let dtype = match tensor.dtype() {
            DType::F32 => ffi::DType::F32,
            DType::F16 => ffi::DType::F16,
            DType::BF16 => ffi::DType::BF16,
            other => {
                return Err(self.tensor_error(format!("element type {other:?} is not reduced")));
            }
        };
        let prim: CubeTensor = tensor
            .try_into_primitive::<Cuda>()
            .map_err(|e| self.tensor_error(format!("not a CUDA tensor ({e:?})")))?;
        let prim = into_contiguous(prim);
        let count = prim.meta.shape().num_elements();
        // Kernels that produced the buffer run on CubeCL's stream: finish them first.
        burn_cubecl::cubecl::future::block_on(prim.client.sync())
            .map_err(|e| self.tensor_error(format!("synchronising CubeCL: {e}")))?;
        let resource = prim
            .client
            .get_resource::<CudaServer>(prim.handle.clone())
            .map_err(|e| self.tensor_error(format!("reading the buffer address: {e}")))?;
        Ok(DeviceBuffer {
            ptr: resource.resource().ptr,
            _pin: resource,
            count,
            dtype,
            prim,
        })
    }

    fn reduce<P, Q>(
        &self,
        send: &DeviceBuffer<P>,
        recv: &DeviceBuffer<Q>,
        op: ReduceOp,
    ) -> Result<(), NcclError> {
        let op = match op {
            ReduceOp::Sum => RedOp::Sum,
            ReduceOp::Avg => RedOp::Avg,
            ReduceOp::Max => RedOp::Max,
        };
        let mut raw = self.raw.lock().unwrap_or_else(|p| p.into_inner());
        raw.all_reduce(
            send.ptr,
            recv.ptr,
            send.count,
            send.dtype,
            op,
            self.stream.cu_stream(),
            self.timeout,
        )
        .map_err(|message| {
            if message.starts_with("timed out") {
                NcclError::Timeout {
                    rank: self.rank,
                    op: format!("all_reduce of {} x {:?}", send.count, send.dtype),
                    timeout: self.timeout,
                }
            } else {
                NcclError::Nccl {
                    rank: self.rank,
                    call: "ncclAllReduce",
                    message,
                }
            }
        })
    }
}

/// A CubeCL buffer pinned while NCCL uses its address (`P`: cubecl's managed resource).
struct DeviceBuffer<P> {
    ptr: u64,
    /// Keeps the allocation alive and in place until dropped.
    _pin: P,
    count: usize,
    dtype: ffi::DType,
    prim: CubeTensor,
}

impl<P> DeviceBuffer<P> {
    /// Releases the pin (the NCCL stream is synchronised) and gives the tensor back to burn.
    fn into_tensor(self) -> Tensor<1> {
        Tensor::from_primitive::<Cuda>(self.prim)
    }
}

//! `NcclComm`: one NCCL communicator per process group, device = local rank; collectives on
//! burn CUDA tensors in place on their CubeCL buffers, on a stream of our own, with no host copy.
//!
//! Each collective has two halves so that a caller can keep computing while it runs:
//! [`NcclComm::start_all_reduce`] (and the broadcast and gather) runs on the thread that
//! produced the tensor and takes a fence on that thread's CubeCL stream right after the kernels
//! that wrote it; [`Pending::wait`], on any thread, waits for that fence, enqueues NCCL on the
//! communicator's stream and waits (bounded by the timeout) for it to finish. burn-ddp calls
//! `wait` on its collective thread, so the next bucket is packed while this one travels.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use burn::backend::Cuda;
use burn::tensor::{DType as BurnDType, Tensor};
use burn_cubecl::cubecl::future::{DynFut, block_on};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use cubecl_cuda::CudaRuntime;
use cubecl_runtime::runtime::Runtime;
use cudarc::driver::{CudaContext, CudaStream};

use crate::error::NcclError;
use crate::ffi::{self, DType, RawComm, RawOp, RedOp};
use crate::library::Located;

type CudaServer = <CudaRuntime as Runtime>::Server;
type Fence = DynFut<Result<(), burn_cubecl::cubecl::server::ServerError>>;

/// Reductions offered by [`NcclComm::start_all_reduce`].
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

/// An NCCL communicator on this rank's GPU. Cloning shares it.
#[derive(Clone)]
pub struct NcclComm {
    inner: Arc<Inner>,
}

struct Inner {
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
            inner: Arc::new(Inner {
                rank,
                world,
                raw: Mutex::new(raw),
                stream,
                timeout,
            }),
        })
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.inner.world
    }

    /// All-reduces a flat CUDA tensor (f32, f16 or bf16) in place and returns it (blocking:
    /// [`NcclComm::start_all_reduce`] then [`Pending::wait`]).
    pub fn all_reduce(&self, tensor: Tensor<1>, op: ReduceOp) -> Result<Tensor<1>, NcclError> {
        self.start_all_reduce(tensor, op)?.wait()
    }

    /// Starts an in-place all-reduce of a flat CUDA tensor (f32, f16 or bf16).
    pub fn start_all_reduce(&self, tensor: Tensor<1>, op: ReduceOp) -> Result<Pending, NcclError> {
        let buf = self.buffer(tensor)?;
        let op = match op {
            ReduceOp::Sum => RedOp::Sum,
            ReduceOp::Avg => RedOp::Avg,
            ReduceOp::Max => RedOp::Max,
            ReduceOp::Min => RedOp::Min,
        };
        let raw = RawOp::AllReduce {
            send: buf.ptr,
            recv: buf.ptr,
            count: buf.count,
            op,
        };
        Ok(self.pending(raw, "all_reduce", buf, None))
    }

    /// Starts an in-place broadcast: the tensor becomes `root`'s on every rank (same length and
    /// type on every rank).
    pub fn start_broadcast(&self, tensor: Tensor<1>, root: usize) -> Result<Pending, NcclError> {
        if root >= self.inner.world {
            return Err(self.tensor_error(format!(
                "broadcast root {root} >= world size {}",
                self.inner.world
            )));
        }
        let buf = self.buffer(tensor)?;
        let raw = RawOp::Broadcast {
            buf: buf.ptr,
            count: buf.count,
            root,
        };
        Ok(self.pending(raw, "broadcast", buf, None))
    }

    /// Starts an all-gather: every rank's tensor (the same length on every rank, which the
    /// caller checks) concatenated in rank order, `world * len` elements.
    pub fn start_all_gather(&self, tensor: Tensor<1>) -> Result<Pending, NcclError> {
        let (dtype, device) = (tensor.dtype(), tensor.device());
        let n = tensor.shape().num_elements();
        let input = self.buffer(tensor)?;
        let output = Tensor::<1>::empty([n * self.inner.world], &device).cast(dtype);
        let output = self.buffer(output)?;
        let raw = RawOp::AllGather {
            send: input.ptr,
            recv: output.ptr,
            count: input.count,
        };
        Ok(self.pending(raw, "all_gather", input, Some(output)))
    }

    /// Aborts the communicator (after a failure elsewhere in the group): pending and later
    /// collectives fail instead of waiting for ranks that will not come.
    pub fn abort(&self) {
        self.inner
            .raw
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .abort();
    }

    fn pending(
        &self,
        op: RawOp,
        name: &'static str,
        input: DeviceBuffer,
        output: Option<DeviceBuffer>,
    ) -> Pending {
        // The fence is recorded on this thread's CubeCL stream, after the kernels that wrote
        // the input (and allocated the output): waiting for it waits for exactly those.
        let ready = input.prim.client.sync();
        Pending {
            comm: self.clone(),
            op,
            name,
            ready,
            input,
            output,
        }
    }

    fn tensor_error(&self, reason: String) -> NcclError {
        NcclError::Tensor {
            rank: self.inner.rank,
            reason,
        }
    }

    /// The tensor's CubeCL buffer, contiguous and pinned.
    fn buffer(&self, tensor: Tensor<1>) -> Result<DeviceBuffer, NcclError> {
        let dtype = match tensor.dtype() {
            BurnDType::F32 => DType::F32,
            BurnDType::F16 => DType::F16,
            BurnDType::BF16 => DType::BF16,
            other => {
                return Err(self.tensor_error(format!("element type {other:?} is not supported")));
            }
        };
        let prim: CubeTensor = tensor
            .try_into_primitive::<Cuda>()
            .map_err(|e| self.tensor_error(format!("not a CUDA tensor ({e:?})")))?;
        let prim = into_contiguous(prim);
        let count = prim.meta.shape().num_elements();
        let resource = prim
            .client
            .get_resource::<CudaServer>(prim.handle.clone())
            .map_err(|e| self.tensor_error(format!("reading the buffer address: {e}")))?;
        Ok(DeviceBuffer {
            ptr: resource.resource().ptr,
            _pin: Box::new(resource),
            count,
            dtype,
            prim,
        })
    }
}

/// A collective started by [`NcclComm`]: wait for it (on any thread) to get the tensor back.
#[must_use = "the collective runs only in Pending::wait"]
pub struct Pending {
    comm: NcclComm,
    op: RawOp,
    name: &'static str,
    ready: Fence,
    input: DeviceBuffer,
    output: Option<DeviceBuffer>,
}

impl Pending {
    /// Waits for the input's kernels, runs the collective on NCCL's stream and waits for it
    /// (at most the communicator's timeout; then the communicator is aborted) and returns the
    /// result: the tensor itself, or for a gather the concatenation of every rank's tensor.
    pub fn wait(self) -> Result<Tensor<1>, NcclError> {
        let inner = &self.comm.inner;
        let (rank, timeout) = (inner.rank, inner.timeout);
        block_on(self.ready).map_err(|e| NcclError::Tensor {
            rank,
            reason: format!("the kernels that produced the tensor failed: {e}"),
        })?;
        let what = format!(
            "{} of {} x {:?}",
            self.name, self.input.count, self.input.dtype
        );
        let stream = inner.stream.cu_stream();
        let mut raw = inner.raw.lock().unwrap_or_else(|p| p.into_inner());
        raw.enqueue(self.op, self.input.dtype, stream)
            .map_err(|message| NcclError::Nccl {
                rank,
                call: self.name,
                message,
            })?;
        raw.wait(stream, timeout).map_err(|message| {
            if message.starts_with("timed out") {
                NcclError::Timeout {
                    rank,
                    op: what,
                    timeout,
                }
            } else {
                NcclError::Nccl {
                    rank,
                    call: self.name,
                    message,
                }
            }
        })?;
        drop(raw);
        // NCCL's stream is finished: the pins may go and burn may read the buffers.
        let out = self.output.unwrap_or(self.input);
        Ok(Tensor::from_primitive::<Cuda>(out.prim))
    }
}

/// A CubeCL buffer pinned while NCCL uses its address.
struct DeviceBuffer {
    ptr: u64,
    /// cubecl's managed resource: keeps the allocation alive and in place until dropped.
    _pin: Box<dyn std::any::Any + Send>,
    count: usize,
    dtype: DType,
    prim: CubeTensor,
}

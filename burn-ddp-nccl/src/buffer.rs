//! The CubeCL buffer under a burn CUDA tensor, as NCCL needs it: reached through burn's fusion
//! client (fusion is always on, see `comm.rs`), contiguous, and pinned (its address stays valid
//! and nothing frees it) for as long as the [`DeviceBuffer`] lives; and the way back from a
//! buffer to a burn tensor once NCCL is done with it.

use burn::backend::Cuda;
use burn::tensor::{Device, Tensor};
use burn_cubecl::CubeBackend;
use burn_cubecl::cubecl::future::DynFut;
use burn_cubecl::fusion::FusionCubeRuntime;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use burn_fusion::stream::StreamId;
use burn_fusion::{FusionTensor, NoOp};
use burn_ir::{BackendIr, InitOperationIr, OperationIr, OperationOutput};
use cubecl_cuda::CudaRuntime;
use cubecl_runtime::runtime::Runtime;

use crate::tables::{DType, cuda_ordinal, wrong_gpu};

type CudaServer = <CudaRuntime as Runtime>::Server;

/// A fence on a CubeCL stream: ready once the work queued before it finished.
pub(crate) type Fence = DynFut<Result<(), burn_cubecl::cubecl::server::ServerError>>;

/// A CubeCL buffer pinned while NCCL uses its address.
pub(crate) struct DeviceBuffer {
    /// The device address of its first element.
    pub(crate) ptr: u64,
    /// cubecl's managed resource: keeps the allocation alive and in place until dropped.
    _pin: Box<dyn std::any::Any + Send>,
    /// Elements.
    pub(crate) count: usize,
    /// NCCL's type of its elements.
    pub(crate) dtype: DType,
    /// burn's device of the buffer (without autodiff).
    device: Device,
    prim: CubeTensor,
}

impl DeviceBuffer {
    /// The buffer of `tensor`, which must be a flat float tensor on CUDA GPU `gpu`; why not, in
    /// words, otherwise.
    pub(crate) fn of(tensor: Tensor<1>, gpu: usize) -> Result<Self, String> {
        let dtype = DType::of(tensor.dtype()).ok_or_else(|| {
            format!(
                "element type {:?} is not supported (f64, f32, f16 and bf16 are)",
                tensor.dtype()
            )
        })?;
        let device = tensor.device().inner();
        let tensor = if tensor.device().is_autodiff() {
            tensor.inner()
        } else {
            tensor
        };
        match cuda_ordinal(&device) {
            Some(on) if on == gpu => {}
            Some(on) => return Err(wrong_gpu(on, gpu)),
            None => return Err(format!("{device:?} is not a CUDA device")),
        }
        let prim = into_contiguous(into_cube(tensor)?);
        let count = prim.meta.shape().num_elements();
        let resource = prim
            .client
            .get_resource::<CudaServer>(prim.handle.clone())
            .map_err(|e| format!("reading the buffer address: {e}"))?;
        Ok(DeviceBuffer {
            ptr: resource.resource().ptr,
            _pin: Box::new(resource),
            count,
            dtype,
            device,
            prim,
        })
    }

    /// A new buffer of `count` elements of this one's type, on its GPU `gpu`: uninitialised,
    /// or filled with NaN when [`POISON_VAR`] is `1` (the device check sets it, so that a
    /// collective's result proves NCCL wrote every element: an unwritten output could otherwise
    /// reuse freed memory that happens to hold the right values).
    pub(crate) fn new_like(&self, count: usize, gpu: usize) -> Result<Self, String> {
        let options = (&self.device, self.prim.dtype);
        let output = if poison() {
            Tensor::<1>::full([count], f32::NAN, options)
        } else {
            Tensor::<1>::empty([count], options)
        };
        Self::of(output, gpu)
    }

    /// A fence on this thread's CubeCL stream, after the kernels that wrote the buffers pinned
    /// so far on this thread (reading their addresses made this stream wait for the streams
    /// that wrote them): waiting for it waits for exactly those.
    pub(crate) fn fence(&self) -> Fence {
        self.prim.client.sync()
    }

    /// The buffer as a burn tensor, registered with fusion as a fresh tensor (what
    /// burn-fusion's `float_from_data` does with a new buffer). Only once NCCL is done with it.
    pub(crate) fn into_tensor(self) -> Tensor<1> {
        let prim = self.prim;
        let client = burn_fusion::get_client::<CubeBackend>(&prim.device);
        let (shape, dtype) = (prim.meta.shape().clone(), prim.dtype);
        let handle = <CubeBackend as BackendIr>::float_tensor_handle(prim);
        let init = InitOperationIr::create(shape, dtype, || client.register_tensor_handle(handle));
        let fused = client
            .register(
                StreamId::current(),
                OperationIr::Init(init),
                NoOp::<CubeBackend>::new(),
            )
            .output();
        Tensor::from_primitive::<Cuda>(fused)
    }
}

/// The `CubeTensor` under a CUDA tensor: fusion runs what is queued for it and hands it over.
fn into_cube(tensor: Tensor<1>) -> Result<CubeTensor, String> {
    let fused: FusionTensor<FusionCubeRuntime> = tensor
        .try_into_primitive::<Cuda>()
        .map_err(|e| format!("not a CUDA tensor ({e:?})"))?;
    let client = fused.client.clone();
    Ok(client.resolve_tensor_float::<CubeBackend>(fused))
}

/// Set to `1`, every collective's output buffer is filled with NaN before NCCL writes it (for
/// checks; costs one fill kernel per collective).
pub const POISON_VAR: &str = "BURN_DDP_NCCL_POISON";

/// Whether [`POISON_VAR`] asks for poisoned outputs (read once).
fn poison() -> bool {
    static POISON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *POISON.get_or_init(|| std::env::var_os(POISON_VAR).is_some_and(|v| v == "1"))
}

//! Cutting and joining flat tensors without burn 0.22's panics: `Tensor::narrow` refuses a
//! length of 0 (burn-tensor `check.rs`), so every cut that can be empty (a rank's empty part, a
//! tensor of no elements) goes through [`cut`], and every join through [`concat`]. And a value
//! made without autodiff put back where a parameter lives ([`on_device`]).

use burn::tensor::{DType, Device, Tensor, TensorData};

/// `len` elements of `tensor` from `start`; an empty tensor for a length of 0 (burn's `narrow`
/// panics there), the tensor itself when it is the whole.
pub(crate) fn cut(tensor: &Tensor<1>, start: usize, len: usize) -> Tensor<1> {
    if len == 0 {
        empty(&tensor.device(), tensor.dtype())
    } else if start == 0 && len == tensor.shape().num_elements() {
        tensor.clone()
    } else {
        tensor.clone().narrow(0, start, len)
    }
}

/// The tensors concatenated; empty ones are left out, and no tensor at all is an empty one.
pub(crate) fn concat(tensors: Vec<Tensor<1>>, device: &Device, dtype: DType) -> Tensor<1> {
    let mut left: Vec<Tensor<1>> = (tensors.into_iter())
        .filter(|t| t.shape().num_elements() > 0)
        .collect();
    match left.len() {
        0 => empty(device, dtype),
        1 => left.remove(0),
        _ => Tensor::cat(left, 0),
    }
}

/// A tensor of no elements of `dtype` on `device`.
pub(crate) fn empty(device: &Device, dtype: DType) -> Tensor<1> {
    let data = TensorData::from_bytes_vec(Vec::new(), [0], dtype);
    Tensor::from_data(data, (device, dtype))
}

/// `inner` (a value without autodiff) on `device`: with autodiff and the device's gradient
/// checkpointing strategy when it has them (`Tensor::autodiff` alone would reset the strategy,
/// and burn refuses operations that mix strategies).
pub(crate) fn on_device<const D: usize>(inner: Tensor<D>, device: &Device) -> Tensor<D> {
    match device.gradient_checkpointing_strategy() {
        Some(strategy) => Tensor::from_inner(inner).with_gradient_checkpointing_strategy(strategy),
        None => inner,
    }
}

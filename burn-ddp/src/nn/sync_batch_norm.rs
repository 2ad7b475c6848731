//! [`SyncBatchNorm`]: burn's `BatchNorm` with the statistics of the global batch.

mod op;

use std::sync::Arc;

use burn::backend::Dispatch;
use burn::module::{Flag, Module, Param, RunningState};
use burn::nn::{BatchNorm, BatchNormConfig};
use burn::tensor::{DType, Device, FloatDType, Tensor};

use self::op::{SyncBnBackend, SyncWith};
use super::current_group;
use crate::{ProcessGroup, ReduceOp};

/// Batch normalisation over the batches of every rank, as PyTorch's `torch.nn.SyncBatchNorm`.
///
/// The fields, configuration and record are those of burn's [`BatchNorm`]: a model switches by
/// changing a field's type, loads a record saved from `BatchNorm`, and converts one with
/// [`From<BatchNorm>`] (PyTorch's `convert_sync_batchnorm`).
///
/// In training (an autodiff device and `training` enabled) inside a [`scope`](super::scope)
/// whose group has more than one rank, the per-channel count, sum and sum of squares of every
/// rank's input are all-reduced (one all-reduce of `2C + 1` values), the input is normalised
/// with the global mean and biased variance, and the running statistics are updated with them
/// exactly as `BatchNorm` updates its own (`running = (1 - momentum) · running + momentum ·
/// batch`, biased variance). The backward pass all-reduces `[Σg, Σg·x̂]` per channel (one more
/// all-reduce) and gives exact gradients. Ranks may have different batch sizes, including
/// empty ones, which still take part in both all-reduces.
///
/// Everything else is `BatchNorm`'s own code: evaluation (a device without autodiff, or
/// `training` off) uses the running statistics and communicates nothing, and training outside a
/// scope or in a world of one normalises with the local batch.
///
/// Every rank of the group must run the same `SyncBatchNorm` layers in the same order, forward
/// and backward, as with PyTorch, and start from the same running statistics (the sums are
/// taken relative to the running mean, for precision, so it must be the same on every rank: it
/// is when the ranks start from the same model or checkpoint, since this layer updates it with
/// the global statistics). A failed collective panics with the group's error (the group
/// has recorded it; the training loop reports it).
///
/// Supported devices: `flex` (CPU), and the CubeCL devices (CUDA, wgpu) when burn-ddp is built
/// with its `nccl` or `wgpu` feature. The statistics are computed in `f32`.
///
/// ```no_run
/// use burn::nn::BatchNormConfig;
/// use burn::tensor::{Device, Tensor};
/// use burn_ddp::nn::{BatchNormSyncExt, SyncBatchNorm};
///
/// let device = Device::flex().autodiff();
/// let bn: SyncBatchNorm = BatchNormConfig::new(16).init_sync(&device);
/// let _scope = burn_ddp::nn::scope(std::sync::Arc::new(burn_ddp::init_process_group()?));
/// let y = bn.forward(Tensor::<4>::ones([2, 16, 8, 8], &device));
/// # Ok::<(), burn_ddp::DdpError>(())
/// ```
#[derive(Module, Debug)]
pub struct SyncBatchNorm {
    /// The learnable weight gamma.
    pub gamma: Param<Tensor<1>>,
    /// The learnable weight beta.
    pub beta: Param<Tensor<1>>,
    /// Whether training behavior is enabled for this layer.
    pub training: Param<Flag>,
    /// The running mean.
    pub running_mean: RunningState<Tensor<1>>,
    /// The running variance (biased, as `BatchNorm`'s).
    pub running_var: RunningState<Tensor<1>>,
    /// Momentum used to update the running statistics.
    pub momentum: f64,
    /// A value required for numerical stability.
    pub epsilon: f64,
}

/// [`BatchNormConfig::init_sync`](BatchNormSyncExt::init_sync): a [`SyncBatchNorm`] from
/// `BatchNorm`'s configuration.
///
/// ```
/// use burn::nn::BatchNormConfig;
/// use burn_ddp::nn::BatchNormSyncExt;
/// let bn = BatchNormConfig::new(4).init_sync(&burn::tensor::Device::flex());
/// assert_eq!(bn.gamma.shape().dims::<1>(), [4]);
/// ```
pub trait BatchNormSyncExt {
    /// Initializes a [`SyncBatchNorm`] as [`BatchNormConfig::init`] initializes a `BatchNorm`.
    fn init_sync(&self, device: &Device) -> SyncBatchNorm;
}

impl BatchNormSyncExt for BatchNormConfig {
    fn init_sync(&self, device: &Device) -> SyncBatchNorm {
        SyncBatchNorm::new(self, device)
    }
}

impl From<BatchNorm> for SyncBatchNorm {
    /// The same layer, synchronised (PyTorch's `convert_sync_batchnorm`): parameters, running
    /// statistics and their ids are kept.
    fn from(bn: BatchNorm) -> Self {
        SyncBatchNorm {
            gamma: bn.gamma,
            beta: bn.beta,
            training: bn.training,
            running_mean: bn.running_mean,
            running_var: bn.running_var,
            momentum: bn.momentum,
            epsilon: bn.epsilon,
        }
    }
}

impl From<SyncBatchNorm> for BatchNorm {
    /// Back to burn's layer, for example to export a model for single-device inference.
    fn from(bn: SyncBatchNorm) -> Self {
        BatchNorm {
            gamma: bn.gamma,
            beta: bn.beta,
            training: bn.training,
            running_mean: bn.running_mean,
            running_var: bn.running_var,
            momentum: bn.momentum,
            epsilon: bn.epsilon,
        }
    }
}

impl SyncBatchNorm {
    /// A new layer, initialised as [`BatchNormConfig::init`] initialises a `BatchNorm` (gamma
    /// ones, beta zeros, running mean zeros, running variance ones).
    ///
    /// # Panics
    ///
    /// As [`BatchNormConfig::init`]: if `num_features` is zero, `epsilon` is not finite and
    /// positive, or `momentum` is not finite and within `[0, 1]`.
    pub fn new(config: &BatchNormConfig, device: &Device) -> Self {
        config.init(device).into()
    }

    /// Applies the layer to `input` (`[batch_size, num_features, ...]`); see [`SyncBatchNorm`].
    ///
    /// # Panics
    ///
    /// If the input has rank < 2 or its second axis is not `num_features`, or if a collective
    /// of the group fails (with the group's error).
    pub fn forward<const D: usize>(&self, input: Tensor<D>) -> Tensor<D> {
        let training = input.device().is_autodiff() && self.training.is_enabled();
        match current_group().filter(|g| training && g.world_size() > 1) {
            Some(group) => self.forward_sync(input, group),
            // Evaluation, or training alone: BatchNorm's own forward, on these very
            // parameters and running statistics (clones share them).
            None => self.as_batch_norm().forward(input),
        }
    }

    /// A `BatchNorm` sharing this layer's parameters and running statistics.
    fn as_batch_norm(&self) -> BatchNorm {
        BatchNorm {
            gamma: self.gamma.clone(),
            beta: self.beta.clone(),
            training: self.training.clone(),
            running_mean: self.running_mean.clone(),
            running_var: self.running_var.clone(),
            momentum: self.momentum,
            epsilon: self.epsilon,
        }
    }

    /// Training with the statistics of every rank's batch.
    fn forward_sync<const D: usize>(
        &self,
        input: Tensor<D>,
        group: Arc<ProcessGroup>,
    ) -> Tensor<D> {
        let [num_features] = self.gamma.shape().dims();
        let dims = input.dims();
        assert!(
            D >= 2 && dims[1] == num_features,
            "SyncBatchNorm expects an input of shape [batch_size, {num_features}, ...], got {dims:?}"
        );
        let device = input.device();
        let dtype = input.dtype();
        let running_mean = self.running_mean.value_sync().to_device(&device);
        let running_var = self.running_var.value_sync().to_device(&device);

        // Sums of x - shift, the shift identical on every rank (the running mean, kept equal
        // by this layer): E[x²] - E[x]² then cancels far less than without it.
        let shift = to_f32(running_mean.clone().inner());
        let (sums, count) = local_sums(to_f32(input.clone().inner()), shift.clone());
        let stats = group
            .all_reduce(Tensor::cat(vec![sums, count], 0), ReduceOp::Sum)
            .wait()
            .unwrap_or_else(|e| panic!("{e}"));
        let mut parts = stats.split_with_sizes(vec![num_features, num_features, 1], 0);
        let (count, sum_sq, sum) = match (parts.pop(), parts.pop(), parts.pop()) {
            (Some(c), Some(s2), Some(s1)) => (c, s2, s1),
            _ => unreachable!("split_with_sizes gives one part per size"),
        };
        let mean_shifted = sum / count.clone();
        let var = (sum_sq / count.clone() - mean_shifted.clone().square()).clamp_min(0.0);
        let mean = mean_shifted + shift;
        let invstd = var.clone().add_scalar(self.epsilon).sqrt().recip();

        let xhat = Tensor::<D>::from_dispatch(<Dispatch as SyncBnBackend>::sync_bn_normalize(
            input.into_dispatch(),
            mean.clone().cast(dtype).into_dispatch(),
            invstd.cast(dtype).into_dispatch(),
            count.cast(dtype).into_dispatch(),
            SyncWith { group },
        ));
        let mut shape = [1; D];
        shape[1] = num_features;
        let output = xhat * self.gamma.val().reshape(shape) + self.beta.val().reshape(shape);

        // The running statistics, exactly as BatchNorm updates them (biased variance).
        let momentum = self.momentum;
        let (mean, var) = (mean.cast(dtype).detach(), var.cast(dtype).detach());
        let running_mean = running_mean
            .mul_scalar(1.0 - momentum)
            .add(mean.mul_scalar(momentum));
        let running_var = running_var
            .mul_scalar(1.0 - momentum)
            .add(var.mul_scalar(momentum));
        self.running_mean.update(running_mean.detach());
        self.running_var.update(running_var.detach());

        output
    }
}

/// `t` in `f32` (the statistics' type), unchanged when it is already.
fn to_f32<const D: usize>(t: Tensor<D>) -> Tensor<D> {
    match t.dtype() {
        DType::F32 => t,
        _ => t.cast(FloatDType::F32),
    }
}

/// Per channel of `x` (`[N, C, ...]`, no autodiff): `[Σ(x - shift), Σ(x - shift)²]` (`[2C]`)
/// and the number of values per channel (`[1]`). An empty batch gives zeros.
fn local_sums<const D: usize>(x: Tensor<D>, shift: Tensor<1>) -> (Tensor<1>, Tensor<1>) {
    let dims = x.dims();
    let channels = dims[1];
    let numel: usize = dims.iter().product();
    let per_channel = numel / channels;
    let device = x.device();
    let count = Tensor::<1>::full([1], per_channel as f64, &device);
    if numel == 0 {
        return (Tensor::zeros([2 * channels], &device), count);
    }
    let centered =
        x.swap_dims(0, 1).reshape([channels, per_channel]) - shift.reshape([channels, 1]);
    let sum = centered.clone().sum_dim(1).reshape([channels]);
    let sum_sq = centered.square().sum_dim(1).reshape([channels]);
    (Tensor::cat(vec![sum, sum_sq], 0), count)
}

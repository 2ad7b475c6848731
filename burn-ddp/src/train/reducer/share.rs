//! The sharded step of a hand-written training loop: after the optimizer stepped this rank's own
//! parameters, [`GradientReducer::share_parameters`] puts every other rank's updated
//! parameters in place. (`DdpLearner` does the same through burn-train's `Learner`, with an
//! optimizer group for the parameters a rank does not own: `sharding::TakeOwners`.)

use burn::module::{Module, ModuleMapper, Param};
use burn::optim::GradientsParams;
use burn::tensor::Tensor;

use crate::collectives::backend::slices::on_device;
use crate::error::Result;
use crate::train::reducer::GradientReducer;
use crate::train::report::telemetry::StepStats;

impl GradientReducer {
    /// Completes a sharded step of a hand-written loop (see [`GradientReducer::sharding`]):
    /// returns `model` with the parameters this rank does not own replaced by the values their
    /// owners' optimizers gave them, all-gathered bucket by bucket (every rank must call it, once
    /// per step, after its optimizer step). Unsharded, or alone, it returns `model` untouched.
    ///
    /// Sharded, [`GradientReducer::reduce`] hands back only the gradients of this rank's own
    /// parameters, so burn's optimizer steps those (and keeps state for those) only:
    ///
    /// ```
    /// use std::sync::Arc;
    /// use burn::module::Module;
    /// use burn::nn::{Linear, LinearConfig};
    /// use burn::optim::{GradientsParams, Optimizer, SgdConfig};
    /// use burn::tensor::{Device, Tensor};
    /// use burn_ddp::ProcessGroup;
    /// use burn_ddp::store::StoreServer;
    /// use burn_ddp::train::{BucketConfig, GradientReducer, Sharding};
    /// use burn_ddp::train::{broadcast_module, parameters_to_vector};
    ///
    /// /// One rank of a hand-written loop with its gradients and optimizer sharded (ZeRO-2).
    /// fn train(group: ProcessGroup) -> burn_ddp::Result<Vec<f32>> {
    ///     let group = Arc::new(group);
    ///     let device = Device::flex().autodiff();
    ///     let model: Linear = LinearConfig::new(4, 2).init(&device);
    ///     let mut model = broadcast_module(model, &group)?; // rank 0's values
    ///     let reducer = GradientReducer::new(&model, group.clone(), BucketConfig::default())?
    ///         .sharding(Sharding::OptimizerAndGradients);
    ///     let mut optim = SgdConfig::new().init();
    ///     for step in 0..3 {
    ///         let x = Tensor::<2>::ones([8, 4], &device) * (group.rank() + step + 1) as f32;
    ///         let loss = model.forward(x).powf_scalar(2.0).mean();
    ///         let grads = GradientsParams::from_grads(loss.backward(), &model);
    ///         let grads = reducer.reduce(&model, grads)?; // this rank's parameters' only
    ///         model = optim.step(0.1, model, grads); // steps those
    ///         model = reducer.share_parameters(model)?; // the others from their owners
    ///     }
    ///     Ok(parameters_to_vector(&model))
    /// }
    ///
    /// // Two ranks as threads of this process, over loopback TCP.
    /// let store = StoreServer::bind("127.0.0.1:0")?;
    /// let port = store.local_addr().port();
    /// let ranks: Vec<_> = (0..2)
    ///     .map(|rank| {
    ///         std::thread::spawn(move || {
    ///             let group = ProcessGroup::builder(rank, 2)
    ///                 .master_addr("127.0.0.1")
    ///                 .master_port(port)
    ///                 .host_store(false)
    ///                 .build()?;
    ///             train(group)
    ///         })
    ///     })
    ///     .collect();
    /// let params = (ranks.into_iter())
    ///     .map(|rank| rank.join().expect("a rank panicked"))
    ///     .collect::<burn_ddp::Result<Vec<_>>>()?;
    /// assert_eq!(params[0], params[1], "the replicas are identical");
    /// # Ok::<(), burn_ddp::DdpError>(())
    /// ```
    pub fn share_parameters<M: Module>(&self, model: M) -> Result<M> {
        // The step's figures are the learner's: a hand-written loop measures its own.
        let mut stats = StepStats::default();
        Ok(match self.share_updates(&model, None, &mut stats)? {
            Some(values) => crate::fsdp::replicated(|| model.map(&mut TakeValues(values))),
            None => model,
        })
    }
}

/// Replaces each parameter that has a value in the `GradientsParams` (by its id) with it, in
/// the parameter's element type, device flavour and `require_grad`.
struct TakeValues(GradientsParams);

impl ModuleMapper for TakeValues {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let Some(value) = self.0.remove::<D>(param.id) else {
            return param;
        };
        param.map(|t| {
            let (dtype, grad) = (t.dtype(), t.is_require_grad());
            let value = if value.dtype() == dtype {
                value
            } else {
                value.cast(dtype)
            };
            // Back where the parameter was (autodiff, its checkpointing strategy).
            on_device(value.inner(), &t.device()).set_require_grad(grad)
        })
    }
}

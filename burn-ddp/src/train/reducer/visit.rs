//! The reducer's visitors of a model's trainable parameters, in visit order: their gradients
//! taken out of burn's `GradientsParams` and given back, and their values.

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::{Device, Tensor};

use crate::error::{DdpError, Result};

/// Takes every trainable parameter's gradient out of `grads` ([`RemoveGradients`]), checking that the
/// model has the `expected` number of trainable tensors; with the device of the first gradient
/// (or parameter), `None` when the model has no trainable parameter.
pub(super) fn take_gradients<M: Module>(
    model: &M,
    grads: &mut GradientsParams,
    expected: usize,
) -> Result<(Vec<Option<Tensor<1>>>, Option<Device>)> {
    let mut take = RemoveGradients {
        grads,
        flat: Vec::with_capacity(expected),
        device: None,
    };
    model.visit(&mut take);
    if take.flat.len() != expected {
        return Err(DdpError::Disagreement(format!(
            "the model has {} trainable tensors, the bucket plan {expected}",
            take.flat.len(),
        )));
    }
    Ok((take.flat, take.device))
}

/// Takes every trainable parameter's gradient out of `grads`, flattened, in visit order.
struct RemoveGradients<'a> {
    grads: &'a mut GradientsParams,
    flat: Vec<Option<Tensor<1>>>,
    device: Option<Device>,
}

impl ModuleVisitor for RemoveGradients<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if !param.val().is_require_grad() {
            return;
        }
        let g = self.grads.remove::<D>(param.id);
        if let Some(g) = &g {
            self.device.get_or_insert_with(|| g.device());
        } else if self.device.is_none() {
            self.device = Some(param.val().device().inner());
        }
        let n = param.val().shape().num_elements();
        self.flat.push(g.map(|g| g.reshape([n])));
    }
}

/// Registers reduced gradients back, reshaped to each parameter's shape.
pub(super) struct RegisterGradients<'a> {
    pub grads: &'a mut GradientsParams,
    pub flat: std::vec::IntoIter<Option<Tensor<1>>>,
}

impl ModuleVisitor for RegisterGradients<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if !param.val().is_require_grad() {
            return;
        }
        if let Some(Some(g)) = self.flat.next() {
            self.grads
                .register::<D>(param.id, g.reshape(param.val().dims()));
        }
    }
}

/// Every trainable parameter's value, flattened, on its backend without autodiff, in visit
/// order.
#[derive(Default)]
pub(super) struct Values(pub Vec<Tensor<1>>);

impl ModuleVisitor for Values {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let t = param.val();
        if t.is_require_grad() {
            let t = t.inner();
            let n = t.shape().num_elements();
            self.0.push(t.reshape([n]));
        }
    }
}

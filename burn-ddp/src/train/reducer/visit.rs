//! The reducer's visitors of a model's trainable parameters, in visit order: their gradients
//! taken out of burn's `GradientsParams` and given back, their values and their ids.

use burn::module::{ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::{Device, Tensor};

/// Takes every trainable parameter's gradient out of `grads`, flattened, in visit order.
pub(super) struct Take<'a> {
    pub grads: &'a mut GradientsParams,
    pub flat: Vec<Option<Tensor<1>>>,
    pub device: Option<Device>,
}

impl ModuleVisitor for Take<'_> {
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
pub(super) struct Give<'a> {
    pub grads: &'a mut GradientsParams,
    pub flat: std::vec::IntoIter<Option<Tensor<1>>>,
}

impl ModuleVisitor for Give<'_> {
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

/// Every trainable parameter's id, in visit order.
#[derive(Default)]
pub(super) struct Ids(pub Vec<u64>);

impl ModuleVisitor for Ids {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if param.val().is_require_grad() {
            self.0.push(param.id.val());
        }
    }
}

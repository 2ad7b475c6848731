//! Non-finite gradients: a NaN or an infinity in any rank's gradients would spread through the
//! all-reduce to every replica in silence (PyTorch's DDP does not look). burn-ddp looks: each
//! rank marks, in its bucket's trailer, whether its own gradients of the bucket are all finite
//! (one slot per rank, so the summed trailer names the ranks), and every rank reads the marks with
//! the step's other flags, in the one device-to-host read a step already makes. Every rank sees
//! the same sums, so every rank decides alike: stop (the default) or skip the step.
//!
//! The cost is one reduction of each gradient on the device (its sum: a NaN or an infinity
//! carries through) and one value read back per bucket; `cargo run --release -p burn-ddp
//! --example bench_reducer` measures it.

use burn::tensor::{Bool, Tensor};

use crate::error::{DdpError, Result};
use crate::status::name_ranks;

/// What the reducer does when some rank's gradients hold a NaN or an infinity.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum NonFinite {
    /// Every rank stops with an error naming the rank(s), the epoch and the step (default).
    #[default]
    Stop,
    /// Every rank skips the optimizer step (no gradient is applied, the step is logged with the
    /// ranks that produced the values), as mixed-precision loss scaling needs.
    SkipStep,
    /// No check: the values spread to every replica, as in PyTorch (and no cost).
    Propagate,
}

impl std::fmt::Display for NonFinite {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            NonFinite::Stop => "stop",
            NonFinite::SkipStep => "skip_step",
            NonFinite::Propagate => "propagate",
        })
    }
}

impl NonFinite {
    /// Whether the reducer checks at all.
    pub(crate) fn checks(self) -> bool {
        self != NonFinite::Propagate
    }

    /// This rank's slots of a bucket's trailer (one per rank of `world`): 1 at `rank` when any of
    /// its `grads` is not finite. The quick test is the sum of every value (NaN and infinities
    /// carry through a sum): one reduction per tensor and one value read back from the device.
    /// Only a sum that is not finite is looked at closely, since a sum of finite values can
    /// overflow.
    pub(crate) fn slots(grads: &[Tensor<1>], rank: usize, world: usize) -> Result<Vec<f32>> {
        let mut slots = vec![0.0; world];
        if grads.is_empty() {
            return Ok(slots);
        }
        let sums: Vec<Tensor<1>> = grads.iter().map(|g| g.clone().sum()).collect();
        let sum = host_values(Tensor::cat(sums, 0).sum())?;
        if sum.iter().all(|v| v.is_finite()) {
            return Ok(slots);
        }
        let bad: Vec<Tensor<1, Bool>> = grads
            .iter()
            .map(|g| g.clone().is_finite().bool_not().any())
            .collect();
        let bad = Tensor::cat(bad, 0).any().into_data();
        let bad = bad
            .try_to_vec::<bool>()
            .map_err(|e| DdpError::Tensor(format!("{e:?}")))?;
        slots[rank] = f32::from(u8::from(bad.first().copied().unwrap_or(false)));
        Ok(slots)
    }

    /// The ranks whose slots in a summed trailer are marked.
    pub(crate) fn marked(summed: &[f32]) -> Vec<usize> {
        (0..summed.len()).filter(|&r| summed[r] > 0.0).collect()
    }

    /// What a step whose gradients `culprits` made non-finite comes to: the error every rank
    /// stops with, or `None` to skip the step.
    pub(crate) fn decide(
        self,
        rank: usize,
        culprits: &[usize],
        (epoch, step): (usize, usize),
    ) -> Option<DdpError> {
        let ranks = name_ranks(culprits);
        match self {
            NonFinite::Stop => Some(DdpError::NonFiniteGradients {
                rank,
                culprits: culprits.to_vec(),
                epoch,
                step,
                detail: format!(
                    "{ranks} produced gradients that are not finite (NaN or infinite) in epoch \
                     {epoch} step {step}; every rank stops before the optimizer step applies \
                     them (DdpLearner::non_finite(NonFinite::SkipStep) skips such steps instead)"
                ),
            }),
            _ => {
                log::warn!(
                    "rank {rank}: {ranks} produced gradients that are not finite in epoch \
                     {epoch} step {step}: the step is skipped on every rank"
                );
                None
            }
        }
    }
}

/// A tensor's values on the host, as `f32`.
fn host_values(t: Tensor<1>) -> Result<Vec<f32>> {
    t.into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .map_err(|e| DdpError::Tensor(format!("{e:?}")))
}

#[cfg(test)]
mod tests {
    use burn::tensor::{Device, TensorData};

    use super::*;

    fn tensor(values: &[f32]) -> Tensor<1> {
        let data = TensorData::new(values.to_vec(), [values.len()]);
        Tensor::from_data(data, &Device::flex())
    }

    #[test]
    fn only_values_that_are_not_finite_mark_the_rank() {
        let fine = [tensor(&[1.0, -2.0]), tensor(&[3.0])];
        assert_eq!(NonFinite::slots(&fine, 1, 3).unwrap(), [0.0, 0.0, 0.0]);
        // Their sum overflows to infinity, each value is finite: not marked.
        let huge = [tensor(&[3e38, 3e38]), tensor(&[3e38])];
        assert_eq!(NonFinite::slots(&huge, 1, 3).unwrap(), [0.0, 0.0, 0.0]);
        let nan = [tensor(&[1.0]), tensor(&[2.0, f32::NAN])];
        assert_eq!(NonFinite::slots(&nan, 2, 3).unwrap(), [0.0, 0.0, 1.0]);
        let inf = [tensor(&[f32::NEG_INFINITY])];
        assert_eq!(NonFinite::slots(&inf, 0, 2).unwrap(), [1.0, 0.0]);
        assert_eq!(NonFinite::marked(&[0.0, 2.0, 0.0, 1.0]), [1, 3]);
    }
}

//! The receiving half of a gradient reduction: the buckets waited for in order, the trailers read
//! back, the fingerprints and non-finite slots checked, and the averaged gradients cut out of
//! the buckets, one per parameter.

use std::ops::Range;
use std::time::Instant;

use burn::tensor::Tensor;

use super::{GradientReducer, InFlight};
use crate::collectives::backend::slices::cut;
use crate::error::{DdpError, Result};
use crate::train::reducer::fingerprint::FINGERPRINT_LEN;
use crate::train::reducer::non_finite::NonFinite;
use crate::train::report::telemetry::StepStats;
use crate::train::report::telemetry::trace::{COMMUNICATION, Span, Trace};

impl GradientReducer {
    /// Waits for the buckets in order, publishing which one this rank waits for; adds the
    /// time waited to `stats.exposed` and each bucket's travel to `trace`.
    pub(super) fn wait_buckets(
        &self,
        pending: Vec<InFlight>,
        trace: Option<&Trace>,
        stats: &mut StepStats,
    ) -> Result<Vec<Tensor<1>>> {
        let status = self.group.status();
        let n = pending.len();
        let mut summed = Vec::with_capacity(n);
        for (b, (work, sent)) in pending.into_iter().enumerate() {
            status.activity(Some(format!("waits for bucket {} of {n}", b + 1)));
            let waiting = Instant::now();
            let done = work.wait();
            let received = Instant::now();
            status.activity(None);
            stats.exposed += (received - waiting).as_secs_f64();
            if let Some(trace) = trace {
                let span = Span::bucket("all-reduce bucket", b);
                trace.span(span, COMMUNICATION, sent, received);
            }
            summed.push(done?);
        }
        Ok(summed)
    }

    /// Uncompressed buckets: their averaged gradients, and every bucket's trailer read in one
    /// device-to-host copy.
    pub(super) fn split_trailers(
        &self,
        summed: Vec<Tensor<1>>,
    ) -> Result<(Vec<Tensor<1>>, Vec<f32>)> {
        let world = self.group.world_size();
        let trailers: Vec<Tensor<1>> = (summed.iter().zip(&self.plan.buckets).enumerate())
            .map(|(b, (t, bucket))| cut(t, bucket.len, self.trailer_len(b)))
            .collect();
        let trailers = host_f32(Tensor::cat(trailers, 0))?;
        let grads = (summed.into_iter().zip(&self.plan.buckets))
            .map(|(sum, bucket)| cut(&sum, 0, bucket.len))
            .collect();
        Ok((average(grads, world), trailers))
    }

    /// Checks the fingerprints and the non-finite slots in the summed `trailers` and hands out the
    /// averaged gradients (`grads`, one tensor per bucket, covering the elements `windows` of
    /// it) some rank produced: none when the step is skipped for non-finite gradients.
    pub(super) fn unpack(
        &self,
        at: (usize, usize),
        grads: Vec<Tensor<1>>,
        windows: &[Range<usize>],
        trailers: &[f32],
    ) -> Result<Vec<Option<Tensor<1>>>> {
        let world = self.group.world_size();
        let fingerprint = if self.check { FINGERPRINT_LEN } else { 0 };
        let mut out = vec![None; self.params.len()];
        let mut culprits = Vec::new();
        let mut offset = 0;
        for (b, (grads, bucket)) in grads.into_iter().zip(&self.plan.buckets).enumerate() {
            let n = bucket.params.len();
            let trailer = &trailers[offset..offset + self.trailer_len(b)];
            offset += self.trailer_len(b);
            if self.check
                && let Err(reason) = self
                    .fingerprint(b, at)
                    .check(&trailer[n..n + fingerprint], world)
            {
                return Err(self.desync(at, b, reason));
            }
            culprits.extend(NonFinite::marked(&trailer[n + fingerprint..]));
            let window = &windows[b];
            for (k, (&p, &offset)) in bucket.params.iter().zip(&bucket.offsets).enumerate() {
                let n = self.params[p].numel();
                let inside = window.start <= offset && offset + n <= window.end;
                if trailer[k] > 0.0 && inside {
                    out[p] = Some(cut(&grads, offset - window.start, n));
                }
            }
        }
        if !culprits.is_empty() {
            culprits.sort_unstable();
            culprits.dedup();
            if let Some(e) = self.non_finite.decide(self.group.rank(), &culprits, at) {
                return Err(e);
            }
            return Ok(vec![None; self.params.len()]);
        }
        Ok(out)
    }

    /// Stops the group for a desync found in bucket `b` at `at`: the error every rank reports.
    fn desync(&self, at: (usize, usize), b: usize, reason: impl std::fmt::Display) -> DdpError {
        let cause = self.group.abort(&reason);
        DdpError::Collective {
            rank: self.group.rank(),
            op: format!(
                "gradient reduction of epoch {} step {} (bucket {} of {})",
                at.0,
                at.1,
                b + 1,
                self.plan.buckets.len()
            ),
            cause,
            ranks: self.group.status().report(),
        }
    }
}

/// Summed buckets divided by the world size.
pub(super) fn average(summed: Vec<Tensor<1>>, world: usize) -> Vec<Tensor<1>> {
    (summed.into_iter())
        .map(|sum| sum.mul_scalar(1.0 / world as f32))
        .collect()
}

/// A tensor's values on the host, as `f32`.
fn host_f32(t: Tensor<1>) -> Result<Vec<f32>> {
    t.into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .map_err(|e| DdpError::Tensor(format!("{e:?}")))
}

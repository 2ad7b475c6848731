//! The desync check that travels with every gradient bucket.
//!
//! Each bucket ends with a fingerprint of what it is: the epoch and step of training it belongs
//! to, the bucket's index and a hash of its size, as six integers below 256. They are summed with
//! the gradients; afterwards each rank compares the sums with `world × its own values`. When all
//! ranks reduced the same step and bucket the two agree on every rank; when they do not (a rank
//! skipped or added a step, or ranks pack buckets differently) they differ on at least the ranks
//! holding the largest and the smallest value, which stop the group. Integers below 256 summed
//! over up to 65 000 ranks are exact in `f32`, so the check has no false alarms. Its cost: six
//! values per bucket and a comparison.

/// Values a fingerprint adds to a bucket.
pub(crate) const FINGERPRINT_LEN: usize = 6;

/// What one bucket of one reduction is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Fingerprint {
    /// The training epoch (0 outside an epoch loop).
    pub epoch: usize,
    /// The step within the epoch (or the reducer's count of reductions).
    pub step: usize,
    /// Index of the bucket in the plan.
    pub bucket: usize,
    /// Gradient values in the bucket.
    pub len: usize,
}

impl Fingerprint {
    fn bytes(&self) -> [u8; FINGERPRINT_LEN] {
        let s = (self.step as u16).to_le_bytes();
        let b = (self.bucket as u16).to_le_bytes();
        let h = (self.len as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 56;
        [s[0], s[1], self.epoch as u8, b[0], b[1], h as u8]
    }

    /// The values to append to the bucket.
    pub(crate) fn values(&self) -> [f32; FINGERPRINT_LEN] {
        self.bytes().map(f32::from)
    }

    /// Checks the summed fingerprint of the reduced bucket; the error says what this rank
    /// reduced and, when the other ranks agree among themselves, what they reduced.
    pub(crate) fn check(&self, summed: &[f32], world: usize) -> Result<(), String> {
        let own = self.bytes();
        let n = world as f32;
        if summed.len() == FINGERPRINT_LEN
            && summed.iter().zip(own).all(|(s, o)| *s == n * f32::from(o))
        {
            return Ok(());
        }
        // The others' values, if they all hold the same.
        let others: Option<Vec<u8>> = (world > 1 && summed.len() == FINGERPRINT_LEN)
            .then(|| {
                summed
                    .iter()
                    .zip(own)
                    .map(|(s, o)| {
                        let v = (s - f32::from(o)) / (n - 1.0);
                        (v.fract() == 0.0 && (0.0..256.0).contains(&v)).then_some(v as u8)
                    })
                    .collect()
            })
            .flatten();
        let theirs = match others {
            Some(b) => format!(
                "the other ranks reduce epoch {} step {} bucket {}",
                b[2],
                u16::from_le_bytes([b[0], b[1]]),
                u16::from_le_bytes([b[3], b[4]]) as usize + 1,
            ),
            None => "the other ranks reduce something else".to_string(),
        };
        Err(format!(
            "ranks disagree on what they reduce (desync): this rank reduces epoch {} step {} \
             bucket {} ({} values), {theirs}; a rank skipped or added a step, or the ranks' \
             models differ",
            self.epoch % 256,
            self.step % (1 << 16),
            self.bucket + 1,
            self.len
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn summed(fps: &[Fingerprint]) -> Vec<f32> {
        (0..FINGERPRINT_LEN)
            .map(|i| fps.iter().map(|f| f.values()[i]).sum())
            .collect()
    }

    #[test]
    fn agreement_passes_and_any_difference_is_caught() {
        let f = |epoch, step, bucket, len| Fingerprint {
            epoch,
            step,
            bucket,
            len,
        };
        let same = vec![f(2, 60_000, 3, 1000); 5];
        assert!(same[0].check(&summed(&same), 5).is_ok());
        for odd in [
            f(2, 60_001, 3, 1000),
            f(3, 60_000, 3, 1000),
            f(2, 60_000, 4, 1000),
            f(2, 60_000, 3, 999),
        ] {
            let mut fps = same.clone();
            fps[2] = odd;
            let s = summed(&fps);
            let caught = fps.iter().filter(|f| f.check(&s, 5).is_err()).count();
            assert!(caught >= 1, "{odd:?} went unnoticed");
        }
        let pair = [f(1, 9, 0, 10), f(1, 10, 0, 10)];
        let e = pair[0].check(&summed(&pair), 2).unwrap_err();
        assert!(
            e.contains("this rank reduces epoch 1 step 9 bucket 1")
                && e.contains("the other ranks reduce epoch 1 step 10 bucket 1"),
            "{e}"
        );
    }
}

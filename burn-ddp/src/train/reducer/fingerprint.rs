//! The desync check that travels with every gradient bucket.
//!
//! Each bucket ends with a fingerprint of what it is: the epoch and step of training it belongs
//! to, the bucket's index and a hash of its size, 48 bits written as twelve 4-bit digits `d`,
//! each followed by `d²`. They are summed with the gradients; afterwards each rank compares the
//! sums with `world × d` and `world × d²` for its own digits. Equal sums of values and of squares
//! mean every rank holds the same digit (their variance is zero), so when ranks disagree (a rank
//! skipped or added a step, or ranks pack buckets differently) every rank notices, at once.
//! The sums stay below 2²⁴ for up to 65 536 ranks, exact in `f32`: no false alarms. Its cost:
//! 24 values per bucket and a comparison.

/// 4-bit digits of a fingerprint.
const DIGITS: usize = 12;
/// Values a fingerprint adds to a bucket (each digit and its square).
pub(crate) const FINGERPRINT_LEN: usize = 2 * DIGITS;

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
    fn bytes(&self) -> [u8; DIGITS / 2] {
        let s = (self.step as u16).to_le_bytes();
        let b = (self.bucket as u16).to_le_bytes();
        let h = (self.len as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 56;
        [s[0], s[1], self.epoch as u8, b[0], b[1], h as u8]
    }

    fn digits(&self) -> [u8; DIGITS] {
        let b = self.bytes();
        std::array::from_fn(|i| (b[i / 2] >> (4 * (i % 2))) & 0xf)
    }

    /// The values to append to the bucket: each digit, then its square.
    pub(crate) fn values(&self) -> [f32; FINGERPRINT_LEN] {
        let d = self.digits();
        std::array::from_fn(|i| {
            let v = f32::from(d[i / 2]);
            if i % 2 == 0 { v } else { v * v }
        })
    }

    /// Checks the summed fingerprint of the reduced bucket; the error says what this rank
    /// reduced and, when the other ranks agree among themselves, what they reduced.
    pub(crate) fn check(&self, summed: &[f32], world: usize) -> Result<(), Desync> {
        let n = world as f32;
        let own = self.values();
        if summed.len() == FINGERPRINT_LEN && summed.iter().zip(own).all(|(s, o)| *s == n * o) {
            return Ok(());
        }
        // The others' digits, if they all hold the same: (sum - own) / (world - 1).
        let others: Option<Vec<u8>> = (world > 1 && summed.len() == FINGERPRINT_LEN)
            .then(|| {
                (0..DIGITS)
                    .map(|i| {
                        let v = (summed[2 * i] - own[2 * i]) / (n - 1.0);
                        (v.fract() == 0.0 && (0.0..16.0).contains(&v)).then_some(v as u8)
                    })
                    .collect()
            })
            .flatten();
        let theirs = others.map(|d| {
            let b: Vec<u8> = d.chunks(2).map(|p| p[0] | (p[1] << 4)).collect();
            Reduced {
                epoch: b[2] as usize,
                step: u16::from_le_bytes([b[0], b[1]]) as usize,
                bucket: u16::from_le_bytes([b[3], b[4]]) as usize + 1,
            }
        });
        Err(Desync {
            own: Reduced {
                epoch: self.epoch % 256,
                step: self.step % (1 << 16),
                bucket: self.bucket + 1,
            },
            len: self.len,
            theirs,
        })
    }
}

/// What a fingerprint says a bucket is, as far as its digits tell: the epoch modulo 256, the
/// step modulo 65 536, the bucket (1-based).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Reduced {
    epoch: usize,
    step: usize,
    bucket: usize,
}

impl std::fmt::Display for Reduced {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let Reduced {
            epoch,
            step,
            bucket,
        } = self;
        write!(f, "epoch {epoch} step {step} bucket {bucket}")
    }
}

/// Ranks reduced different buckets: what this rank reduced and, when the other ranks agree
/// among themselves, what they reduced.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "ranks disagree on what they reduce (desync): this rank reduces {own} ({len} values), {}; \
     a rank skipped or added a step, or the ranks' models differ",
    match theirs {
        Some(r) => format!("the other ranks reduce {r}"),
        None => "the other ranks reduce something else".to_string(),
    }
)]
pub(crate) struct Desync {
    /// What this rank reduced.
    own: Reduced,
    /// Gradient values in this rank's bucket.
    len: usize,
    /// What the other ranks reduced, if they agree among themselves.
    theirs: Option<Reduced>,
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
            assert_eq!(caught, 5, "{odd:?}: every rank must notice");
        }
        // Three ranks whose digits average to the middle one's: all still notice.
        let (lo, mid, hi) = (f(0, 1, 0, 0), f(0, 2, 0, 0), f(0, 3, 0, 0));
        let s = summed(&[lo, mid, hi]);
        assert!(
            mid.check(&s, 3).is_err(),
            "the rank at the mean must notice too"
        );
        // The largest world keeps sums exact: no false alarm.
        let big = f(255, 65_535, 65_535, usize::MAX);
        let sums: Vec<f32> = big.values().iter().map(|v| v * 65_536.0).collect();
        assert!(big.check(&sums, 65_536).is_ok());
        let pair = [f(1, 9, 0, 10), f(1, 10, 0, 10)];
        let e = pair[0].check(&summed(&pair), 2).unwrap_err().to_string();
        assert!(
            e.contains("this rank reduces epoch 1 step 9 bucket 1")
                && e.contains("the other ranks reduce epoch 1 step 10 bucket 1"),
            "{e}"
        );
    }
}

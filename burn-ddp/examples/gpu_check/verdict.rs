//! The verdicts of the GPU check, apart from the GPU: whether values match the host's result
//! (a NaN never does: the outputs are poisoned with NaN before each operation), whether a dead
//! rank was named as the culprit, whether every bucket of the bandwidth run holds its mean.
//! Each returns the row's detail: `Ok` for a passed check, `Err` for a failed one.

use std::time::Duration;

/// The largest difference between `got` and `want`, relative to `max(|want|, 1)`, that
/// passes (`tolerance`: the type's precision). A value that is not finite never passes.
pub(crate) fn compare(got: &[f64], want: &[f64], tolerance: f64) -> Result<(), String> {
    if got.len() != want.len() {
        return Err(format!("{} values, expected {}", got.len(), want.len()));
    }
    // Written so that a NaN fails: every comparison with NaN is false.
    let close = |g: f64, w: f64| (g - w).abs() <= tolerance * w.abs().max(1.0);
    match got.iter().zip(want).position(|(&g, &w)| !close(g, w)) {
        None => Ok(()),
        Some(i) => Err(format!("index {i}: {} instead of {}", got[i], want[i])),
    }
}

/// The verdict on a collective that a dead rank (`dead`) should have failed: it must fail
/// within `within`, and the group's failure record must name `dead` as the culprit (an error's
/// text names every rank, the dead one among them, whoever was blamed).
pub(crate) fn names_the_dead_rank(
    outcome: Result<(), String>,
    culprit: Option<usize>,
    dead: usize,
    (took, within): (Duration, Duration),
) -> Result<String, String> {
    let secs = took.as_secs_f64();
    let message = match outcome {
        Ok(()) => return Err(format!("the collective succeeded without rank {dead}")),
        Err(message) => message,
    };
    match culprit {
        Some(c) if c == dead && took <= within => Ok(format!(
            "culprit rank {c} recorded, in {secs:.2} s: {message}"
        )),
        Some(c) if c == dead => Err(format!(
            "culprit rank {c} recorded, but after {secs:.2} s (limit {:.0} s): {message}",
            within.as_secs_f64()
        )),
        Some(c) => Err(format!(
            "rank {c} recorded as the culprit instead of rank {dead}, after {secs:.2} s: {message}"
        )),
        None => Err(format!(
            "no culprit recorded (rank {dead} expected), after {secs:.2} s: {message}"
        )),
    }
}

/// The verdict on the bandwidth run's buckets: `extremes[b]` is bucket `b`'s (min, max) after
/// the all-reduce, `want[b]` the mean every value must have.
pub(crate) fn buckets_hold(extremes: &[(f64, f64)], want: &[f64]) -> Result<(), String> {
    if extremes.len() != want.len() {
        return Err(format!(
            "{} buckets, expected {}",
            extremes.len(),
            want.len()
        ));
    }
    for (b, (&(lo, hi), &w)) in extremes.iter().zip(want).enumerate() {
        compare(&[lo, hi], &[w, w], 1e-6)
            .map_err(|_| format!("bucket {b} holds values in [{lo}, {hi}] instead of {w}"))?;
    }
    Ok(())
}

/// max |a - b| / max |b| (0 for empty inputs; infinite where a value is not finite).
pub(crate) fn relative_error(a: &[f64], b: &[f64]) -> f64 {
    let mut diff = 0f64;
    for (x, y) in a.iter().zip(b) {
        let d = (x - y).abs();
        diff = if d.is_nan() {
            f64::INFINITY
        } else {
            diff.max(d)
        };
    }
    let scale = b.iter().map(|y| y.abs()).fold(f64::MIN_POSITIVE, f64::max);
    diff / scale
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_nan_never_matches() {
        assert!(compare(&[1.0, 2.0], &[1.0, 2.0], 1e-6).is_ok());
        assert!(compare(&[1.0, f64::NAN], &[1.0, 2.0], 1e-6).is_err());
        assert!(compare(&[f64::NAN], &[f64::NAN], 1e-6).is_err());
        assert!(compare(&[1.0], &[1.0, 2.0], 1e-6).is_err());
        assert!(compare(&[1.01], &[1.0], 1e-3).is_err());
    }

    /// Every collective error lists where each rank was ("rank 1: exited ..."), so the text
    /// names rank 1 even when the record blames rank 0: only the culprit counts.
    #[test]
    fn only_the_recorded_culprit_names_the_dead_rank() {
        let second = Duration::from_secs(1);
        let within = Duration::from_secs(10);
        let message = || {
            Err(
                "rank 0: all_reduce #2 failed: rank 0: NCCL remote error; where the ranks \
                 were: rank 1: all_reduce #2"
                    .to_string(),
            )
        };
        let blamed_self = names_the_dead_rank(message(), Some(0), 1, (second, within));
        assert!(blamed_self.is_err(), "{blamed_self:?}");
        assert!(names_the_dead_rank(message(), None, 1, (second, within)).is_err());
        assert!(names_the_dead_rank(Ok(()), Some(1), 1, (second, within)).is_err());
        let late = names_the_dead_rank(message(), Some(1), 1, (within * 2, within));
        assert!(late.is_err(), "{late:?}");
        let named = names_the_dead_rank(message(), Some(1), 1, (second, within));
        assert!(named.is_ok(), "{named:?}");
    }

    #[test]
    fn every_bucket_must_hold_its_mean() {
        assert!(buckets_hold(&[(1.5, 1.5), (3.0, 3.0)], &[1.5, 3.0]).is_ok());
        // A bucket left as the input (a no-op all-reduce), one half-reduced, one poisoned.
        assert!(buckets_hold(&[(1.0, 1.0), (3.0, 3.0)], &[1.5, 3.0]).is_err());
        assert!(buckets_hold(&[(1.5, 1.5), (2.0, 3.0)], &[1.5, 3.0]).is_err());
        assert!(buckets_hold(&[(f64::NAN, f64::NAN)], &[1.5]).is_err());
        assert!(buckets_hold(&[(1.5, 1.5)], &[1.5, 3.0]).is_err());
    }

    #[test]
    fn the_relative_error_of_a_nan_is_infinite() {
        assert_eq!(relative_error(&[1.0, 2.0], &[1.0, 2.0]), 0.0);
        assert_eq!(relative_error(&[1.0, 3.0], &[1.0, 2.0]), 0.5);
        assert!(relative_error(&[f64::NAN, 2.0], &[1.0, 2.0]).is_infinite());
    }
}

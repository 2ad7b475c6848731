//! Element-wise reduction kernels for each element type.
//!
//! Half-precision types are widened to `f32` in blocks (vectorised conversions from `half`),
//! combined, and rounded back once, which equals IEEE half arithmetic for one operation.

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

use crate::collectives::{Reduce, ReduceOp};

#[inline]
fn pick<T: PartialOrd + Copy>(a: T, b: T, op: ReduceOp, is_nan: impl Fn(T) -> bool) -> T {
    let take_b = match op {
        ReduceOp::Max => b > a,
        ReduceOp::Min => b < a,
        ReduceOp::Sum | ReduceOp::Avg => unreachable!("pick is for max and min"),
    };
    if is_nan(a) {
        a
    } else if take_b || is_nan(b) {
        b
    } else {
        a
    }
}

macro_rules! float_reduce {
    ($t:ty) => {
        impl Reduce for $t {
            fn combine(acc: &mut [Self], other: &[Self], op: ReduceOp) {
                match op {
                    ReduceOp::Sum | ReduceOp::Avg => {
                        for (a, b) in acc.iter_mut().zip(other) {
                            *a += *b;
                        }
                    }
                    ReduceOp::Max | ReduceOp::Min => {
                        for (a, b) in acc.iter_mut().zip(other) {
                            *a = pick(*a, *b, op, <$t>::is_nan);
                        }
                    }
                }
            }
            fn divide(data: &mut [Self], divisor: usize) {
                let d = divisor as $t;
                for x in data {
                    *x /= d;
                }
            }
        }
    };
}

float_reduce!(f32);
float_reduce!(f64);

const BLOCK: usize = 512;

macro_rules! half_reduce {
    ($t:ty) => {
        impl Reduce for $t {
            fn combine(acc: &mut [Self], other: &[Self], op: ReduceOp) {
                let mut a32 = [0f32; BLOCK];
                let mut b32 = [0f32; BLOCK];
                for (a, b) in acc.chunks_mut(BLOCK).zip(other.chunks(BLOCK)) {
                    let n = a.len();
                    a.convert_to_f32_slice(&mut a32[..n]);
                    b.convert_to_f32_slice(&mut b32[..n]);
                    <f32 as Reduce>::combine(&mut a32[..n], &b32[..n], op);
                    a.convert_from_f32_slice(&a32[..n]);
                }
            }
            fn divide(data: &mut [Self], divisor: usize) {
                let mut a32 = [0f32; BLOCK];
                for a in data.chunks_mut(BLOCK) {
                    let n = a.len();
                    a.convert_to_f32_slice(&mut a32[..n]);
                    <f32 as Reduce>::divide(&mut a32[..n], divisor);
                    a.convert_from_f32_slice(&a32[..n]);
                }
            }
        }
    };
}

half_reduce!(f16);
half_reduce!(bf16);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn max_and_min_propagate_nan() {
        let mut a = [1.0f32, f32::NAN, 3.0];
        f32::combine(&mut a, &[f32::NAN, 2.0, 4.0], ReduceOp::Max);
        assert!(a[0].is_nan() && a[1].is_nan());
        assert_eq!(a[2], 4.0);
        let mut a = [1.0f32, 5.0];
        f32::combine(&mut a, &[2.0, -1.0], ReduceOp::Min);
        assert_eq!(a, [1.0, -1.0]);
    }

    #[test]
    fn half_sum_rounds_like_half_arithmetic() {
        let xs: Vec<f16> = (0..1500)
            .map(|i| f16::from_f32(i as f32 * 0.37 - 200.0))
            .collect();
        let ys: Vec<f16> = (0..1500)
            .map(|i| f16::from_f32(i as f32 * -0.11 + 3.5))
            .collect();
        let mut acc = xs.clone();
        f16::combine(&mut acc, &ys, ReduceOp::Sum);
        for i in 0..xs.len() {
            assert_eq!(acc[i], xs[i] + ys[i], "element {i}");
        }
        let mut b: Vec<bf16> = xs.iter().map(|x| bf16::from_f32(x.to_f32())).collect();
        bf16::divide(&mut b, 3);
        assert_eq!(
            b[7],
            bf16::from_f32(bf16::from_f32(xs[7].to_f32()).to_f32() / 3.0)
        );
    }
}

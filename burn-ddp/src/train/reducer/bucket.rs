//! Bucket plans: which parameters' gradients travel together in one flat buffer.
//!
//! As PyTorch DDP: buckets are filled in reverse parameter order (the order backward produces
//! gradients), the first bucket is small (so communication starts early), later ones up to a
//! cap. The plan depends only on the parameter sizes in module visit order, so every rank builds
//! the same one.

/// Sizes of the buckets, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BucketConfig {
    /// Cap of every bucket but the first (default 25 MiB).
    pub cap_bytes: usize,
    /// Cap of the first bucket (default 1 MiB).
    pub first_cap_bytes: usize,
}

impl Default for BucketConfig {
    fn default() -> Self {
        BucketConfig {
            cap_bytes: 25 << 20,
            first_cap_bytes: 1 << 20,
        }
    }
}

/// One bucket: parameters (indices in visit order) and where each sits in the flat buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bucket {
    /// Parameter indices, in packing order (reverse visit order).
    pub params: Vec<usize>,
    /// Start of each parameter's gradient in the buffer, in elements.
    pub offsets: Vec<usize>,
    /// Gradient elements in the bucket.
    pub len: usize,
}

/// The buckets of a model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BucketPlan {
    /// Buckets in reduction order.
    pub buckets: Vec<Bucket>,
}

impl BucketPlan {
    /// Plans buckets for parameters of `sizes[i]` elements of `elem_bytes` bytes each, in
    /// reverse visit order (the last parameters' gradients are ready first), the first bucket
    /// capped at `config.first_cap_bytes`, the others at `config.cap_bytes`.
    pub fn new(sizes: &[usize], elem_bytes: usize, config: &BucketConfig) -> Self {
        let mut buckets = Vec::new();
        let mut current = Bucket {
            params: Vec::new(),
            offsets: Vec::new(),
            len: 0,
        };
        for (index, &size) in sizes.iter().enumerate().rev() {
            let cap = if buckets.is_empty() {
                config.first_cap_bytes
            } else {
                config.cap_bytes
            };
            if !current.params.is_empty() && (current.len + size) * elem_bytes > cap {
                buckets.push(std::mem::replace(
                    &mut current,
                    Bucket {
                        params: Vec::new(),
                        offsets: Vec::new(),
                        len: 0,
                    },
                ));
            }
            current.params.push(index);
            current.offsets.push(current.len);
            current.len += size;
        }
        if !current.params.is_empty() {
            buckets.push(current);
        }
        BucketPlan { buckets }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_fill_in_reverse_order_up_to_their_caps() {
        let cfg = BucketConfig {
            cap_bytes: 40,
            first_cap_bytes: 16,
        };
        let plan = BucketPlan::new(&[4, 4, 4, 4, 4], 4, &cfg);
        let params: Vec<_> = plan.buckets.iter().map(|b| b.params.clone()).collect();
        assert_eq!(params, vec![vec![4], vec![3, 2], vec![1, 0]]);
    }

    #[test]
    fn every_parameter_lands_in_exactly_one_bucket_within_caps() {
        let sizes: Vec<usize> = (0..50).map(|i| (i * 37) % 200 + 1).collect();
        let cfg = BucketConfig {
            cap_bytes: 400,
            first_cap_bytes: 100,
        };
        let plan = BucketPlan::new(&sizes, 4, &cfg);
        let mut seen: Vec<usize> = plan.buckets.iter().flat_map(|b| b.params.clone()).collect();
        assert_eq!(
            seen,
            (0..50).rev().collect::<Vec<_>>(),
            "reverse order, each once"
        );
        seen.sort();
        for (i, b) in plan.buckets.iter().enumerate() {
            let cap = if i == 0 { 100 } else { 400 };
            assert!(
                b.len * 4 <= cap || b.params.len() == 1,
                "bucket {i} over cap"
            );
            assert_eq!(b.len, b.params.iter().map(|p| sizes[*p]).sum::<usize>());
        }
    }

    #[test]
    fn a_parameter_above_the_cap_gets_its_own_bucket() {
        let plan = BucketPlan::new(&[10, 1000, 10], 4, &BucketConfig::default());
        assert_eq!(plan.buckets.len(), 1);
        let cfg = BucketConfig {
            cap_bytes: 100,
            first_cap_bytes: 100,
        };
        let plan = BucketPlan::new(&[10, 1000, 10], 4, &cfg);
        let params: Vec<_> = plan.buckets.iter().map(|b| b.params.clone()).collect();
        assert_eq!(params, vec![vec![2], vec![1], vec![0]]);
    }
}

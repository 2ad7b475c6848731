//! The settings every rank must share ([`SharedSettings`]): `DdpLearner`'s options that change
//! what the ranks compute or send (among them the bucket sizes, which decide the buckets and,
//! when sharded, which rank owns which parameter), and the user's own (`DdpLearner::setting`). They are
//! compared across the ranks as a whole, with the model's layout, before the first step
//! ([`check_agreement`](crate::train::reducer::params::check_agreement)); a mismatch stops every rank naming the setting.

use crate::train::learner::buffers::BufferSync;
use crate::train::reducer::bucket::BucketConfig;
use crate::train::reducer::compression::Compression;
use crate::train::reducer::non_finite::NonFinite;
use crate::train::reducer::ownership::Sharding;

/// `DdpLearner`'s settings that every rank must share.
#[derive(Debug, Clone)]
pub(crate) struct SharedSettings {
    /// Whether splits without a sampler are sharded by slicing.
    pub shard_loaders: bool,
    /// Whether every bucket's fingerprint is checked.
    pub desync_check: bool,
    /// How buffers are kept identical.
    pub buffer_sync: BufferSync,
    /// Whether ranks may hold different numbers of training batches (join).
    pub uneven: bool,
    /// The format gradient buckets travel in.
    pub compression: Compression,
    /// What a non-finite gradient comes to.
    pub non_finite: NonFinite,
    /// How the optimizer's work is sharded.
    pub sharding: Sharding,
    /// Bucket sizes: the buckets, and with sharding who owns which parameter.
    pub buckets: BucketConfig,
    /// The largest global norm of the gradients, if clipped.
    pub clip_grad_norm: Option<f32>,
    /// The user's own settings, by name.
    pub user: Vec<(String, String)>,
}

impl Default for SharedSettings {
    fn default() -> Self {
        SharedSettings {
            shard_loaders: true,
            desync_check: true,
            buffer_sync: BufferSync::default(),
            uneven: false,
            compression: Compression::default(),
            non_finite: NonFinite::default(),
            sharding: Sharding::default(),
            buckets: BucketConfig::default(),
            clip_grad_norm: None,
            user: Vec::new(),
        }
    }
}

impl SharedSettings {
    /// Every setting as `(name, value)`: the user's first, then the learner's. The struct is
    /// taken apart field by field, so a field added to it cannot be left out of the comparison.
    pub(crate) fn entries(&self) -> Vec<(String, String)> {
        let SharedSettings {
            shard_loaders,
            desync_check,
            buffer_sync,
            uneven,
            compression,
            non_finite,
            sharding,
            buckets,
            clip_grad_norm,
            user,
        } = self;
        let learner = [
            ("shard_loaders", shard_loaders.to_string()),
            ("desync_check", desync_check.to_string()),
            ("buffer_sync", buffer_sync.to_string()),
            ("uneven_inputs", uneven.to_string()),
            ("compression", compression.to_string()),
            ("non_finite", non_finite.to_string()),
            ("sharding", sharding.to_string()),
            ("bucket_cap_bytes", buckets.cap_bytes.to_string()),
            (
                "first_bucket_cap_bytes",
                buckets.first_cap_bytes.to_string(),
            ),
            (
                "clip_grad_norm",
                clip_grad_norm.map_or("none".into(), |m| m.to_string()),
            ),
        ];
        let mut all = user.clone();
        all.extend(learner.map(|(name, value)| (name.to_string(), value)));
        all
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_setting_is_compared_under_its_name() {
        let mut settings = SharedSettings::default();
        settings.user.push(("batch_size".into(), "32".into()));
        settings.compression = Compression::Bf16;
        let entries = settings.entries();
        let names: Vec<&str> = entries.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            [
                "batch_size",
                "shard_loaders",
                "desync_check",
                "buffer_sync",
                "uneven_inputs",
                "compression",
                "non_finite",
                "sharding",
                "bucket_cap_bytes",
                "first_bucket_cap_bytes",
                "clip_grad_norm"
            ]
        );
        assert_eq!(entries[5].1, Compression::Bf16.to_string());
    }
}

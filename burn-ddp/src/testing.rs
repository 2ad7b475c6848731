//! Not API: what burn-ddp's own integration tests and `cargo xtask` need to look inside a job
//! (store keys, the status encoding) and to run one across hosts (`cluster`, network
//! namespaces on one Linux machine). Behind the `test-support` feature, hidden from the docs;
//! it may change in any release.

use std::time::Duration;

use crate::status::RankStatus;

/// Makes the shared-memory waits of the groups formed later on master port `port` pause for
/// `pause` between reading a peer's step counter and checking its connection: the window in
/// which a peer that finished the step may return and leave, made wide. Only that job's groups
/// are affected, so tests running beside it are not.
pub fn widen_leave_window(port: u16, pause: Duration) {
    crate::collectives::transport::shm::setup::widen_leave_window(port, pause);
}

pub use crate::failure::FailureRecord;
#[cfg(feature = "train")]
pub use crate::train::learner::checkpoint::{GatherStats, last_gather as last_checkpoint_gather};

/// The parameters (indices in visit order) of each of `reducer`'s buckets, in bucket order.
#[cfg(feature = "train")]
pub fn bucket_layout(reducer: &crate::train::GradientReducer) -> Vec<Vec<usize>> {
    (reducer.plan().buckets.iter())
        .map(|b| b.params.clone())
        .collect()
}

#[cfg(target_os = "linux")]
pub mod cluster;

/// How often a rank publishes a changed status.
pub const PUBLISH_INTERVAL: Duration = crate::status::PUBLISH_INTERVAL;

/// Store key of the job secret ranks agree on when the launcher gave them none (c10d only).
pub const SECRET_KEY: &str = crate::store::keys::SECRET;

/// The store key of a rank's status.
pub fn status_key(rank: usize) -> String {
    crate::store::keys::status(rank)
}

/// The store key of a rank's data-plane address.
pub fn mesh_addr_key(rank: usize) -> String {
    crate::store::keys::mesh_addr(rank)
}

/// Decodes a status read from the store by other means than [`RankStatus::fetch`].
pub fn decode_status(raw: &[u8]) -> Option<RankStatus> {
    RankStatus::from_bytes(raw)
}

/// The group's all-gather of tensors of unequal lengths (`parts`, by rank), concatenated in rank
/// order: crate-private because only the sharded optimizer calls it; here for its tests.
#[cfg(feature = "train")]
pub fn all_gather_parts(
    group: &crate::ProcessGroup,
    tensor: burn::tensor::Tensor<1>,
    parts: &[usize],
) -> crate::Work<burn::tensor::Tensor<1>> {
    group.all_gather_parts(tensor, parts)
}

//! Not API: what burn-ddp's own integration tests and `cargo xtask` need to look inside a job
//! (store keys, the status encoding) and to run one across hosts (`cluster`, network
//! namespaces on one Linux machine). Behind the `test-support` feature, hidden from the docs;
//! it may change in any release.

use std::time::Duration;

use crate::status::RankStatus;

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

//! Every key burn-ddp writes in the store, in one place. They all start with `bddp/`; a
//! program that uses the store too ([`crate::ProcessGroup::store`]) keeps to other prefixes.

/// The group's failure record ([`crate::failure::FailureRecord`]): first report wins.
pub(crate) const FAILURE: &str = "bddp/abort";
/// The job secret's proof, agreed at rendezvous.
pub(crate) const SECRET: &str = "bddp/secret";
/// Prefix of the ranks' host records for the shared-memory decision (`{prefix}/{rank}`).
pub(crate) const SHM_HOST: &str = "bddp/shm/host";
/// Prefix of the ranks' reports that they mapped their host's segment (`{prefix}/{rank}`).
pub(crate) const SHM_MAPPED: &str = "bddp/shm/mapped";

/// A rank's published status ([`crate::status`]).
pub(crate) fn status(rank: usize) -> String {
    format!("bddp/status/{rank}")
}

/// A rank's data-plane address.
pub(crate) fn mesh_addr(rank: usize) -> String {
    format!("bddp/mesh/addr/{rank}")
}

/// The claim of a rank by one process (a second process with the same rank is refused).
pub(crate) fn mesh_claim(rank: usize) -> String {
    format!("bddp/mesh/rank/{rank}")
}

/// The name of host `host`'s shared-memory segment.
pub(crate) fn shm_segment(host: usize) -> String {
    format!("bddp/shm/segment/{host}")
}

/// Key `rank` under `prefix` (one of the per-rank prefixes above).
pub(crate) fn per_rank(prefix: &str, rank: usize) -> String {
    format!("{prefix}/{rank}")
}

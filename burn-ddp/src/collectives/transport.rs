//! [`Transport`]: how a group's ranks exchange host buffers (TCP, shared memory or the choice
//! between them), chosen with `BURN_DDP_TRANSPORT` or `GroupOptions::transport`; the choice is
//! made at rendezvous (`shm/setup.rs`).

pub(crate) mod host;
pub(crate) mod reduce;
pub(crate) mod schedule;
pub(crate) mod shm;
pub(crate) mod tcp;

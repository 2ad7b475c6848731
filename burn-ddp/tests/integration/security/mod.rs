//! Security: only holders of the job secret get in, the secret never crosses the wire, and
//! hostile peers (fake stores, wrong secrets, replayed handshakes, malformed frames) meet named
//! errors while the job goes on.
//!
//! - `admission`: the store and the data plane admit the job's ranks only; the store listens
//!   on the master address only;
//! - `hostile`: fake stores, wrong secrets, replayed handshakes, malformed frames;
//! - `mesh_flood`: 2,000 unauthenticated connections at the ranks' data plane during a rendezvous;
//! - `startup`: what admission costs when a world of 8 forms;
//! - `relay`, `watch`: a recording man in the middle and a fake store; the warnings this
//!   process logs and the sizes it allocates.

mod admission;
mod hostile;
mod mesh_flood;
mod relay;
mod startup;
pub(crate) mod watch;

use std::time::Duration;

use burn_ddp::secret::JobSecret;
use burn_ddp::store::Store;
use burn_ddp::{GroupOptions, ProcessGroup};

use crate::common::options;

/// Rank `rank` of a world of `world` joining the job whose store listens on `port`, with
/// `secret` and `options`.
fn join(
    rank: usize,
    world: usize,
    port: u16,
    secret: &JobSecret,
    options: GroupOptions,
) -> burn_ddp::Result<ProcessGroup> {
    ProcessGroup::builder(rank, world)
        .master_addr("127.0.0.1")
        .master_port(port)
        .host_store(false)
        .secret(secret.clone())
        .options(options)
        .build()
}

/// Rank `rank` of a world of two joining the job whose store listens on `port`, with `secret`.
fn join_pair(rank: usize, port: u16, secret: &JobSecret) -> burn_ddp::Result<ProcessGroup> {
    join(rank, 2, port, secret, options(20))
}

/// Rank 0's data-plane address, once rank 0 (forming its group on another thread) published
/// it; a placeholder for rank 1's address lets rank 0 start accepting before rank 1 runs, so
/// whatever the test connects first is the first to reach it.
fn rank_0_accepting(store: &Store) -> Vec<u8> {
    let addr0 = store.get(&burn_ddp::testing::mesh_addr_key(0)).unwrap();
    store
        .set(&burn_ddp::testing::mesh_addr_key(1), b"127.0.0.1:1")
        .unwrap();
    addr0
}

/// A client of the store at `port` holding `secret`.
fn store_client(port: u16, secret: &JobSecret) -> Store {
    let addr = format!("127.0.0.1:{port}");
    Store::connect_with_secret(&addr, Duration::from_secs(5), Some(secret)).unwrap()
}

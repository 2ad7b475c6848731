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

use std::time::{Duration, Instant};

use burn_ddp::secret::{AdmissionError, JobSecret};
use burn_ddp::store::{Store, StoreServer};
use burn_ddp::{DdpError, GroupOptions, ProcessGroup, ReduceOp};

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

/// A store holding `secret`, listening on a free port of the loopback address.
fn store_holding(secret: &JobSecret) -> StoreServer {
    StoreServer::bind_with_secret("127.0.0.1:0", Some(secret.clone())).unwrap()
}

/// A fresh job secret and a store holding it ([`store_holding`]).
fn secured_store() -> (JobSecret, StoreServer) {
    let secret = JobSecret::generate().unwrap();
    let server = store_holding(&secret);
    (secret, server)
}

/// The admission error `e` carries, if it is one.
fn admission(e: &DdpError) -> Option<&AdmissionError> {
    match e {
        DdpError::Admission { source, .. } => Some(source),
        _ => None,
    }
}

/// The two ranks of a pair all-reduce together: each gives its rank + 1 in 100 elements and
/// gets 3 in each.
fn assert_pair_reduces(pair: &[ProcessGroup; 2]) {
    let works = pair.each_ref().map(|g| {
        let mine = vec![g.rank() as f32 + 1.0; 100];
        g.all_reduce(mine, ReduceOp::Sum)
    });
    for work in works {
        assert_eq!(work.wait().unwrap(), vec![3.0; 100]);
    }
}

/// A job of two ranks (a fresh secret and its store) whose rank 0 meets `first` before rank 1:
/// rank 0 forms its group on another thread, accepting ([`rank_0_accepting`]), `first` is
/// given rank 0's data-plane address, and then rank 1 joins. Returns what `first` returned and
/// how long it took from rank 1's start until both ranks had their groups, once the two have
/// all-reduced together.
fn pair_met_first_by<T>(first: impl FnOnce(&[u8]) -> T) -> (T, Duration) {
    let (secret, server) = secured_store();
    let port = server.local_addr().port();
    let store = store_client(port, &secret);
    std::thread::scope(|s| {
        let rank0 = s.spawn(|| join_pair(0, port, &secret));
        let met = first(&rank_0_accepting(&store));
        let started = Instant::now();
        let rank1 = join_pair(1, port, &secret).unwrap();
        let pair = [rank0.join().unwrap().unwrap(), rank1];
        let took = started.elapsed();
        assert_pair_reduces(&pair);
        (met, took)
    })
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

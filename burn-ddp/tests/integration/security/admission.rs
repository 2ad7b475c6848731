//! Only the job's ranks get in: the store and the data plane require the job secret, and the
//! store listens on the master address only unless told otherwise.

use std::net::{IpAddr, TcpStream, UdpSocket};
use std::time::{Duration, Instant};

use burn_ddp::launch::free_port;
use burn_ddp::secret::{AdmissionError, JobSecret};
use burn_ddp::store::{Store, StoreServer};
use burn_ddp::{ProcessGroup, ReduceOp};

use super::{admission, pair_met_first_by, secured_store};
use crate::common::{options, run_world_with_secret};

#[test]
fn the_store_admits_only_clients_with_the_job_secret() {
    let (secret, server) = secured_store();
    let addr = server.local_addr().to_string();
    let t = Duration::from_secs(5);
    let without = Store::connect(&addr, t).unwrap_err().to_string();
    assert!(
        without.contains("refused") && without.contains("BURN_DDP_SECRET"),
        "{without}"
    );
    let other = JobSecret::generate().unwrap();
    let wrong = Store::connect_with_secret(&addr, t, Some(&other)).unwrap_err();
    assert!(wrong.to_string().contains("could not prove"), "{wrong}");
    let ok = Store::connect_with_secret(&addr, t, Some(&secret)).unwrap();
    ok.set("k", b"v").unwrap();
    assert_eq!(ok.get("k").unwrap(), b"v");
}

/// A process that is not part of the job but runs burn-ddp as rank 1 of 2 holding `secret`
/// (or none), with a store of its own in which rank 0's data-plane address was planted: it
/// reaches rank 0's data plane without ever passing rank 0's store.
fn stray(rank0_addr: &[u8], secret: Option<JobSecret>) -> burn_ddp::Result<ProcessGroup> {
    let own = StoreServer::bind_with_secret("127.0.0.1:0", secret.clone()).unwrap();
    let port = own.local_addr().port();
    let store = Store::connect_with_secret(&format!("127.0.0.1:{port}"), T, secret.as_ref());
    store
        .unwrap()
        .set(&burn_ddp::testing::mesh_addr_key(0), rank0_addr)
        .unwrap();
    let mut b = ProcessGroup::builder(1, 2)
        .master_addr("127.0.0.1")
        .master_port(port)
        .host_store(false)
        .options(options(10));
    if let Some(s) = secret {
        b = b.secret(s);
    }
    b.build()
}

const T: Duration = Duration::from_secs(5);

#[test]
fn strays_claiming_a_rank_cannot_join_the_data_plane() {
    // The strays are the first to reach rank 0; then the real rank 1 still joins, and the
    // collectives see only real ranks.
    pair_met_first_by(|addr0| {
        let start = Instant::now();
        let wrong = stray(addr0, Some(JobSecret::generate().unwrap())).unwrap_err();
        assert!(
            matches!(admission(&wrong), Some(AdmissionError::Unproven { .. })),
            "{wrong}"
        );
        let shown = wrong.to_string();
        assert!(shown.contains("data plane of rank 0") && shown.contains("could not prove"));
        let none = stray(addr0, None).unwrap_err();
        assert!(
            matches!(admission(&none), Some(AdmissionError::Refused { .. })),
            "{none}"
        );
        assert!(none.to_string().contains("BURN_DDP_SECRET"), "{none}");
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "{:?}",
            start.elapsed()
        );
    });
}

#[test]
fn ranks_sharing_a_secret_train_together() {
    let secret = JobSecret::new("a secret shared by the ranks").unwrap();
    let out = run_world_with_secret(3, options(10), Some(secret), |g| {
        g.all_reduce(vec![1.0f32; 10], ReduceOp::Sum)
            .wait()
            .unwrap()
    });
    assert!(out.iter().all(|v| v == &vec![3.0; 10]));
}

/// A non-loopback address of this machine, if it has one (no packet is sent).
fn outside_address() -> Option<IpAddr> {
    let s = UdpSocket::bind("0.0.0.0:0").ok()?;
    s.connect("10.255.255.255:9").ok()?;
    let ip = s.local_addr().ok()?.ip();
    (!ip.is_loopback() && !ip.is_unspecified()).then_some(ip)
}

#[test]
fn the_store_listens_on_the_master_address_only() {
    let Some(outside) = outside_address() else {
        eprintln!("SKIPPED: this machine has no non-loopback address to probe from");
        return;
    };
    let reachable = |port: u16| {
        TcpStream::connect_timeout(&(outside, port).into(), Duration::from_secs(2)).is_ok()
    };

    let port = free_port("127.0.0.1").unwrap();
    let group = ProcessGroup::builder(0, 1)
        .master_addr("127.0.0.1")
        .master_port(port)
        .build()
        .unwrap();
    assert!(
        !reachable(port),
        "the store answers on {outside}, not only on 127.0.0.1"
    );
    drop(group);

    let port = free_port("127.0.0.1").unwrap();
    let group = ProcessGroup::builder(0, 1)
        .master_addr("127.0.0.1")
        .master_port(port)
        .store_bind("0.0.0.0")
        .build()
        .unwrap();
    assert!(
        reachable(port),
        "store_bind(0.0.0.0) should listen on {outside} too"
    );
    drop(group);
}

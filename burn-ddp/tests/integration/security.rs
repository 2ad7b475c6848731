//! Only the job's ranks get in: the store and the data plane require the job secret, and the
//! store listens on the master address only unless told otherwise.

use std::io::{Read, Write};
use std::net::{IpAddr, TcpStream, UdpSocket};
use std::time::Duration;

use burn_ddp::launch::free_port;
use burn_ddp::secret::JobSecret;
use burn_ddp::store::{Store, StoreServer};
use burn_ddp::{ProcessGroup, ReduceOp};

use crate::common::{options, run_world_with_secret};

#[test]
fn the_store_admits_only_clients_with_the_job_secret() {
    let secret = JobSecret::generate().unwrap();
    let server = StoreServer::bind_with_secret("127.0.0.1:0", Some(secret.clone())).unwrap();
    let addr = server.local_addr().to_string();
    let t = Duration::from_secs(5);
    let without = Store::connect(&addr, t).unwrap_err().to_string();
    assert!(
        without.contains("refused") && without.contains("BURN_DDP_SECRET"),
        "{without}"
    );
    let other = JobSecret::generate().unwrap();
    let wrong = Store::connect_with_secret(&addr, t, Some(&other)).unwrap_err();
    assert!(wrong.to_string().contains("refused"), "{wrong}");
    let ok = Store::connect_with_secret(&addr, t, Some(&secret)).unwrap();
    ok.set("k", b"v").unwrap();
    assert_eq!(ok.get("k").unwrap(), b"v");
}

/// The mesh hello as a stray process would forge it: magic, rank, world, empty secret.
fn forged_hello(rank: u32, world: u32) -> Vec<u8> {
    let mut h = b"BDDPMESH".to_vec();
    h.extend_from_slice(&rank.to_le_bytes());
    h.extend_from_slice(&world.to_le_bytes());
    h.extend_from_slice(&0u32.to_le_bytes());
    h
}

#[test]
fn a_stray_process_claiming_a_rank_cannot_join_the_data_plane() {
    let secret = JobSecret::generate().unwrap();
    let server = StoreServer::bind_with_secret("127.0.0.1:0", Some(secret.clone())).unwrap();
    let port = server.local_addr().port();
    let build = |rank: usize| {
        ProcessGroup::builder(rank, 2)
            .master_addr("127.0.0.1")
            .master_port(port)
            .host_store(false)
            .secret(secret.clone())
            .options(options(10))
            .build()
    };
    std::thread::scope(|s| {
        let rank0 = s.spawn(|| build(0));
        // The stray learns rank 0's data-plane port (here from the store, as a port scan
        // would) and connects first, pretending to be rank 1.
        let store = Store::connect_with_secret(
            &format!("127.0.0.1:{port}"),
            Duration::from_secs(5),
            Some(&secret),
        )
        .unwrap();
        let addr = String::from_utf8(store.get("bddp/mesh/addr/0").unwrap()).unwrap();
        let mut stray = TcpStream::connect(&addr).unwrap();
        stray.write_all(&forged_hello(1, 2)).unwrap();
        // The real rank 1 comes after it (rank 0 accepts once every rank has published).
        let rank1 = s.spawn(|| build(1));
        stray
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let mut answer = Vec::new();
        let _ = stray.read_to_end(&mut answer);
        assert!(answer.is_empty(), "rank 0 answered the stray: {answer:?}");
        // Rank 1 still joins, and the collectives see only real ranks.
        let groups = [
            rank0.join().unwrap().unwrap(),
            rank1.join().unwrap().unwrap(),
        ];
        std::thread::scope(|s| {
            for g in &groups {
                s.spawn(move || {
                    let out = g
                        .all_reduce(vec![g.rank() as f32 + 1.0; 100], ReduceOp::Sum)
                        .wait()
                        .unwrap();
                    assert_eq!(out, vec![3.0; 100]);
                });
            }
        });
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

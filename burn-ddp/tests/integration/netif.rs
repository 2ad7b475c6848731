//! The data plane's network interface: `BURN_DDP_SOCKET_IFNAME` (or `GLOO_SOCKET_IFNAME`)
//! chooses the address each rank listens on and advertises.

use std::collections::HashMap;
use std::net::IpAddr;
use std::time::Duration;

use burn_ddp::env::LaunchEnv;
use burn_ddp::launch::free_port;
use burn_ddp::store::{Store, StoreServer};
use burn_ddp::{ProcessGroup, ReduceOp};

use crate::common::options;

/// Forms a group of two threads with the store on loopback and the data plane on `ifname`;
/// returns what rank 0 advertised and checks an all-reduce.
fn advertised_with(ifname: &str) -> String {
    let server = StoreServer::bind("127.0.0.1:0").unwrap();
    let port = server.local_addr().port();
    let sums = std::thread::scope(|s| {
        let ranks: Vec<_> = (0..2)
            .map(|rank| {
                s.spawn(move || {
                    let g = ProcessGroup::builder(rank, 2)
                        .master_addr("127.0.0.1")
                        .master_port(port)
                        .host_store(false)
                        .socket_ifname(ifname)
                        .options(options(30))
                        .build()
                        .unwrap_or_else(|e| panic!("rank {rank}: {e}"));
                    g.all_reduce(vec![rank as f32 + 1.0; 8], ReduceOp::Sum)
                        .wait()
                        .unwrap()
                })
            })
            .collect();
        ranks
            .into_iter()
            .map(|r| r.join().unwrap())
            .collect::<Vec<_>>()
    });
    assert_eq!(sums, vec![vec![3.0f32; 8]; 2]);
    let store = Store::connect(&format!("127.0.0.1:{port}"), Duration::from_secs(5)).unwrap();
    String::from_utf8(store.get(&burn_ddp::testing::mesh_addr_key(0)).unwrap()).unwrap()
}

#[test]
fn the_data_plane_listens_on_the_named_interface() {
    let addr = advertised_with("lo");
    assert!(addr.starts_with("127.0.0.1:"), "{addr}");
    // A non-loopback interface, where the machine has one: advertised although the store
    // connection runs over loopback.
    let other = if_addrs::get_if_addrs()
        .unwrap()
        .into_iter()
        .find(|i| !i.is_loopback() && matches!(i.ip(), IpAddr::V4(_)));
    match other {
        Some(i) => {
            let addr = advertised_with(&i.name);
            assert!(
                addr.starts_with(&format!("{}:", i.ip())),
                "{}: {addr}",
                i.name
            );
        }
        None => println!("SKIPPED (part): no non-loopback IPv4 interface here"),
    }
}

#[test]
fn an_unknown_interface_is_an_error_listing_the_interfaces() {
    let port = free_port("127.0.0.1").unwrap();
    let e = ProcessGroup::builder(0, 2)
        .master_addr("127.0.0.1")
        .master_port(port)
        .socket_ifname("nosuch0")
        .options(options(10))
        .build()
        .expect_err("no such interface")
        .to_string();
    assert!(
        e.contains("\"nosuch0\"") && e.contains("lo (127.0.0.1"),
        "{e}"
    );
    assert!(e.contains("BURN_DDP_SOCKET_IFNAME"), "{e}");
}

#[test]
fn the_interface_comes_from_the_environment() {
    let parse = |vars: &[(&str, &str)]| {
        let map: HashMap<&str, &str> = vars.iter().copied().collect();
        LaunchEnv::from_lookup(|k| map.get(k).map(|v| v.to_string()))
            .unwrap()
            .socket_ifname
    };
    assert_eq!(parse(&[]), None);
    assert_eq!(
        parse(&[("GLOO_SOCKET_IFNAME", "eth1")]).as_deref(),
        Some("eth1")
    );
    assert_eq!(
        parse(&[
            ("BURN_DDP_SOCKET_IFNAME", "ib0"),
            ("GLOO_SOCKET_IFNAME", "eth1")
        ])
        .as_deref(),
        Some("ib0")
    );
}

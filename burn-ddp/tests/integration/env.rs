//! Launcher variables: every family, the world of one, and each invalid case.

use std::collections::HashMap;
use std::net::TcpListener;

use burn_ddp::env::{EnvSource, LaunchEnv};
use burn_ddp::{DdpError, ProcessGroup};

fn parse(vars: &[(&str, &str)]) -> Result<LaunchEnv, DdpError> {
    let map: HashMap<String, String> = vars
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    LaunchEnv::from_lookup(|k| map.get(k).cloned())
}

fn error(vars: &[(&str, &str)]) -> String {
    parse(vars).expect_err("should be refused").to_string()
}

#[test]
fn no_variables_is_a_world_of_one() {
    let env = parse(&[]).unwrap();
    assert_eq!((env.rank, env.world_size, env.local_rank), (0, 1, 0));
    assert_eq!(env.source, EnvSource::Single);
    assert!(env.master_addr.is_none());
}

#[test]
fn torchrun_variables() {
    let env = parse(&[
        ("RANK", "5"),
        ("WORLD_SIZE", "8"),
        ("LOCAL_RANK", "1"),
        ("LOCAL_WORLD_SIZE", "4"),
        ("MASTER_ADDR", "node0"),
        ("MASTER_PORT", "1234"),
        ("BURN_DDP_TIMEOUT", "2.5"),
    ])
    .unwrap();
    assert_eq!(env.source, EnvSource::Torchrun);
    assert_eq!(
        (
            env.rank,
            env.world_size,
            env.local_rank,
            env.local_world_size
        ),
        (5, 8, 1, 4)
    );
    assert_eq!(
        (env.master_addr.as_deref(), env.master_port),
        (Some("node0"), 1234)
    );
    assert_eq!(env.timeout, Some(std::time::Duration::from_millis(2500)));
}

#[test]
fn slurm_and_open_mpi_variables() {
    let env = parse(&[
        ("SLURM_PROCID", "3"),
        ("SLURM_NTASKS", "4"),
        ("SLURM_LOCALID", "1"),
        ("SLURM_NTASKS_PER_NODE", "2(x2)"),
        ("MASTER_ADDR", "10.0.0.1"),
    ])
    .unwrap();
    assert_eq!(env.source, EnvSource::Slurm);
    assert_eq!(
        (env.rank, env.world_size, env.local_rank, env.master_port),
        (3, 4, 1, 29500)
    );
    let env = parse(&[
        ("OMPI_COMM_WORLD_RANK", "2"),
        ("OMPI_COMM_WORLD_SIZE", "3"),
        ("OMPI_COMM_WORLD_LOCAL_RANK", "0"),
        ("MASTER_ADDR", "10.0.0.1"),
    ])
    .unwrap();
    assert_eq!(env.source, EnvSource::OpenMpi);
    assert_eq!((env.rank, env.world_size, env.local_rank), (2, 3, 0));
}

#[test]
fn torchrun_names_win_over_slurm() {
    let env = parse(&[
        ("RANK", "0"),
        ("WORLD_SIZE", "1"),
        ("SLURM_PROCID", "7"),
        ("SLURM_NTASKS", "8"),
    ])
    .unwrap();
    assert_eq!((env.source, env.world_size), (EnvSource::Torchrun, 1));
}

#[test]
fn rank_not_below_world_size_is_refused() {
    let e = error(&[("RANK", "4"), ("WORLD_SIZE", "4"), ("MASTER_ADDR", "h")]);
    assert!(
        e.contains("RANK=\"4\"") && e.contains("below WORLD_SIZE=4"),
        "{e}"
    );
    let e = error(&[
        ("SLURM_PROCID", "9"),
        ("SLURM_NTASKS", "2"),
        ("MASTER_ADDR", "h"),
    ]);
    assert!(
        e.contains("SLURM_PROCID") && e.contains("SLURM_NTASKS=2"),
        "{e}"
    );
}

#[test]
fn non_numbers_are_refused_naming_the_variable() {
    for (var, vars) in [
        ("RANK", vec![("RANK", "one"), ("WORLD_SIZE", "2")]),
        ("WORLD_SIZE", vec![("RANK", "0"), ("WORLD_SIZE", "-2")]),
        (
            "LOCAL_RANK",
            vec![("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "x")],
        ),
        (
            "MASTER_PORT",
            vec![("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_PORT", "70000")],
        ),
        ("MASTER_PORT", vec![("MASTER_PORT", "http")]),
        ("BURN_DDP_TIMEOUT", vec![("BURN_DDP_TIMEOUT", "soon")]),
    ] {
        let e = error(&vars);
        assert!(e.contains(&format!("{var}=")), "{var}: {e}");
        assert!(e.contains("invalid"), "{e}");
    }
}

#[test]
fn zero_world_and_half_set_pairs_are_refused() {
    let e = error(&[("RANK", "0"), ("WORLD_SIZE", "0")]);
    assert!(e.contains("WORLD_SIZE") && e.contains("at least 1"), "{e}");
    let e = error(&[("RANK", "0")]);
    assert!(e.contains("WORLD_SIZE is not set"), "{e}");
    let e = error(&[
        ("RANK", "1"),
        ("WORLD_SIZE", "4"),
        ("LOCAL_RANK", "2"),
        ("LOCAL_WORLD_SIZE", "2"),
        ("MASTER_ADDR", "h"),
    ]);
    assert!(
        e.contains("LOCAL_RANK") && e.contains("LOCAL_WORLD_SIZE=2"),
        "{e}"
    );
}

#[test]
fn missing_master_addr_with_several_ranks_is_refused() {
    let e = error(&[("RANK", "0"), ("WORLD_SIZE", "2")]);
    assert!(
        e.contains("MASTER_ADDR is not set") && e.contains("world size is 2"),
        "{e}"
    );
    // A world of one does not need it.
    parse(&[("RANK", "0"), ("WORLD_SIZE", "1")]).unwrap();
}

#[test]
fn port_in_use_is_a_clear_error() {
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let e = ProcessGroup::builder(0, 2)
        .master_addr("127.0.0.1")
        .master_port(port)
        .build()
        .expect_err("the port is taken");
    let msg = e.to_string();
    assert!(matches!(e, DdpError::Bind { .. }), "{msg}");
    assert!(
        msg.contains("already in use") && msg.contains("MASTER_PORT"),
        "{msg}"
    );
    assert!(msg.contains(&port.to_string()), "{msg}");
}

#[test]
fn world_of_one_runs_alone() {
    let g = ProcessGroup::from_launch_env(&parse(&[]).unwrap()).unwrap();
    assert_eq!((g.rank(), g.world_size()), (0, 1));
    let out = g
        .all_reduce(vec![1.5f32, -2.0], burn_ddp::ReduceOp::Avg)
        .wait()
        .unwrap();
    assert_eq!(out, vec![1.5, -2.0]);
    g.barrier().wait().unwrap();
    assert_eq!(
        g.all_gather(b"x".to_vec()).wait().unwrap(),
        vec![b"x".to_vec()]
    );
}

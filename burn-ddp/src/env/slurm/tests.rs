//! Tests of the Slurm notations: examples, malformed lists, round trips through a compressor,
//! and the defaults `LaunchEnv` derives under `srun`.

use std::collections::HashMap;

use proptest::prelude::*;

use super::*;
use crate::env::{EnvSource, LaunchEnv};

#[test]
fn node_lists_expand_as_slurm_does() {
    let cases: [(&str, &[&str]); 8] = [
        (
            "node[01-03,7],gpu-a",
            &["node01", "node02", "node03", "node7", "gpu-a"],
        ),
        ("node[01-02,07]", &["node01", "node02", "node07"]),
        ("rack1-n[1-2]-ib", &["rack1-n1-ib", "rack1-n2-ib"]),
        ("r[1-2]n[1-2]", &["r1n1", "r1n2", "r2n1", "r2n2"]),
        ("n[08-10]", &["n08", "n09", "n10"]),
        ("n[9-10],x[007]", &["n9", "n10", "x007"]),
        ("gpu-a", &["gpu-a"]),
        (" n[1-2] ", &["n1", "n2"]),
    ];
    for (list, hosts) in cases {
        assert_eq!(expand_nodelist(list).unwrap(), hosts, "{list}");
        assert_eq!(first_host(list).unwrap(), hosts[0], "{list}");
        assert_eq!(count_hosts(list).unwrap(), hosts.len() as u64, "{list}");
    }
}

#[test]
fn malformed_node_lists_are_refused_with_the_reason() {
    for (list, why) in [
        ("", "empty"),
        ("a,,b", "empty host"),
        ("a,", "empty host"),
        (",a", "empty host"),
        ("n[1-", "without its ']'"),
        ("n]1[", "without its '['"),
        ("n[3-1]", "decreasing"),
        ("n[a-b]", "not a number"),
        ("n[]", "not a number"),
        ("n[1-2,]", "not a number"),
        ("n[[1]]", "inside brackets"),
        ("a b", "white space"),
        ("n[1-1234567890123456789]", "18 digits"),
    ] {
        let e = expand_nodelist(list).expect_err(list);
        assert!(e.to_string().contains(why), "{list:?}: {e}");
        assert!(first_host(list).is_err(), "{list:?}");
    }
    let e = expand_nodelist("n[0-999999999]").unwrap_err();
    assert!(e.to_string().contains("1000000000 hosts"), "{e}");
    assert_eq!(first_host("n[0-999999999]").unwrap(), "n0");
}

#[test]
fn tasks_per_node_lists() {
    let runs = parse_tasks_per_node("2(x3),1").unwrap();
    assert_eq!(runs, [(2, 3), (1, 1)]);
    let per_node: Vec<_> = (0..5).map(|n| tasks_on_node(&runs, n)).collect();
    assert_eq!(per_node, [Some(2), Some(2), Some(2), Some(1), None]);
    for bad in [
        "", "2(x0)", "x", "2(3)", "2,,1", "-1", "2(x3", "2(x3)1", "+2",
    ] {
        assert!(parse_tasks_per_node(bad).is_err(), "{bad:?}");
    }
}

#[test]
fn job_port_formula() {
    assert_eq!(job_port(0), 10_000);
    assert_eq!(job_port(1_234_567), 24_567);
    assert_eq!(job_port(19_999), 29_999);
    assert_eq!(job_port(20_000), 10_000);
}

fn launch(vars: &[(&str, &str)]) -> Result<LaunchEnv> {
    let map: HashMap<&str, &str> = vars.iter().copied().collect();
    LaunchEnv::from_lookup(|k| map.get(k).map(|v| v.to_string()))
}

/// What plain `srun -n 3` sets on the second of two nodes (tasks 2, 1).
const SRUN: [(&str, &str); 7] = [
    ("SLURM_PROCID", "2"),
    ("SLURM_NTASKS", "3"),
    ("SLURM_LOCALID", "0"),
    ("SLURM_NODEID", "1"),
    ("SLURM_STEP_TASKS_PER_NODE", "2,1"),
    ("SLURM_JOB_NODELIST", "node[07-08]"),
    ("SLURM_JOB_ID", "4242"),
];

#[test]
fn srun_without_hand_set_variables() {
    let env = launch(&SRUN).unwrap();
    assert_eq!(env.source, EnvSource::Slurm);
    assert_eq!((env.rank, env.world_size), (2, 3));
    assert_eq!((env.local_rank, env.local_world_size), (0, 1));
    assert_eq!(env.master_addr.as_deref(), Some("node07"));
    assert_eq!(env.master_port, 14_242);
}

#[test]
fn hand_set_variables_win_and_the_step_list_comes_first() {
    let mut vars = SRUN.to_vec();
    vars.extend([("MASTER_ADDR", "10.1.1.1"), ("MASTER_PORT", "29600")]);
    let env = launch(&vars).unwrap();
    assert_eq!(env.master_addr.as_deref(), Some("10.1.1.1"));
    assert_eq!(env.master_port, 29_600);
    let mut vars = SRUN.to_vec();
    vars.extend([
        ("SLURM_STEP_NODELIST", "node08"),
        ("SLURM_TASKS_PER_NODE", "4(x2)"),
    ]);
    let env = launch(&vars).unwrap();
    assert_eq!(env.master_addr.as_deref(), Some("node08"));
    assert_eq!(env.local_world_size, 1);
    // Only the job's list: 4 tasks on node 1.
    let vars: Vec<_> = SRUN
        .iter()
        .copied()
        .filter(|(k, _)| *k != "SLURM_STEP_TASKS_PER_NODE")
        .chain([("SLURM_TASKS_PER_NODE", "4(x2)"), ("SLURM_LOCALID", "3")])
        .collect();
    assert_eq!(launch(&vars).unwrap().local_world_size, 4);
}

#[test]
fn a_world_of_one_under_slurm_needs_no_master() {
    let env = launch(&[
        ("SLURM_PROCID", "0"),
        ("SLURM_NTASKS", "1"),
        ("SLURM_JOB_NODELIST", "n1"),
        ("SLURM_JOB_ID", "7"),
    ])
    .unwrap();
    assert_eq!(env.master_addr, None);
}

#[test]
fn malformed_slurm_variables_are_named() {
    for (var, value, wanted) in [
        (
            "SLURM_JOB_NODELIST",
            "node[01-",
            "SLURM_JOB_NODELIST=\"node[01-\"",
        ),
        (
            "SLURM_STEP_TASKS_PER_NODE",
            "2(x",
            "SLURM_STEP_TASKS_PER_NODE",
        ),
        ("SLURM_JOB_ID", "abc", "SLURM_JOB_ID=\"abc\""),
        ("SLURM_NODEID", "5", "SLURM_NODEID=\"5\""),
    ] {
        let mut vars: Vec<_> = SRUN.iter().copied().filter(|(k, _)| *k != var).collect();
        vars.push((var, value));
        let e = launch(&vars).expect_err(var).to_string();
        assert!(e.contains(wanted) && e.contains("invalid"), "{var}: {e}");
    }
    let vars: Vec<_> = SRUN
        .iter()
        .copied()
        .filter(|(k, _)| *k != "SLURM_NODEID")
        .collect();
    let e = launch(&vars).unwrap_err().to_string();
    assert!(e.contains("SLURM_NODEID is not set"), "{e}");
    let vars: Vec<_> = SRUN
        .iter()
        .copied()
        .filter(|(k, _)| *k != "SLURM_JOB_NODELIST")
        .collect();
    let e = launch(&vars).unwrap_err().to_string();
    assert!(e.contains("MASTER_ADDR is not set"), "{e}");
}

/// Compact form of `hosts`, as Slurm's `scontrol show hostlist` would write it for this order:
/// adjacent hosts that differ only in a trailing number share brackets.
fn compress(hosts: &[String]) -> String {
    let split = |h: &str| {
        let cut = h.trim_end_matches(|c: char| c.is_ascii_digit()).len();
        (h[..cut].to_string(), h[cut..].to_string())
    };
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < hosts.len() {
        let (prefix, digits) = split(&hosts[i]);
        if digits.is_empty() {
            out.push(prefix);
            i += 1;
            continue;
        }
        let mut ranges: Vec<(String, u64)> = Vec::new();
        while i < hosts.len() {
            let (p, d) = split(&hosts[i]);
            if p != prefix || d.is_empty() {
                break;
            }
            let n: u64 = d.parse().unwrap();
            match ranges.last_mut() {
                Some((lo, hi)) if d == format!("{:0w$}", *hi + 1, w = lo.len()) => *hi = n,
                _ => ranges.push((d, n)),
            }
            i += 1;
        }
        let inner: Vec<String> = ranges
            .iter()
            .map(|(lo, hi)| {
                if lo.parse::<u64>().unwrap() == *hi {
                    lo.clone()
                } else {
                    format!("{lo}-{hi}")
                }
            })
            .collect();
        out.push(format!("{prefix}[{}]", inner.join(",")));
    }
    out.join(",")
}

/// One generated name part: literal text, or ranges `(first, length, width)`.
fn part() -> impl Strategy<Value = Result<String, Vec<(u64, u64, usize)>>> {
    prop_oneof![
        "[a-z][a-z0-9-]{0,4}".prop_map(Ok),
        proptest::collection::vec((0u64..200, 0u64..4, 1usize..4), 1..4).prop_map(Err),
    ]
}

proptest! {
    /// A generated compact list expands to the product of its parts, and its first host and
    /// count agree with that expansion.
    #[test]
    fn generated_lists_expand_to_their_product(
        names in proptest::collection::vec(proptest::collection::vec(part(), 1..4), 1..5)
    ) {
        let mut rendered = Vec::new();
        let mut expected = Vec::new();
        for name in &names {
            let mut text = String::new();
            let mut hosts = vec![String::new()];
            for p in name {
                match p {
                    Ok(t) => {
                        text.push_str(t);
                        hosts = hosts.into_iter().map(|h| h + t).collect();
                    }
                    Err(ranges) => {
                        let mut numbers = Vec::new();
                        let inner: Vec<String> = ranges.iter().map(|&(a, len, w)| {
                            let lo = format!("{a:0w$}");
                            numbers.extend((a..=a + len).map(|n| format!("{n:0w$}", w = lo.len())));
                            format!("{lo}-{}", a + len)
                        }).collect();
                        text.push_str(&format!("[{}]", inner.join(",")));
                        hosts = hosts
                            .iter()
                            .flat_map(|h| numbers.iter().map(move |n| format!("{h}{n}")))
                            .collect();
                    }
                }
            }
            rendered.push(text);
            expected.extend(hosts);
        }
        let list = rendered.join(",");
        prop_assert_eq!(&expand_nodelist(&list).unwrap(), &expected);
        prop_assert_eq!(count_hosts(&list).unwrap(), expected.len() as u64);
        prop_assert_eq!(first_host(&list).unwrap(), expected[0].clone());
    }

    /// Compressing any host list and expanding it again gives the list back, order and padding
    /// included.
    #[test]
    fn compress_then_expand_is_the_identity(
        picks in proptest::collection::vec((0usize..4, proptest::option::of(0u64..30), 1usize..4), 1..40),
        sorted in any::<bool>(),
    ) {
        const PREFIXES: [&str; 4] = ["node", "gpu-a", "rack1-n", "x"];
        let mut hosts: Vec<String> = picks
            .iter()
            .map(|&(p, n, w)| match n {
                Some(n) => format!("{}{n:0w$}", PREFIXES[p]),
                None => format!("{}-ib", PREFIXES[p]),
            })
            .collect();
        if sorted {
            hosts.sort();
        }
        let list = compress(&hosts);
        prop_assert_eq!(expand_nodelist(&list).unwrap(), hosts.clone());
        prop_assert_eq!(first_host(&list).unwrap(), hosts[0].clone());
    }

    /// A run-length tasks-per-node list gives back every node's count.
    #[test]
    fn tasks_per_node_round_trip(counts in proptest::collection::vec(1usize..5, 1..30)) {
        let mut runs: Vec<(usize, usize)> = Vec::new();
        for &c in &counts {
            match runs.last_mut() {
                Some((t, n)) if *t == c => *n += 1,
                _ => runs.push((c, 1)),
            }
        }
        let spec: Vec<String> = runs
            .iter()
            .map(|&(t, n)| if n == 1 { t.to_string() } else { format!("{t}(x{n})") })
            .collect();
        let parsed = parse_tasks_per_node(&spec.join(",")).unwrap();
        for (node, &c) in counts.iter().enumerate() {
            prop_assert_eq!(tasks_on_node(&parsed, node), Some(c));
        }
        prop_assert_eq!(tasks_on_node(&parsed, counts.len()), None);
    }

    /// Garbage never panics the parsers; whatever expands is consistent.
    #[test]
    fn garbage_never_panics(s in "[\\[\\]0-9a-z,()x -]{0,24}") {
        let _ = parse_tasks_per_node(&s);
        if let Ok(hosts) = expand_nodelist(&s) {
            prop_assert_eq!(count_hosts(&s).unwrap(), hosts.len() as u64);
            prop_assert_eq!(first_host(&s).unwrap(), hosts[0].clone());
        }
    }

    /// Every job id maps into the documented range.
    #[test]
    fn job_ports_stay_in_range(id in any::<u64>()) {
        let p = job_port(id);
        prop_assert!((10_000..30_000).contains(&p));
    }
}

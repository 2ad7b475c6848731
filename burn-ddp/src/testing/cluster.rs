//! A cluster in a box: several hosts on one Linux machine, each a network namespace with its own
//! loopback and its own address on a bridge, for running and testing multi-node jobs for real
//! (`cargo xtask cluster`, and the cross-host tests).
//!
//! Host `i` is the namespace `bddp-<id>-h<i>` with the interface `eth0` at `10.77.0.<i + 1>/24`,
//! joined to the others through a veth pair and the bridge `bd<id>br` in the machine's own
//! namespace. [`ClusterConfig::link_rate`] limits each host's link in both directions with a
//! token bucket (`tc qdisc ... tbf`). Everything the cluster created is removed when it is
//! dropped, panics included: the processes still running in its namespaces are killed, then the
//! namespaces (and with them their veths) and the bridge are deleted. Only names carrying the
//! cluster's own id are touched.
//!
//! It needs root (or `CAP_NET_ADMIN` and `CAP_SYS_ADMIN`) and iproute2 (`ip`, `tc`):
//! [`Cluster::create`] says in one line what is missing ([`ClusterError::Unavailable`]).

use std::net::Ipv4Addr;
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};

/// What can go wrong building or driving a cluster.
#[derive(thiserror::Error)]
pub enum ClusterError {
    /// Namespaces cannot be made here (not root, no iproute2, no permission): the reason.
    #[error("network namespaces are unavailable here: {0}")]
    Unavailable(String),
    /// A command failed.
    #[error("`{command}` failed: {detail}")]
    Command {
        /// The command line.
        command: String,
        /// Its exit status and error output.
        detail: String,
    },
}

crate::error::debug_as_display!(ClusterError);

/// Settings of a [`Cluster`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterConfig {
    /// Hosts (namespaces), at least 1 and at most 250.
    pub hosts: usize,
    /// Rate of each host's link in `tc` syntax (`1gbit`, `100mbit`), in both directions;
    /// `None`: unlimited.
    pub link_rate: Option<String>,
}

impl ClusterConfig {
    /// `hosts` hosts on unlimited links.
    pub fn new(hosts: usize) -> Self {
        ClusterConfig {
            hosts,
            link_rate: None,
        }
    }

    /// Limits each host's link to `rate` (`tc` syntax, for example `1gbit`).
    pub fn link_rate(mut self, rate: impl Into<String>) -> Self {
        self.link_rate = Some(rate.into());
        self
    }
}

/// Hosts made of network namespaces; removed on drop.
#[derive(Debug)]
pub struct Cluster {
    id: String,
    hosts: usize,
    /// What exists so far, to remove: namespaces created, and whether the bridge is.
    made_hosts: usize,
    made_bridge: bool,
}

/// The interface of every host, as `BURN_DDP_SOCKET_IFNAME` would name it.
pub const HOST_IFNAME: &str = "eth0";

static NEXT: AtomicUsize = AtomicUsize::new(0);

fn run(args: &[&str]) -> Result<Output, ClusterError> {
    let command = args.join(" ");
    let out = Command::new(args[0])
        .args(&args[1..])
        .stdin(Stdio::null())
        .output()
        .map_err(|e| ClusterError::Command {
            command: command.clone(),
            detail: e.to_string(),
        })?;
    if !out.status.success() {
        return Err(ClusterError::Command {
            command,
            detail: format!(
                "{}: {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ),
        });
    }
    Ok(out)
}

impl Cluster {
    /// Builds the hosts. On failure everything made so far is removed again.
    pub fn create(config: &ClusterConfig) -> Result<Self, ClusterError> {
        if !(1..=250).contains(&config.hosts) {
            return Err(ClusterError::Unavailable(format!(
                "{} hosts asked for, 1 to 250 possible",
                config.hosts
            )));
        }
        let id = format!(
            "{}{}",
            std::process::id() % 100_000,
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        let mut cluster = Cluster {
            id,
            hosts: config.hosts,
            made_hosts: 0,
            made_bridge: false,
        };
        cluster.build(config).map_err(|e| match e {
            ClusterError::Command { command, detail }
                if detail.contains("Operation not permitted")
                    || detail.contains("No such file")
                    || detail.contains("not found") =>
            {
                ClusterError::Unavailable(format!("{command}: {detail}"))
            }
            e => e,
        })?;
        Ok(cluster)
    }

    fn build(&mut self, config: &ClusterConfig) -> Result<(), ClusterError> {
        let bridge = self.bridge();
        run(&["ip", "link", "add", &bridge, "type", "bridge"])?;
        self.made_bridge = true;
        run(&["ip", "link", "set", &bridge, "up"])?;
        for i in 0..self.hosts {
            let (ns, outside, inside) = (
                self.namespace(i),
                self.veth(i),
                format!("{}p", self.veth(i)),
            );
            run(&["ip", "netns", "add", &ns])?;
            self.made_hosts = i + 1;
            run(&[
                "ip", "link", "add", &outside, "type", "veth", "peer", "name", &inside,
            ])?;
            run(&["ip", "link", "set", &inside, "netns", &ns])?;
            run(&["ip", "link", "set", &outside, "master", &bridge])?;
            run(&["ip", "link", "set", &outside, "up"])?;
            let addr = format!("{}/24", self.address(i));
            for step in [
                vec!["link", "set", &inside, "name", HOST_IFNAME],
                vec!["addr", "add", &addr, "dev", HOST_IFNAME],
                vec!["link", "set", HOST_IFNAME, "up"],
                vec!["link", "set", "lo", "up"],
            ] {
                let mut args = vec!["ip", "-n", &ns];
                args.extend(step);
                run(&args)?;
            }
            if let Some(rate) = &config.link_rate {
                let tbf = [
                    "root", "tbf", "rate", rate, "burst", "64kb", "latency", "50ms",
                ];
                let mut out = vec!["tc", "qdisc", "add", "dev", &outside];
                out.extend(tbf);
                run(&out)?;
                let mut inn = vec![
                    "ip",
                    "netns",
                    "exec",
                    &ns,
                    "tc",
                    "qdisc",
                    "add",
                    "dev",
                    HOST_IFNAME,
                ];
                inn.extend(tbf);
                run(&inn)?;
            }
        }
        Ok(())
    }

    /// Hosts in the cluster.
    pub fn hosts(&self) -> usize {
        self.hosts
    }

    /// The namespace of host `i`.
    pub fn namespace(&self, i: usize) -> String {
        format!("bddp-{}-h{i}", self.id)
    }

    /// The address of host `i` (on [`HOST_IFNAME`]).
    pub fn address(&self, i: usize) -> Ipv4Addr {
        Ipv4Addr::new(10, 77, 0, i as u8 + 1)
    }

    fn bridge(&self) -> String {
        format!("bd{}br", self.id)
    }

    /// The outer end of host `i`'s veth pair (on the bridge).
    fn veth(&self, i: usize) -> String {
        format!("bd{}h{i}", self.id)
    }

    /// A command that runs `program` on host `i` (`ip netns exec`).
    pub fn command(&self, i: usize, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.namespace(i)]).arg(program);
        c
    }

    /// Cuts (`up == false`) or restores host `i`'s link, as a pulled cable would: its
    /// processes live on, packets to and from it are lost.
    pub fn set_link(&self, i: usize, up: bool) -> Result<(), ClusterError> {
        let state = if up { "up" } else { "down" };
        run(&["ip", "link", "set", &self.veth(i), state]).map(|_| ())
    }

    /// The names this cluster created that still exist (namespaces and links): empty after
    /// drop, as the tests check.
    pub fn leftovers_of(id: &str) -> Vec<String> {
        let mut found = Vec::new();
        let listed = |args: &[&str]| {
            Command::new(args[0])
                .args(&args[1..])
                .output()
                .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
                .unwrap_or_default()
        };
        let ns_prefix = format!("bddp-{id}-");
        for line in listed(&["ip", "netns", "list"]).lines() {
            if let Some(name) = line
                .split_whitespace()
                .next()
                .filter(|n| n.starts_with(&ns_prefix))
            {
                found.push(name.to_string());
            }
        }
        let link_prefix = format!("bd{id}");
        for line in listed(&["ip", "-o", "link", "show"]).lines() {
            if let Some(name) = line
                .split(": ")
                .nth(1)
                .map(|n| n.split('@').next().unwrap_or(n))
                && (name.starts_with(&format!("{link_prefix}h"))
                    || name == format!("{link_prefix}br"))
            {
                found.push(name.to_string());
            }
        }
        found
    }

    /// This cluster's id (in every name it creates).
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The processes running on host `i`.
    pub fn pids(&self, i: usize) -> Vec<i32> {
        Command::new("ip")
            .args(["netns", "pids", &self.namespace(i)])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default()
            .split_whitespace()
            .filter_map(|p| p.parse().ok())
            .collect()
    }

    /// Sends `signal` to every process on host `i`.
    pub fn signal_host(&self, i: usize, signal: rustix::process::Signal) {
        for pid in self.pids(i) {
            if let Some(pid) = rustix::process::Pid::from_raw(pid) {
                let _ = rustix::process::kill_process(pid, signal);
            }
        }
    }

    /// Kills every process still running in the cluster's namespaces.
    pub fn kill_all(&self) {
        for i in 0..self.made_hosts {
            self.signal_host(i, rustix::process::Signal::KILL);
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.kill_all();
        for i in 0..self.made_hosts {
            // Deleting the namespace deletes the inner veth end, and with it the pair.
            if let Err(e) = run(&["ip", "netns", "del", &self.namespace(i)]) {
                log::warn!("removing host {i} of cluster {}: {e}", self.id);
            }
            let _ = run(&["ip", "link", "del", &self.veth(i)]);
        }
        if self.made_bridge
            && let Err(e) = run(&["ip", "link", "del", &self.bridge()])
        {
            log::warn!("removing the bridge of cluster {}: {e}", self.id);
        }
    }
}

/// One launcher per host, running the same program: what [`Cluster::spawn`] starts.
#[derive(Debug, Clone)]
pub struct ClusterJob {
    /// The `burn-ddp-run` binary.
    pub launcher: std::path::PathBuf,
    /// Ranks per host.
    pub nproc_per_host: usize,
    /// The program and its arguments.
    pub program: Vec<std::ffi::OsString>,
    /// Extra environment of every launcher (and so of every rank).
    pub env: Vec<(String, String)>,
    /// The store's port on host 0 (namespaces are private: any free port of the machine is
    /// free there).
    pub master_port: u16,
    /// The job secret every host's launcher shares.
    pub secret: String,
}

impl Cluster {
    /// Starts host `i`'s launcher of `job` (`burn-ddp-run --nnodes <hosts> --node-rank i
    /// --master-addr <host 0> ...`) in its namespace, with piped output.
    pub fn spawn(&self, job: &ClusterJob, i: usize) -> std::io::Result<std::process::Child> {
        let mut c = self.command(i, &job.launcher);
        c.args(["--nnodes", &self.hosts.to_string()])
            .args(["--node-rank", &i.to_string()])
            .args(["--nproc-per-node", &job.nproc_per_host.to_string()])
            .args(["--master-addr", &self.address(0).to_string()])
            .args(["--master-port", &job.master_port.to_string()])
            .arg("--")
            .args(&job.program)
            .env(crate::secret::SECRET_VAR, &job.secret)
            .envs(job.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        c.spawn()
    }
}

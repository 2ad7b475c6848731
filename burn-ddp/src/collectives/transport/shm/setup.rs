//! Choosing the transport at rendezvous and setting up the shared-memory segment.
//!
//! Every rank publishes the transport it asks for ([`Transport`], `BURN_DDP_TRANSPORT`), its
//! slot size and its host identity (host name, the kernel's boot id and the network namespace)
//! through the store; every rank then makes the same decision from the same data. Shared memory
//! serves a group on one host, or a group on several hosts with the same number of ranks (two or
//! more) on each: then all-reduce is hierarchical (shared memory within each host, TCP between
//! the hosts) and the other collectives run over TCP. On each host its first rank creates the
//! segment (an anonymous, sealed memory file) and offers its descriptor over a Unix socket whose
//! name and token it publishes (with a tag of the job secret, when the group has one: the store
//! may be torchrun's, writable by anyone who reaches it); the others verify the record and the
//! socket's owner, take it, map it and report, and the creator closes the offer once every rank
//! has reported. Only when every rank mapped its segment do collectives use them; otherwise
//! (a record or socket refused included) the group stays on TCP (or fails, when shared memory
//! was demanded).

use std::time::{Duration, Instant};

use super::ShmChannel;
use super::handoff;
use super::segment::{self, Layout};
use crate::env::{TRANSPORT_VAR, Transport};
use crate::error::{DdpError, Result};
use crate::secret::JobSecret;
use crate::store::{Store, keys};
use crate::sys::mapping::Mapping;

/// What a rank asks of the rendezvous.
pub(crate) struct ShmRequest {
    pub rank: usize,
    pub world: usize,
    pub mode: Transport,
    pub port: u16,
    pub slot_bytes: usize,
    pub timeout: Duration,
    pub spin: Duration,
    /// This rank's host identity, when the user set one ([`crate::GroupOptions::host_id`]).
    pub host: Option<String>,
    /// The group's job secret, which authenticates the segment records in the store.
    pub secret: Option<JobSecret>,
}

/// What the rendezvous decided for shared memory: this rank's channel on its host, and the
/// ranks it all-reduces with across hosts (group ranks, one per host in host order, this rank
/// among them; empty when the group runs on one host).
pub(crate) struct ShmSetup {
    pub channel: ShmChannel,
    pub across: Vec<usize>,
}

/// This host's identity: its name, the kernel's boot id (so two containers or hosts that share
/// a name but not a kernel are told apart) and the network namespace (so hosts simulated with
/// namespaces on one machine count as distinct). `None` where the boot id cannot be read.
fn host_identity() -> Option<String> {
    let read = |p: &str| {
        std::fs::read_to_string(p)
            .ok()
            .map(|s| s.trim().to_string())
    };
    let boot = read("/proc/sys/kernel/random/boot_id").filter(|s| !s.is_empty())?;
    let host = read("/proc/sys/kernel/hostname").unwrap_or_default();
    let net = std::fs::read_link("/proc/self/ns/net")
        .map(|p| p.display().to_string())
        .unwrap_or_default();
    Some(format!("{host}/{boot}/{net}"))
}

/// The group's hosts: the ranks of each distinct identity, hosts ordered by their first rank.
/// An empty identity (unknown host) is a host of its own.
fn hosts_of(idents: &[&str]) -> Vec<Vec<usize>> {
    let mut hosts: Vec<(&str, Vec<usize>)> = Vec::new();
    for (rank, id) in idents.iter().enumerate() {
        match hosts.iter_mut().find(|(h, _)| !id.is_empty() && h == id) {
            Some((_, ranks)) => ranks.push(rank),
            None => hosts.push((id, vec![rank])),
        }
    }
    hosts.into_iter().map(|(_, ranks)| ranks).collect()
}

/// Why `hosts` cannot use shared memory (`None`: they can): one host of two or more ranks, or
/// several hosts with the same number of ranks each, at least two.
fn unsuitable(hosts: &[Vec<usize>]) -> Option<String> {
    let sizes: Vec<usize> = hosts.iter().map(Vec::len).collect();
    if sizes.iter().any(|&s| s != sizes[0]) {
        return Some(format!(
            "the hosts have different numbers of ranks ({sizes:?})"
        ));
    }
    if sizes[0] < 2 {
        return Some(format!(
            "every host has one rank ({} hosts): nothing to share",
            hosts.len()
        ));
    }
    None
}

/// Decides the transport with the peers: `Some` setup for shared memory (on one host, or on
/// each of several hosts with TCP between them), `None` for TCP alone.
pub(crate) fn negotiate(
    req: &ShmRequest,
    store: &Store,
    deadline: Instant,
) -> Result<Option<ShmSetup>> {
    let rank = req.rank;
    let fail = |reason: String| DdpError::Rendezvous { rank, reason };
    let asks = publish_and_read(req, store, deadline)?;
    let wants = |m| asks.iter().position(|(a, _, _)| *a == m);
    match (wants(Transport::Tcp), wants(Transport::Shm)) {
        (Some(t), Some(s)) => {
            return Err(fail(format!(
                "ranks disagree on {}: rank {t} asks for tcp, rank {s} for shm",
                TRANSPORT_VAR
            )));
        }
        (Some(_), None) => return Ok(None),
        _ => {}
    }
    // Without shared memory: an error when it was asked for, TCP otherwise.
    let forced = wants(Transport::Shm).is_some();
    let without = |why: String, level: log::Level| {
        if forced {
            return Err(fail(format!("{TRANSPORT_VAR}=shm, but {why}")));
        }
        log::log!(level, "rank {rank}: collectives over TCP ({why})");
        Ok(None)
    };
    let idents: Vec<&str> = asks.iter().map(|(_, _, id)| id.as_str()).collect();
    let hosts = hosts_of(&idents);
    if let Some(why) = unsuitable(&hosts) {
        return without(why, log::Level::Info);
    }
    let host = hosts.iter().position(|h| h.contains(&rank)).unwrap_or(0);
    let local = hosts[host].iter().position(|&r| r == rank).unwrap_or(0);
    // Every host cuts buffers alike (rank 0's slot size), so pieces match across hosts.
    let layout = Layout::new(hosts[host].len(), asks[0].1);
    if layout.checked_len().is_none() {
        let why = format!(
            "a segment of {} ranks with slots of {} bytes does not fit in memory",
            layout.world, asks[0].1
        );
        return without(why, log::Level::Warn);
    }
    let peers = hosts[host].len() - 1;
    match map_segment(req, store, deadline, (host, local, peers), layout.len())? {
        Ok(map) => {
            let across: Vec<usize> = if hosts.len() > 1 {
                hosts.iter().map(|h| h[local]).collect()
            } else {
                Vec::new()
            };
            log::info!(
                "rank {rank}: collectives over shared memory ({} bytes){}",
                layout.len(),
                if across.is_empty() {
                    String::new()
                } else {
                    format!(
                        ", all-reduce across {} hosts over TCP with ranks {across:?}",
                        hosts.len()
                    )
                }
            );
            let timing = (req.timeout, req.spin);
            #[cfg_attr(not(feature = "test-support"), allow(unused_mut))]
            let mut channel =
                ShmChannel::new(local, hosts[host].clone(), hosts.len(), map, layout, timing);
            #[cfg(feature = "test-support")]
            channel.widen_leave_window(leave_window(req.port));
            Ok(Some(ShmSetup { channel, across }))
        }
        Err(why) => without(why, log::Level::Warn),
    }
}

/// Publishes this rank's ask (transport, slot size, host identity) and reads every rank's.
fn publish_and_read(
    req: &ShmRequest,
    store: &Store,
    deadline: Instant,
) -> Result<Vec<(Transport, usize, String)>> {
    let ident = req.host.clone().or_else(host_identity).unwrap_or_default();
    store.set(
        &keys::per_rank(keys::SHM_HOST, req.rank),
        format!("{}\n{}\n{ident}", req.mode, req.slot_bytes).as_bytes(),
    )?;
    let records = gather(store, keys::SHM_HOST, req.world, deadline)?;
    (records.iter().enumerate())
        .map(|(r, raw)| {
            let mut fields = raw.splitn(3, '\n');
            let (mode, slot, id) = (fields.next(), fields.next(), fields.next());
            let mode: Option<Transport> = mode.and_then(|m| m.parse().ok());
            let slot: Option<usize> = slot.and_then(|s| s.parse().ok());
            match (mode, slot) {
                (Some(mode), Some(slot)) => Ok((mode, slot, id.unwrap_or("").to_string())),
                _ => Err(DdpError::Rendezvous {
                    rank: req.rank,
                    reason: format!("rank {r} published a bad transport {raw:?}"),
                }),
            }
        })
        .collect()
}

/// Maps host `host`'s segment of `len` bytes: its first rank (`local` 0) creates it and offers
/// it to the host's `peers` other ranks (its record in the store), they take and map it; every
/// rank reports, and the creator closes the offer once all have. The mapping, or why some rank
/// of the group could not map its segment.
fn map_segment(
    req: &ShmRequest,
    store: &Store,
    deadline: Instant,
    (host, local, peers): (usize, usize, usize),
    len: usize,
) -> Result<std::result::Result<Mapping, String>> {
    let rank = req.rank;
    let key = keys::shm_segment(host);
    let seal = (req.secret.as_ref()).map(|secret| handoff::Seal { secret, host });
    let mut offer = None;
    let mapped = if local == 0 {
        let made = segment::create(len).and_then(|(fd, map)| {
            let tag = req.port.to_string();
            let (o, record) = handoff::Offer::start(fd, &tag, peers, deadline, seal)?;
            Ok((o, record, map))
        });
        match made {
            Ok((o, record, map)) => {
                store.set(&key, format!("ok {record}").as_bytes())?;
                offer = Some(o);
                Ok(map)
            }
            Err(e) => {
                let reason = format!("rank {rank} could not create its host's segment: {e}");
                store.set(&key, format!("error {reason}").as_bytes())?;
                Err(reason)
            }
        }
    } else {
        let left = deadline.saturating_duration_since(Instant::now());
        let raw = store.get_timeout(&key, left)?;
        let raw = String::from_utf8_lossy(&raw).to_string();
        match raw.split_once(' ') {
            Some(("ok", record)) => handoff::take(record, seal, deadline)
                .and_then(|fd| segment::open(&fd, len))
                .map_err(|e| format!("rank {rank} could not map its host's segment: {e}")),
            Some((_, reason)) => Err(reason.to_string()),
            None => Err(format!("a bad segment record {raw:?}")),
        }
    };
    let report = match &mapped {
        Ok(_) => "ok".to_string(),
        Err(e) => e.clone(),
    };
    store.set(&keys::per_rank(keys::SHM_MAPPED, rank), report.as_bytes())?;
    let reports = gather(store, keys::SHM_MAPPED, req.world, deadline);
    // Every rank has mapped it or given up: the offer closes, the mappings stay.
    drop(offer);
    let problems: Vec<String> = reports?.into_iter().filter(|r| r != "ok").collect();
    Ok(match (mapped, problems.first()) {
        (Ok(map), None) => Ok(map),
        (_, problem) => Err(problem.cloned().unwrap_or_default()),
    })
}

/// Waits for `prefix/<rank>` of every rank and returns the values in rank order.
fn gather(store: &Store, prefix: &str, world: usize, deadline: Instant) -> Result<Vec<String>> {
    let names: Vec<String> = (0..world).map(|r| keys::per_rank(prefix, r)).collect();
    store.wait(&names, deadline.saturating_duration_since(Instant::now()))?;
    names
        .iter()
        .map(|k| Ok(String::from_utf8_lossy(&store.get(k)?).into_owned()))
        .collect()
}

/// The leave windows set by [`widen_leave_window`], by master port (feature `test-support`).
#[cfg(feature = "test-support")]
static LEAVE_WINDOWS: std::sync::Mutex<Vec<(u16, Duration)>> = std::sync::Mutex::new(Vec::new());

/// Makes the groups formed later on master port `port` pause for `pause` between reading a
/// peer's step counter and checking its connection (`burn_ddp::testing::widen_leave_window`).
#[cfg(feature = "test-support")]
pub(crate) fn widen_leave_window(port: u16, pause: Duration) {
    let mut windows = crate::sync::lock(&LEAVE_WINDOWS);
    windows.retain(|(p, _)| *p != port);
    windows.push((port, pause));
}

/// The pause set for master port `port` (zero if none).
#[cfg(feature = "test-support")]
fn leave_window(port: u16) -> Duration {
    let windows = crate::sync::lock(&LEAVE_WINDOWS);
    (windows.iter())
        .find(|(p, _)| *p == port)
        .map_or(Duration::ZERO, |(_, d)| *d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transport_names_parse() {
        for t in [Transport::Auto, Transport::Tcp, Transport::Shm] {
            assert_eq!(t.name().parse::<Transport>(), Ok(t));
        }
        assert_eq!(" SHM ".parse::<Transport>(), Ok(Transport::Shm));
        assert!("udp".parse::<Transport>().is_err());
        assert!(host_identity().is_some_and(|id| id.contains("/net:")));
    }

    #[test]
    fn hosts_group_ranks_by_identity() {
        let hosts = hosts_of(&["a", "b", "a", "b"]);
        assert_eq!(hosts, vec![vec![0, 2], vec![1, 3]]);
        assert_eq!(unsuitable(&hosts), None);
        assert_eq!(hosts_of(&["", ""]), vec![vec![0], vec![1]]);
        assert!(unsuitable(&hosts_of(&["a", "a", "b"])).is_some());
        assert!(unsuitable(&hosts_of(&["a", "b"])).is_some());
        assert_eq!(unsuitable(&hosts_of(&["a", "a", "a"])), None);
    }
}

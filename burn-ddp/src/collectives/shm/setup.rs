//! Choosing the transport at rendezvous and setting up the shared-memory segment.
//!
//! Every rank publishes the transport it asks for ([`Transport`], `BURN_DDP_TRANSPORT`) and its
//! host identity (host name and the kernel's boot id) through the store; every rank then makes
//! the same decision from the same data. For shared memory, rank 0 creates the segment and
//! publishes its name (port and a random token), the others map it and report, and rank 0
//! unlinks it once every rank has reported. Only when every rank mapped it do collectives use
//! it; otherwise the group stays on TCP (or fails, when shared memory was demanded).

use std::time::{Duration, Instant};

use super::ShmChannel;
use super::segment::{self, Layout};
use crate::error::{DdpError, Result};
use crate::store::Store;

/// The environment variable that chooses the transport: `tcp`, `shm` or `auto`.
pub const TRANSPORT_VAR: &str = "BURN_DDP_TRANSPORT";

/// How the ranks of a group exchange collective data.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Transport {
    /// Shared memory when every rank runs on the same host, TCP otherwise.
    Auto,
    /// The TCP transport, always (the default, until shared memory has met its performance
    /// targets and run the whole test suite: choose `auto` or `shm` to use it).
    #[default]
    Tcp,
    /// Shared memory; forming the group fails when the ranks are not all on one host.
    Shm,
}

impl Transport {
    /// Its name, as `BURN_DDP_TRANSPORT` spells it.
    pub fn name(self) -> &'static str {
        match self {
            Transport::Auto => "auto",
            Transport::Tcp => "tcp",
            Transport::Shm => "shm",
        }
    }
}

impl std::fmt::Display for Transport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Transport {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" | "" => Ok(Transport::Auto),
            "tcp" => Ok(Transport::Tcp),
            "shm" => Ok(Transport::Shm),
            _ => Err("tcp, shm or auto".to_string()),
        }
    }
}

/// What a rank asks of the rendezvous.
pub(crate) struct ShmRequest {
    pub rank: usize,
    pub world: usize,
    pub mode: Transport,
    pub port: u16,
    pub slot_bytes: usize,
    pub timeout: Duration,
    pub spin: Duration,
}

/// This host's identity: its name and the boot id (so two containers or hosts that share a
/// name but not a kernel are told apart). `None` where the boot id cannot be read.
fn host_identity() -> Option<String> {
    let read = |p: &str| {
        std::fs::read_to_string(p)
            .ok()
            .map(|s| s.trim().to_string())
    };
    let boot = read("/proc/sys/kernel/random/boot_id").filter(|s| !s.is_empty())?;
    let host = read("/proc/sys/kernel/hostname").unwrap_or_default();
    Some(format!("{host}/{boot}"))
}

/// Decides the transport with the peers; `Some` channel for shared memory, `None` for TCP.
pub(crate) fn negotiate(
    req: &ShmRequest,
    store: &Store,
    deadline: Instant,
) -> Result<Option<ShmChannel>> {
    let (rank, world) = (req.rank, req.world);
    let fail = |reason: String| DdpError::Rendezvous { rank, reason };
    let ident = host_identity().unwrap_or_default();
    store.set(
        &format!("bddp/shm/host/{rank}"),
        format!("{}\n{ident}", req.mode).as_bytes(),
    )?;
    let peers = gather(store, "bddp/shm/host", world, deadline)?;
    let mut asks = Vec::with_capacity(world);
    for (r, raw) in peers.iter().enumerate() {
        let (mode, id) = raw.split_once('\n').unwrap_or((raw, ""));
        let mode: Transport = mode
            .parse()
            .map_err(|_| fail(format!("rank {r} published a bad transport {mode:?}")))?;
        asks.push((mode, id));
    }
    let wants = |m| asks.iter().position(|(a, _)| *a == m);
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
    let forced = wants(Transport::Shm).is_some();
    if let Some(other) = asks
        .iter()
        .position(|(_, id)| id.is_empty() || *id != asks[0].1)
    {
        if forced {
            return Err(fail(format!(
                "{TRANSPORT_VAR}=shm, but rank {other} is not on rank 0's host (rank 0: {:?}, \
                 rank {other}: {:?})",
                asks[0].1, asks[other].1
            )));
        }
        log::info!("rank {rank}: ranks on several hosts, collectives over TCP");
        return Ok(None);
    }

    let layout = Layout::new(world, req.slot_bytes);
    let len = layout.len();
    let mut created = None;
    let mapped = if rank == 0 {
        let made = segment::segment_name(req.port).and_then(|name| {
            let (c, map) = segment::create(&name, len)?;
            Ok((name, c, map))
        });
        match made {
            Ok((name, c, map)) => {
                store.set("bddp/shm/segment", format!("ok {name}").as_bytes())?;
                created = Some(c);
                Ok(map)
            }
            Err(e) => {
                let reason = format!("rank 0 could not create the segment: {e}");
                store.set("bddp/shm/segment", format!("error {reason}").as_bytes())?;
                Err(reason)
            }
        }
    } else {
        let left = deadline.saturating_duration_since(Instant::now());
        let raw = store.get_timeout("bddp/shm/segment", left)?;
        let raw = String::from_utf8_lossy(&raw).to_string();
        match raw.split_once(' ') {
            Some(("ok", name)) => segment::open(name, len)
                .map_err(|e| format!("rank {rank} could not map the segment {name}: {e}")),
            Some((_, reason)) => Err(reason.to_string()),
            None => Err(format!("rank 0 published a bad segment {raw:?}")),
        }
    };
    let report = match &mapped {
        Ok(_) => "ok".to_string(),
        Err(e) => e.clone(),
    };
    store.set(&format!("bddp/shm/mapped/{rank}"), report.as_bytes())?;
    let reports = gather(store, "bddp/shm/mapped", world, deadline);
    // Every rank has mapped it or given up: the name goes, the mappings stay.
    if let Some(mut c) = created {
        c.unlink();
    }
    let problems: Vec<String> = reports?.into_iter().filter(|r| r != "ok").collect();
    match (mapped, problems.first()) {
        (Ok(map), None) => {
            log::info!("rank {rank}: collectives over shared memory ({len} bytes)");
            Ok(Some(ShmChannel::new(
                rank,
                map,
                layout,
                req.timeout,
                req.spin,
            )))
        }
        (_, problem) => {
            let why = problem.cloned().unwrap_or_default();
            if forced {
                return Err(fail(format!("{TRANSPORT_VAR}=shm, but {why}")));
            }
            log::warn!("rank {rank}: shared memory unavailable ({why}), collectives over TCP");
            Ok(None)
        }
    }
}

/// Waits for `prefix/<rank>` of every rank and returns the values in rank order.
fn gather(store: &Store, prefix: &str, world: usize, deadline: Instant) -> Result<Vec<String>> {
    let keys: Vec<String> = (0..world).map(|r| format!("{prefix}/{r}")).collect();
    store.wait(&keys, deadline.saturating_duration_since(Instant::now()))?;
    keys.iter()
        .map(|k| Ok(String::from_utf8_lossy(&store.get(k)?).into_owned()))
        .collect()
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
        assert!(host_identity().is_some_and(|id| id.contains('/')));
    }
}

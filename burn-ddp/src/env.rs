//! Reads who-am-I from the launcher's environment: torchrun, Slurm or Open MPI variables.
//!
//! Precedence: torchrun names (`RANK`, `WORLD_SIZE`, ...) when either `RANK` or `WORLD_SIZE` is
//! set, else Slurm (`SLURM_PROCID`, `SLURM_NTASKS`, ...), else Open MPI
//! (`OMPI_COMM_WORLD_RANK`, ...), else a world of size 1. `MASTER_ADDR` and `MASTER_PORT` are
//! read in every case; `MASTER_PORT` defaults to 29500 as in PyTorch. Under Slurm, unset
//! `MASTER_ADDR`/`MASTER_PORT` and the local world size come from Slurm's own variables (see
//! [`slurm`]).
//!
//! Under torchrun (`TORCHELASTIC_USE_AGENT_STORE=True`) torchrun's agent already serves a
//! PyTorch c10d store at `MASTER_ADDR:MASTER_PORT`: no rank serves one, every rank joins that
//! store as a client, under a key prefix of the attempt ([`store_namespace`]).
//!
//! Every `BURN_DDP_*` variable of the library is read here (docs/guide/launchers.md lists them).

pub mod slurm;

use std::time::Duration;

use crate::error::{DdpError, Result};
use crate::secret::{JobSecret, SECRET_VAR};
use crate::store::StoreKind;

/// Set to `1` by a launcher that serves the store itself (rank 0 then does not).
pub const AGENT_STORE_VAR: &str = "BURN_DDP_AGENT_STORE";
/// Host the store listens on instead of `MASTER_ADDR`'s interface.
pub const STORE_BIND_VAR: &str = "BURN_DDP_STORE_BIND";
/// Network interface of the data plane (listened on and advertised to the peers).
pub const SOCKET_IFNAME_VAR: &str = "BURN_DDP_SOCKET_IFNAME";
/// Gloo's name for the same, read when [`SOCKET_IFNAME_VAR`] is unset.
pub const GLOO_SOCKET_IFNAME_VAR: &str = "GLOO_SOCKET_IFNAME";

/// The environment variable that chooses the transport: `tcp`, `shm` or `auto`.
pub const TRANSPORT_VAR: &str = "BURN_DDP_TRANSPORT";

/// How the ranks of a group exchange collective data.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Transport {
    /// Shared memory between the ranks of each host and TCP between hosts, where every host
    /// has the same number of ranks (two or more); TCP alone otherwise. The default.
    #[default]
    Auto,
    /// The TCP transport, always.
    Tcp,
    /// As `Auto`, but forming the group fails where shared memory cannot serve it.
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

/// Set by `burn-ddp-run` in each rank's environment: which restart of the job the rank
/// belongs to (0: the first start).
pub const RESTART_COUNT_VAR: &str = "BURN_DDP_RESTART_COUNT";
/// Set by `burn-ddp-run` in each rank's environment: the launcher's process id, so that a rank
/// dies with its launcher ([`crate::elastic::die_with_launcher`]).
pub const LAUNCHER_PID_VAR: &str = "BURN_DDP_LAUNCHER_PID";
pub use crate::liveness::{LINK_TIMEOUT_VAR, link_timeout};

/// Default rendezvous port, the same as PyTorch's.
pub const DEFAULT_MASTER_PORT: u16 = 29500;

/// Which launcher's variables described this process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EnvSource {
    /// `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE` (torchrun, `cargo xtask multi-cpu`).
    Torchrun,
    /// `SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`; the local world size from
    /// `SLURM_STEP_TASKS_PER_NODE` (or `SLURM_TASKS_PER_NODE`) and `SLURM_NODEID`, else
    /// `SLURM_NTASKS_PER_NODE`.
    Slurm,
    /// `OMPI_COMM_WORLD_RANK`, `OMPI_COMM_WORLD_SIZE`, `OMPI_COMM_WORLD_LOCAL_RANK`, `..._LOCAL_SIZE`.
    OpenMpi,
    /// None of the above: a single process.
    Single,
}

/// The launch description of one process, as read from its environment.
#[derive(Debug, Clone, PartialEq)]
pub struct LaunchEnv {
    /// Global rank, `0..world_size`.
    pub rank: usize,
    /// Number of processes in the job.
    pub world_size: usize,
    /// Rank among the processes of this node (selects the GPU).
    pub local_rank: usize,
    /// Number of processes on this node.
    pub local_world_size: usize,
    /// Host of the store (rank 0's, or the launcher's); `None` for a world of size 1 without
    /// `MASTER_ADDR`.
    pub master_addr: Option<String>,
    /// Port of rank 0's store.
    pub master_port: u16,
    /// Collective timeout from `BURN_DDP_TIMEOUT` (seconds), if set.
    pub timeout: Option<Duration>,
    /// Rendezvous timeout from `BURN_DDP_RENDEZVOUS_TIMEOUT` (seconds), if set.
    pub rendezvous_timeout: Option<Duration>,
    /// Transport of collectives from `BURN_DDP_TRANSPORT` (`tcp`, `shm`, `auto`), if set.
    pub transport: Option<Transport>,
    /// Which variables were used.
    pub source: EnvSource,
    /// The job secret from `BURN_DDP_SECRET` (set by `burn-ddp-run`), if any.
    pub secret: Option<JobSecret>,
    /// `BURN_DDP_AGENT_STORE=1` or `TORCHELASTIC_USE_AGENT_STORE=True`: the launcher serves
    /// the store, so rank 0 does not.
    pub agent_store: bool,
    /// The store to join: torchrun's c10d store under `TORCHELASTIC_USE_AGENT_STORE=True`,
    /// with keys under the attempt's namespace; burn-ddp's own otherwise.
    pub store_kind: StoreKind,
    /// Which start of the job this is: `BURN_DDP_RESTART_COUNT`, else
    /// `TORCHELASTIC_RESTART_COUNT`, else 0.
    pub restart_count: usize,
    /// `BURN_DDP_STORE_BIND`: the host the store listens on, instead of `MASTER_ADDR`'s
    /// interface (for example `0.0.0.0`).
    pub store_bind: Option<String>,
    /// `BURN_DDP_SOCKET_IFNAME` (else `GLOO_SOCKET_IFNAME`): the network interface the data
    /// plane listens on and advertises.
    pub socket_ifname: Option<String>,
}

/// Names of the four identity variables of one launcher family.
struct Names {
    rank: &'static str,
    world: &'static str,
    local_rank: &'static str,
    local_world: &'static str,
    source: EnvSource,
}

const FAMILIES: [Names; 3] = [
    Names {
        rank: "RANK",
        world: "WORLD_SIZE",
        local_rank: "LOCAL_RANK",
        local_world: "LOCAL_WORLD_SIZE",
        source: EnvSource::Torchrun,
    },
    Names {
        rank: "SLURM_PROCID",
        world: "SLURM_NTASKS",
        local_rank: "SLURM_LOCALID",
        local_world: "SLURM_NTASKS_PER_NODE",
        source: EnvSource::Slurm,
    },
    Names {
        rank: "OMPI_COMM_WORLD_RANK",
        world: "OMPI_COMM_WORLD_SIZE",
        local_rank: "OMPI_COMM_WORLD_LOCAL_RANK",
        local_world: "OMPI_COMM_WORLD_LOCAL_SIZE",
        source: EnvSource::OpenMpi,
    },
];

impl LaunchEnv {
    /// Reads the process environment.
    pub fn from_env() -> Result<Self> {
        Self::from_lookup(|name| std::env::var_os(name).map(|v| v.to_string_lossy().into_owned()))
    }

    /// Reads variables through `get` (a map in tests, the process environment in
    /// [`LaunchEnv::from_env`]).
    ///
    /// ```
    /// use burn_ddp::env::LaunchEnv;
    /// let vars = [("RANK", "1"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "10.0.0.1")];
    /// let env = LaunchEnv::from_lookup(|k| {
    ///     vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())
    /// })
    /// .unwrap();
    /// assert_eq!((env.rank, env.world_size, env.master_port), (1, 2, 29500));
    /// ```
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let get = |name: &str| get(name).filter(|v| !v.trim().is_empty());
        let family = FAMILIES
            .iter()
            .find(|f| get(f.rank).is_some() || get(f.world).is_some());

        let (rank, world_size, local_rank, local_world_size, source) = match family {
            None => (0, 1, 0, 1, EnvSource::Single),
            Some(f) => {
                let (rank, world, local_rank, local_world) = ranks_of(f, &get)?;
                (rank, world, local_rank, local_world, f.source)
            }
        };
        let (master_addr, master_port) = master_of(&get, world_size, source)?;
        let restart_count = restart_count_from(get)?;
        let torchrun_store = uses_agent_store(get)?;
        let store_kind = if torchrun_store {
            StoreKind::C10d {
                namespace: store_namespace(restart_count),
            }
        } else {
            StoreKind::BurnDdp
        };
        Ok(LaunchEnv {
            rank,
            world_size,
            local_rank,
            local_world_size,
            master_addr,
            master_port,
            timeout: parse_seconds(&get, "BURN_DDP_TIMEOUT")?,
            rendezvous_timeout: parse_seconds(&get, "BURN_DDP_RENDEZVOUS_TIMEOUT")?,
            transport: get(TRANSPORT_VAR)
                .map(|v| {
                    v.parse()
                        .map_err(|e: String| invalid(TRANSPORT_VAR, &v, &e))
                })
                .transpose()?,
            source,
            secret: get(SECRET_VAR).map(JobSecret::new).transpose()?,
            agent_store: torchrun_store
                || match get(AGENT_STORE_VAR).as_deref().map(str::trim) {
                    None | Some("0") => false,
                    Some("1") => true,
                    Some(v) => return Err(invalid(AGENT_STORE_VAR, v, "0 or 1")),
                },
            store_kind,
            restart_count,
            store_bind: get(STORE_BIND_VAR).map(|v| v.trim().to_string()),
            socket_ifname: get(SOCKET_IFNAME_VAR)
                .or_else(|| get(GLOO_SOCKET_IFNAME_VAR))
                .map(|v| v.trim().to_string()),
        })
    }
}

/// Rank, world size, local rank and local world size under the launcher whose variables
/// are `f`.
fn ranks_of(
    f: &Names,
    get: &impl Fn(&str) -> Option<String>,
) -> Result<(usize, usize, usize, usize)> {
    let world_size = parse_required(get, f.world, f.rank)?;
    if world_size == 0 {
        return Err(invalid(f.world, "0", "a world size of at least 1"));
    }
    let rank = parse_required(get, f.rank, f.world)?;
    if rank >= world_size {
        return Err(invalid(
            f.rank,
            &rank.to_string(),
            &format!("a rank below {}={world_size}", f.world),
        ));
    }
    let from_layout = match f.source {
        EnvSource::Slurm => slurm::local_world_size(get)?,
        _ => None,
    };
    let local_world = match (from_layout, get(f.local_world)) {
        (Some(n), _) => Some(n),
        // Slurm writes e.g. "2(x3)" for heterogeneous layouts: only a plain number is usable,
        // anything else means "unknown".
        (None, Some(v)) if f.source == EnvSource::Slurm && v.parse::<usize>().is_err() => None,
        (None, Some(v)) => Some(parse_usize(f.local_world, &v)?),
        (None, None) => None,
    };
    let local_rank = match get(f.local_rank) {
        Some(v) => parse_usize(f.local_rank, &v)?,
        None => local_world.map_or(rank, |lw| rank % lw.max(1)),
    };
    let local_world = local_world.unwrap_or(world_size);
    if local_world == 0 || local_rank >= local_world {
        return Err(invalid(
            f.local_rank,
            &local_rank.to_string(),
            &match from_layout {
                Some(_) => format!(
                    "a local rank below the {local_world} tasks Slurm placed on this node \
                     (SLURM_STEP_TASKS_PER_NODE, SLURM_NODEID)"
                ),
                None => format!("a local rank below {}={local_world}", f.local_world),
            },
        ));
    }
    Ok((rank, world_size, local_rank, local_world))
}

/// Rank 0's store address and port (`MASTER_ADDR`, `MASTER_PORT`; under Slurm from its node
/// list and job id when unset).
fn master_of(
    get: &impl Fn(&str) -> Option<String>,
    world_size: usize,
    source: EnvSource,
) -> Result<(Option<String>, u16)> {
    let slurm = source == EnvSource::Slurm && world_size > 1;
    let master_addr = match get("MASTER_ADDR") {
        Some(a) => Some(a.trim().to_string()),
        None if slurm => slurm::master_addr(get)?,
        None => None,
    };
    if world_size > 1 && master_addr.is_none() {
        return Err(DdpError::MissingEnv {
            var: "MASTER_ADDR",
            why: format!(
                "the world size is {world_size}, so every rank needs the host of rank 0's store \
                 (for example MASTER_ADDR=127.0.0.1 on one machine){}",
                if slurm {
                    "; under Slurm it defaults to the first host of SLURM_STEP_NODELIST or \
                     SLURM_JOB_NODELIST, and neither is set"
                } else {
                    ""
                }
            ),
        });
    }
    let master_port = match get("MASTER_PORT") {
        None if slurm => slurm::master_port(get)?.unwrap_or(DEFAULT_MASTER_PORT),
        None => DEFAULT_MASTER_PORT,
        Some(v) => match v.trim().parse::<u16>() {
            Ok(p) if p > 0 => p,
            _ => return Err(invalid("MASTER_PORT", &v, "a TCP port number in 1..=65535")),
        },
    };
    Ok((master_addr, master_port))
}

fn invalid(var: &'static str, value: &str, expected: &str) -> DdpError {
    DdpError::InvalidEnv {
        var,
        value: value.to_string(),
        expected: expected.to_string(),
    }
}

fn parse_usize(var: &'static str, value: &str) -> Result<usize> {
    value
        .trim()
        .parse::<usize>()
        .map_err(|_| invalid(var, value, "a non-negative integer"))
}

fn parse_required(
    get: &impl Fn(&str) -> Option<String>,
    var: &'static str,
    partner: &'static str,
) -> Result<usize> {
    match get(var) {
        Some(v) => parse_usize(var, &v),
        None => Err(DdpError::MissingEnv {
            var,
            why: format!("{partner} is set, and the two go together"),
        }),
    }
}

fn parse_seconds(
    get: &impl Fn(&str) -> Option<String>,
    var: &'static str,
) -> Result<Option<Duration>> {
    get(var)
        .map(|v| match v.trim().parse::<f64>() {
            Ok(s) if s.is_finite() && s > 0.0 && s < 1e9 => Ok(Duration::from_secs_f64(s)),
            _ => Err(invalid(var, &v, "a positive number of seconds")),
        })
        .transpose()
}
/// `True` when torchrun's agent serves a c10d `TCPStore` at `MASTER_ADDR:MASTER_PORT`, which
/// the ranks then join as clients instead of rank 0 serving one.
pub const USE_AGENT_STORE_VAR: &str = "TORCHELASTIC_USE_AGENT_STORE";
/// How many times torchrun restarted the workers (0 on the first start).
pub const TORCHELASTIC_RESTART_COUNT_VAR: &str = "TORCHELASTIC_RESTART_COUNT";
/// The restart count from `get`: `BURN_DDP_RESTART_COUNT` (burn-ddp-run) if set, else
/// `TORCHELASTIC_RESTART_COUNT` (torchrun), else 0.
pub fn restart_count_from(get: impl Fn(&str) -> Option<String>) -> Result<usize> {
    for var in [RESTART_COUNT_VAR, TORCHELASTIC_RESTART_COUNT_VAR] {
        if let Some(v) = get(var).filter(|v| !v.trim().is_empty()) {
            return v.trim().parse().map_err(|_| DdpError::InvalidEnv {
                var,
                value: v.clone(),
                expected: "a non-negative integer".into(),
            });
        }
    }
    Ok(0)
}

/// Whether `get` says torchrun's agent serves the store (`TORCHELASTIC_USE_AGENT_STORE`, which
/// PyTorch compares with `"True"`; `true` and `1` are accepted too).
pub fn uses_agent_store(get: impl Fn(&str) -> Option<String>) -> Result<bool> {
    match get(USE_AGENT_STORE_VAR).as_deref().map(str::trim) {
        None | Some("" | "False" | "false" | "0") => Ok(false),
        Some("True" | "true" | "1") => Ok(true),
        Some(v) => Err(DdpError::InvalidEnv {
            var: USE_AGENT_STORE_VAR,
            value: v.to_string(),
            expected: "True or False".into(),
        }),
    }
}

/// The key prefix of one attempt of a job in torchrun's store, which outlives restarts: keys
/// of earlier attempts are never seen by later ones. PyTorch itself uses
/// `/worker/attempt_{n}` for its own keys.
pub fn store_namespace(restart_count: usize) -> String {
    format!("burn_ddp/attempt_{restart_count}/")
}

/// This process's restart count ([`restart_count_from`] on the process environment; 0 when
/// unreadable).
pub(crate) fn process_restart_count() -> usize {
    restart_count_from(|name| std::env::var(name).ok()).unwrap_or(0)
}

/// The process id of the `burn-ddp-run` that started this process, when it did.
pub(crate) fn launcher_pid() -> Option<i32> {
    std::env::var(LAUNCHER_PID_VAR)
        .ok()
        .and_then(|v| v.parse::<i32>().ok())
}

/// The job secret a launcher was given in its own environment (`BURN_DDP_SECRET`).
pub(crate) fn launcher_secret() -> Option<String> {
    std::env::var(SECRET_VAR).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lookup<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |k| {
            vars.iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        }
    }

    #[test]
    fn ours_takes_precedence_over_torchrun_restart_count() {
        assert_eq!(restart_count_from(lookup(&[])).unwrap(), 0);
        let torchrun = [(TORCHELASTIC_RESTART_COUNT_VAR, "2")];
        assert_eq!(restart_count_from(lookup(&torchrun)).unwrap(), 2);
        let both = [
            (TORCHELASTIC_RESTART_COUNT_VAR, "2"),
            (RESTART_COUNT_VAR, "5"),
        ];
        assert_eq!(restart_count_from(lookup(&both)).unwrap(), 5);
        let bad = [(TORCHELASTIC_RESTART_COUNT_VAR, "two")];
        let e = restart_count_from(lookup(&bad)).unwrap_err().to_string();
        assert!(e.contains(TORCHELASTIC_RESTART_COUNT_VAR), "{e}");
    }

    #[test]
    fn agent_store_flag_reads_pythons_spelling() {
        for (v, on) in [("True", true), ("1", true), ("False", false), ("", false)] {
            let vars = [(USE_AGENT_STORE_VAR, v)];
            assert_eq!(uses_agent_store(lookup(&vars)).unwrap(), on, "{v:?}");
        }
        assert!(!uses_agent_store(lookup(&[])).unwrap());
        assert!(uses_agent_store(lookup(&[(USE_AGENT_STORE_VAR, "yes")])).is_err());
    }
}

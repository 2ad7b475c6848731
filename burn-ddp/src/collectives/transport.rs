//! [`Transport`]: how a group's ranks exchange host buffers (TCP, shared memory or the choice
//! between them), chosen with `BURN_DDP_TRANSPORT` or `GroupOptions::transport`; the choice is
//! made at rendezvous (`shm/setup.rs`).

pub(crate) mod host;
pub(crate) mod reduce;
pub(crate) mod schedule;
pub(crate) mod shm;
pub(crate) mod tcp;

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

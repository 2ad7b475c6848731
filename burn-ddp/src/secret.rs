//! The job secret: only processes that hold it join the store and the data plane, so a stray
//! process can neither join the group nor inject gradients. `burn-ddp-run` generates one per
//! job and hands it to its ranks in `BURN_DDP_SECRET`; under other launchers users set that
//! variable on every node (see `SECURITY.md`).
//!
//! The secret never leaves the process: every store and data-plane connection opens with a
//! challenge and response (the handshake) in which both sides prove with an HMAC-SHA256 over
//! fresh nonces that they hold it. It is never printed (its `Debug` shows only its length).
//! It keeps out processes that do not hold it; it does not encrypt or authenticate the traffic
//! after admission (use a private network or WireGuard/IPsec for that, as with NCCL and gloo).

use std::fmt;

use crate::error::{DdpError, Result};

pub(crate) mod handshake;

pub use handshake::{AdmissionError, Domain};

/// Environment variable carrying the job secret to the ranks.
pub const SECRET_VAR: &str = "BURN_DDP_SECRET";
/// Shortest secret accepted (bytes).
pub const MIN_SECRET_LEN: usize = 16;
/// Longest secret accepted (bytes).
pub const MAX_SECRET_LEN: usize = 256;

/// A shared job secret. Its `Debug` output does not show it.
#[derive(Clone, PartialEq, Eq)]
pub struct JobSecret(Vec<u8>);

impl fmt::Debug for JobSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "JobSecret(<{} bytes>)", self.0.len())
    }
}

impl JobSecret {
    /// A fresh random secret (32 bytes from the operating system, written as 64 hex digits).
    pub fn generate() -> Result<Self> {
        let mut raw = [0u8; 32];
        getrandom::fill(&mut raw).map_err(|e| {
            DdpError::io(
                "drawing the job secret from the operating system's random generator",
                std::io::Error::other(e.to_string()),
            )
        })?;
        Ok(JobSecret(
            raw.iter()
                .map(|b| format!("{b:02x}"))
                .collect::<String>()
                .into_bytes(),
        ))
    }

    /// A secret given by the user (for example the value of `BURN_DDP_SECRET`).
    ///
    /// ```
    /// use burn_ddp::secret::JobSecret;
    /// assert!(JobSecret::new("0123456789abcdef0123").is_ok());
    /// assert!(JobSecret::new("short").is_err());
    /// ```
    pub fn new(value: impl Into<Vec<u8>>) -> Result<Self> {
        let value = value.into();
        if !(MIN_SECRET_LEN..=MAX_SECRET_LEN).contains(&value.len()) {
            return Err(DdpError::InvalidEnv {
                var: SECRET_VAR,
                value: format!("<{} bytes>", value.len()),
                expected: format!(
                    "a secret of {MIN_SECRET_LEN} to {MAX_SECRET_LEN} bytes (for example the \
                     output of `openssl rand -hex 32`)"
                ),
            });
        }
        Ok(JobSecret(value))
    }

    /// The value to put in [`SECRET_VAR`] for a rank.
    pub fn to_env_value(&self) -> String {
        String::from_utf8_lossy(&self.0).into_owned()
    }

    pub(crate) fn as_bytes(&self) -> &[u8] {
        &self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_secrets_differ_round_trip_and_do_not_show() {
        let (a, b) = (
            JobSecret::generate().unwrap(),
            JobSecret::generate().unwrap(),
        );
        assert_ne!(a, b);
        assert_eq!(a.as_bytes().len(), 64);
        assert!(a.as_bytes().iter().all(u8::is_ascii_hexdigit));
        assert_eq!(JobSecret::new(a.to_env_value()).unwrap(), a);
        assert!(!format!("{a:?}").contains(&a.to_env_value()));
    }
}

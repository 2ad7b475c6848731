//! The job secret: the launcher generates one per job and hands it to its ranks in
//! `BURN_DDP_SECRET`; the store and the data plane refuse connections that do not present it, so
//! a stray process can neither join the group nor inject gradients.
//!
//! The secret is presented in the first message of each connection (store hello, mesh hello) and
//! compared in constant time. It keeps out processes that do not know it; it does not encrypt
//! the traffic (use a private network for that, as with NCCL and gloo).

use std::fmt;

use crate::error::{DdpError, Result};

/// Environment variable carrying the job secret to the ranks.
pub const SECRET_VAR: &str = "BURN_DDP_SECRET";
/// Shortest secret accepted (bytes).
pub const MIN_SECRET_LEN: usize = 16;
/// Longest secret accepted (bytes); also bounds what a connecting peer may send.
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
        let mut f = std::fs::File::open("/dev/urandom")
            .map_err(|e| DdpError::io("opening /dev/urandom for the job secret", e))?;
        std::io::Read::read_exact(&mut f, &mut raw)
            .map_err(|e| DdpError::io("reading /dev/urandom for the job secret", e))?;
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

    /// Whether `presented` is this secret, in time independent of where they differ.
    pub(crate) fn matches(&self, presented: &[u8]) -> bool {
        presented.len() == self.0.len()
            && presented
                .iter()
                .zip(&self.0)
                .fold(0u8, |acc, (a, b)| acc | (a ^ b))
                == 0
    }
}

/// What a listener checks: no secret accepts everyone; a secret accepts only its holders.
pub(crate) fn admits(expected: Option<&JobSecret>, presented: &[u8]) -> bool {
    expected.is_none_or(|s| s.matches(presented))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_secrets_differ_and_match_themselves() {
        let (a, b) = (
            JobSecret::generate().unwrap(),
            JobSecret::generate().unwrap(),
        );
        assert_ne!(a, b);
        assert!(a.matches(a.as_bytes()));
        assert!(!a.matches(b.as_bytes()));
        assert!(!a.matches(&a.as_bytes()[1..]));
        assert!(admits(None, b"anything"));
        assert!(!admits(Some(&a), b""));
        assert_eq!(JobSecret::new(a.to_env_value()).unwrap(), a);
        assert!(!format!("{a:?}").contains(&a.to_env_value()));
    }
}

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

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::error::{DdpError, Result};
use crate::wire::Writer;

pub(crate) mod handshake;

pub use handshake::{AdmissionError, Domain};

/// Environment variable carrying the job secret to the ranks.
pub const SECRET_VAR: &str = "BURN_DDP_SECRET";
/// Shortest secret accepted (bytes).
pub const MIN_SECRET_LEN: usize = 16;
/// Longest secret accepted (bytes).
pub const MAX_SECRET_LEN: usize = 256;
/// Fewest bits of estimated entropy a secret must carry ([`estimated_bits`]).
pub const MIN_SECRET_BITS: usize = 128;
/// Bytes of a tag ([`JobSecret::tag`]).
pub(crate) const TAG_LEN: usize = 32;

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

    /// A secret given by the user (for example the value of `BURN_DDP_SECRET`): 16 to 256
    /// bytes of at least 128 bits of estimated entropy ([`estimated_bits`]), so 32 hex digits,
    /// 22 base64 characters or 16 other bytes at least, and not one character repeated.
    ///
    /// ```
    /// use burn_ddp::secret::JobSecret;
    /// assert!(JobSecret::new("0123456789abcdef0123456789abcdef").is_ok());
    /// assert!(JobSecret::new("0123456789abcdef0123").is_err()); // 80 bits
    /// assert!(JobSecret::new("short").is_err());
    /// ```
    pub fn new(value: impl Into<Vec<u8>>) -> Result<Self> {
        let value = value.into();
        let refuse = |what: String| DdpError::InvalidEnv {
            var: SECRET_VAR,
            value: format!("<{} bytes>", value.len()),
            expected: format!(
                "{what} (for example the output of `openssl rand -hex 32`, 256 bits)"
            ),
        };
        if !(MIN_SECRET_LEN..=MAX_SECRET_LEN).contains(&value.len()) {
            return Err(refuse(format!(
                "a secret of {MIN_SECRET_LEN} to {MAX_SECRET_LEN} bytes"
            )));
        }
        let bits = estimated_bits(&value);
        if bits < MIN_SECRET_BITS || value.iter().all(|&b| b == value[0]) {
            return Err(refuse(format!(
                "a random secret of at least {MIN_SECRET_BITS} bits: this one is worth about \
                 {bits} bits (4 a hex digit, 6 a base64 character, 8 any other byte, none when \
                 one character repeats)"
            )));
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

    /// An HMAC-SHA256 tag, keyed with the secret, over `label` (what the record is, and its
    /// version) and `fields`, each length-prefixed (so no two lists of fields give the same
    /// input): proof that a holder of the secret wrote them.
    pub(crate) fn tag(&self, label: &[u8], fields: &[&[u8]]) -> [u8; TAG_LEN] {
        self.mac(label, fields).finalize().into_bytes().into()
    }

    /// Whether `tag` is [`JobSecret::tag`] of `label` and `fields`, compared in constant time.
    pub(crate) fn verify(&self, label: &[u8], fields: &[&[u8]], tag: &[u8]) -> bool {
        self.mac(label, fields).verify_slice(tag).is_ok()
    }

    fn mac(&self, label: &[u8], fields: &[&[u8]]) -> Hmac<Sha256> {
        let mut w = Writer::default();
        w.bytes(label);
        for field in fields {
            w.bytes(field);
        }
        let mut mac =
            <Hmac<Sha256> as Mac>::new_from_slice(&self.0).expect("HMAC takes keys of any length");
        mac.update(&w.buf);
        mac
    }
}

/// The entropy a secret can carry at most, judged by the alphabet it is written in: 4 bits a
/// character when all are hex digits, 6 when all are base64 or base64url characters (padding
/// `=` counts for nothing), 8 a byte otherwise. An upper bound for a random value in that
/// alphabet (a chosen word carries far less, which no rule can see).
pub fn estimated_bits(value: &[u8]) -> usize {
    let base64 = |b: &u8| b.is_ascii_alphanumeric() || b"+/-_=".contains(b);
    if value.iter().all(u8::is_ascii_hexdigit) {
        value.len() * 4
    } else if value.iter().all(base64) {
        value.iter().filter(|&&b| b != b'=').count() * 6
    } else {
        value.len() * 8
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

    #[test]
    fn tags_verify_only_under_the_same_secret_label_and_fields() {
        let (a, b) = (
            JobSecret::generate().unwrap(),
            JobSecret::generate().unwrap(),
        );
        let tag = a.tag(b"label", &[b"one", b"two"]);
        assert!(a.verify(b"label", &[b"one", b"two"], &tag));
        assert!(!b.verify(b"label", &[b"one", b"two"], &tag));
        assert!(!a.verify(b"other", &[b"one", b"two"], &tag));
        // Fields are length-prefixed: moving a byte across a boundary changes the tag.
        assert!(!a.verify(b"label", &[b"on", b"etwo"], &tag));
        assert!(!a.verify(b"label", &[b"one", b"two"], &tag[..31]));
        let mut flipped = tag;
        flipped[0] ^= 1;
        assert!(!a.verify(b"label", &[b"one", b"two"], &flipped));
    }

    /// `n` characters cycling through `alphabet` (distinct neighbours, never one repeated).
    fn cycle(alphabet: &str, n: usize) -> String {
        alphabet.chars().cycle().take(n).collect()
    }

    #[test]
    fn secrets_under_128_bits_of_estimated_entropy_are_refused() {
        let hex = "0123456789abcdef";
        let b64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
        // Hex digits carry 4 bits each: 32 are needed.
        assert!(JobSecret::new(cycle(hex, 31)).is_err());
        assert!(JobSecret::new(cycle(hex, 32)).is_ok());
        assert!(JobSecret::new(cycle(&hex.to_uppercase(), 31)).is_err());
        // Base64 (and base64url) characters carry 6 bits each: 22 are needed; padding carries
        // none.
        assert!(JobSecret::new(cycle(b64, 21)).is_err());
        assert!(JobSecret::new(cycle(b64, 22)).is_ok());
        assert!(JobSecret::new(format!("{}==", cycle(b64, 21))).is_err());
        assert!(JobSecret::new(format!("{}==", cycle(b64, 22))).is_ok());
        assert!(JobSecret::new(cycle("ghijk-_", 21)).is_err());
        assert!(JobSecret::new(cycle("ghijk-_", 22)).is_ok());
        // Anything else: 8 bits a byte, 16 bytes.
        assert!(JobSecret::new(cycle("a b!", 16)).is_ok());
        // One repeated character is refused whatever its length.
        for c in ["a", "0", " ", "="] {
            let e = JobSecret::new(c.repeat(64)).unwrap_err().to_string();
            assert!(e.contains("openssl rand -hex 32"), "{e}");
        }
        let e = JobSecret::new(cycle(hex, 31)).unwrap_err().to_string();
        assert!(
            e.contains("128 bits") && e.contains("openssl rand -hex 32"),
            "{e}"
        );
        assert!(
            !e.contains(&cycle(hex, 31)),
            "the error quotes the secret: {e}"
        );
        for _ in 0..10 {
            let generated = JobSecret::generate().unwrap();
            assert!(JobSecret::new(generated.to_env_value()).is_ok());
        }
    }
}

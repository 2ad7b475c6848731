//! Admission by challenge and response: how a connecting process (the initiator: a store
//! client, or the higher rank of a data-plane pair) and the process it connects to (the
//! responder: the store, or the lower rank) prove to each other that they hold the job secret
//! without sending it. The store and the data plane both use this module; each gives its own
//! magic (protocol and version) and claims (the data plane: rank and world size).
//!
//! On the wire, before anything else on the connection:
//!
//! ```text
//! initiator -> responder  hello:     magic | u8 n | claims[n] | nonce_i[32]
//! responder -> initiator  challenge: magic | u8 n | claims[n] | u8 has_secret | nonce_r[32] | proof_r[32]
//! initiator -> responder  answer:    u8 code (1: proof, 2: no secret, 3: your proof failed) | proof_i[32]
//! responder -> initiator  verdict:   u32 len | reason[len]   (empty: admitted)
//!
//! proof_r = HMAC-SHA256(secret, LABEL | domain | "responder" | claims_i | claims_r | nonce_i | nonce_r)
//! proof_i = HMAC-SHA256(secret, LABEL | domain | "initiator" | claims_i | claims_r | nonce_i | nonce_r)
//! ```
//!
//! Each field of the MAC's input is length-prefixed. Both nonces are fresh per connection
//! (`getrandom`), so a recorded handshake replayed to either side fails; the direction differs
//! between the two proofs, so a reflected proof fails; the domain (store or data plane) and the
//! claims (ranks) are covered, so a proof made for one connection counts for no other. Proofs
//! are checked with `Mac::verify_slice` (constant time). The responder proves first and the
//! initiator answers only a verified challenge, so a fake responder learns nothing it could use.
//! Without a secret on either side, both send zeros and the responder admits everyone (as
//! PyTorch's store does); a side that holds a secret refuses a peer that cannot prove it.
//!
//! Every read is bounded in size and by the caller's deadline, however slowly the peer sends.

use std::io::{self, Read, Write};

pub use crate::error::admission::{AdmissionError, Domain};
use std::net::TcpStream;
use std::time::Instant;

use hmac::{Hmac, Mac};
use sha2::Sha256;

use super::JobSecret;
use crate::wire::{FrameError, Writer, read_frame, write_frame};

/// Bytes of a nonce and of a proof.
const LEN: usize = 32;
/// Longest claims accepted.
const MAX_CLAIMS: usize = 64;
/// Longest verdict accepted.
const MAX_VERDICT: usize = 1024;
/// First field of every proof's input: this protocol and its version.
const LABEL: &[u8] = b"burn-ddp admission v1";

mod code {
    pub const PROOF: u8 = 1;
    pub const NO_SECRET: u8 = 2;
    pub const UNPROVEN: u8 = 3;
}

/// The reason a responder holding the secret gives a peer that has none.
const NO_SECRET_REASON: &str =
    "this process does not present the job secret (BURN_DDP_SECRET) of this job";
/// The reason a responder gives a peer whose proof does not verify.
const WRONG_PROOF_REASON: &str = "this process's proof does not match the job secret: its \
     BURN_DDP_SECRET differs, or it replays another connection's handshake";

impl AdmissionError {
    /// Whether the peer closed the connection before its verdict, without refusing: a store
    /// sheds unadmitted connections under a flood, so this is worth dialling again.
    pub(crate) fn dropped_by_peer(&self) -> bool {
        use io::ErrorKind::*;
        matches!(self, AdmissionError::Io { step, source }
            if [READING_CHALLENGE, READING_VERDICT].contains(step)
                && matches!(source.kind(), UnexpectedEof | ConnectionReset | BrokenPipe | ConnectionAborted))
    }
}

const READING_CHALLENGE: &str = "reading the peer's challenge";
const READING_VERDICT: &str = "reading the verdict";

/// One side of a handshake.
pub(crate) struct Side<'a> {
    /// What the connection is for.
    pub domain: Domain,
    /// First bytes of both sides' first message: the protocol and its version.
    pub magic: &'static [u8],
    /// The job secret; `None`: admit everyone, prove nothing.
    pub secret: Option<&'a JobSecret>,
    /// What this side says it is (covered by both proofs), at most 64 bytes.
    pub claims: &'a [u8],
}

/// The responder's view of an initiator whose proof verified (or of anyone, without a secret):
/// the caller checks its claims, then admits or refuses it.
#[must_use = "the peer waits for a verdict: admit or refuse it"]
pub(crate) struct Verified {
    /// What the initiator says it is.
    pub claims: Vec<u8>,
}

impl Verified {
    /// Tells the peer it is admitted; the stream is left without timeouts.
    pub(crate) fn admit(self, stream: &TcpStream) -> io::Result<()> {
        write_frame(&mut &*stream, b"")?;
        stream.set_read_timeout(None)?;
        stream.set_write_timeout(None)
    }

    /// Tells the peer why it is refused (best effort).
    pub(crate) fn refuse(self, stream: &TcpStream, reason: &str) {
        refuse(stream, reason);
    }
}

fn refuse(stream: &TcpStream, reason: &str) {
    let reason = &reason.as_bytes()[..reason.len().min(MAX_VERDICT)];
    let _ = write_frame(&mut &*stream, reason);
}

/// Both nonces and claims: what the proofs cover.
struct Transcript<'a> {
    domain: Domain,
    claims_i: &'a [u8],
    claims_r: &'a [u8],
    nonce_i: &'a [u8; LEN],
    nonce_r: &'a [u8; LEN],
}

impl Transcript<'_> {
    /// The MAC of `direction` (`initiator` or `responder`) over the transcript.
    fn mac(&self, secret: &JobSecret, direction: &[u8]) -> Hmac<Sha256> {
        let mut w = Writer::default();
        w.bytes(LABEL)
            .bytes(self.domain.label())
            .bytes(direction)
            .bytes(self.claims_i)
            .bytes(self.claims_r)
            .bytes(self.nonce_i)
            .bytes(self.nonce_r);
        let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(secret.as_bytes())
            .expect("HMAC takes keys of any length");
        mac.update(&w.buf);
        mac
    }

    fn proof(&self, secret: &JobSecret, direction: &[u8]) -> [u8; LEN] {
        self.mac(secret, direction).finalize().into_bytes().into()
    }

    fn verify(&self, secret: &JobSecret, direction: &[u8], proof: &[u8]) -> bool {
        self.mac(secret, direction).verify_slice(proof).is_ok()
    }
}

/// A fresh nonce from the operating system.
fn nonce() -> Result<[u8; LEN], AdmissionError> {
    let mut n = [0u8; LEN];
    getrandom::fill(&mut n).map_err(|e| AdmissionError::Random(e.to_string()))?;
    Ok(n)
}

/// Reads from a stream until a deadline, however slowly the peer trickles bytes.
struct Before<'a> {
    stream: &'a TcpStream,
    deadline: Instant,
}

impl Read for Before<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the handshake did not complete in time",
            ));
        }
        self.stream.set_read_timeout(Some(left))?;
        (&mut &*self.stream).read(buf)
    }
}

impl Before<'_> {
    fn exact<const N: usize>(&mut self, step: &'static str) -> Result<[u8; N], AdmissionError> {
        let mut b = [0u8; N];
        self.read_exact(&mut b)
            .map_err(|source| AdmissionError::Io { step, source })?;
        Ok(b)
    }

    /// The peer's magic and claims; `Err(NotBurnDdp)` on another magic.
    fn magic_and_claims(
        &mut self,
        me: &Side<'_>,
        step: &'static str,
    ) -> Result<Vec<u8>, AdmissionError> {
        let io = |source| AdmissionError::Io { step, source };
        let mut magic = vec![0u8; me.magic.len()];
        self.read_exact(&mut magic).map_err(io)?;
        if magic != me.magic {
            return Err(AdmissionError::NotBurnDdp { domain: me.domain });
        }
        let [n] = self.exact::<1>(step)?;
        if n as usize > MAX_CLAIMS {
            return Err(AdmissionError::Malformed(format!(
                "claims of {n} bytes exceed {MAX_CLAIMS}"
            )));
        }
        let mut claims = vec![0u8; n as usize];
        self.read_exact(&mut claims).map_err(io)?;
        Ok(claims)
    }

    /// Writes `bytes` within the deadline.
    fn send(&self, bytes: &[u8], step: &'static str) -> Result<(), AdmissionError> {
        let io = |source| AdmissionError::Io { step, source };
        let left = self.deadline.saturating_duration_since(Instant::now());
        let left = left.max(std::time::Duration::from_millis(1));
        self.stream.set_write_timeout(Some(left)).map_err(io)?;
        (&mut &*self.stream).write_all(bytes).map_err(io)
    }
}

fn opening(me: &Side<'_>) -> Writer {
    let mut w = Writer::default();
    w.buf.extend_from_slice(me.magic);
    debug_assert!(me.claims.len() <= MAX_CLAIMS, "claims too long");
    w.u8(me.claims.len() as u8);
    w.buf.extend_from_slice(me.claims);
    w
}

/// Opens a connection's admission as the connecting side: proves the secret only to a peer that
/// proved it first. Returns the peer's claims once admitted; the stream is then left without
/// timeouts.
pub(crate) fn initiate(
    stream: &TcpStream,
    me: &Side<'_>,
    deadline: Instant,
) -> Result<Vec<u8>, AdmissionError> {
    let mut input = Before { stream, deadline };
    let nonce_i = nonce()?;
    let mut hello = opening(me);
    hello.buf.extend_from_slice(&nonce_i);
    input.send(&hello.buf, "sending the hello")?;

    let claims_r = input.magic_and_claims(me, READING_CHALLENGE)?;
    let [has_secret] = input.exact::<1>(READING_CHALLENGE)?;
    let nonce_r = input.exact::<LEN>(READING_CHALLENGE)?;
    let proof_r = input.exact::<LEN>(READING_CHALLENGE)?;
    let transcript = Transcript {
        domain: me.domain,
        claims_i: me.claims,
        claims_r: &claims_r,
        nonce_i: &nonce_i,
        nonce_r: &nonce_r,
    };
    let mut answer = [0u8; 1 + LEN];
    match me.secret {
        None => answer[0] = code::NO_SECRET,
        Some(secret) => {
            if has_secret != 1 || !transcript.verify(secret, b"responder", &proof_r) {
                answer[0] = code::UNPROVEN;
                let _ = input.send(&answer, "sending the answer");
                return Err(AdmissionError::Unproven {
                    domain: me.domain,
                    peer_has_secret: has_secret == 1,
                });
            }
            answer[0] = code::PROOF;
            answer[1..].copy_from_slice(&transcript.proof(secret, b"initiator"));
        }
    }
    input.send(&answer, "sending the answer")?;

    let verdict = read_frame(&mut input, MAX_VERDICT).map_err(|e| AdmissionError::Io {
        step: READING_VERDICT,
        source: match e {
            FrameError::Io(e) => e,
            FrameError::Closed => io::Error::new(io::ErrorKind::UnexpectedEof, "closed"),
            other => io::Error::new(io::ErrorKind::InvalidData, other.to_string()),
        },
    })?;
    if !verdict.is_empty() {
        return Err(AdmissionError::Refused {
            reason: String::from_utf8_lossy(&verdict).into_owned(),
        });
    }
    let reset = |source| AdmissionError::Io {
        step: "configuring the socket",
        source,
    };
    stream.set_read_timeout(None).map_err(reset)?;
    stream.set_write_timeout(None).map_err(reset)?;
    Ok(claims_r)
}

/// Answers a connection's admission as the accepting side: challenges the initiator, proves the
/// secret, and checks the initiator's proof. A peer that does not hold the secret is refused
/// here (and told why); a verified one is left for the caller to admit or refuse.
pub(crate) fn respond(
    stream: &TcpStream,
    me: &Side<'_>,
    deadline: Instant,
) -> Result<Verified, AdmissionError> {
    let mut input = Before { stream, deadline };
    const HELLO: &str = "reading the hello";
    let claims_i = input.magic_and_claims(me, HELLO).map_err(|e| match e {
        AdmissionError::NotBurnDdp { .. } => {
            AdmissionError::Malformed("bad hello: not a burn-ddp client of this version".into())
        }
        other => other,
    })?;
    let nonce_i = input.exact::<LEN>(HELLO)?;

    let nonce_r = nonce()?;
    let transcript = Transcript {
        domain: me.domain,
        claims_i: &claims_i,
        claims_r: me.claims,
        nonce_i: &nonce_i,
        nonce_r: &nonce_r,
    };
    let mut challenge = opening(me);
    challenge.u8(me.secret.is_some() as u8);
    challenge.buf.extend_from_slice(&nonce_r);
    let proof_r = me
        .secret
        .map_or([0u8; LEN], |s| transcript.proof(s, b"responder"));
    challenge.buf.extend_from_slice(&proof_r);
    input.send(&challenge.buf, "sending the challenge")?;

    let answer = input.exact::<{ 1 + LEN }>("reading the answer")?;
    let Some(secret) = me.secret else {
        return match answer[0] {
            code::PROOF | code::NO_SECRET => Ok(Verified { claims: claims_i }),
            code::UNPROVEN => Err(AdmissionError::Distrusted),
            other => Err(AdmissionError::Malformed(format!("unknown answer {other}"))),
        };
    };
    let refusal = match answer[0] {
        code::PROOF if transcript.verify(secret, b"initiator", &answer[1..]) => {
            return Ok(Verified { claims: claims_i });
        }
        code::PROOF => (AdmissionError::WrongProof, WRONG_PROOF_REASON),
        code::NO_SECRET => (AdmissionError::NoSecret, NO_SECRET_REASON),
        code::UNPROVEN => (AdmissionError::Distrusted, WRONG_PROOF_REASON),
        other => {
            let e = AdmissionError::Malformed(format!("unknown answer {other}"));
            (e, "malformed handshake")
        }
    };
    refuse(stream, refusal.1);
    Err(refusal.0)
}

#[cfg(test)]
mod tests;

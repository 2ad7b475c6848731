//! Why two processes did not admit each other ([`AdmissionError`]) and what their connection
//! was for ([`Domain`]): the handshake's errors (`secret/handshake.rs`), here so that the
//! crate's errors sit below everything that returns them.

use std::io;

/// What a connection is for; part of every proof, so a proof made for one never counts for
/// the other.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Domain {
    /// A store client and the store.
    Store,
    /// Two ranks' data-plane connection.
    DataPlane,
}

impl Domain {
    pub(crate) fn label(self) -> &'static [u8] {
        match self {
            Domain::Store => b"store",
            Domain::DataPlane => b"data plane",
        }
    }

    /// The responder, and what else it may be, in words (as the initiator names it).
    fn responder(self) -> (&'static str, &'static str) {
        match self {
            Domain::Store => ("the store", "it is not this job's store"),
            Domain::DataPlane => ("the peer", "it is not one of this job's ranks"),
        }
    }
}

/// Why two processes did not admit each other.
#[derive(thiserror::Error)]
pub enum AdmissionError {
    /// The peer did not prove that it holds the job secret, so this process did not trust it
    /// (and sent nothing that depends on the secret).
    #[error(
        "{} could not prove it knows the job secret ({}): either BURN_DDP_SECRET differs \
         between the two, or {}",
        domain.responder().0,
        if *peer_has_secret { "its proof is wrong" } else { "it has none" },
        domain.responder().1
    )]
    Unproven {
        /// What the connection is for.
        domain: Domain,
        /// Whether the peer claimed to hold a secret at all.
        peer_has_secret: bool,
    },
    /// The peer refused this process, for the reason it gave.
    #[error("refused: {reason}")]
    Refused {
        /// The peer's reason.
        reason: String,
    },
    /// The peer holds no secret, this process does (a responder's view).
    #[error("it does not present the job secret (BURN_DDP_SECRET)")]
    NoSecret,
    /// The peer's proof does not verify (a responder's view).
    #[error(
        "its proof does not match the job secret (it holds another BURN_DDP_SECRET, or \
         replays a recorded handshake)"
    )]
    WrongProof,
    /// The peer did not accept this process's proof (a responder's view).
    #[error(
        "it did not accept this process's proof (it holds another BURN_DDP_SECRET, or this \
         process holds none)"
    )]
    Distrusted,
    /// The responder does not speak this protocol (another program, or another burn-ddp
    /// version); a responder reports such an initiator as [`AdmissionError::Malformed`].
    #[error("{}", match domain {
        Domain::Store => "the server is not a burn-ddp store (bad hello); is another program using this port?",
        Domain::DataPlane => "not a burn-ddp peer of this version (bad hello)",
    })]
    NotBurnDdp {
        /// What the connection is for.
        domain: Domain,
    },
    /// A message of the peer does not decode.
    #[error("malformed handshake: {0}")]
    Malformed(String),
    /// The socket failed, the peer closed it, or the deadline passed.
    #[error("{step}: {source}")]
    Io {
        /// What was being done.
        step: &'static str,
        /// The operating system's error.
        #[source]
        source: io::Error,
    },
    /// The operating system's random generator failed.
    #[error("drawing a nonce: {0}")]
    Random(String),
}

super::debug_as_display!(AdmissionError);

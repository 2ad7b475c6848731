//! The handshake between two sockets of this process: every combination of secrets, claims
//! exchanged, proofs bound to their direction, domain, claims and nonces, bounded reads.

use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use super::*;

const MAGIC: &[u8] = b"test magic";

fn pair() -> (TcpStream, TcpStream) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    (c, l.accept().unwrap().0)
}

fn soon() -> Instant {
    Instant::now() + Duration::from_secs(5)
}

type Outcome = Result<Vec<u8>, AdmissionError>;

/// Runs a handshake between an initiator and a responder (which admits whom it verified).
fn handshake(
    (secret_i, domain_i): (Option<&JobSecret>, Domain),
    (secret_r, domain_r): (Option<&JobSecret>, Domain),
) -> (Outcome, Outcome) {
    let (c, s) = pair();
    std::thread::scope(|scope| {
        let responder = scope.spawn(move || {
            let me = Side {
                domain: domain_r,
                magic: MAGIC,
                secret: secret_r,
                claims: b"responder",
            };
            let v = respond(&s, &me, soon())?;
            let claims = v.claims.clone();
            v.admit(&s).unwrap();
            Ok(claims)
        });
        let me = Side {
            domain: domain_i,
            magic: MAGIC,
            secret: secret_i,
            claims: b"initiator",
        };
        let out = initiate(&c, &me, soon());
        drop(c);
        (out, responder.join().unwrap())
    })
}

fn secrets() -> (JobSecret, JobSecret) {
    (
        JobSecret::generate().unwrap(),
        JobSecret::generate().unwrap(),
    )
}

#[test]
fn holders_of_the_same_secret_admit_each_other_and_exchange_claims() {
    let (a, _) = secrets();
    let (i, r) = handshake((Some(&a), Domain::Store), (Some(&a), Domain::Store));
    assert_eq!(i.unwrap(), b"responder");
    assert_eq!(r.unwrap(), b"initiator");
    let (i, r) = handshake((None, Domain::Store), (None, Domain::Store));
    assert_eq!(
        (i.unwrap(), r.unwrap()),
        (b"responder".to_vec(), b"initiator".to_vec())
    );
}

#[test]
fn a_wrong_secret_is_refused_on_both_sides() {
    let (a, b) = secrets();
    let (i, r) = handshake((Some(&b), Domain::Store), (Some(&a), Domain::Store));
    assert!(
        matches!(
            i,
            Err(AdmissionError::Unproven {
                peer_has_secret: true,
                ..
            })
        ),
        "{i:?}"
    );
    assert!(matches!(r, Err(AdmissionError::Distrusted)), "{r:?}");
    let shown = i.unwrap_err().to_string();
    assert!(
        shown.contains("the store could not prove it knows the job secret"),
        "{shown}"
    );
    assert!(shown.contains("BURN_DDP_SECRET"), "{shown}");
}

#[test]
fn a_side_without_the_secret_is_refused_and_told_why() {
    let (a, _) = secrets();
    let (i, r) = handshake((None, Domain::Store), (Some(&a), Domain::Store));
    match i {
        Err(AdmissionError::Refused { reason }) => assert!(reason.contains("BURN_DDP_SECRET")),
        other => panic!("{other:?}"),
    }
    assert!(matches!(r, Err(AdmissionError::NoSecret)), "{r:?}");
    // A responder without a secret proves nothing: a holder does not trust it.
    let (i, r) = handshake((Some(&a), Domain::Store), (None, Domain::Store));
    assert!(
        matches!(
            i,
            Err(AdmissionError::Unproven {
                peer_has_secret: false,
                ..
            })
        ),
        "{i:?}"
    );
    assert!(matches!(r, Err(AdmissionError::Distrusted)), "{r:?}");
}

#[test]
fn a_proof_counts_for_its_domain_only() {
    let (a, _) = secrets();
    let (i, r) = handshake((Some(&a), Domain::Store), (Some(&a), Domain::DataPlane));
    assert!(matches!(i, Err(AdmissionError::Unproven { .. })), "{i:?}");
    assert!(matches!(r, Err(AdmissionError::Distrusted)), "{r:?}");
}

#[test]
fn proofs_depend_on_direction_nonces_claims_and_secret() {
    let (a, b) = secrets();
    let (n1, n2) = ([1u8; LEN], [2u8; LEN]);
    let t = Transcript {
        domain: Domain::DataPlane,
        claims_i: b"rank 1",
        claims_r: b"rank 0",
        nonce_i: &n1,
        nonce_r: &n2,
    };
    let responder = t.proof(&a, b"responder");
    assert!(t.verify(&a, b"responder", &responder));
    // Reflected: the responder's proof is no initiator's proof.
    assert!(!t.verify(&a, b"initiator", &responder));
    assert!(!t.verify(&b, b"responder", &responder));
    assert!(!t.verify(&a, b"responder", &responder[..LEN - 1]));
    let swapped = Transcript {
        nonce_i: &n2,
        nonce_r: &n1,
        ..t
    };
    assert!(!swapped.verify(&a, b"responder", &responder));
    let other_claims = Transcript {
        claims_i: b"rank 2",
        ..t
    };
    assert!(!other_claims.verify(&a, b"responder", &responder));
    // The proof is not the secret, nor does it contain it.
    let hay = [responder.as_slice(), &t.proof(&a, b"initiator")].concat();
    assert!(
        !hay.windows(16)
            .any(|w| a.as_bytes().windows(16).any(|s| s == w))
    );
}

#[test]
fn oversized_claims_and_silent_peers_end_within_bounds() {
    let (a, _) = secrets();
    let me = Side {
        domain: Domain::Store,
        magic: MAGIC,
        secret: Some(&a),
        claims: &[],
    };
    let (mut c, s) = pair();
    c.write_all(&[MAGIC, &[255u8]].concat()).unwrap();
    let e = respond(&s, &me, soon()).err().unwrap();
    assert!(matches!(e, AdmissionError::Malformed(_)), "{e:?}");
    let (mut c, s) = pair();
    c.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
    let e = respond(&s, &me, soon()).err().unwrap();
    assert!(e.to_string().contains("not a burn-ddp client"), "{e}");

    // A peer that never answers: the deadline ends the handshake, whatever the socket.
    let (_c, s) = pair();
    let start = Instant::now();
    let deadline = start + Duration::from_millis(300);
    let e = initiate(&s, &me, deadline).unwrap_err();
    assert!(matches!(e, AdmissionError::Io { .. }), "{e:?}");
    assert!(
        start.elapsed() < Duration::from_secs(3),
        "{:?}",
        start.elapsed()
    );
}

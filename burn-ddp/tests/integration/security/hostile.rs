//! Hostile peers of the store: a fake store that records what a rank sends (the secret never
//! appears), a client with the wrong secret or none, a handshake recorded and replayed in
//! either direction, and an admitted client that sends malformed frames. Each meets a named
//! error; the store goes on serving the job's clients.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use burn_ddp::secret::{AdmissionError, JobSecret};
use burn_ddp::store::{Store, StoreServer};
use burn_ddp::{DdpError, ProcessGroup};

use super::relay::{Relay, fake_store};
use super::watch::{keep_warnings, warning, watch_allocations_of, watched_allocation};
use super::{admission, assert_pair_reduces, pair_met_first_by, secured_store, store_holding};
use crate::common::{STORE_CHALLENGE_LEN, STORE_HELLO, options, store_answer, store_hello};

const T: Duration = Duration::from_secs(5);

/// Whether any 12 bytes of the secret, as text, as its hex or as the bytes its hex stands
/// for, appear in `bytes`.
fn leaks(secret: &JobSecret, bytes: &[u8]) -> bool {
    let text = secret.to_env_value().into_bytes();
    let hex: Vec<u8> = text
        .iter()
        .flat_map(|b| format!("{b:02x}").into_bytes())
        .collect();
    let raw: Vec<u8> = (0..text.len() / 2)
        .filter_map(|i| {
            u8::from_str_radix(std::str::from_utf8(&text[2 * i..2 * i + 2]).ok()?, 16).ok()
        })
        .collect();
    [text, hex, raw]
        .iter()
        .any(|form| form.windows(12).any(|w| bytes.windows(12).any(|b| b == w)))
}

/// A rank of a world of 2 whose store is at `port`, holding `secret`.
fn rank(rank: usize, port: u16, secret: &JobSecret) -> burn_ddp::Result<ProcessGroup> {
    super::join(rank, 2, port, secret, options(10))
}

fn is_unproven_store(e: &DdpError) -> bool {
    matches!(admission(e), Some(AdmissionError::Unproven { .. }))
        && e.to_string()
            .contains("the store could not prove it knows the job secret")
        && e.to_string().contains("BURN_DDP_SECRET")
}

#[test]
fn a_rank_pointed_at_a_fake_store_never_sends_the_secret() {
    keep_warnings();
    let secret = JobSecret::generate().unwrap();
    assert!(
        leaks(&secret, secret.to_env_value().as_bytes()),
        "the check finds the secret"
    );

    // A fake that speaks the protocol as far as it can: a challenge with a made-up proof.
    let forged = [STORE_HELLO, &[0, 1], &[0x5a; 64]].concat();
    let (fake, received) = fake_store(forged);
    let start = Instant::now();
    let e = rank(1, fake.port(), &secret).unwrap_err();
    assert!(is_unproven_store(&e), "{e}");
    assert!(start.elapsed() < T, "took {:?}", start.elapsed());

    // A real store holding another secret, behind a recording relay.
    let other = store_holding(&JobSecret::generate().unwrap());
    let relay = Relay::start(other.local_addr());
    let e = rank(1, relay.addr().port(), &secret).unwrap_err();
    assert!(is_unproven_store(&e), "{e}");
    let conn = &relay.conns()[0];
    let seen_as = conn.seen_as().to_string();
    let line = warning(
        &["refused the connection from", &seen_as, "did not accept"],
        T,
    );
    assert!(
        line.is_some(),
        "the store did not log which connection it refused"
    );

    // The job's own store behind the relay: a whole group forms and reduces through it.
    let server = store_holding(&secret);
    let relay_ok = Relay::start(server.local_addr());
    let port = relay_ok.addr().port();
    let pair = std::thread::scope(|s| {
        let rank1 = s.spawn(|| rank(1, port, &secret).unwrap());
        [rank(0, port, &secret).unwrap(), rank1.join().unwrap()]
    });
    assert_pair_reduces(&pair);

    let mut recorded: Vec<Vec<u8>> = received.lock().unwrap().clone();
    for c in relay.conns().iter().chain(&relay_ok.conns()) {
        recorded.extend([c.sent(), c.received()]);
    }
    assert!(recorded.len() >= 5 && recorded.iter().any(|b| b.len() > 100));
    for (i, bytes) in recorded.iter().enumerate() {
        assert!(
            !leaks(&secret, bytes),
            "connection record {i} carries the secret"
        );
    }
}

/// Opens a raw connection to `addr`, sends a hello and `answer`; returns the server's bytes
/// after its challenge (the verdict and anything after) and this side's address.
fn raw_admission(addr: std::net::SocketAddr, answer: &[u8]) -> (Vec<u8>, String) {
    let mut c = TcpStream::connect(addr).unwrap();
    c.set_read_timeout(Some(T)).unwrap();
    c.write_all(&[store_hello(), answer.to_vec()].concat())
        .unwrap();
    let mut all = Vec::new();
    let _ = c.read_to_end(&mut all);
    assert!(all.len() >= STORE_CHALLENGE_LEN, "no challenge: {all:?}");
    (
        all[STORE_CHALLENGE_LEN..].to_vec(),
        c.local_addr().unwrap().to_string(),
    )
}

#[test]
fn clients_without_the_secret_are_refused_and_the_store_serves_on() {
    keep_warnings();
    let (secret, server) = secured_store();
    let addr = server.local_addr();
    let early = Store::connect_with_secret(&addr.to_string(), T, Some(&secret)).unwrap();

    let wrong = JobSecret::generate().unwrap();
    let e = Store::connect_with_secret(&addr.to_string(), T, Some(&wrong)).unwrap_err();
    assert!(is_unproven_store(&e), "{e}");

    // A made-up proof, and no secret at all: refused with the reason, logged with the address.
    for (code, reason, logged) in [
        (
            1,
            "does not match the job secret",
            "its proof does not match",
        ),
        (
            2,
            "does not present the job secret",
            "does not present the job secret",
        ),
    ] {
        let (verdict, me) = raw_admission(addr, &store_answer(code, [0x42; 32]));
        let text = String::from_utf8_lossy(&verdict);
        assert!(verdict.len() > 4 && text.contains(reason), "{text}");
        let line = warning(&["refused the connection from", &me, logged], T);
        assert!(line.is_some(), "no warning names {me}");
    }

    early.set("still", b"served").unwrap();
    let late = Store::connect_with_secret(&addr.to_string(), T, Some(&secret)).unwrap();
    assert_eq!(late.get("still").unwrap(), b"served");
}

#[test]
fn a_recorded_handshake_replayed_is_refused_both_ways() {
    let (secret, server) = secured_store();
    let relay = Relay::start(server.local_addr());
    let client = Store::connect_with_secret(&relay.addr().to_string(), T, Some(&secret)).unwrap();
    assert_eq!(client.add("replayed", 1).unwrap(), 1);
    drop(client);
    let conn = relay.conns()[0].clone();
    assert!(conn.wait_server_closed(T));
    let (sent, received) = (conn.sent(), conn.received());

    // The client's side replayed to the server: its old proof does not answer a new nonce.
    let mut c = TcpStream::connect(server.local_addr()).unwrap();
    c.set_read_timeout(Some(T)).unwrap();
    c.write_all(&sent).unwrap();
    let mut answer = Vec::new();
    let _ = c.read_to_end(&mut answer);
    let after = &answer[STORE_CHALLENGE_LEN.min(answer.len())..];
    let len = after
        .get(..4)
        .map_or(0, |l| u32::from_le_bytes(l.try_into().unwrap()) as usize);
    assert!(
        len > 0 && after.len() == 4 + len,
        "not one refusal: {after:?}"
    );
    assert!(
        String::from_utf8_lossy(&after[4..]).contains("replays"),
        "{after:?}"
    );
    let check = Store::connect_with_secret(&server.local_addr().to_string(), T, Some(&secret));
    assert_eq!(
        check.unwrap().add("replayed", 0).unwrap(),
        1,
        "the replayed add ran"
    );

    // The server's side replayed to a new client: its old proof does not answer a new nonce.
    let (fake, _) = fake_store(received);
    let e = Store::connect_with_secret(&fake.to_string(), T, Some(&secret)).unwrap_err();
    assert!(is_unproven_store(&e), "{e}");
}

#[test]
fn an_admitted_client_sending_malformed_frames_meets_named_errors() {
    keep_warnings();
    let (secret, server) = secured_store();
    let addr = server.local_addr().to_string();
    let bystander = Store::connect_with_secret(&addr, T, Some(&secret)).unwrap();
    let relay = Relay::start(server.local_addr());
    // Under the 64 MiB frame limit, and a size no other test allocates.
    const DECLARED: u32 = 61_234_567;
    watch_allocations_of(DECLARED as usize);

    let truncated = [&DECLARED.to_le_bytes()[..], b"ten bytes!"].concat();
    let cases: [(&str, Vec<u8>, &str); 4] = [
        (
            "wrong op",
            vec![3, 0, 0, 0, 99, 1, 2],
            "unknown request code 99",
        ),
        (
            "u32::MAX length",
            vec![0xff; 4],
            "frame of 4294967295 bytes exceeds",
        ),
        (
            "u64::MAX length",
            vec![0xff; 8],
            "frame of 4294967295 bytes exceeds",
        ),
        (
            "truncated, then closed",
            truncated,
            "closed after 10 of 61234567 frame bytes",
        ),
    ];
    for (i, (what, bytes, named)) in cases.into_iter().enumerate() {
        let victim = Store::connect_with_secret(&relay.addr().to_string(), T, Some(&secret));
        let victim = victim.unwrap();
        let conn = relay.conns()[i].clone();
        let admitted = conn.received().len();
        conn.inject(&bytes);
        if what.starts_with("truncated") {
            conn.close_towards_server();
            let line = warning(&["store: client", &conn.seen_as().to_string(), named], T);
            assert!(line.is_some(), "{what}: no warning names the connection");
        } else {
            assert!(
                conn.wait_server_closed(T),
                "{what}: the server kept the connection"
            );
            let answer = String::from_utf8_lossy(&conn.received()[admitted..]).into_owned();
            assert!(answer.contains(named), "{what}: answered {answer:?}");
        }
        assert!(
            conn.wait_server_closed(T),
            "{what}: the server kept the connection"
        );
        // The client whose connection was abused fails with a named error, not a hang.
        let e = victim.set("k", b"v").unwrap_err().to_string();
        assert!(e.contains("store at"), "{what}: {e}");
        // Everyone else is served.
        bystander.set(what, b"ok").unwrap();
        assert_eq!(bystander.get(what).unwrap(), b"ok");
    }
    assert_eq!(
        watched_allocation(),
        None,
        "allocated the size a frame announced"
    );
}

#[test]
fn a_client_that_asks_too_much_of_the_store_is_refused_and_the_store_serves_on() {
    let server = StoreServer::bind("127.0.0.1:0").unwrap();
    let addr = server.local_addr().to_string();
    let hostile = Store::connect(&addr, T).unwrap();
    let honest = Store::connect(&addr, T).unwrap();
    // A wait for 100 000 keys (each scanned on every write while it waits) is refused.
    let keys: Vec<String> = (0..100_000).map(|i| format!("k{i}")).collect();
    let started = Instant::now();
    let refused = hostile.wait(&keys, Duration::from_secs(30));
    assert!(refused.is_err(), "a wait for 100 000 keys was accepted");
    assert!(
        started.elapsed() < T,
        "refused only after {:?}",
        started.elapsed()
    );
    // A value above the frame limit is refused by the client before anything is sent.
    let big = vec![0u8; 65 << 20];
    let e = honest.set("big", &big).unwrap_err().to_string();
    assert!(e.contains("exceeds the store's limit"), "{e}");
    honest.set("still", b"served").unwrap();
    assert_eq!(honest.get("still").unwrap(), b"served");
}

#[test]
fn silent_connections_do_not_hold_up_the_rendezvous() {
    // The silent connections are the first rank 0 meets.
    let (silent, took) = pair_met_first_by(|addr0| {
        let addr0: std::net::SocketAddr = String::from_utf8_lossy(addr0).parse().unwrap();
        // Four connections that never say a word (each may take 10 s before it is refused).
        let silent: Vec<TcpStream> = (0..4).map(|_| TcpStream::connect(addr0).unwrap()).collect();
        std::thread::sleep(Duration::from_millis(200));
        silent
    });
    assert!(
        took < Duration::from_secs(5),
        "the rendezvous took {took:?} behind four silent connections"
    );
    drop(silent);
}

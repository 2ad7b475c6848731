//! The store's bounds against an admitted client (one holding the job secret): how many keys
//! and bytes it holds, measured in the memory of a store served by another process; waits
//! that wake for their own keys only; and a long wait that does not hold up the other requests
//! of the same client.

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use burn_ddp::secret::JobSecret;
use burn_ddp::store::{Store, StoreServer};

const T: Duration = Duration::from_secs(10);
/// The test below, which this binary runs as the store's own process.
const SERVE_ENTRY: &str = "store::limits::serve_a_store_for_the_test_that_started_this_process";
const SECRET_VAR: &str = "BDDP_TEST_STORE_SECRET";
/// Most keys the store holds (`MAX_KEYS` in `store/entries.rs`, named in its refusal).
const KEY_CAP: usize = 1 << 20;
/// What the store counts for an entry besides its key and value (`ENTRY_COST` there).
const ENTRY_COST: u64 = 160;

/// Not a test: serves a store holding the secret in [`SECRET_VAR`] for the test that started
/// this process, prints its address and serves until its standard input closes (at most 120 s).
#[test]
#[ignore = "the store's process of the tests below"]
fn serve_a_store_for_the_test_that_started_this_process() {
    let Ok(secret) = std::env::var(SECRET_VAR) else {
        return;
    };
    let secret = JobSecret::new(secret).unwrap();
    let server = StoreServer::bind_with_secret("127.0.0.1:0", Some(secret)).unwrap();
    println!("STORE_AT {}", server.local_addr());
    let (closed, stdin_closed) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = std::io::stdin().read_to_end(&mut Vec::new());
        let _ = closed.send(());
    });
    let _ = stdin_closed.recv_timeout(Duration::from_secs(120));
}

/// A store served by a child process (so that its memory is its own); killed when dropped.
struct StoreProcess {
    child: Child,
    addr: String,
}

impl StoreProcess {
    fn start(secret: &JobSecret) -> Self {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", SERVE_ENTRY, "--ignored", "--nocapture"])
            .args(["--test-threads=1"])
            .env(SECRET_VAR, secret.to_env_value())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let out = BufReader::new(child.stdout.take().unwrap());
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in out.lines().map_while(Result::ok) {
                // libtest prints the test's name on the same line first.
                if let Some((_, addr)) = line.split_once("STORE_AT ") {
                    let _ = tx.send(addr.trim().to_string());
                }
            }
        });
        let mut this = StoreProcess {
            child,
            addr: String::new(),
        };
        this.addr = rx
            .recv_timeout(Duration::from_secs(30))
            .expect("the store's address");
        this
    }

    /// The store process's resident memory, in bytes.
    fn rss(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap();
        let kib = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .expect("VmRSS in /proc/<pid>/status");
        kib * 1024
    }
}

impl Drop for StoreProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The `i`-th of 16 777 216 distinct 4-byte keys.
fn tiny_key(i: usize) -> [u8; 4] {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    [0, 6, 12, 18].map(|shift| ALPHABET[(i >> shift) & 63])
}

/// A whole set request frame: `key` to the empty value.
fn set_frame(key: &[u8]) -> Vec<u8> {
    let mut body = vec![1u8];
    body.extend_from_slice(&(key.len() as u32).to_le_bytes());
    body.extend_from_slice(key);
    body.extend_from_slice(&0u32.to_le_bytes());
    [&(body.len() as u32).to_le_bytes()[..], &body].concat()
}

/// The next answer on `c`: `Ok` for OK, else the text of the error (or what else came).
fn read_answer(c: &mut impl Read) -> Result<(), String> {
    let mut len = [0u8; 4];
    c.read_exact(&mut len).expect("an answer's length");
    let mut body = vec![0u8; u32::from_le_bytes(len) as usize];
    c.read_exact(&mut body).expect("an answer");
    match body.first() {
        Some(100) => Ok(()),
        Some(104) => Err(String::from_utf8_lossy(body.get(5..).unwrap_or_default()).into()),
        _ => Err(format!("unexpected answer {body:?}")),
    }
}

/// An admitted client sets 4-byte keys with empty values (the cheapest entries to send, the
/// dearest to hold), many requests per write, until refused: the refusal names the key limit
/// and comes before the store's memory grew by more than it counts for what it holds.
#[test]
fn tiny_keys_meet_a_named_cap_before_the_store_outgrows_what_it_counts() {
    const BATCH: usize = 4096;
    let give_up = KEY_CAP + KEY_CAP / 4;
    let secret = JobSecret::generate().unwrap();
    let server = StoreProcess::start(&secret);
    let honest = Store::connect_with_secret(&server.addr, T, Some(&secret)).unwrap();
    honest.set("before", b"v").unwrap();
    let flooder = Store::connect_with_secret(&server.addr, T, Some(&secret)).unwrap();
    let mut conn = flooder
        .into_admitted_stream()
        .expect("the flooder's connection");
    conn.set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let mut answers = BufReader::new(conn.try_clone().unwrap());
    let before = server.rss();
    let started = Instant::now();
    let (mut stored, mut refusal) = (0usize, None::<String>);
    let mut sent = 0;
    while refusal.is_none() && sent < give_up {
        let batch: Vec<u8> = (sent..sent + BATCH)
            .flat_map(|i| set_frame(&tiny_key(i)))
            .collect();
        conn.write_all(&batch).unwrap();
        sent += BATCH;
        for _ in 0..BATCH {
            match read_answer(&mut answers) {
                Ok(()) if refusal.is_none() => stored += 1,
                Ok(()) => panic!("a set was accepted after a refusal"),
                Err(e) => drop(refusal.get_or_insert(e)),
            }
        }
    }
    let after = server.rss();
    let grown = after.saturating_sub(before);
    let counted = stored as u64 * (ENTRY_COST + 4);
    println!(
        "stored {stored} keys of 4 bytes in {:.1?}; the store's RSS {} -> {} MiB (+{} MiB, \
         {} bytes per key; the store counts {} per key: {} MiB); refusal: {refusal:?}",
        started.elapsed(),
        before >> 20,
        after >> 20,
        grown >> 20,
        grown / stored.max(1) as u64,
        ENTRY_COST + 4,
        counted >> 20,
    );
    let refusal = refusal.unwrap_or_else(|| {
        panic!(
            "no refusal after {stored} keys of 4 bytes: the store grew by {} MiB, {} bytes per \
             key, while counting 4",
            grown >> 20,
            grown / stored.max(1) as u64
        )
    });
    assert!(refusal.contains("1048576 keys"), "{refusal}");
    assert_eq!(stored + 1, KEY_CAP, "keys set besides \"before\"");
    assert!(
        grown <= counted,
        "the store grew by {grown} bytes while counting {counted} for its keys"
    );
    // The store serves on: its keys are read, replaced; a new key is refused by name.
    assert_eq!(honest.get("before").unwrap(), b"v");
    honest.set("before", b"w").unwrap();
    assert_eq!(honest.get("before").unwrap(), b"w");
    let e = honest.set("one more", b"").unwrap_err().to_string();
    assert!(e.contains("1048576 keys"), "{e}");
}

/// A client's long wait (on one thread) leaves its other requests (on other threads) to go
/// ahead: a rank's failure agreement and status reports share the store a program waits on.
#[test]
fn a_long_wait_does_not_hold_up_other_requests_on_the_same_client() {
    let secret = JobSecret::generate().unwrap();
    let server = StoreServer::bind_with_secret("127.0.0.1:0", Some(secret.clone())).unwrap();
    let addr = server.local_addr().to_string();
    let store = Arc::new(Store::connect_with_secret(&addr, T, Some(&secret)).unwrap());
    store.set("present", b"v").unwrap();
    let waiting = store.clone();
    let waiter =
        std::thread::spawn(move || waiting.wait(&["never".to_string()], Duration::from_secs(30)));
    // The wait reaches the store.
    std::thread::sleep(Duration::from_millis(300));
    let (done, outcome) = mpsc::channel();
    let other = store.clone();
    std::thread::spawn(move || {
        let started = Instant::now();
        let result = other.set("k", b"v").and_then(|()| {
            let got = other.get("present")?;
            let won = other.compare_set("failure", b"", b"mine")?;
            Ok((got, won, other.add("n", 1)?))
        });
        let _ = done.send((result, started.elapsed()));
    });
    let outcome = outcome.recv_timeout(Duration::from_secs(2));
    let still_waiting = !waiter.is_finished();
    // End the wait either way, so that the test ends.
    let setter = Store::connect_with_secret(&addr, T, Some(&secret)).unwrap();
    setter.set("never", b"now").unwrap();
    let waited = waiter.join().unwrap();
    let (result, took) = outcome.expect(
        "a set, get, compare_set and add on the client were still held up after 2 s behind \
         its 30 s wait",
    );
    println!("set, get, compare_set and add took {took:?} beside a pending wait");
    assert_eq!(result.unwrap(), (b"v".to_vec(), b"mine".to_vec(), 1));
    assert!(
        still_waiting,
        "the wait ended before the other requests did"
    );
    waited.expect("the wait saw its key set");
}

/// Waits of several clients for overlapping keys, among writes of other keys: each ends when
/// its own keys are all set, and a wait that times out names exactly the keys still missing.
#[test]
fn waits_end_on_their_own_keys_and_name_those_missing() {
    let server = StoreServer::bind("127.0.0.1:0").unwrap();
    let addr = server.local_addr().to_string();
    let key = |i: usize| format!("w/{i}");
    let waits: Vec<_> = [(0, 1000), (500, 1500), (999, 1000)]
        .into_iter()
        .map(|(from, to)| {
            let addr = addr.clone();
            let keys: Vec<String> = (from..=to).map(key).collect();
            std::thread::spawn(move || {
                let s = Store::connect(&addr, T).unwrap();
                s.wait(&keys, Duration::from_secs(20))
            })
        })
        .collect();
    let writer = Store::connect(&addr, T).unwrap();
    for i in 0..=1500 {
        writer.set(&format!("other/{i}"), b"x").unwrap();
        writer.set(&key(1500 - i), b"v").unwrap();
    }
    for w in waits {
        w.join().unwrap().unwrap();
    }
    let keys: Vec<String> = ["w/3", "absent/1", "w/7", "absent/2", "absent/1"]
        .map(String::from)
        .to_vec();
    let e = writer
        .wait(&keys, Duration::from_millis(300))
        .unwrap_err()
        .to_string();
    assert!(e.contains(r#"["absent/1", "absent/2", "absent/1"]"#), "{e}");
}

/// CPU seconds this process has used (user and system).
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap();
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .unwrap()
        .1
        .split_whitespace()
        .collect();
    let ticks: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
    ticks as f64 / 100.0
}

/// Not a test: writes per second to a store, and the CPU they cost, while 0 or 64 clients
/// wait, each for 65 536 keys of which all but the last are set (a scan of a wait's keys stops
/// at the first not set, so this is the dearest wait to scan; `--ignored --nocapture` prints
/// the figures).
#[test]
#[ignore = "a benchmark"]
fn writes_per_second_beside_64_waits_for_65536_keys() {
    for waiters in [0, 64] {
        let server = StoreServer::bind("127.0.0.1:0").unwrap();
        let addr = server.local_addr().to_string();
        let writer = Store::connect(&addr, T).unwrap();
        let set: Vec<String> = (0..65_535).map(|i| format!("set/{i}")).collect();
        for key in &set {
            writer.set(key, b"v").unwrap();
        }
        let waits: Vec<_> = (0..waiters)
            .map(|w| {
                let (addr, mut keys) = (addr.clone(), set.clone());
                keys.push(format!("never/{w}"));
                std::thread::spawn(move || {
                    let s = Store::connect(&addr, Duration::from_secs(30)).unwrap();
                    let _ = s.wait(&keys, Duration::from_secs(12));
                })
            })
            .collect();
        std::thread::sleep(Duration::from_secs(3));
        let (started, cpu) = (Instant::now(), cpu_seconds());
        let mut writes = 0u64;
        while started.elapsed() < Duration::from_secs(5) {
            writer.set(&format!("written/{writes}"), b"v").unwrap();
            writes += 1;
        }
        let (took, cpu) = (started.elapsed().as_secs_f64(), cpu_seconds() - cpu);
        println!(
            "{waiters} waits for 65536 keys each: {:.0} writes/s, {:.0} us of CPU per write",
            writes as f64 / took,
            cpu * 1e6 / writes as f64
        );
        for w in waits {
            w.join().unwrap();
        }
    }
}

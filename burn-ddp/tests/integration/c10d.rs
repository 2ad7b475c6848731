//! burn-ddp's c10d client against a real PyTorch `torch.distributed.TCPStore` server (Python
//! with torch needed: `BURN_DDP_TEST_PYTHON`, else `python3` on PATH; skipped loudly without).

use std::io::{BufRead, BufReader};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};

use burn_ddp::store::{Store, StoreKind};
use burn_ddp::{DdpError, ProcessGroup, ReduceOp};

use crate::common::options;

/// Serves a TCPStore (`serve`), or also checks from Python what the Rust side wrote (`check`).
/// Prints the port, then runs until its stdin closes.
const SCRIPT: &str = r#"
import datetime, sys
import torch.distributed as dist
t = datetime.timedelta(seconds=30)
store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False, timeout=t)
print(store.port, flush=True)
if sys.argv[1] == "check":
    client = dist.TCPStore("127.0.0.1", store.port, 1, is_master=False, timeout=t)
    client.wait(["ns/rust_done"])
    got = {
        "from_rust": client.get("ns/from_rust"),
        "counter": client.add("ns/counter", 0),
        "cs": client.get("ns/cs"),
        "absent": client.check(["ns/absent"]),
    }
    want = {"from_rust": b"hello", "counter": 3, "cs": b"first", "absent": False}
    client.set("ns/python_verdict", b"ok" if got == want else repr(got).encode())
    client.set("ns/from_python", b"py")
sys.stdin.read()
"#;

/// A Python process serving a TCPStore; killed when dropped.
struct PyStore {
    child: Child,
    _stdin: ChildStdin,
    port: u16,
}

impl Drop for PyStore {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn python() -> String {
    std::env::var("BURN_DDP_TEST_PYTHON").unwrap_or_else(|_| "python3".into())
}

/// Starts the script in `mode`, or says why it cannot (no python, no torch).
fn py_store(mode: &str) -> Result<PyStore, String> {
    let mut child = Command::new(python())
        .args(["-c", SCRIPT, mode])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot run {}: {e}", python()))?;
    let (stdin, stdout) = (child.stdin.take(), child.stdout.take());
    let (Some(stdin), Some(stdout)) = (stdin, stdout) else {
        let _ = child.kill();
        return Err("no pipes to python".into());
    };
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut line = String::new();
        let _ = BufReader::new(stdout).read_line(&mut line);
        let _ = tx.send(line);
    });
    let line = rx
        .recv_timeout(Duration::from_secs(120))
        .unwrap_or_default();
    let mut store = PyStore {
        child,
        _stdin: stdin,
        port: 0,
    };
    match line.trim().parse() {
        Ok(port) => {
            store.port = port;
            Ok(store)
        }
        Err(_) => {
            let _ = store.child.kill();
            let mut err = String::new();
            if let Some(mut e) = store.child.stderr.take() {
                let _ = std::io::Read::read_to_string(&mut e, &mut err);
            }
            let last = err.lines().last().unwrap_or("no output").to_string();
            Err(format!(
                "{} -c 'import torch.distributed' failed: {last}",
                python()
            ))
        }
    }
}

macro_rules! py_store_or_skip {
    ($mode:expr) => {
        match py_store($mode) {
            Ok(s) => s,
            Err(why) => {
                eprintln!("SKIPPED: python with torch not available ({why})");
                return;
            }
        }
    };
}

#[test]
fn c10d_client_and_pytorch_read_each_others_keys() {
    let py = py_store_or_skip!("check");
    let addr = format!("127.0.0.1:{}", py.port);
    let store = Store::connect_c10d(&addr, Duration::from_secs(10), "ns/").unwrap();
    store.set("from_rust", b"hello").unwrap();
    assert_eq!(store.add("counter", 3).unwrap(), 3);
    assert_eq!(store.compare_set("cs", b"", b"first").unwrap(), b"first");
    assert_eq!(store.compare_set("cs", b"", b"second").unwrap(), b"first");
    assert_eq!(store.compare_set("cs", b"other", b"x").unwrap(), b"first");
    // The server answers `expected` for an absent key; the client says "empty", as ours does.
    assert_eq!(store.compare_set("absent", b"x", b"y").unwrap(), b"");
    assert_eq!(store.compare_set("absent", b"x", b"x").unwrap(), b"");
    assert_eq!(store.try_get("absent").unwrap(), None);

    // A wait that times out is cancelled, and the connection stays usable.
    let start = Instant::now();
    let err = store
        .wait(
            &["from_rust".into(), "never".into()],
            Duration::from_millis(300),
        )
        .unwrap_err();
    assert!(start.elapsed() >= Duration::from_millis(300));
    assert!(
        matches!(&err, DdpError::StoreTimeout { what, .. } if what.contains("never") && !what.contains("from_rust")),
        "{err}"
    );
    let err = store
        .get_timeout("never", Duration::from_millis(200))
        .unwrap_err();
    assert!(matches!(err, DdpError::StoreTimeout { .. }), "{err}");
    assert_eq!(store.get("from_rust").unwrap(), b"hello");

    // Python waits for this, checks the keys above, then answers: a blocking get.
    store.set("rust_done", b"1").unwrap();
    assert_eq!(
        store
            .get_timeout("from_python", Duration::from_secs(30))
            .unwrap(),
        b"py"
    );
    let verdict = store.get("python_verdict").unwrap();
    assert_eq!(String::from_utf8_lossy(&verdict), "ok");
}

#[test]
fn c10d_barrier_and_a_refused_oversized_value() {
    let py = py_store_or_skip!("serve");
    let addr = format!("127.0.0.1:{}", py.port);
    std::thread::scope(|s| {
        for _ in 0..3 {
            s.spawn(|| {
                let store = Store::connect_c10d(&addr, Duration::from_secs(10), "b/").unwrap();
                store.barrier("start", 3, Duration::from_secs(30)).unwrap();
            });
        }
    });
    let store = Store::connect_c10d(&addr, Duration::from_secs(10), "b/").unwrap();
    let err = store
        .set("big", &vec![0u8; 9 << 20])
        .unwrap_err()
        .to_string();
    assert!(err.contains("limit"), "{err}");
    // Refused before sending: the connection still works.
    store.set("small", b"1").unwrap();
    assert_eq!(store.get("small").unwrap(), b"1");
    let lonely = store.barrier("lonely", 2, Duration::from_millis(200));
    assert!(lonely.unwrap_err().to_string().contains("1 of 2"));
}

#[test]
fn a_c10d_client_of_a_closed_port_or_a_foreign_server_says_so() {
    // Our own store is not a c10d store: the handshake fails with a clear message.
    let ours = burn_ddp::store::StoreServer::bind("127.0.0.1:0").unwrap();
    let addr = ours.local_addr().to_string();
    let err = Store::connect_c10d(&addr, Duration::from_secs(5), "")
        .unwrap_err()
        .to_string();
    assert!(err.contains("PyTorch c10d TCPStore"), "{err}");
    let port = burn_ddp::launch::free_port("127.0.0.1").unwrap();
    let start = Instant::now();
    let err = Store::connect_c10d(&format!("127.0.0.1:{port}"), Duration::from_millis(500), "")
        .unwrap_err()
        .to_string();
    assert!(start.elapsed() < Duration::from_secs(5));
    assert!(err.contains("torchrun's agent store"), "{err}");
}

fn c10d_world<T: Send>(port: u16, namespace: &str, f: impl Fn(ProcessGroup) -> T + Sync) -> Vec<T> {
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..2)
            .map(|rank| {
                let f = &f;
                s.spawn(move || {
                    let group = ProcessGroup::builder(rank, 2)
                        .master_addr("127.0.0.1")
                        .master_port(port)
                        .store_kind(StoreKind::C10d {
                            namespace: namespace.into(),
                        })
                        .options(options(20))
                        .build()
                        .unwrap_or_else(|e| panic!("rank {rank} could not join: {e}"));
                    f(group)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn a_group_forms_and_fails_through_a_pytorch_store_and_attempts_stay_apart() {
    let py = py_store_or_skip!("serve");
    // Attempt 0: a group over the c10d store; rank 1 stops it, rank 0 is told why.
    let errors = c10d_world(py.port, "burn_ddp/attempt_0/", |g| {
        let sum = g.all_reduce(vec![g.rank() as f32 + 1.0; 1000], ReduceOp::Sum);
        assert_eq!(sum.wait().unwrap(), vec![3.0; 1000]);
        if g.rank() == 1 {
            g.abort("rank 1 gave up on purpose");
            return None;
        }
        let err = g
            .all_reduce(vec![0f32; 10], ReduceOp::Sum)
            .wait()
            .unwrap_err();
        Some(err.to_string())
    });
    let err = errors[0].as_deref().unwrap();
    assert!(err.contains("rank 1 gave up on purpose"), "{err}");
    // The ranks agreed on a job secret through the store.
    let addr = format!("127.0.0.1:{}", py.port);
    let peek = Store::connect_c10d(&addr, Duration::from_secs(5), "burn_ddp/attempt_0/").unwrap();
    let secret = peek
        .try_get(burn_ddp::testing::SECRET_KEY)
        .unwrap()
        .unwrap();
    assert_eq!(secret.len(), 64);

    // Attempt 1 on the same store sees none of attempt 0's keys (failure record included).
    let fine = c10d_world(py.port, "burn_ddp/attempt_1/", |g| {
        let out = g
            .all_reduce(vec![1.0f32; 10], ReduceOp::Sum)
            .wait()
            .unwrap();
        (out[0], g.recorded_failure())
    });
    assert_eq!(fine, vec![(2.0, None), (2.0, None)]);
    let other = Store::connect_c10d(&addr, Duration::from_secs(5), "burn_ddp/attempt_1/").unwrap();
    assert_ne!(
        other
            .try_get(burn_ddp::testing::SECRET_KEY)
            .unwrap()
            .unwrap(),
        secret
    );
}

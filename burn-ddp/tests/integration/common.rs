//! Helpers: worlds of ranks as threads, deterministic data, tolerances.

use std::hash::Hasher;
use std::time::Duration;

use burn_ddp::secret::JobSecret;
use burn_ddp::store::StoreServer;
use burn_ddp::{GroupOptions, ProcessGroup, ProcessGroupBuilder, Reduce};
use half::{bf16, f16};

/// Options with timeouts short enough for tests, long enough for a loaded 2-core machine.
pub fn options(timeout_secs: u64) -> GroupOptions {
    GroupOptions {
        timeout: Duration::from_secs(timeout_secs),
        rendezvous_timeout: Duration::from_secs(30),
        ..GroupOptions::default()
    }
}

/// Runs `f` on `n` ranks, one thread each, connected through a store this test serves on an
/// ephemeral port. Returns the results in rank order; a panicking rank fails the test.
pub fn run_world<T: Send>(
    n: usize,
    opts: GroupOptions,
    f: impl Fn(ProcessGroup) -> T + Sync,
) -> Vec<T> {
    run_world_with_secret(n, opts, None, f)
}

/// As [`run_world`], with a job secret the store and every rank use.
pub fn run_world_with_secret<T: Send>(
    n: usize,
    opts: GroupOptions,
    secret: Option<JobSecret>,
    f: impl Fn(ProcessGroup) -> T + Sync,
) -> Vec<T> {
    run_world_each(n, |_| opts.clone(), secret, f)
}

/// As [`run_world_with_secret`], with each rank's options from `opts`.
pub fn run_world_each<T: Send>(
    n: usize,
    opts: impl Fn(usize) -> GroupOptions,
    secret: Option<JobSecret>,
    f: impl Fn(ProcessGroup) -> T + Sync,
) -> Vec<T> {
    run_world_built(n, opts, secret, |b| b, f)
}

/// As [`run_world`], with the NCCL backend's plans in place of host staging for tensors
/// (`ProcessGroupBuilder::nccl_plans_on_host`): everything of the NCCL backend but its calls.
pub fn run_world_nccl_plans<T: Send>(
    n: usize,
    opts: GroupOptions,
    f: impl Fn(ProcessGroup) -> T + Sync,
) -> Vec<T> {
    run_world_built(n, |_| opts.clone(), None, |b| b.nccl_plans_on_host(), f)
}

/// As [`run_world_each`], each rank's builder passed through `build` last.
fn run_world_built<T: Send>(
    n: usize,
    opts: impl Fn(usize) -> GroupOptions,
    secret: Option<JobSecret>,
    build: impl Fn(ProcessGroupBuilder) -> ProcessGroupBuilder + Sync,
    f: impl Fn(ProcessGroup) -> T + Sync,
) -> Vec<T> {
    let server = StoreServer::bind_with_secret("127.0.0.1:0", secret.clone()).expect("store");
    let port = server.local_addr().port();
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..n)
            .map(|rank| {
                let (f, build, opts, secret) = (&f, &build, opts(rank), secret.clone());
                s.spawn(move || {
                    let mut builder = ProcessGroup::builder(rank, n)
                        .master_addr("127.0.0.1")
                        .master_port(port)
                        .host_store(false)
                        .options(opts);
                    if let Some(secret) = secret {
                        builder = builder.secret(secret);
                    }
                    let group = build(builder)
                        .build()
                        .unwrap_or_else(|e| panic!("rank {rank} could not join: {e}"));
                    f(group)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a rank panicked"))
            .collect()
    })
}

/// First bytes of the store protocol, both directions (`store::protocol::HELLO`).
pub const STORE_HELLO: &[u8] = b"burn-ddp store v3";
/// Bytes of the store's challenge: magic, no claims, has-secret flag, nonce, proof
/// (`secret::handshake`).
pub const STORE_CHALLENGE_LEN: usize = STORE_HELLO.len() + 1 + 1 + 32 + 32;

/// A store client's hello as the wire carries it: magic, no claims, a nonce.
pub fn store_hello() -> Vec<u8> {
    [STORE_HELLO, &[0], &[7u8; 32]].concat()
}

/// A client's answer to the store's challenge: `code` (1: proof, 2: no secret) and 32 bytes.
pub fn store_answer(code: u8, proof: [u8; 32]) -> Vec<u8> {
    [&[code][..], &proof].concat()
}

/// SplitMix64: a well-mixed 64-bit value of `x` (deterministic test data).
pub fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// A deterministic value in [-1, 1) for (case, rank, index).
pub fn value(case: u64, rank: usize, i: usize) -> f32 {
    let h = splitmix(case.wrapping_mul(0x1000_0001) ^ ((rank as u64) << 40) ^ i as u64);
    (h >> 40) as f32 / (1u64 << 23) as f32 - 1.0
}

/// Float types under test.
pub trait TestFloat: Reduce + Copy + PartialEq + std::fmt::Debug {
    /// Machine epsilon.
    const EPS: f64;
    fn from_f32(x: f32) -> Self;
    fn to_f64(self) -> f64;
}

impl TestFloat for f32 {
    const EPS: f64 = f32::EPSILON as f64;
    fn from_f32(x: f32) -> Self {
        x
    }
    fn to_f64(self) -> f64 {
        self as f64
    }
}
impl TestFloat for f64 {
    const EPS: f64 = f64::EPSILON;
    fn from_f32(x: f32) -> Self {
        x as f64
    }
    fn to_f64(self) -> f64 {
        self
    }
}
impl TestFloat for f16 {
    const EPS: f64 = 0.000_976_562_5;
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }
    fn to_f64(self) -> f64 {
        self.to_f64()
    }
}
impl TestFloat for bf16 {
    const EPS: f64 = 0.007_812_5;
    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x)
    }
    fn to_f64(self) -> f64 {
        self.to_f64()
    }
}

/// The data rank `rank` contributes to `case`.
pub fn rank_data<T: TestFloat>(case: u64, rank: usize, len: usize) -> Vec<T> {
    (0..len)
        .map(|i| T::from_f32(value(case, rank, i)))
        .collect()
}

/// A hash of a buffer's bytes, to compare results across ranks bit for bit.
pub fn digest(bytes: &[u8]) -> u64 {
    let mut h = std::hash::DefaultHasher::new();
    h.write(bytes);
    h.finish()
}

/// The events of `rank`'s Chrome trace in `dir` (`rank-{rank}.json`, as `DdpLearner::profile`
/// writes it).
pub fn trace_events(dir: &std::path::Path, rank: usize) -> Vec<serde_json::Value> {
    let path = dir.join(format!("rank-{rank}.json"));
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("a trace per rank: {}: {e}", path.display()));
    let mut trace: serde_json::Value = serde_json::from_str(&text).expect("valid JSON");
    match trace["traceEvents"].take() {
        serde_json::Value::Array(events) => events,
        other => panic!("traceEvents is not a list: {other}"),
    }
}

/// The complete spans (`"ph": "X"`) of `rank`'s Chrome trace in `dir`: each span's name and
/// duration in microseconds.
pub fn trace_spans(dir: &std::path::Path, rank: usize) -> Vec<(String, f64)> {
    spans_of(&trace_events(dir, rank))
}

/// The complete spans (`"ph": "X"`) among a trace's `events`: each span's name and duration in
/// microseconds.
pub fn spans_of(events: &[serde_json::Value]) -> Vec<(String, f64)> {
    (events.iter())
        .filter(|e| e["ph"] == "X")
        .map(|e| {
            let name = e["name"].as_str().unwrap_or_default().to_string();
            (name, e["dur"].as_f64().unwrap_or(0.0))
        })
        .collect()
}

/// ‖a − b‖ / ‖b‖.
pub fn relative_error(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let diff: f64 = a
        .iter()
        .zip(b)
        .map(|(x, y)| (*x as f64 - *y as f64).powi(2))
        .sum();
    let norm: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (diff / norm).sqrt()
}

/// max |a − b| / max |b|: the largest error relative to the largest value.
pub fn max_relative_error(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let diff = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs() as f64)
        .fold(0.0, f64::max);
    let scale = b.iter().map(|y| y.abs() as f64).fold(1e-12, f64::max);
    diff / scale
}

/// The device the CPU tests train on: burn's `flex`, with autodiff.
pub fn flex() -> burn::tensor::Device {
    burn::tensor::Device::flex().autodiff()
}

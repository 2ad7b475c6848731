//! What this test process does while hostile peers talk to it: the warnings it logs (a logger
//! that keeps them and info lines, installed by the security and sharding tests; no other test
//! installs one) and whether it ever allocates a given size (the test binary's allocator
//! watches for one size).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, Once};
use std::time::{Duration, Instant};

/// Lines logged at info level or above, oldest first (at most `KEPT`).
static LINES: Mutex<Vec<String>> = Mutex::new(Vec::new());
const KEPT: usize = 10_000;

struct Keep;

impl log::Log for Keep {
    fn enabled(&self, m: &log::Metadata<'_>) -> bool {
        m.level() <= log::Level::Info
    }
    fn log(&self, r: &log::Record<'_>) {
        if self.enabled(r.metadata()) {
            let mut lines = LINES.lock().unwrap_or_else(|p| p.into_inner());
            if lines.len() >= KEPT {
                lines.drain(..KEPT / 2);
            }
            lines.push(format!("{} {}", r.level(), r.args()));
        }
    }
    fn flush(&self) {}
}

/// Keeps this process's warnings and info lines from now on.
pub fn keep_warnings() {
    static ONCE: Once = Once::new();
    static KEEP: Keep = Keep;
    ONCE.call_once(|| {
        if log::set_logger(&KEEP).is_ok() {
            log::set_max_level(log::LevelFilter::Info);
        }
    });
}

/// The first warning containing every one of `needles`, waiting up to `timeout` for it.
pub fn warning(needles: &[&str], timeout: Duration) -> Option<String> {
    let mut needles = needles.to_vec();
    needles.push("WARN ");
    logged(&needles, timeout)
}

/// The first line logged (info or above) containing every one of `needles`, waiting up to
/// `timeout` for it.
pub fn logged(needles: &[&str], timeout: Duration) -> Option<String> {
    let until = Instant::now() + timeout;
    loop {
        let found = LINES
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .find(|l| needles.iter().all(|n| l.contains(n)))
            .cloned();
        if found.is_some() || Instant::now() >= until {
            return found;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The size watched for; allocations of this size up to `WINDOW` more are noted.
static WATCHED: AtomicUsize = AtomicUsize::new(usize::MAX);
static SEEN: AtomicUsize = AtomicUsize::new(0);
const WINDOW: usize = 64 << 10;

/// Notes from now on any allocation of `size` bytes (or up to 64 KiB more). Choose an odd
/// size no other test allocates.
pub fn watch_allocations_of(size: usize) {
    SEEN.store(0, Ordering::SeqCst);
    WATCHED.store(size, Ordering::SeqCst);
}

/// The largest allocation of the watched size seen, if any.
pub fn watched_allocation() -> Option<usize> {
    Some(SEEN.load(Ordering::SeqCst)).filter(|s| *s > 0)
}

fn note(size: usize) {
    let w = WATCHED.load(Ordering::Relaxed);
    if size >= w && size - w < WINDOW {
        SEEN.fetch_max(size, Ordering::Relaxed);
    }
}

/// The system allocator, watching for one size.
struct Watch;

// SAFETY: every call is forwarded unchanged to the system allocator; noting a size allocates
// nothing and touches only atomics.
unsafe impl GlobalAlloc for Watch {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        // SAFETY: the caller's contract is the system allocator's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        // SAFETY: as above.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note(new_size);
        // SAFETY: as above.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Watch = Watch;

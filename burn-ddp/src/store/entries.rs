//! The store server's keys and values, with what they cost counted, and the waits for them: a
//! client (any process that reaches the port when no job secret is set, as under torchrun by
//! default; any holder of the secret otherwise) cannot make rank 0's store hold more than
//! [`MAX_STORED_BYTES`] or [`MAX_KEYS`] keys, nor keep more than [`MAX_WAITS`] waits open.
//!
//! A wait is registered under the first of its keys not set; when that key is set, the write
//! moves the wait on to its next key not set, or wakes it when there is none. So a write looks
//! only at the waits registered under its key, and each key of a wait is looked up about once
//! over the wait's life, however many writes happen meanwhile (keys are never removed).

use std::collections::HashMap;
use std::sync::{Arc, Condvar};

/// Most bytes the store counts for what it holds (keys, values and [`ENTRY_COST`] per entry);
/// a write beyond it is refused. burn-ddp's own keys take a few hundred bytes per rank.
pub(crate) const MAX_STORED_BYTES: usize = 1 << 30;
/// Most keys the store holds; a new key beyond it is refused. burn-ddp's own keys are a few per
/// rank, so this is far above any job's, and bounds what the tiniest entries cost (130 MiB
/// for 1 048 576 keys of 4 bytes and empty values, measured).
pub(crate) const MAX_KEYS: usize = 1 << 20;
/// What an entry costs the store besides its key's and value's bytes, counted against
/// [`MAX_STORED_BYTES`]: its slot in the hash table (a `String` and a `Vec`, 48 bytes, and a
/// control byte) at the table's sparsest (just grown: 2 × 8/7 slots per entry, 112 bytes),
/// plus what the allocator adds to each of the two buffers (up to 24 bytes each). A store of
/// 1 048 576 keys of 4 bytes and empty values measured 130 bytes per entry in all (its table
/// 57% full), 110 at 1 310 720 keys.
pub(crate) const ENTRY_COST: usize = 160;
/// Most waits open at once. A connection has at most one request in flight, and a rank's
/// client opens at most a few connections, so this is far above any job's ranks.
pub(crate) const MAX_WAITS: usize = 1 << 16;

/// The bounds of an [`Entries`] (tests use small ones).
#[derive(Debug)]
struct Limits {
    bytes: usize,
    keys: usize,
    waits: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            bytes: MAX_STORED_BYTES,
            keys: MAX_KEYS,
            waits: MAX_WAITS,
        }
    }
}

/// The keys and values, what they cost, and the waits for keys not yet set.
#[derive(Debug, Default)]
pub(crate) struct Entries {
    map: HashMap<String, Vec<u8>>,
    bytes: usize,
    limits: Limits,
    waits: Waits,
}

/// The open waits, each registered under one key: the first of its keys not set.
#[derive(Debug, Default)]
struct Waits {
    next: u64,
    /// For each absent key that is waited for, the waits registered under it.
    by_key: HashMap<String, Vec<u64>>,
    open: HashMap<u64, Wait>,
}

#[derive(Debug)]
struct Wait {
    keys: Arc<[String]>,
    /// `keys[..at]` are set; `keys[at]` is not, and the wait is registered under it (`at` is
    /// `keys.len()` once all are set).
    at: usize,
    /// Notified when all are set (and when the server stops).
    wake: Arc<Condvar>,
}

/// An open wait, from [`Entries::watch`]; end it with [`Entries::unwatch`].
#[derive(Debug)]
pub(crate) struct WaitId(u64);

/// What `key` with `value` counts against [`MAX_STORED_BYTES`].
fn cost(key: &str, value: &[u8]) -> usize {
    key.len() + value.len() + ENTRY_COST
}

/// The position of the first of `keys[from..]` not in `map` (`keys.len()` if none).
fn first_absent(map: &HashMap<String, Vec<u8>>, keys: &[String], from: usize) -> usize {
    from + keys[from..]
        .iter()
        .take_while(|k| map.contains_key(*k))
        .count()
}

impl Entries {
    /// Entries bounded by `bytes`, `keys` and `waits` (tests use small bounds).
    #[cfg(test)]
    fn with_limits(bytes: usize, keys: usize, waits: usize) -> Self {
        Entries {
            limits: Limits { bytes, keys, waits },
            ..Entries::default()
        }
    }

    pub(crate) fn get(&self, key: &str) -> Option<&Vec<u8>> {
        self.map.get(key)
    }

    pub(crate) fn contains_key(&self, key: &str) -> bool {
        self.map.contains_key(key)
    }

    /// Sets `key` to `value`, unless the store would then hold more keys or count more bytes
    /// than its limits; a new key ends the waits whose last missing key it was.
    pub(crate) fn insert(&mut self, key: String, value: Vec<u8>) -> Result<(), String> {
        let Limits {
            bytes: limit, keys, ..
        } = self.limits;
        let old = self.map.get(&key).map(|v| cost(&key, v));
        if old.is_none() && self.map.len() >= keys {
            return Err(format!(
                "the store holds {keys} keys, its limit: {key:?} is not added"
            ));
        }
        let bytes = self.bytes - old.unwrap_or(0) + cost(&key, &value);
        if bytes > limit {
            return Err(format!(
                "the store would count {bytes} bytes with {key:?} (keys, values and \
                 {ENTRY_COST} bytes per entry), above its limit of {limit}"
            ));
        }
        self.bytes = bytes;
        let awaited = old.is_none() && self.waits.by_key.contains_key(&key);
        let arrived = awaited.then(|| key.clone());
        self.map.insert(key, value);
        if let Some(key) = arrived {
            self.waits.arrived(&self.map, &key);
        }
        Ok(())
    }

    /// Opens a wait for `keys`, woken through `wake` when all are set; `None` when all are
    /// set now. Refused when [`MAX_WAITS`] waits are open.
    pub(crate) fn watch(
        &mut self,
        keys: &Arc<[String]>,
        wake: &Arc<Condvar>,
    ) -> Result<Option<WaitId>, String> {
        let at = first_absent(&self.map, keys, 0);
        let Some(key) = keys.get(at) else {
            return Ok(None);
        };
        let waits = &mut self.waits;
        if waits.open.len() >= self.limits.waits {
            return Err(format!(
                "the store has {} waits open, its limit: this wait is refused",
                self.limits.waits
            ));
        }
        let id = waits.next;
        waits.next += 1;
        waits.by_key.entry(key.clone()).or_default().push(id);
        let wait = Wait {
            keys: keys.clone(),
            at,
            wake: wake.clone(),
        };
        waits.open.insert(id, wait);
        Ok(Some(WaitId(id)))
    }

    /// Whether every key of the wait `id` is set.
    pub(crate) fn arrived(&self, id: &WaitId) -> bool {
        self.waits
            .open
            .get(&id.0)
            .is_none_or(|w| w.at == w.keys.len())
    }

    /// Ends the wait `id`, set or not.
    pub(crate) fn unwatch(&mut self, id: WaitId) {
        let Some(wait) = self.waits.open.remove(&id.0) else {
            return;
        };
        let Some(key) = wait.keys.get(wait.at) else {
            return;
        };
        if let Some(ids) = self.waits.by_key.get_mut(key) {
            ids.retain(|i| *i != id.0);
            if ids.is_empty() {
                self.waits.by_key.remove(key);
            }
        }
    }

    /// Wakes every open wait (the server stops).
    pub(crate) fn wake_all(&self) {
        for wait in self.waits.open.values() {
            wait.wake.notify_all();
        }
    }
}

impl Waits {
    /// `key` was just set in `map`: each wait registered under it moves on to its next key not
    /// set, or is woken when there is none.
    fn arrived(&mut self, map: &HashMap<String, Vec<u8>>, key: &str) {
        for id in self.by_key.remove(key).unwrap_or_default() {
            let Some(wait) = self.open.get_mut(&id) else {
                continue;
            };
            wait.at = first_absent(map, &wait.keys, wait.at);
            match wait.keys.get(wait.at) {
                Some(next) => self.by_key.entry(next.clone()).or_default().push(id),
                None => wait.wake.notify_all(),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_beyond_the_limit_are_refused_and_replacing_counts_once() {
        // Room for three entries of 1-byte keys and 18 bytes of values.
        let limit = 3 * (1 + ENTRY_COST) + 18;
        let mut e = Entries::with_limits(limit, 10, 10);
        e.insert("a".into(), vec![0; 9]).unwrap();
        e.insert("a".into(), vec![0; 9]).unwrap();
        e.insert("b".into(), vec![0; 9]).unwrap();
        let refused = e.insert("c".into(), vec![0; 1]).unwrap_err();
        assert!(
            refused.contains(&format!("above its limit of {limit}")),
            "{refused}"
        );
        assert!(!e.contains_key("c"));
        // A smaller value in place of a larger one makes room.
        e.insert("a".into(), Vec::new()).unwrap();
        e.insert("c".into(), vec![0; 5]).unwrap();
        assert_eq!(e.get("c").map(Vec::len), Some(5));
    }

    #[test]
    fn keys_beyond_the_limit_are_refused_by_name_and_old_keys_still_change() {
        let mut e = Entries::with_limits(MAX_STORED_BYTES, 2, 10);
        e.insert("a".into(), Vec::new()).unwrap();
        e.insert("b".into(), Vec::new()).unwrap();
        let refused = e.insert("c".into(), Vec::new()).unwrap_err();
        assert!(refused.contains("holds 2 keys, its limit"), "{refused}");
        e.insert("a".into(), b"new".to_vec()).unwrap();
        assert_eq!(e.get("a").map(Vec::as_slice), Some(&b"new"[..]));
    }

    fn keys(names: &[&str]) -> Arc<[String]> {
        names.iter().map(|n| n.to_string()).collect()
    }

    #[test]
    fn a_wait_ends_with_its_last_key_and_only_then() {
        let mut e = Entries::default();
        let wake = Arc::new(Condvar::new());
        e.insert("here".into(), Vec::new()).unwrap();
        let id = e
            .watch(&keys(&["here", "x", "y", "x"]), &wake)
            .unwrap()
            .expect("x and y are not set");
        e.insert("unrelated".into(), Vec::new()).unwrap();
        e.insert("y".into(), Vec::new()).unwrap();
        assert!(!e.arrived(&id));
        e.insert("x".into(), Vec::new()).unwrap();
        assert!(e.arrived(&id));
        e.unwatch(id);
        assert!(e.waits.open.is_empty() && e.waits.by_key.is_empty());
        let all_set = e.watch(&keys(&["x", "y", "here"]), &wake).unwrap();
        assert!(all_set.is_none(), "all set: no wait");
    }

    #[test]
    fn a_wait_is_registered_under_one_key_at_a_time_and_leaves_nothing_behind() {
        let mut e = Entries::default();
        let wake = Arc::new(Condvar::new());
        let id = e.watch(&keys(&["a", "b", "c"]), &wake).unwrap().unwrap();
        let registered = |e: &Entries| e.waits.by_key.keys().cloned().collect::<Vec<_>>();
        assert_eq!(registered(&e), ["a"]);
        e.insert("b".into(), Vec::new()).unwrap();
        assert_eq!(registered(&e), ["a"]);
        e.insert("a".into(), Vec::new()).unwrap();
        assert_eq!(registered(&e), ["c"], "moved past b, set meanwhile");
        e.unwatch(id);
        assert!(e.waits.open.is_empty() && e.waits.by_key.is_empty());
    }

    #[test]
    fn open_waits_are_bounded() {
        let mut e = Entries::with_limits(MAX_STORED_BYTES, 100, 2);
        let wake = Arc::new(Condvar::new());
        let shared = keys(&["shared"]);
        let first = e.watch(&shared, &wake).unwrap().unwrap();
        let second = e.watch(&shared, &wake).unwrap().unwrap();
        let refused = e.watch(&keys(&["other"]), &wake).unwrap_err();
        assert!(refused.contains("2 waits open, its limit"), "{refused}");
        e.unwatch(first);
        assert_eq!(e.waits.by_key["shared"], [second.0]);
        let third = e
            .watch(&keys(&["other", "shared"]), &wake)
            .unwrap()
            .unwrap();
        e.insert("shared".into(), Vec::new()).unwrap();
        assert!(e.arrived(&second) && !e.arrived(&third));
        e.unwatch(second);
        e.unwatch(third);
        assert!(e.waits.open.is_empty() && e.waits.by_key.is_empty());
    }
}

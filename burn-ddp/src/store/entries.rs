//! The store server's keys and values, with the bytes they hold counted: a client (any process
//! that reaches the port when no job secret is set, as under torchrun by default) cannot make
//! rank 0's store hold more than [`MAX_STORED_BYTES`].

use std::collections::HashMap;

/// Most bytes (keys and values) the store holds; a write beyond it is refused. burn-ddp's own
/// keys take a few hundred bytes per rank.
pub(crate) const MAX_STORED_BYTES: usize = 1 << 30;

/// The keys and values, and their size.
#[derive(Debug, Default)]
pub(crate) struct Entries {
    map: HashMap<String, Vec<u8>>,
    bytes: usize,
    limit: Option<usize>,
}

impl Entries {
    /// Entries that hold at most `limit` bytes (tests use a small one).
    #[cfg(test)]
    fn with_limit(limit: usize) -> Self {
        Entries {
            limit: Some(limit),
            ..Entries::default()
        }
    }

    pub(crate) fn get(&self, key: &str) -> Option<&Vec<u8>> {
        self.map.get(key)
    }

    pub(crate) fn contains_key(&self, key: &str) -> bool {
        self.map.contains_key(key)
    }

    /// Sets `key` to `value`, unless the store would then hold more than its limit.
    pub(crate) fn insert(&mut self, key: String, value: Vec<u8>) -> Result<(), String> {
        let limit = self.limit.unwrap_or(MAX_STORED_BYTES);
        let old = self.map.get(&key).map_or(0, |v| key.len() + v.len());
        let bytes = self.bytes - old + key.len() + value.len();
        if bytes > limit {
            return Err(format!(
                "the store would hold {bytes} bytes with {key:?}, above its limit of {limit}"
            ));
        }
        self.bytes = bytes;
        self.map.insert(key, value);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_beyond_the_limit_are_refused_and_replacing_counts_once() {
        let mut e = Entries::with_limit(20);
        e.insert("a".into(), vec![0; 9]).unwrap();
        e.insert("a".into(), vec![0; 9]).unwrap();
        e.insert("b".into(), vec![0; 9]).unwrap();
        let refused = e.insert("c".into(), vec![0; 1]).unwrap_err();
        assert!(refused.contains("above its limit of 20"), "{refused}");
        assert!(!e.contains_key("c"));
        // A smaller value in place of a larger one makes room.
        e.insert("a".into(), Vec::new()).unwrap();
        e.insert("c".into(), vec![0; 5]).unwrap();
        assert_eq!(e.get("c").map(Vec::len), Some(5));
    }
}

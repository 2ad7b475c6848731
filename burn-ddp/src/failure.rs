//! The group's failure record. The first rank that sees a failure records in the store the
//! cause and, when known, the rank that caused it; every other rank reads the same record, so
//! all errors name one root cause, and the launcher names the culprit even when it sees another
//! rank exit first.

use crate::error::Result;
use crate::store::Store;

/// Store key of the record.
pub(crate) const FAILURE_KEY: &str = crate::store::keys::FAILURE;

/// What went wrong first in a group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FailureRecord {
    /// The rank that caused it (died, left, stalled, sent garbage), when known.
    pub culprit: Option<usize>,
    /// The cause in words, naming the rank that saw it and the operation.
    pub cause: String,
}

impl FailureRecord {
    fn encode(&self) -> Vec<u8> {
        let culprit = self.culprit.map_or("-".to_string(), |c| c.to_string());
        format!("{culprit}\n{}", self.cause).into_bytes()
    }

    /// Decodes a record as the store holds it.
    pub(crate) fn from_bytes(raw: &[u8]) -> Option<Self> {
        let text = String::from_utf8_lossy(raw);
        let (culprit, cause) = text.split_once('\n')?;
        Some(FailureRecord {
            culprit: culprit.parse().ok(),
            cause: cause.to_string(),
        })
    }

    /// Records `self` unless a record exists; returns the record that holds (first wins).
    pub(crate) fn agree(self, store: &Store) -> Result<Self> {
        let agreed = store.compare_set(FAILURE_KEY, b"", &self.encode())?;
        Ok(Self::from_bytes(&agreed).unwrap_or(self))
    }

    /// The group's record, if a rank wrote one.
    pub fn read(store: &Store) -> Option<Self> {
        store
            .try_get(FAILURE_KEY)
            .ok()
            .flatten()
            .and_then(|raw| Self::from_bytes(&raw))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip() {
        for culprit in [Some(3), None] {
            let r = FailureRecord {
                culprit,
                cause: "rank 3 closed\nits connection".into(),
            };
            assert_eq!(FailureRecord::from_bytes(&r.encode()), Some(r));
        }
        assert_eq!(FailureRecord::from_bytes(b"no newline"), None);
    }
}

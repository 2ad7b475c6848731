//! The one way the ranks check that they agree on something: every rank's description of it,
//! gathered (one all-gather), compared with rank 0's. Every rank sees the same gathered bytes,
//! so every rank finds the same disagreement and fails alike, naming the same ranks.

use super::{ProcessGroup, Worker};
use crate::error::Result;

/// Every rank's description of one thing, by rank.
pub(crate) struct Said {
    /// The descriptions, by rank.
    pub all: Vec<Vec<u8>>,
}

impl Said {
    /// The ranks whose description differs from rank 0's.
    pub(crate) fn differing(&self) -> Vec<usize> {
        (1..self.all.len())
            .filter(|&r| self.all[r] != self.all[0])
            .collect()
    }
}

impl ProcessGroup {
    /// Gathers every rank's `mine` (a description of something every rank must agree on).
    pub(crate) fn gather_said(&self, mine: Vec<u8>) -> Result<Said> {
        Ok(Said {
            all: self.all_gather(mine).wait()?,
        })
    }
}

impl Worker {
    /// As [`ProcessGroup::gather_said`], on the collective thread.
    pub(crate) fn gather_said(&mut self, mine: &[u8]) -> Result<Said> {
        Ok(Said {
            all: self.run(|t| t.all_gather(mine))?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_are_compared_with_rank_0() {
        let said = |all: &[&[u8]]| Said {
            all: all.iter().map(|b| b.to_vec()).collect(),
        };
        assert_eq!(said(&[b"a", b"a", b"a"]).differing(), Vec::<usize>::new());
        assert_eq!(said(&[b"a", b"b", b"a", b"c"]).differing(), vec![1, 3]);
        assert_eq!(said(&[b"a", b"a", b"c"]).differing(), vec![2]);
        assert_eq!(said(&[b"x"]).differing(), Vec::<usize>::new());
    }
}

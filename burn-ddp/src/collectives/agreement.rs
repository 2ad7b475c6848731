//! The one way the ranks tell each other something and check that they agree: every rank's
//! message, encoded with [`Writer`](crate::wire::Writer), gathered (one all-gather) into a
//! [`Gathered`], then compared with rank 0's ([`Gathered::differing`]) or decoded rank by rank
//! ([`Gathered::decode_each`]). Every rank sees the same gathered bytes, so every rank finds the
//! same disagreement (or the same malformed message) and fails alike, naming the same ranks.

use super::worker::Queue;
use super::worker::Worker;
use crate::error::{DdpError, Result};
use crate::wire::{DecodeError, Reader};

/// Every rank's description of one thing, by rank.
pub(crate) struct Gathered {
    /// The descriptions, by rank.
    pub all: Vec<Vec<u8>>,
}

impl Gathered {
    /// The ranks whose description differs from rank 0's.
    pub(crate) fn differing(&self) -> Vec<usize> {
        (1..self.all.len())
            .filter(|&r| self.all[r] != self.all[0])
            .collect()
    }

    /// Every rank's message decoded by `decode`, by rank; a message `decode` refuses, or does
    /// not read to its end, is an error naming its rank and `what` it was to be.
    pub(crate) fn decode_each<T>(
        &self,
        what: &str,
        decode: impl Fn(&mut Reader<'_>) -> std::result::Result<T, DecodeError>,
    ) -> Result<Vec<T>> {
        (self.all.iter().enumerate())
            .map(|(rank, message)| {
                let mut r = Reader::new(message);
                let value = decode(&mut r).and_then(|v| r.finish().map(|()| v));
                value.map_err(|e| {
                    DdpError::Disagreement(format!("rank {rank} sent malformed {what}: {e}"))
                })
            })
            .collect()
    }
}

impl Queue {
    /// Gathers every rank's `mine` (a description of something every rank must agree on).
    pub(crate) fn all_gather_object(&self, mine: Vec<u8>) -> Result<Gathered> {
        if self.world() == 1 {
            return Ok(Gathered { all: vec![mine] });
        }
        Ok(Gathered {
            all: self.submit(move |t| t.all_gather(&mine)).wait()?,
        })
    }
}

impl Worker {
    /// As [`Queue::all_gather_object`], on the collective thread.
    pub(crate) fn all_gather_object(&mut self, mine: &[u8]) -> Result<Gathered> {
        Ok(Gathered {
            all: self.run(|t| t.all_gather(mine))?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_are_compared_with_rank_0() {
        let said = |all: &[&[u8]]| Gathered {
            all: all.iter().map(|b| b.to_vec()).collect(),
        };
        assert_eq!(said(&[b"a", b"a", b"a"]).differing(), Vec::<usize>::new());
        assert_eq!(said(&[b"a", b"b", b"a", b"c"]).differing(), vec![1, 3]);
        assert_eq!(said(&[b"a", b"a", b"c"]).differing(), vec![2]);
        assert_eq!(said(&[b"x"]).differing(), Vec::<usize>::new());
        let counts = [7u64.to_le_bytes().to_vec(), 9u64.to_le_bytes().to_vec()];
        let decoded = Gathered {
            all: counts.to_vec(),
        }
        .decode_each("counts", |r| r.u64());
        assert_eq!(decoded.unwrap(), vec![7, 9]);
        let short = Gathered {
            all: vec![counts[0].clone(), vec![1, 2, 3]],
        };
        let error = short.decode_each("counts", |r| r.u64()).unwrap_err();
        assert!(
            error.to_string().contains("rank 1 sent malformed counts"),
            "{error}"
        );
        let long = Gathered {
            all: vec![[counts[0].clone(), vec![0]].concat()],
        };
        assert!(long.decode_each("counts", |r| r.u64()).is_err());
    }
}

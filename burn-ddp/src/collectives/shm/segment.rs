//! The shared-memory segment of a group: its layout (a control block per rank, a data slot per
//! rank, a result area), and creating, opening and unlinking the POSIX segment behind it.
//!
//! Rank 0 creates the segment (`shm_open` with `O_EXCL`, sized and its pages reserved), the
//! others open it by the name rank 0 published, and rank 0 unlinks it as soon as every rank has
//! mapped it: from then on nothing of it remains in `/dev/shm`, whatever happens to the ranks.

use std::io;
use std::os::fd::{AsFd, OwnedFd};

use rustix::fs::{FallocateFlags, Mode};
use rustix::shm::OFlags;

use super::mapping::Mapping;

/// Bytes of a rank's control block (two cache lines: the counter does not share a line with
/// another rank's).
const CONTROL: usize = 128;
const PAGE: usize = 4096;
/// Prefix of every segment's name (`/dev/shm/burn-ddp-...`).
pub(crate) const NAME_PREFIX: &str = "burn-ddp-";

/// Fields of a control block, in `u64` words.
#[derive(Debug, Clone, Copy)]
#[repr(usize)]
pub(crate) enum Field {
    /// Steps the rank completed (release-stored after everything else it wrote).
    Step = 0,
    /// Its current operation: kind, sequence number, dtype, bytes, and an operand (the root
    /// of a broadcast, the rank's own size in an all-gather).
    Kind = 1,
    Seq = 2,
    DType = 3,
    Bytes = 4,
    Aux = 5,
}

/// Where everything lies in the segment of a `world`-rank group whose slots hold `world`
/// pieces of `piece` bytes each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Layout {
    pub world: usize,
    /// Bytes of one segment's piece per round (a multiple of 64).
    pub piece: usize,
}

impl Layout {
    /// The layout for slots of about `slot_bytes` per rank.
    pub(crate) fn new(world: usize, slot_bytes: usize) -> Self {
        let piece = (slot_bytes / world.max(1) / 64).max(1) * 64;
        Layout { world, piece }
    }

    /// Offset of `rank`'s control field; operation fields come in two banks, used by
    /// alternate steps (a peer may publish its next operation while this rank still reads the
    /// current one, but never two steps ahead).
    pub(crate) fn field(&self, rank: usize, field: Field, bank: u64) -> usize {
        let word = match field {
            Field::Step => 0,
            f => f as usize + bank as usize % 2 * 5,
        };
        rank * CONTROL + word * 8
    }

    fn data(&self) -> usize {
        (self.world * CONTROL).div_ceil(PAGE) * PAGE
    }

    /// Bytes of one rank's slot.
    pub(crate) fn slot_len(&self) -> usize {
        self.world * self.piece
    }

    /// Offset of `rank`'s slot.
    pub(crate) fn slot(&self, rank: usize) -> usize {
        self.data() + rank * self.slot_len()
    }

    /// Offset of the result area (one piece per segment of the buffer).
    pub(crate) fn result(&self) -> usize {
        self.slot(self.world)
    }

    /// Total bytes of the segment.
    pub(crate) fn len(&self) -> usize {
        self.result() + self.slot_len()
    }

    /// Total bytes of the segment, `None` when they do not fit a `usize` (an absurd slot size
    /// or world): checked before any offset of it is computed.
    pub(crate) fn checked_len(&self) -> Option<usize> {
        let slot = self.world.checked_mul(self.piece)?;
        let data = self
            .world
            .checked_mul(CONTROL)?
            .checked_next_multiple_of(PAGE)?;
        // The ranks' slots and the result area.
        let slots = self.world.checked_add(1)?.checked_mul(slot)?;
        data.checked_add(slots)
    }
}

/// The segment's name in `shm_open`'s form (`/burn-ddp-<port>-<token>`), unique per job: the
/// store's port and a random token rank 0 draws.
pub(crate) fn segment_name(port: u16) -> io::Result<String> {
    let mut token = [0u8; 8];
    getrandom::fill(&mut token).map_err(|e| io::Error::other(e.to_string()))?;
    Ok(format!(
        "/{NAME_PREFIX}{port}-{}-{:016x}",
        std::process::id(),
        u64::from_le_bytes(token)
    ))
}

/// A segment rank 0 created; unlinked on drop unless already unlinked.
pub(crate) struct Created {
    name: String,
    linked: bool,
}

impl Created {
    /// Removes the segment's name now (the mappings stay valid).
    pub(crate) fn unlink(&mut self) {
        if std::mem::take(&mut self.linked)
            && let Err(e) = rustix::shm::unlink(self.name.as_str())
        {
            log::warn!(
                "removing the shared-memory segment {} failed: {e}",
                self.name
            );
        }
    }
}

impl Drop for Created {
    fn drop(&mut self) {
        self.unlink();
    }
}

/// Creates the segment `name` of `len` bytes (zero-filled, pages reserved so that a full
/// `/dev/shm` is an error here rather than a SIGBUS later) and maps it.
pub(crate) fn create(name: &str, len: usize) -> io::Result<(Created, Mapping)> {
    let fd = rustix::shm::open(
        name,
        OFlags::CREATE | OFlags::EXCL | OFlags::RDWR,
        Mode::RUSR | Mode::WUSR,
    )?;
    let created = Created {
        name: name.to_string(),
        linked: true,
    };
    rustix::fs::ftruncate(&fd, len as u64)?;
    match rustix::fs::fallocate(&fd, FallocateFlags::empty(), 0, len as u64) {
        Ok(()) => {}
        Err(rustix::io::Errno::OPNOTSUPP) | Err(rustix::io::Errno::NOSYS) => {}
        Err(e) => {
            return Err(io::Error::other(format!(
                "reserving {len} bytes of shared memory: {e} (is /dev/shm full or small?)"
            )));
        }
    }
    let map = Mapping::map(fd.as_fd(), len)?;
    Ok((created, map))
}

/// Opens and maps the segment `name` rank 0 created, checking it has `len` bytes.
pub(crate) fn open(name: &str, len: usize) -> io::Result<Mapping> {
    let fd: OwnedFd = rustix::shm::open(name, OFlags::RDWR, Mode::empty())?;
    let size = rustix::fs::fstat(&fd)?.st_size;
    if size != len as i64 {
        return Err(io::Error::other(format!(
            "the segment has {size} bytes, expected {len}"
        )));
    }
    Mapping::map(fd.as_fd(), len)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_keeps_areas_apart_and_aligned() {
        let l = Layout::new(3, 1 << 20);
        assert_eq!(l.piece % 64, 0);
        assert!(l.field(2, Field::Aux, 1) + 8 <= l.slot(0));
        assert!(l.field(0, Field::Aux, 1) + 8 <= l.field(1, Field::Step, 0));
        assert_eq!(l.slot(0) % PAGE, 0);
        assert_eq!(l.slot(1) - l.slot(0), l.slot_len());
        assert_eq!(l.len(), l.slot(0) + 4 * l.slot_len());
        assert_eq!(l.checked_len(), Some(l.len()));
        // Sizes whose segment cannot exist are caught before any offset is computed.
        assert_eq!(Layout::new(64, usize::MAX / 2).checked_len(), None);
        assert_eq!(Layout::new(usize::MAX / 64, 1 << 20).checked_len(), None);
    }

    #[test]
    fn created_segment_is_shared_and_unlinked() {
        let name = segment_name(1).unwrap();
        let (mut created, a) = create(&name, 8192).unwrap();
        let b = open(&name, 8192).unwrap();
        assert!(open(&name, 4096).is_err());
        created.unlink();
        assert!(open(&name, 8192).is_err(), "unlinked");
        a.write(4096, b"hello");
        let mut got = [0u8; 5];
        b.read(4096, &mut got);
        assert_eq!(&got, b"hello");
        a.counter(8).store(7, std::sync::atomic::Ordering::Release);
        assert_eq!(b.counter(8).load(std::sync::atomic::Ordering::Acquire), 7);
    }
}

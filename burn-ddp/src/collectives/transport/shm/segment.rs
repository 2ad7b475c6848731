//! The shared-memory segment of a host: its layout (a control block per rank, a data slot per
//! rank, a result area), and creating and opening the file behind it.
//!
//! The host's first rank creates the segment as an anonymous memory file (`memfd_create`), sizes
//! it, reserves its pages and seals it against resizing; the others receive its descriptor (see
//! `handoff`) and check the seals before they map it. It never has a name in `/dev/shm` or
//! anywhere: the kernel frees it when the last process that maps it ends, however it ends.

use std::io;
use std::os::fd::{AsFd, OwnedFd};

use rustix::fs::{FallocateFlags, MemfdFlags, SealFlags};

use crate::sys::mapping::Mapping;

/// Bytes of a rank's control block (two cache lines: the counter does not share a line with
/// another rank's).
const CONTROL: usize = 128;
const PAGE: usize = 4096;

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

/// Seals every segment carries: its size can never change, so no access inside a mapping can
/// fault for want of backing (a truncated POSIX segment kills every rank with SIGBUS), and no
/// further seal can be added.
fn seals() -> SealFlags {
    SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL
}

/// Creates a segment of `len` bytes (zero-filled, pages reserved so that a full memory is an
/// error here rather than a SIGBUS later, sealed against resizing) and maps it. The descriptor
/// is what the host's other ranks receive (see `handoff`).
pub(crate) fn create(len: usize) -> io::Result<(OwnedFd, Mapping)> {
    let fd = rustix::fs::memfd_create(
        "burn-ddp-segment",
        MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING,
    )?;
    rustix::fs::ftruncate(&fd, len as u64)?;
    match rustix::fs::fallocate(&fd, FallocateFlags::empty(), 0, len as u64) {
        Ok(()) => {}
        Err(rustix::io::Errno::OPNOTSUPP) | Err(rustix::io::Errno::NOSYS) => {}
        Err(e) => {
            return Err(io::Error::other(format!(
                "reserving {len} bytes of shared memory: {e} (is memory short, or a cgroup limit low?)"
            )));
        }
    }
    rustix::fs::fcntl_add_seals(&fd, seals())?;
    let map = Mapping::map(fd.as_fd(), len)?;
    Ok((fd, map))
}

/// Maps the segment `fd` another rank created, after checking it has `len` bytes and is sealed
/// against resizing.
pub(crate) fn open(fd: &OwnedFd, len: usize) -> io::Result<Mapping> {
    let sealed = rustix::fs::fcntl_get_seals(fd)?;
    if !sealed.contains(SealFlags::SHRINK | SealFlags::GROW) {
        return Err(io::Error::other(
            "the segment is not sealed against resizing",
        ));
    }
    let size = rustix::fs::fstat(fd)?.st_size;
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
    fn a_segment_is_shared_and_cannot_be_resized() {
        let (fd, a) = create(8192).unwrap();
        let b = open(&fd, 8192).unwrap();
        assert!(open(&fd, 4096).is_err(), "wrong size");
        // Whoever opens the file anew (as any process of the user can, through /proc) cannot
        // shrink or grow it.
        let path = format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(&fd));
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .unwrap();
        for size in [0, 4096, 1 << 20] {
            let e = file.set_len(size).unwrap_err();
            assert_eq!(
                e.raw_os_error(),
                Some(libc_eperm()),
                "resizing to {size}: {e}"
            );
        }
        a.write(4096, b"hello");
        let mut got = [0u8; 5];
        b.read(4096, &mut got);
        assert_eq!(&got, b"hello");
        a.counter(8).store(7, std::sync::atomic::Ordering::Release);
        assert_eq!(b.counter(8).load(std::sync::atomic::Ordering::Acquire), 7);
        // A file without the seals (as a hostile creator might hand over) is refused.
        let plain = rustix::fs::memfd_create("burn-ddp-test", MemfdFlags::CLOEXEC).unwrap();
        rustix::fs::ftruncate(&plain, 8192).unwrap();
        let e = open(&plain, 8192)
            .err()
            .expect("an unsealed file is refused");
        assert!(e.to_string().contains("not sealed"), "{e}");
    }

    fn libc_eperm() -> i32 {
        rustix::io::Errno::PERM.raw_os_error()
    }
}

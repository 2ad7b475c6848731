//! Mapping a shared-memory file into this process and moving bytes and counters in and out of
//! that mapping (for the shared-memory transport, `collectives/transport/shm`).
//!
//! The mapping is shared with the other ranks' processes, so Rust references to its bytes are
//! never formed (another process may write them at any time): bytes move with raw-pointer copies
//! and the only references handed out are to [`AtomicU64`] counters, which are made to be
//! written concurrently. Every offset is checked against the mapping's length, so safe code
//! cannot reach outside it.

use std::io;
use std::os::fd::BorrowedFd;
use std::ptr::NonNull;
use std::sync::atomic::AtomicU64;

use rustix::mm::{MapFlags, ProtFlags};

/// A read-write shared mapping of a whole file, unmapped on drop.
pub(crate) struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is plain memory owned by this value (no thread-local state); moving the
// owner to another thread (the collective thread) is sound. It is not `Sync`: one thread uses it.
unsafe impl Send for Mapping {}

impl Mapping {
    /// Maps the first `len` bytes of `fd` (a shared-memory file that long, sealed against
    /// shrinking) read-write and shared.
    pub(crate) fn map(fd: BorrowedFd<'_>, len: usize) -> io::Result<Self> {
        if len == 0 {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "empty mapping"));
        }
        // SAFETY: a fresh mapping at an address the kernel chooses (null hint), so no existing
        // memory is replaced; `len` is non-zero and the caller checked the file is that long and
        // sealed against shrinking (`segment::open`), so no access within `len` faults for lack
        // of backing (the creator also reserved the pages with fallocate, so memory running out
        // cannot raise SIGBUS later).
        let ptr = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED,
                fd,
                0,
            )
        }?;
        let ptr = NonNull::new(ptr.cast::<u8>())
            .ok_or_else(|| io::Error::other("mmap returned a null address"))?;
        Ok(Mapping { ptr, len })
    }

    /// Length in bytes.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    fn check(&self, offset: usize, len: usize) {
        assert!(
            offset.checked_add(len).is_some_and(|end| end <= self.len),
            "shared-memory access {offset}+{len} outside a mapping of {} bytes",
            self.len
        );
    }

    /// The counter at `offset` (a multiple of 8).
    pub(crate) fn counter(&self, offset: usize) -> &AtomicU64 {
        self.check(offset, 8);
        assert_eq!(offset % 8, 0, "unaligned shared-memory counter");
        // SAFETY: in bounds (checked above) and 8-byte aligned (mmap returns a page-aligned
        // address and `offset` is a multiple of 8); the memory lives as long as `self`, which
        // the returned reference borrows. `AtomicU64` has the layout of `u64`, any bit pattern
        // is a valid value, and concurrent access from other processes through atomics is what
        // it is for (lock-free on every target with 64-bit atomics, so address-free).
        unsafe { &*self.ptr.as_ptr().add(offset).cast::<AtomicU64>() }
    }

    /// Copies `src` into the mapping at `offset`.
    pub(crate) fn write(&self, offset: usize, src: &[u8]) {
        self.check(offset, src.len());
        // SAFETY: the destination range is inside the mapping (checked above) and cannot
        // overlap `src`, a Rust slice of this process's own memory (the mapping is never lent
        // out as a slice). Ranks write disjoint ranges, ordered by the counters' release and
        // acquire; a peer that breaks the protocol can only leave garbage bytes, which every
        // element type accepts as values.
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr.as_ptr().add(offset), src.len());
        }
    }

    /// Copies bytes of the mapping at `offset` into `dst`.
    pub(crate) fn read(&self, offset: usize, dst: &mut [u8]) {
        self.check(offset, dst.len());
        // SAFETY: the source range is inside the mapping (checked above) and cannot overlap
        // `dst`, exclusively borrowed memory of this process. As for `write`, a peer writing the
        // range concurrently (against the protocol) yields arbitrary but valid bytes.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.ptr.as_ptr().add(offset),
                dst.as_mut_ptr(),
                dst.len(),
            );
        }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `ptr` and `len` are exactly what `mmap` returned and was asked for, and no
        // reference into the mapping outlives `self` (counters borrow it).
        if let Err(e) = unsafe { rustix::mm::munmap(self.ptr.as_ptr().cast(), self.len) } {
            log::warn!("unmapping the shared-memory segment failed: {e}");
        }
    }
}

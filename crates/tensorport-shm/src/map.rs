//! The one place that maps memory and forms raw views into it.
//!
//! A [`Mapping`] owns a `MAP_SHARED` read-write mapping of a whole fd and unmaps it on drop.
//! Views are handed out as raw parts; callers (the pool and the runtime's guards) tie their
//! lifetime to an `Arc` of the pool, so the mapping outlives every view.

use std::num::NonZeroUsize;
use std::os::fd::AsFd;
use std::ptr::NonNull;

use nix::sys::mman::{mmap, munmap, MapFlags, ProtFlags};

use crate::{sys, Result, ShmError};

/// A shared read-write mapping of `len` bytes of an fd, unmapped on drop.
#[derive(Debug)]
pub struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is plain memory owned by this value; moving the owner to another thread
// moves no thread-bound state. Concurrent access is governed by the slot protocol above.
unsafe impl Send for Mapping {}
// SAFETY: `&Mapping` only exposes the address and length; reads and writes through views are
// coordinated by the slot states (one writer per slot at a time).
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps `len` bytes of `fd` from offset 0, shared and read-write.
    pub fn new(fd: impl AsFd, len: usize) -> Result<Mapping> {
        let nz = NonZeroUsize::new(len).ok_or_else(|| ShmError::BadLayout("empty pool".into()))?;
        // SAFETY: we ask the kernel for a fresh mapping (no fixed address), so no existing Rust
        // object is aliased. The fd is sealed against shrinking by the caller, so every page of
        // `len` stays backed for the mapping's life.
        let ptr = unsafe {
            mmap(
                None,
                nz,
                ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
                MapFlags::MAP_SHARED,
                fd,
                0,
            )
        }
        .map_err(sys("mmap"))?;
        Ok(Mapping {
            ptr: ptr.cast(),
            len,
        })
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the mapping is empty (never, for a constructed mapping).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Start address.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Shared view of `len` bytes at `offset`.
    ///
    /// # Safety
    /// `offset + len` must be within the mapping (checked here, panics otherwise only as a last
    /// resort in debug builds), and no one may write these bytes while the view lives, unless the
    /// caller accepts that a writer in *another process* can change them (the bytes are then
    /// merely unspecified, never out of bounds).
    pub unsafe fn slice(&self, offset: usize, len: usize) -> &[u8] {
        debug_assert!(offset.checked_add(len).is_some_and(|e| e <= self.len));
        // SAFETY: in bounds by the caller's contract; the mapping lives as long as `self`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(offset), len) }
    }

    /// Exclusive view of `len` bytes at `offset`.
    ///
    /// # Safety
    /// As [`Mapping::slice`], and no other view of these bytes may exist in this process while
    /// this one lives.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slice_mut(&self, offset: usize, len: usize) -> &mut [u8] {
        debug_assert!(offset.checked_add(len).is_some_and(|e| e <= self.len));
        // SAFETY: in bounds and exclusive by the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().add(offset), len) }
    }
}

impl Mapping {
    /// The 8-byte word at `offset` as an atomic, for indices and flags that two processes share.
    /// Panics if `offset` is unaligned or past the end (callers pass constants and checked
    /// ring positions).
    pub fn atomic_u64(&self, offset: usize) -> &std::sync::atomic::AtomicU64 {
        assert!(
            offset.is_multiple_of(8) && offset.checked_add(8).is_some_and(|e| e <= self.len),
            "atomic word {offset} outside a mapping of {}",
            self.len
        );
        // SAFETY: in bounds and 8-aligned (checked above; the mapping itself is page-aligned);
        // `AtomicU64` has the size and alignment of `u64` and every bit pattern is a valid value,
        // so a peer writing any bytes there at any time cannot make this reference invalid; all
        // accesses to shared ring words in this process go through such atomics; the reference
        // borrows `self`, so the mapping outlives it.
        unsafe { &*(self.ptr.as_ptr().add(offset) as *const std::sync::atomic::AtomicU64) }
    }
}

/// What a [`Mapping::prefetch`] is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Prefetch {
    /// The line will be read.
    Read,
    /// The line will be written (fetched exclusive: the write does not wait for the other
    /// core's copy to be invalidated).
    Write,
}

impl Mapping {
    /// Starts fetching the cache line holding `offset` into this core's cache, without waiting
    /// for it: a hint, so a line another core is writing arrives while this one works on
    /// something else. Does nothing past the end of the mapping, or off x86-64.
    #[inline]
    pub fn prefetch(&self, offset: usize, why: Prefetch) {
        if offset >= self.len {
            return;
        }
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::x86_64::{_mm_prefetch, _MM_HINT_ET0, _MM_HINT_T0};
            let p = self.ptr.as_ptr().wrapping_add(offset) as *const i8;
            // SAFETY: a prefetch is only a hint: it never faults, reads nothing into this
            // program's values and writes nothing (and the address is inside the mapping
            // anyway). SSE, which `prefetcht0` needs, is part of x86-64; `prefetchw` is a no-op
            // hint on cores without it.
            unsafe {
                match why {
                    Prefetch::Read => _mm_prefetch::<_MM_HINT_T0>(p),
                    Prefetch::Write => _mm_prefetch::<_MM_HINT_ET0>(p),
                }
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = why;
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` are exactly what mmap returned, and every view into the mapping
        // borrows from `self` (or from an Arc that owns it), so none outlives this call.
        if let Err(e) = unsafe { munmap(self.ptr.cast(), self.len) } {
            // Nothing sensible to do: report and move on (the memory goes with the process).
            eprintln!("tensorport-shm: munmap failed: {e}");
        }
    }
}

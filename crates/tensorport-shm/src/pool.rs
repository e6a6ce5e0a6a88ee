//! Sealed memfd pools.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};

use nix::fcntl::{fcntl, FcntlArg, SealFlag};
use nix::sys::memfd::{memfd_create, MFdFlags};
use nix::sys::stat::fstat;
use nix::unistd::ftruncate;

use crate::map::Mapping;
use crate::{sys, Result, ShmError};

/// Seals every pool carries: it can neither shrink nor grow, and no one can remove the seals.
pub const REQUIRED_SEALS: i32 = libc_seals::SHRINK | libc_seals::GROW | libc_seals::SEAL;

mod libc_seals {
    // Values from <linux/fcntl.h>; part of the Linux ABI.
    pub const SEAL: i32 = 0x0001;
    pub const SHRINK: i32 = 0x0002;
    pub const GROW: i32 = 0x0004;
}

/// The system page size.
pub fn page_size() -> u64 {
    nix::unistd::sysconf(nix::unistd::SysconfVar::PAGE_SIZE)
        .ok()
        .flatten()
        .map(|v| v as u64)
        .unwrap_or(4096)
}

/// Pins a pool for fast device copies (e.g. `cuMemHostRegister`). Implemented by the CUDA crate;
/// the host-only build uses none.
pub trait PinHook: Send + Sync {
    /// Registers `len` bytes at `ptr`. The returned registration is dropped (and must unregister)
    /// before the memory is unmapped.
    ///
    /// # Safety
    /// `ptr..ptr+len` must be a live mapping that stays mapped until the returned registration
    /// has been dropped. [`HostPool::pin_with`] guarantees this.
    unsafe fn pin(&self, ptr: *mut u8, len: usize) -> std::result::Result<PinRegistration, String>;
}

/// A live pinning of a pool; dropping it unpins.
pub struct PinRegistration(#[allow(dead_code)] Box<dyn Send + Sync>);

impl PinRegistration {
    /// Wraps whatever unpins on drop.
    pub fn new(guard: impl Send + Sync + 'static) -> PinRegistration {
        PinRegistration(Box::new(guard))
    }
}

impl std::fmt::Debug for PinRegistration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PinRegistration")
    }
}

/// A pool of equal slots in one sealed memfd, mapped read-write.
#[derive(Debug)]
pub struct HostPool {
    // Field order matters: the pin registration drops before the mapping, the mapping before
    // the fd.
    pin: Option<PinRegistration>,
    map: Mapping,
    fd: OwnedFd,
    slot_count: u32,
    slot_size: u64,
}

impl HostPool {
    /// The slot size (rounded up to the page size) and the bytes a pool of `slot_count` such
    /// slots reserves, as [`HostPool::create`] would make it; `None` if that overflows.
    pub fn size_for(slot_count: u32, slot_size: u64) -> Option<(u64, u64)> {
        let slot = slot_size.checked_next_multiple_of(page_size())?;
        let len = slot
            .checked_mul(u64::from(slot_count))
            .filter(|&l| l <= isize::MAX as u64)?;
        Some((slot, len))
    }

    /// Creates a pool of `slot_count` slots of at least `slot_size` bytes each (rounded up to the
    /// page size, so every slot starts page-aligned). The memory is reserved and sealed before
    /// this returns.
    pub fn create(name: &str, slot_count: u32, slot_size: u64) -> Result<HostPool> {
        if slot_count == 0 || slot_size == 0 {
            return Err(ShmError::BadLayout(format!(
                "{slot_count} slots of {slot_size} bytes"
            )));
        }
        let (slot_size, len) = HostPool::size_for(slot_count, slot_size)
            .ok_or_else(|| ShmError::BadLayout("pool size overflows".into()))?;
        let fd = memfd_create(name, MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING)
            .map_err(sys("memfd_create"))?;
        // Over RLIMIT_FSIZE both calls fail with EFBIG — and raise SIGXFSZ, whose default action
        // kills the process: a server must ignore or catch it (`tensorport serve` does).
        match ftruncate(&fd, len as i64) {
            Ok(()) => {}
            Err(nix::Error::EFBIG) => return Err(ShmError::FileSizeLimit { bytes: len }),
            Err(e) => return Err(sys("ftruncate")(e)),
        }
        // Reserve the pages now: on a full tmpfs or memory cgroup this fails here with ENOSPC
        // instead of killing a process with SIGBUS when it first touches the page.
        match nix::fcntl::fallocate(&fd, nix::fcntl::FallocateFlags::empty(), 0, len as i64) {
            Ok(()) => {}
            Err(nix::Error::EOPNOTSUPP) => {}
            Err(nix::Error::EFBIG) => return Err(ShmError::FileSizeLimit { bytes: len }),
            Err(source) => return Err(ShmError::NoSpace { bytes: len, source }),
        }
        fcntl(
            &fd,
            FcntlArg::F_ADD_SEALS(
                SealFlag::F_SEAL_SHRINK | SealFlag::F_SEAL_GROW | SealFlag::F_SEAL_SEAL,
            ),
        )
        .map_err(sys("fcntl(F_ADD_SEALS)"))?;
        let map = Mapping::new(&fd, len as usize)?;
        Ok(HostPool {
            pin: None,
            map,
            fd,
            slot_count,
            slot_size,
        })
    }

    /// Maps a pool received from a peer, after checking that it is sealed and large enough for
    /// `slot_count * slot_size` bytes.
    pub fn open(fd: OwnedFd, slot_count: u32, slot_size: u64) -> Result<HostPool> {
        let len = slot_size
            .checked_mul(slot_count as u64)
            .filter(|&l| l > 0 && l <= isize::MAX as u64)
            .ok_or_else(|| ShmError::BadLayout(format!("{slot_count} x {slot_size} bytes")))?;
        let seals = fcntl(&fd, FcntlArg::F_GET_SEALS).map_err(sys("fcntl(F_GET_SEALS)"))?;
        if seals & REQUIRED_SEALS != REQUIRED_SEALS {
            return Err(ShmError::NotSealed {
                have: seals,
                need: REQUIRED_SEALS,
            });
        }
        let st = fstat(&fd).map_err(sys("fstat"))?;
        if (st.st_size as u64) < len {
            return Err(ShmError::TooSmall {
                actual: st.st_size as u64,
                expected: len,
            });
        }
        let map = Mapping::new(&fd, len as usize)?;
        Ok(HostPool {
            pin: None,
            map,
            fd,
            slot_count,
            slot_size,
        })
    }

    /// Pins the pool with `hook` (once; later calls are no-ops).
    pub fn pin_with(&mut self, hook: &dyn PinHook) -> Result<()> {
        if self.pin.is_none() {
            // SAFETY: the whole mapping is live, and `pin` is declared before `map` in HostPool,
            // so the registration is dropped before the mapping is unmapped.
            let reg =
                unsafe { hook.pin(self.map.as_ptr(), self.map.len()) }.map_err(ShmError::Pin)?;
            self.pin = Some(reg);
        }
        Ok(())
    }

    /// Whether the pool is pinned.
    pub fn is_pinned(&self) -> bool {
        self.pin.is_some()
    }

    /// Number of slots.
    pub fn slot_count(&self) -> u32 {
        self.slot_count
    }

    /// Bytes per slot.
    pub fn slot_size(&self) -> u64 {
        self.slot_size
    }

    /// Bytes in the pool.
    pub fn len(&self) -> u64 {
        self.map.len() as u64
    }

    /// Whether the pool has no bytes (never true).
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// The memfd, to send to a peer.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// The raw memfd number (for logs).
    pub fn raw_fd(&self) -> i32 {
        self.fd.as_raw_fd()
    }

    /// The mapping.
    pub fn mapping(&self) -> &Mapping {
        &self.map
    }

    /// Byte offset of `slot` in the pool, if it exists.
    pub fn slot_offset(&self, slot: u32) -> Option<usize> {
        (slot < self.slot_count).then(|| (slot as u64 * self.slot_size) as usize)
    }

    /// Read view of `len` bytes at `offset` inside `slot`, or `None` if any of it lies outside.
    ///
    /// # Safety
    /// The caller must hold the slot in a state where no honest peer writes it (submitted to the
    /// server). A dishonest peer in another process can still change the bytes, which makes them
    /// unspecified but never out of bounds.
    pub unsafe fn slot_bytes(&self, slot: u32, offset: u64, len: u64) -> Option<&[u8]> {
        let base = self.slot_offset(slot)?;
        let end = offset.checked_add(len)?;
        if end > self.slot_size {
            return None;
        }
        // SAFETY: bounds checked just above; exclusivity is the caller's contract.
        Some(unsafe { self.map.slice(base + offset as usize, len as usize) })
    }

    /// Write view of the whole of `slot`, or `None` if it does not exist.
    ///
    /// # Safety
    /// The caller must hold the slot exclusively (granted to it, not submitted) and form no other
    /// view of it while this one lives.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slot_bytes_mut(&self, slot: u32) -> Option<&mut [u8]> {
        let base = self.slot_offset(slot)?;
        // SAFETY: the slot lies inside the mapping (slot < slot_count); exclusivity is the
        // caller's contract.
        Some(unsafe { self.map.slice_mut(base, self.slot_size as usize) })
    }
}

impl AsFd for HostPool {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn create_seal_and_reopen() {
        let pool = HostPool::create("tensorport-test", 4, 1000).unwrap();
        assert_eq!(pool.slot_size(), page_size());
        assert_eq!(pool.len(), 4 * page_size());
        // Shrinking or growing the sealed memfd fails.
        assert_eq!(ftruncate(pool.fd(), 0), Err(nix::Error::EPERM));
        assert_eq!(
            ftruncate(pool.fd(), (pool.len() * 2) as i64),
            Err(nix::Error::EPERM)
        );
        // SAFETY: the test holds slot 2 exclusively.
        unsafe { pool.slot_bytes_mut(2).unwrap()[..4].copy_from_slice(b"abcd") };
        let dup = pool.fd().try_clone_to_owned().unwrap();
        let other = HostPool::open(dup, 4, pool.slot_size()).unwrap();
        // SAFETY: nobody writes slot 2 now.
        assert_eq!(unsafe { other.slot_bytes(2, 0, 4) }.unwrap(), b"abcd");
        // SAFETY: as above; the request is out of bounds and must be refused.
        assert!(unsafe { other.slot_bytes(2, pool.slot_size() - 2, 4) }.is_none());
        // SAFETY: slot 4 does not exist; the call must refuse it without reading.
        assert!(unsafe { other.slot_bytes(4, 0, 1) }.is_none());
    }

    #[test]
    fn open_refuses_unsealed_or_short() {
        let fd = memfd_create("x", MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING).unwrap();
        ftruncate(&fd, 8192).unwrap();
        assert!(matches!(
            HostPool::open(fd, 2, 4096),
            Err(ShmError::NotSealed { .. })
        ));
        let pool = HostPool::create("tensorport-test", 1, 4096).unwrap();
        let dup = pool.fd().try_clone_to_owned().unwrap();
        assert!(matches!(
            HostPool::open(dup, 2, 4096),
            Err(ShmError::TooSmall { .. })
        ));
    }

    #[test]
    fn bad_layouts() {
        assert!(HostPool::create("x", 0, 4096).is_err());
        assert!(HostPool::create("x", 1, 0).is_err());
        assert!(HostPool::create("x", u32::MAX, u64::MAX / 2).is_err());
    }

    #[test]
    fn pin_hook_runs_and_unpins_before_unmap() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        use std::sync::Arc;
        struct Hook(Arc<AtomicUsize>);
        struct Unpin(Arc<AtomicUsize>);
        impl Drop for Unpin {
            fn drop(&mut self) {
                self.0.fetch_sub(1, Ordering::SeqCst);
            }
        }
        impl PinHook for Hook {
            unsafe fn pin(
                &self,
                _p: *mut u8,
                len: usize,
            ) -> std::result::Result<PinRegistration, String> {
                assert!(len > 0);
                self.0.fetch_add(1, Ordering::SeqCst);
                Ok(PinRegistration::new(Unpin(self.0.clone())))
            }
        }
        let live = Arc::new(AtomicUsize::new(0));
        let mut pool = HostPool::create("x", 2, 4096).unwrap();
        pool.pin_with(&Hook(live.clone())).unwrap();
        pool.pin_with(&Hook(live.clone())).unwrap();
        assert!(pool.is_pinned());
        assert_eq!(live.load(Ordering::SeqCst), 1);
        drop(pool);
        assert_eq!(live.load(Ordering::SeqCst), 0);
    }
}

//! The server's memory budget for producer pools: what all sessions' pools may reserve together.
//!
//! A session's pool is charged before it is created and the charge is given back when the last
//! reference to the pool goes (the session and every request still reading it), so a burst of
//! `Hello`s asking for the most memory each cannot push the server past its budget.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Bytes all pools may hold together, and how many they hold now.
#[derive(Debug)]
pub(crate) struct MemoryBudget {
    limit: u64,
    used: Arc<AtomicU64>,
}

/// Bytes charged to a [`MemoryBudget`]; given back when dropped.
#[derive(Debug)]
pub(crate) struct Charge {
    used: Arc<AtomicU64>,
    bytes: u64,
}

impl Drop for Charge {
    fn drop(&mut self) {
        self.used.fetch_sub(self.bytes, Ordering::SeqCst);
    }
}

impl MemoryBudget {
    pub(crate) fn new(limit: u64) -> MemoryBudget {
        MemoryBudget {
            limit,
            used: Arc::new(AtomicU64::new(0)),
        }
    }

    pub(crate) fn limit(&self) -> u64 {
        self.limit
    }

    pub(crate) fn used(&self) -> u64 {
        self.used.load(Ordering::SeqCst)
    }

    /// Charges `bytes` if they fit; otherwise returns what is in use.
    pub(crate) fn charge(&self, bytes: u64) -> Result<Charge, u64> {
        self.used
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |u| {
                u.checked_add(bytes).filter(|&t| t <= self.limit)
            })
            .map(|_| Charge {
                used: self.used.clone(),
                bytes,
            })
    }
}

/// Bytes of physical memory, or `None` where the system does not say.
pub(crate) fn physical_memory() -> Option<u64> {
    use nix::unistd::{sysconf, SysconfVar};
    let pages = sysconf(SysconfVar::_PHYS_PAGES).ok().flatten()?;
    let page = sysconf(SysconfVar::PAGE_SIZE).ok().flatten()?;
    u64::try_from(pages)
        .ok()?
        .checked_mul(u64::try_from(page).ok()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn charges_fit_or_are_refused_and_come_back_when_dropped() {
        let b = MemoryBudget::new(100);
        let a = b.charge(60).unwrap();
        assert_eq!(b.charge(41).unwrap_err(), 60);
        let c = b.charge(40).unwrap();
        assert_eq!(b.used(), 100);
        drop(a);
        assert_eq!(b.used(), 40);
        assert!(b.charge(u64::MAX).is_err(), "an overflowing ask is refused");
        drop(c);
        assert_eq!(b.used(), 0);
    }

    #[test]
    fn physical_memory_is_known_here() {
        assert!(physical_memory().is_some_and(|m| m > 1 << 20));
    }
}

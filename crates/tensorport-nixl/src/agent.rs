//! A NIXL agent with a UCX backend, the host memory it registers, and the peers it may read.
//!
//! Ownership: an [`Agent`] owns its NIXL agent and backend; a [`Region`] owns page-aligned host
//! memory registered with the agent and keeps the agent alive; a [`Peer`] is a remote agent whose
//! metadata was loaded, with the slots it says it registered — checked for bounds here, and again
//! by NIXL against the registrations in its metadata before any read is prepared.

use std::alloc::Layout;
use std::ffi::{c_char, CString};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::capi::{Capi, Handle, MEM_DRAM};
use crate::error::{Error, Result};

/// The largest metadata blob accepted from a peer (a UCX agent's is a few hundred bytes).
pub const MAX_METADATA: usize = 64 << 10;
/// The most slots a peer may describe.
pub const MAX_SLOTS: u32 = 4096;
/// The largest slot a peer may describe.
pub const MAX_SLOT_LEN: u64 = 1 << 30;

pub(crate) struct AgentInner {
    pub(crate) capi: Arc<Capi>,
    raw: Handle,
    backend: Handle,
    pub(crate) name: String,
    /// Held for every call on the agent: NIXL's default agent does not synchronise its own API.
    lock: Mutex<()>,
}

// SAFETY: a NIXL agent may be called from any thread (its progress thread is its own); calls
// through this crate are serialised by `lock` (`AgentInner::locked`).
unsafe impl Send for AgentInner {}
// SAFETY: as above.
unsafe impl Sync for AgentInner {}

impl AgentInner {
    /// The agent's handle, with the lock that every call on it holds.
    pub(crate) fn locked(&self) -> (MutexGuard<'_, ()>, Handle) {
        (
            self.lock.lock().unwrap_or_else(|e| e.into_inner()),
            self.raw,
        )
    }
}

impl Drop for AgentInner {
    fn drop(&mut self) {
        // SAFETY: both handles were made by this agent and nothing uses them after this; regions
        // and readers hold an `Arc` to this, so all of them are gone.
        unsafe {
            (self.capi.destroy_agent)(self.raw);
            (self.capi.destroy_backend)(self.backend);
        }
    }
}

/// A NIXL agent with a UCX backend (UCX picks its transports; `UCX_TLS=tcp` forces TCP).
pub struct Agent {
    pub(crate) inner: Arc<AgentInner>,
}

impl std::fmt::Debug for Agent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Agent")
            .field("name", &self.inner.name)
            .finish()
    }
}

fn c_string(s: &str) -> Result<CString> {
    CString::new(s).map_err(|_| Error::Refused("a name with a NUL byte"))
}

impl Agent {
    /// An agent named `name` (unique among the agents that will meet) with a UCX backend.
    pub fn new(capi: &Arc<Capi>, name: &str) -> Result<Agent> {
        let cname = c_string(name)?;
        let mut raw: Handle = std::ptr::null_mut();
        // SAFETY: a valid C string and an out-pointer.
        Capi::check("create_agent", unsafe {
            (capi.create_agent)(cname.as_ptr(), &mut raw)
        })?;
        let (mut mems, mut params): (Handle, Handle) = (std::ptr::null_mut(), std::ptr::null_mut());
        let ucx = c"UCX";
        // SAFETY: a live agent, a C string and two out-pointers.
        let got = Capi::check("get_plugin_params", unsafe {
            (capi.get_plugin_params)(raw, ucx.as_ptr(), &mut mems, &mut params)
        });
        let mut backend: Handle = std::ptr::null_mut();
        let made = got.and_then(|()| {
            // SAFETY: a live agent and the plugin's default parameters.
            Capi::check("create_backend", unsafe {
                (capi.create_backend)(raw, ucx.as_ptr(), params, &mut backend)
            })
        });
        // SAFETY: the lists were returned to us (or are null) and are not used again.
        unsafe {
            if !mems.is_null() {
                (capi.destroy_mem_list)(mems);
            }
            if !params.is_null() {
                (capi.destroy_params)(params);
            }
        }
        if let Err(e) = made {
            // SAFETY: the agent is ours and unused.
            unsafe { (capi.destroy_agent)(raw) };
            return Err(e);
        }
        Ok(Agent {
            inner: Arc::new(AgentInner {
                capi: capi.clone(),
                raw,
                backend,
                name: name.to_owned(),
                lock: Mutex::new(()),
            }),
        })
    }

    /// This agent's name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The metadata a peer loads to read this agent's registered memory: its name, its UCX
    /// addresses and its registrations' keys. Send it over an authenticated channel only.
    pub fn metadata(&self) -> Result<Vec<u8>> {
        let mut data = std::ptr::null_mut();
        let mut len = 0usize;
        let (_g, raw) = self.inner.locked();
        // SAFETY: a live agent and two out-pointers.
        Capi::check("get_local_md", unsafe {
            (self.inner.capi.get_local_md)(raw, &mut data, &mut len)
        })?;
        // SAFETY: NIXL `malloc`ed `len` bytes for us.
        Ok(unsafe { Capi::take_blob(data, len) })
    }

    /// Registers `slots` slots of `slot_len` bytes of fresh, zeroed, page-aligned host memory.
    pub fn register(&self, slots: u32, slot_len: u64) -> Result<Region> {
        if slots == 0 || slots > MAX_SLOTS || slot_len == 0 || slot_len > MAX_SLOT_LEN {
            return Err(Error::Refused("slot count or length out of bounds"));
        }
        let len = (slot_len as usize)
            .checked_mul(slots as usize)
            .ok_or(Error::Refused("region too large"))?;
        let layout =
            Layout::from_size_align(len, 4096).map_err(|_| Error::Refused("region too large"))?;
        // SAFETY: `layout` has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            return Err(Error::Refused("out of memory for the region"));
        }
        let mem = Mem::Owned {
            ptr,
            layout,
            leaked: false,
        };
        let capi = &self.inner.capi;
        let dlist = reg_dlist(capi, ptr as usize, len)?;
        let (g, raw) = self.inner.locked();
        // SAFETY: a live agent and a descriptor list of memory we own for the region's life.
        let r = Capi::check("register_mem", unsafe {
            (capi.register_mem)(raw, dlist, std::ptr::null_mut())
        });
        drop(g);
        if let Err(e) = r {
            // SAFETY: ours, unused after this.
            unsafe { (capi.destroy_reg_dlist)(dlist) };
            return Err(e);
        }
        Ok(Region {
            agent: self.inner.clone(),
            mem,
            dlist,
            slots,
            slot_len,
            stride: slot_len,
        })
    }

    /// Registers memory this crate did not allocate — a shared-memory pool, say — as `slots`
    /// slots `stride` bytes apart from `base`, of which each transfer moves the first
    /// `slot_len`. The region holds `keep` until it is dropped (or for ever, if a transfer into
    /// it could not be finished).
    ///
    /// # Safety
    /// `base .. base + stride * slots` must stay mapped, readable and writable for as long as
    /// `keep` lives, and nothing else may write a slot while a transfer into it runs or read it
    /// before the transfer has finished (a [`crate::Reader`] into the region says when).
    pub(crate) unsafe fn register_external(
        &self,
        base: *mut u8,
        stride: u64,
        slot_len: u64,
        slots: u32,
        keep: impl Send + Sync + 'static,
    ) -> Result<Region> {
        if slots == 0 || slots > MAX_SLOTS || slot_len == 0 || slot_len > MAX_SLOT_LEN {
            return Err(Error::Refused("slot count or length out of bounds"));
        }
        if stride < slot_len || base.is_null() {
            return Err(Error::Refused("slots overlap, or no memory"));
        }
        let len = stride
            .checked_mul(u64::from(slots))
            .and_then(|l| usize::try_from(l).ok())
            .filter(|&l| (base as usize).checked_add(l).is_some())
            .ok_or(Error::Refused("region too large"))?;
        let mem = Mem::Borrowed {
            ptr: base,
            keep: Some(Box::new(keep)),
        };
        let capi = &self.inner.capi;
        let dlist = reg_dlist(capi, base as usize, len)?;
        let (g, raw) = self.inner.locked();
        // SAFETY: a live agent and a descriptor list of memory the caller keeps mapped while
        // `keep` (now the region's) lives.
        let r = Capi::check("register_mem", unsafe {
            (capi.register_mem)(raw, dlist, std::ptr::null_mut())
        });
        drop(g);
        if let Err(e) = r {
            // SAFETY: ours, unused after this.
            unsafe { (capi.destroy_reg_dlist)(dlist) };
            return Err(e);
        }
        Ok(Region {
            agent: self.inner.clone(),
            mem,
            dlist,
            slots,
            slot_len,
            stride,
        })
    }

    /// Loads a peer's metadata (at most [`MAX_METADATA`] bytes), whose registered memory it says
    /// holds `layout`'s slots. The peer's name comes from the metadata and must be `expect`.
    pub fn add_peer(&self, metadata: &[u8], expect: &str, layout: SlotLayout) -> Result<Peer> {
        if metadata.is_empty() || metadata.len() > MAX_METADATA {
            return Err(Error::Refused("peer metadata empty or over 64 KiB"));
        }
        layout.check()?;
        let mut name: *mut c_char = std::ptr::null_mut();
        let (g, raw) = self.inner.locked();
        // SAFETY: a live agent, `metadata.len()` readable bytes, an out-pointer.
        let loaded = Capi::check("load_remote_md", unsafe {
            (self.inner.capi.load_remote_md)(
                raw,
                metadata.as_ptr().cast(),
                metadata.len(),
                &mut name,
            )
        });
        drop(g);
        loaded?;
        // SAFETY: NIXL `strdup`ed the name for us.
        let name = unsafe { Capi::take_string(name) };
        let peer = Peer {
            agent: self.inner.clone(),
            cname: c_string(&name)?,
            name,
            layout,
        };
        if peer.name != expect {
            return Err(Error::Refused("the peer's metadata names another agent"));
        }
        Ok(peer)
    }
}

/// A descriptor list of one DRAM span.
fn reg_dlist(capi: &Capi, addr: usize, len: usize) -> Result<Handle> {
    let mut dlist: Handle = std::ptr::null_mut();
    // SAFETY: an out-pointer.
    Capi::check("create_reg_dlist", unsafe {
        (capi.create_reg_dlist)(MEM_DRAM, &mut dlist)
    })?;
    // SAFETY: a live list; the span is only described here, not accessed.
    let r = Capi::check("reg_dlist_add_desc", unsafe {
        (capi.reg_dlist_add_desc)(dlist, addr, len, 0, std::ptr::null(), 0)
    });
    if let Err(e) = r {
        // SAFETY: ours, unused after this.
        unsafe { (capi.destroy_reg_dlist)(dlist) };
        return Err(e);
    }
    Ok(dlist)
}

/// A region's memory: allocated here, or another owner's kept alive by a guard.
enum Mem {
    Owned {
        ptr: *mut u8,
        layout: Layout,
        /// A transfer into it may still run: never free it.
        leaked: bool,
    },
    Borrowed {
        ptr: *mut u8,
        /// Keeps the memory mapped; forgotten (never dropped) if a transfer may still run.
        keep: Option<Box<dyn Send + Sync>>,
    },
}

impl Mem {
    fn ptr(&self) -> *mut u8 {
        match self {
            Mem::Owned { ptr, .. } | Mem::Borrowed { ptr, .. } => *ptr,
        }
    }

    fn leak(&mut self) {
        match self {
            Mem::Owned { leaked, .. } => *leaked = true,
            Mem::Borrowed { keep, .. } => std::mem::forget(keep.take()),
        }
    }
}

impl Drop for Mem {
    fn drop(&mut self) {
        if let Mem::Owned {
            ptr,
            layout,
            leaked: false,
        } = self
        {
            // SAFETY: allocated with this layout in `Agent::register`.
            unsafe { std::alloc::dealloc(*ptr, *layout) }
        }
    }
}

/// Host memory registered with an agent: `slots` slots of `slot_len` bytes, `stride` bytes
/// apart, each one a tensor's place. Peers read it (given this agent's metadata); readers write
/// into it.
pub struct Region {
    pub(crate) agent: Arc<AgentInner>,
    mem: Mem,
    dlist: Handle,
    pub(crate) slots: u32,
    pub(crate) slot_len: u64,
    stride: u64,
}

// SAFETY: the memory and the handles belong to the region alone; see `AgentInner`.
unsafe impl Send for Region {}

impl std::fmt::Debug for Region {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Region")
            .field("slots", &self.slots)
            .field("slot_len", &self.slot_len)
            .field("stride", &self.stride)
            .finish()
    }
}

impl Region {
    /// What a peer needs besides the metadata to read this region's slots (of a region made by
    /// [`Agent::register`], whose slots are back to back).
    pub fn layout(&self) -> SlotLayout {
        debug_assert_eq!(self.stride, self.slot_len);
        SlotLayout {
            base: self.mem.ptr() as u64,
            slot_len: self.slot_len,
            slots: self.slots,
        }
    }

    /// Slot `i`'s bytes.
    pub fn slot(&self, i: u32) -> Option<&[u8]> {
        let (off, len) = self.span(i)?;
        // SAFETY: inside the region's memory; `&self` excludes writers through this crate (a
        // reader owns the region it reads into and hands out only slots with no transfer in
        // flight).
        Some(unsafe { std::slice::from_raw_parts(self.mem.ptr().add(off), len) })
    }

    /// Slot `i`'s bytes, to fill.
    pub fn slot_mut(&mut self, i: u32) -> Option<&mut [u8]> {
        let (off, len) = self.span(i)?;
        // SAFETY: inside the region's memory, borrowed uniquely.
        Some(unsafe { std::slice::from_raw_parts_mut(self.mem.ptr().add(off), len) })
    }

    fn span(&self, i: u32) -> Option<(usize, usize)> {
        (i < self.slots).then(|| (i as usize * self.stride as usize, self.slot_len as usize))
    }

    pub(crate) fn slot_addr(&self, i: u32) -> u64 {
        self.mem.ptr() as u64 + u64::from(i) * self.stride
    }

    /// A transfer into the region may outlive it: its memory stays allocated (or mapped).
    pub(crate) fn leak_memory(&mut self) {
        self.mem.leak();
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        let (_g, raw) = self.agent.locked();
        // SAFETY: registered in `Agent::register` with this list; no transfer into it runs
        // (a reader owns its region and finishes or gives up its transfers before it drops, and
        // leaks the memory of one it could not).
        unsafe {
            (self.agent.capi.deregister_mem)(raw, self.dlist, std::ptr::null_mut());
            (self.agent.capi.destroy_reg_dlist)(self.dlist);
        }
    }
}

/// Where a peer says its slots are: `slots` slots of `slot_len` bytes from `base`, in its own
/// address space. Untrusted until [`SlotLayout::check`]ed, and NIXL refuses any read outside
/// what the peer's metadata registered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotLayout {
    pub base: u64,
    pub slot_len: u64,
    pub slots: u32,
}

impl SlotLayout {
    /// Within [`MAX_SLOTS`] and [`MAX_SLOT_LEN`], and not wrapping the address space.
    pub fn check(&self) -> Result<()> {
        if self.slots == 0 || self.slots > MAX_SLOTS {
            return Err(Error::Refused("slot count out of bounds"));
        }
        if self.slot_len == 0 || self.slot_len > MAX_SLOT_LEN {
            return Err(Error::Refused("slot length out of bounds"));
        }
        self.slot_len
            .checked_mul(u64::from(self.slots))
            .and_then(|len| self.base.checked_add(len))
            .ok_or(Error::Refused("slots wrap the address space"))?;
        Ok(())
    }
}

/// A remote agent whose metadata this agent loaded.
pub struct Peer {
    pub(crate) agent: Arc<AgentInner>,
    pub(crate) name: String,
    pub(crate) cname: CString,
    pub(crate) layout: SlotLayout,
}

impl std::fmt::Debug for Peer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Peer")
            .field("name", &self.name)
            .field("layout", &self.layout)
            .finish()
    }
}

impl Peer {
    /// The peer's agent name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its slots.
    pub fn layout(&self) -> SlotLayout {
        self.layout
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let (_g, raw) = self.agent.locked();
        // SAFETY: a live agent and a C string; forgetting a peer's metadata ends its connection.
        unsafe { (self.agent.capi.invalidate_remote_md)(raw, self.cname.as_ptr()) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_out_of_bounds_are_refused() {
        let ok = SlotLayout {
            base: 4096,
            slot_len: 602_112,
            slots: 64,
        };
        assert!(ok.check().is_ok());
        for bad in [
            SlotLayout { slots: 0, ..ok },
            SlotLayout {
                slots: MAX_SLOTS + 1,
                ..ok
            },
            SlotLayout { slot_len: 0, ..ok },
            SlotLayout {
                slot_len: MAX_SLOT_LEN + 1,
                ..ok
            },
            SlotLayout {
                base: u64::MAX - 4096,
                ..ok
            },
        ] {
            assert!(matches!(bad.check(), Err(Error::Refused(_))), "{bad:?}");
        }
    }
}

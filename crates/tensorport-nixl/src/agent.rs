//! A NIXL agent with a UCX backend, the host memory it registers, and the peers it may read.
//!
//! Ownership: an [`Agent`] owns its NIXL agent and backend; a [`Region`] owns page-aligned host
//! memory registered with the agent and keeps the agent alive; a [`Peer`] is a remote agent whose
//! metadata was loaded, with the slots it says it registered — checked for bounds here, and again
//! by NIXL against the registrations in its metadata before any read is prepared.

use std::alloc::Layout;
use std::ffi::{c_char, CString};
use std::sync::{Arc, Mutex, MutexGuard};

use tensorport_cuda::{DeviceBuffer, Gpu, Stream};

use crate::capi::{Capi, Handle, MEM_DRAM, MEM_VRAM};
use crate::error::{Error, Result};

/// The largest metadata blob accepted from a peer (a UCX agent's is a few hundred bytes).
pub const MAX_METADATA: usize = 64 << 10;
/// The most slots a peer may describe.
pub const MAX_SLOTS: u32 = 4096;
/// The largest slot a peer may describe.
pub const MAX_SLOT_LEN: u64 = 1 << 30;
/// The highest GPU ordinal a peer may name.
pub const MAX_GPU: u32 = 63;

/// `UCX_TLS` for "TCP only" on this host: `tcp`, or `tcp,cuda_copy` where NVIDIA GPUs are
/// present, since NIXL's UCX backend refuses a list without a CUDA transport there
/// (`cuda_copy` moves only device memory; host memory still goes over TCP).
pub fn tcp_transports() -> &'static str {
    if gpus_present() {
        "tcp,cuda_copy"
    } else {
        "tcp"
    }
}

/// Whether this host has an NVIDIA GPU device node.
fn gpus_present() -> bool {
    std::path::Path::new("/dev/nvidia0").exists()
}

/// Where slots live: host memory, or the memory of a GPU (by ordinal on its own host).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Memory {
    #[default]
    Host,
    Device(u32),
}

impl Memory {
    /// NIXL's memory type and device id.
    pub(crate) fn nixl(self) -> (std::ffi::c_int, u64) {
        match self {
            Memory::Host => (MEM_DRAM, 0),
            Memory::Device(gpu) => (MEM_VRAM, u64::from(gpu)),
        }
    }
}

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
        Agent::with_params(capi, name, &[])
    }

    /// [`Agent::new`] with parameters for NIXL's UCX backend beside its defaults, e.g.
    /// `("ucx_error_handling_mode", "none")`.
    pub fn with_params(capi: &Arc<Capi>, name: &str, params: &[(&str, &str)]) -> Result<Agent> {
        let cname = c_string(name)?;
        let wait = progress_wait_us()?;
        let mut raw: Handle = std::ptr::null_mut();
        match capi.create_configured_agent {
            Some(create) => {
                let cfg = crate::capi::AgentConfig {
                    enable_prog_thread: true,
                    enable_listen_thread: false,
                    listen_port: 0,
                    thread_sync: 0,
                    num_workers: 1,
                    pthr_delay_us: wait,
                    lthr_delay_us: 100_000,
                    capture_telemetry: false,
                    zeroes: [0; 8],
                };
                // SAFETY: a valid C string, a config that outlives the call, an out-pointer.
                Capi::check("create_configured_agent", unsafe {
                    create(cname.as_ptr(), &cfg, &mut raw)
                })?;
            }
            // SAFETY: a valid C string and an out-pointer.
            None => Capi::check("create_agent", unsafe {
                (capi.create_agent)(cname.as_ptr(), &mut raw)
            })?,
        }
        let (mut mems, mut map): (Handle, Handle) = (std::ptr::null_mut(), std::ptr::null_mut());
        let ucx = c"UCX";
        // SAFETY: a live agent, a C string and two out-pointers.
        let got = Capi::check("get_plugin_params", unsafe {
            (capi.get_plugin_params)(raw, ucx.as_ptr(), &mut mems, &mut map)
        });
        let mut backend: Handle = std::ptr::null_mut();
        let got = got.and_then(|()| {
            for (k, v) in params {
                let (k, v) = (c_string(k)?, c_string(v)?);
                // SAFETY: the plugin's parameter map (returned above) and two C strings.
                Capi::check("params_add", unsafe {
                    (capi.params_add)(map, k.as_ptr(), v.as_ptr())
                })?;
            }
            Ok(())
        });
        let made = got.and_then(|()| {
            // SAFETY: a live agent and the plugin's parameters.
            Capi::check("create_backend", unsafe {
                (capi.create_backend)(raw, ucx.as_ptr(), map, &mut backend)
            })
        });
        // SAFETY: the lists were returned to us (or are null) and are not used again.
        unsafe {
            if !mems.is_null() {
                (capi.destroy_mem_list)(mems);
            }
            if !map.is_null() {
                (capi.destroy_params)(map);
            }
        }
        if let Err(e) = made {
            // SAFETY: the agent is ours and unused.
            unsafe { (capi.destroy_agent)(raw) };
            return Err(match std::env::var("UCX_TLS") {
                // NIXL refuses a UCX_TLS without a CUDA transport where NVIDIA GPUs are present.
                Ok(tls) if !tls.contains("cuda") && gpus_present() => Error::Transports(tls),
                _ => e,
            });
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
        let addrs = (0..u64::from(slots))
            .map(|i| ptr as u64 + i * slot_len)
            .collect();
        // SAFETY: `len` bytes from `ptr` are ours for the region's life.
        unsafe { self.register_spans(mem, Memory::Host, addrs, slot_len, &[(ptr as u64, len)]) }
    }

    /// Registers `slots` slots of `slot_len` bytes of fresh memory on `gpu`, back to back in
    /// one allocation (a GPU producer's tensors, which peers read over UCX's CUDA transports).
    pub fn register_device(&self, gpu: &Arc<Gpu>, slots: u32, slot_len: u64) -> Result<Region> {
        if slots == 0 || slots > MAX_SLOTS || slot_len == 0 || slot_len > MAX_SLOT_LEN {
            return Err(Error::Refused("slot count or length out of bounds"));
        }
        let len = slot_len
            .checked_mul(u64::from(slots))
            .and_then(|l| usize::try_from(l).ok())
            .ok_or(Error::Refused("region too large"))?;
        let cuda = |e: tensorport_cuda::Error| Error::Cuda(e.to_string());
        let buffer = DeviceBuffer::new(gpu, len).map_err(cuda)?;
        let stream = Stream::new(gpu).map_err(cuda)?;
        let base = buffer.ptr().raw();
        let addrs = (0..u64::from(slots)).map(|i| base + i * slot_len).collect();
        let memory = Memory::Device(gpu.ordinal() as u32);
        let mem = Mem::Device {
            buffer: Some(buffer),
            stream,
        };
        // SAFETY: the buffer is the region's (in `mem`), allocated for its life.
        unsafe { self.register_spans(mem, memory, addrs, slot_len, &[(base, len)]) }
    }

    /// Registers `spans` of `memory` with the agent as a region of `slots` at `addrs`, owning
    /// (or keeping alive) the memory through `mem`.
    ///
    /// # Safety
    /// The spans must stay allocated while `mem` lives, and cover every slot.
    unsafe fn register_spans(
        &self,
        mem: Mem,
        memory: Memory,
        addrs: Vec<u64>,
        slot_len: u64,
        spans: &[(u64, usize)],
    ) -> Result<Region> {
        let capi = &self.inner.capi;
        let dlist = reg_dlist(capi, memory, spans)?;
        let (g, raw) = self.inner.locked();
        // SAFETY: a live agent and a descriptor list of memory that `mem` keeps for the
        // region's life (the caller's contract).
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
            slots: addrs.len() as u32,
            slot_len,
            addrs,
            memory,
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
            keep: Some(Box::new(keep)),
        };
        let addrs = (0..u64::from(slots))
            .map(|i| base as u64 + i * stride)
            .collect();
        // SAFETY: the caller keeps `len` bytes from `base` mapped while `keep` (now `mem`'s)
        // lives.
        unsafe { self.register_spans(mem, Memory::Host, addrs, slot_len, &[(base as u64, len)]) }
    }

    /// Registers the buffers of `gpu`'s device memory at `addrs` (each at least `slot_len`
    /// bytes), kept allocated by their owner, as a region.
    ///
    /// # Safety
    /// Each buffer must stay allocated while the region lives (and for ever if a transfer into
    /// it could not be finished: see [`Region::leak_memory`]).
    pub(crate) unsafe fn register_device_external(
        &self,
        gpu: u32,
        addrs: Vec<u64>,
        slot_len: u64,
    ) -> Result<Region> {
        if addrs.is_empty() || addrs.len() > MAX_SLOTS as usize || slot_len == 0 {
            return Err(Error::Refused("slot count or length out of bounds"));
        }
        let spans: Vec<(u64, usize)> = addrs.iter().map(|&a| (a, slot_len as usize)).collect();
        let mem = Mem::Borrowed { keep: None };
        // SAFETY: the caller's contract.
        unsafe { self.register_spans(mem, Memory::Device(gpu), addrs, slot_len, &spans) }
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

/// A descriptor list of `spans` of `memory`.
fn reg_dlist(capi: &Capi, memory: Memory, spans: &[(u64, usize)]) -> Result<Handle> {
    let (kind, dev) = memory.nixl();
    let mut dlist: Handle = std::ptr::null_mut();
    // SAFETY: an out-pointer.
    Capi::check("create_reg_dlist", unsafe {
        (capi.create_reg_dlist)(kind, &mut dlist)
    })?;
    let mut r = Ok(());
    for &(addr, len) in spans {
        // SAFETY: a live list; the span is only described here, not accessed.
        r = Capi::check("reg_dlist_add_desc", unsafe {
            (capi.reg_dlist_add_desc)(dlist, addr as usize, len, dev, std::ptr::null(), 0)
        });
        if r.is_err() {
            break;
        }
    }
    if let Err(e) = r {
        // SAFETY: ours, unused after this.
        unsafe { (capi.destroy_reg_dlist)(dlist) };
        return Err(e);
    }
    Ok(dlist)
}

/// A region's memory: host memory allocated here, another owner's kept alive by a guard, or
/// device buffers allocated here.
enum Mem {
    Owned {
        ptr: *mut u8,
        layout: Layout,
        /// A transfer into it may still run: never free it.
        leaked: bool,
    },
    Borrowed {
        /// Keeps the memory mapped; forgotten (never dropped) if a transfer may still run.
        keep: Option<Box<dyn Send + Sync>>,
    },
    Device {
        /// Forgotten (never freed) if a transfer may still run.
        buffer: Option<DeviceBuffer>,
        /// Uploads into the buffer.
        stream: Stream,
    },
}

impl Mem {
    fn leak(&mut self) {
        match self {
            Mem::Owned { leaked, .. } => *leaked = true,
            Mem::Borrowed { keep } => std::mem::forget(keep.take()),
            Mem::Device { buffer, .. } => std::mem::forget(buffer.take()),
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

/// Memory registered with an agent: `slots` slots of `slot_len` bytes, in host memory or on a
/// GPU, each one a tensor's place. Peers read it (given this agent's metadata); readers write
/// into it.
pub struct Region {
    pub(crate) agent: Arc<AgentInner>,
    mem: Mem,
    dlist: Handle,
    pub(crate) slots: u32,
    pub(crate) slot_len: u64,
    /// Each slot's address (in host memory or the GPU's).
    addrs: Vec<u64>,
    pub(crate) memory: Memory,
}

// SAFETY: the memory and the handles belong to the region alone; see `AgentInner`.
unsafe impl Send for Region {}

impl std::fmt::Debug for Region {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Region")
            .field("slots", &self.slots)
            .field("slot_len", &self.slot_len)
            .field("memory", &self.memory)
            .finish()
    }
}

impl Region {
    /// What a peer needs besides the metadata to read this region's slots (of a region made by
    /// [`Agent::register`] or [`Agent::register_device`], whose slots are back to back).
    pub fn layout(&self) -> SlotLayout {
        SlotLayout {
            base: self.addrs[0],
            slot_len: self.slot_len,
            slots: self.slots,
            memory: self.memory,
        }
    }

    /// Slot `i`'s bytes (of host memory; `None` on a GPU).
    pub fn slot(&self, i: u32) -> Option<&[u8]> {
        let addr = self.host_slot(i)?;
        // SAFETY: a slot of the region's host memory; `&self` excludes writers through this
        // crate (a reader owns the region it reads into and hands out only slots with no
        // transfer in flight).
        Some(unsafe { std::slice::from_raw_parts(addr as *const u8, self.slot_len as usize) })
    }

    /// Slot `i`'s bytes, to fill (of host memory; `None` on a GPU).
    pub fn slot_mut(&mut self, i: u32) -> Option<&mut [u8]> {
        let addr = self.host_slot(i)?;
        // SAFETY: a slot of the region's host memory, borrowed uniquely.
        Some(unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, self.slot_len as usize) })
    }

    fn host_slot(&self, i: u32) -> Option<u64> {
        match self.memory {
            Memory::Host => self.addrs.get(i as usize).copied(),
            Memory::Device(_) => None,
        }
    }

    /// Copies `bytes` (at most a slot) into slot `i` of a region of device memory this crate
    /// allocated ([`Agent::register_device`]), and waits for the copy.
    pub fn upload(&mut self, i: u32, bytes: &[u8]) -> Result<()> {
        let Mem::Device {
            buffer: Some(_),
            stream,
        } = &self.mem
        else {
            return Err(Error::Refused("not a region of device buffers"));
        };
        if i >= self.slots || bytes.len() as u64 > self.slot_len {
            return Err(Error::Refused("no such slot, or more bytes than a slot"));
        }
        let dst = tensorport_cuda::DevicePtr::new(self.addrs[i as usize])
            .ok_or(Error::Refused("a slot at a null address"))?;
        // SAFETY: slot `i` lies inside the region's one allocation, of the stream's context;
        // `bytes` stays borrowed until the stream has run the copy (synchronised below, also
        // after an error in enqueueing it).
        let r = unsafe { stream.copy_host_to_device_async(dst, bytes) };
        let synced = stream.synchronize();
        r.and(synced).map_err(|e| Error::Cuda(e.to_string()))
    }

    /// Copies slot `i` of a region of device memory this crate allocated into `out` (at most a
    /// slot's bytes).
    pub fn download(&self, i: u32, out: &mut [u8]) -> Result<()> {
        let Mem::Device {
            buffer: Some(b), ..
        } = &self.mem
        else {
            return Err(Error::Refused("not a region of device buffers"));
        };
        if i >= self.slots || out.len() as u64 > self.slot_len {
            return Err(Error::Refused("no such slot, or more bytes than a slot"));
        }
        b.copy_to_host_at((u64::from(i) * self.slot_len) as usize, out)
            .map_err(|e| Error::Cuda(e.to_string()))
    }

    pub(crate) fn slot_addr(&self, i: u32) -> u64 {
        self.addrs[i as usize]
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
    pub memory: Memory,
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
        if matches!(self.memory, Memory::Device(gpu) if gpu > MAX_GPU) {
            return Err(Error::Refused("GPU ordinal out of bounds"));
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

/// How long an agent's progress thread waits for a transfer event before progressing its workers
/// anyway, in microseconds: `$TENSORPORT_NIXL_PROGRESS_WAIT_US`, else [`PROGRESS_WAIT_US`].
/// NIXL's own default, 0, never waits: the thread then spins a core in every process with an
/// agent, which on a busy host takes that core from the producers' preprocessing.
fn progress_wait_us() -> Result<u64> {
    parse_progress_wait(std::env::var(PROGRESS_WAIT_VAR).ok().as_deref())
}

/// The environment variable that sets the progress thread's wait.
const PROGRESS_WAIT_VAR: &str = "TENSORPORT_NIXL_PROGRESS_WAIT_US";

/// The progress thread's wait where the environment does not set one: 1 ms
/// (docs/benchmarks.md measures it against NIXL's 0).
const PROGRESS_WAIT_US: u64 = 1_000;

/// The longest wait the variable may set: 1 s.
const MAX_PROGRESS_WAIT_US: u64 = 1_000_000;

/// The wait `value` (the variable's, if set) asks for.
fn parse_progress_wait(value: Option<&str>) -> Result<u64> {
    let Some(v) = value else {
        return Ok(PROGRESS_WAIT_US);
    };
    match v.trim().parse::<u64>() {
        Ok(us) if us <= MAX_PROGRESS_WAIT_US => Ok(us),
        _ => Err(Error::Setting(format!(
            "{PROGRESS_WAIT_VAR}={v:?}: expected microseconds from 0 to {MAX_PROGRESS_WAIT_US} \
             (unset it for {PROGRESS_WAIT_US})"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_progress_wait_is_bounded_and_a_bad_one_is_named() {
        assert_eq!(parse_progress_wait(None).unwrap(), PROGRESS_WAIT_US);
        assert_eq!(parse_progress_wait(Some(" 0 ")).unwrap(), 0);
        assert_eq!(parse_progress_wait(Some("1000000")).unwrap(), 1_000_000);
        for bad in ["", "-1", "1ms", "1000001", "99999999999999999999999"] {
            let e = parse_progress_wait(Some(bad)).unwrap_err().to_string();
            assert!(
                e.contains(PROGRESS_WAIT_VAR) && e.contains("microseconds"),
                "{e}"
            );
        }
    }

    #[test]
    fn layouts_out_of_bounds_are_refused() {
        let ok = SlotLayout {
            base: 4096,
            slot_len: 602_112,
            slots: 64,
            memory: Memory::Host,
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
            SlotLayout {
                memory: Memory::Device(MAX_GPU + 1),
                ..ok
            },
        ] {
            assert!(matches!(bad.check(), Err(Error::Refused(_))), "{bad:?}");
        }
    }
}

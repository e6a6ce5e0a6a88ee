//! One-sided reads of a peer's slots into a local region's slots.
//!
//! A [`Reader`] owns the region it reads into, so nothing reads a slot a transfer is writing
//! except through [`Reader::slot`], which refuses slots in flight. Each (peer slot,
//! local slot) pair gets one NIXL request, made the first time and posted again after; dropping
//! the reader waits for its transfers (a bounded time) and releases the requests. A transfer that
//! neither finishes nor releases within that time leaves the region's memory allocated for ever
//! (it is leaked, never freed under a running transfer).

use std::collections::HashMap;
use std::ffi::c_int;
use std::time::{Duration, Instant};

use crate::agent::{Memory, Peer, Region};
use crate::capi::{Capi, Handle, IN_PROGRESS, OP_READ, OP_WRITE};
use crate::error::{Error, Result};

/// How long a dropped reader waits for its transfers.
pub(crate) const DROP_WAIT: Duration = Duration::from_secs(5);
/// Requests a reader keeps for posting again; past this, the idle ones are released (a peer
/// with many slots read into many local ones would otherwise make one per pair).
const MAX_REQUESTS: usize = 1024;

/// Reads from one peer into one region, each local slot holding at most one transfer.
pub struct Reader {
    region: Region,
    peer: Peer,
    local: Handle,
    remote: Handle,
    requests: HashMap<(u32, u32), Handle>,
    /// Per local slot: the request of its transfer in flight.
    in_flight: Vec<Option<Handle>>,
    /// NIXL's operation for its transfers: reads, or writes where [`Reader::write_instead`]
    /// was called.
    op: std::ffi::c_int,
}

// SAFETY: its handles (prepared lists, requests) are NIXL objects of its agent, used only
// through `&mut self` and with the agent's lock held, so moving the reader to another thread
// moves their only user; the region and peer it owns are `Send`.
unsafe impl Send for Reader {}

impl std::fmt::Debug for Reader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reader")
            .field("peer", &self.peer.name())
            .field("in_flight", &self.in_flight.iter().flatten().count())
            .finish()
    }
}

/// A prepared descriptor list of spans of `len` bytes of `memory` at `addrs`, on
/// `agent_name`'s side ("" for this agent's own memory).
fn prepped(
    region: &Region,
    agent_name: &std::ffi::CStr,
    memory: Memory,
    addrs: impl Iterator<Item = u64>,
    len: u64,
) -> Result<Handle> {
    let capi = &region.agent.capi;
    let (kind, dev) = memory.nixl();
    let mut dlist: Handle = std::ptr::null_mut();
    // SAFETY: an out-pointer.
    Capi::check("create_xfer_dlist", unsafe {
        (capi.create_xfer_dlist)(kind, &mut dlist)
    })?;
    let mut r = Ok(());
    for addr in addrs {
        // SAFETY: a live list; spans are only described here.
        r = Capi::check("xfer_dlist_add_desc", unsafe {
            (capi.xfer_dlist_add_desc)(dlist, addr as usize, len as usize, dev)
        });
        if r.is_err() {
            break;
        }
    }
    let mut handle: Handle = std::ptr::null_mut();
    if r.is_ok() {
        let (_g, raw) = region.agent.locked();
        // SAFETY: a live agent, a C string, a live list and an out-pointer. NIXL checks the spans
        // against the registrations it knows for `agent_name` (ours, or those in the peer's
        // metadata) and refuses any outside them.
        r = Capi::check("prep_xfer_dlist", unsafe {
            (capi.prep_xfer_dlist)(
                raw,
                agent_name.as_ptr(),
                dlist,
                &mut handle,
                std::ptr::null_mut(),
            )
        });
    }
    // SAFETY: ours; the prepared handle keeps what it needs.
    unsafe { (capi.destroy_xfer_dlist)(dlist) };
    r.map(|()| handle)
}

impl Reader {
    /// A reader from `peer`'s slots into `region`'s (both of one agent; the slots must be of one
    /// length).
    pub fn new(region: Region, peer: Peer) -> Result<Reader> {
        if !std::sync::Arc::ptr_eq(&region.agent, &peer.agent) {
            return Err(Error::Refused(
                "the region and the peer belong to different agents",
            ));
        }
        if region.slot_len != peer.layout.slot_len {
            return Err(Error::Refused(
                "the peer's slots are not the region's length",
            ));
        }
        let local = prepped(
            &region,
            c"",
            region.memory,
            (0..region.slots).map(|i| region.slot_addr(i)),
            region.slot_len,
        )?;
        let layout = peer.layout;
        let remote = match prepped(
            &region,
            &peer.cname,
            layout.memory,
            (0..layout.slots).map(|i| layout.base + u64::from(i) * layout.slot_len),
            layout.slot_len,
        ) {
            Ok(h) => h,
            Err(e) => {
                let (_g, raw) = region.agent.locked();
                // SAFETY: prepared above, unused.
                unsafe { (region.agent.capi.release_xfer_dlist_handle)(raw, local) };
                return Err(e);
            }
        };
        let slots = region.slots as usize;
        Ok(Reader {
            region,
            peer,
            local,
            remote,
            requests: HashMap::new(),
            in_flight: vec![None; slots],
            op: OP_READ,
        })
    }

    /// Makes the transfers write local slot `into` into the peer's slot `from` instead of
    /// reading it, to measure the engine's writes beside its reads (`nixl-bench read --op
    /// write`); the gateway only reads. Refused once a transfer has been made.
    pub fn write_instead(&mut self) -> Result<()> {
        if !self.requests.is_empty() {
            return Err(Error::Refused("the reader has made transfers already"));
        }
        self.op = OP_WRITE;
        Ok(())
    }

    /// Starts reading the peer's slot `from` into local slot `into`, which must be idle (or,
    /// after [`Reader::write_instead`], writing `into` into `from`).
    pub fn start(&mut self, from: u32, into: u32) -> Result<()> {
        if from >= self.peer.layout.slots {
            return Err(Error::Refused("no such slot at the peer"));
        }
        let Some(state) = self.in_flight.get(into as usize) else {
            return Err(Error::Refused("no such local slot"));
        };
        if state.is_some() {
            return Err(Error::Refused("the local slot has a transfer in flight"));
        }
        let agent = self.region.agent.clone();
        let capi = &agent.capi;
        let (_g, raw) = agent.locked();
        if self.requests.len() >= MAX_REQUESTS && !self.requests.contains_key(&(from, into)) {
            let busy: Vec<Handle> = self.in_flight.iter().flatten().copied().collect();
            self.requests.retain(|_, &mut req| {
                if busy.contains(&req) {
                    return true;
                }
                // SAFETY: a live agent and its request, idle (not in flight): released and
                // destroyed, never used again (it has left the map).
                unsafe {
                    if (capi.release_xfer_req)(raw, req) == 0 {
                        (capi.destroy_xfer_req)(req);
                    }
                }
                false
            });
        }
        let req = match self.requests.get(&(from, into)) {
            Some(&r) => r,
            None => {
                let (l, r) = (into as c_int, from as c_int);
                let mut req: Handle = std::ptr::null_mut();
                // SAFETY: a live agent, two prepared lists of this agent, one index into each
                // (checked against their lengths above), an out-pointer.
                Capi::check("make_xfer_req", unsafe {
                    (capi.make_xfer_req)(
                        raw,
                        self.op,
                        self.local,
                        &l,
                        1,
                        self.remote,
                        &r,
                        1,
                        &mut req,
                        std::ptr::null_mut(),
                    )
                })?;
                self.requests.insert((from, into), req);
                req
            }
        };
        // SAFETY: a live agent and its request, not in flight (each request maps to one local
        // slot, which is idle).
        let s = unsafe { (capi.post_xfer_req)(raw, req, std::ptr::null_mut()) };
        match s {
            0 | IN_PROGRESS => {
                self.in_flight[into as usize] = Some(req);
                Ok(())
            }
            s => Err(Error::Call {
                call: "post_xfer_req",
                status: s,
            }),
        }
    }

    /// Whether local slot `into`'s transfer has finished (true also when none runs). A failed
    /// transfer is an error, and leaves the slot idle.
    pub fn poll(&mut self, into: u32) -> Result<bool> {
        let Some(Some(req)) = self.in_flight.get(into as usize).copied() else {
            return Ok(true);
        };
        let (g, raw) = self.region.agent.locked();
        // SAFETY: a live agent and its posted request.
        let s = unsafe { (self.region.agent.capi.get_xfer_status)(raw, req) };
        drop(g);
        match s {
            IN_PROGRESS => Ok(false),
            s => {
                self.in_flight[into as usize] = None;
                Capi::check("get_xfer_status", s).map(|()| true)
            }
        }
    }

    /// Waits for local slot `into`'s transfer, at most `timeout`.
    pub fn wait(&mut self, into: u32, timeout: Duration) -> Result<()> {
        let peer = self.peer.name().to_owned();
        wait_for(&peer, timeout, || Ok(self.poll(into)?.then_some(())))
    }

    /// Waits at most `within` for every transfer in flight to finish (or fail); returns the
    /// local slots whose transfers still run.
    pub(crate) fn settle(&mut self, within: Duration) -> Vec<u32> {
        let deadline = Instant::now() + within;
        let mut running = Vec::new();
        for i in 0..self.in_flight.len() as u32 {
            while self.in_flight[i as usize].is_some() {
                match self.poll(i) {
                    Ok(false) if Instant::now() < deadline => std::thread::yield_now(),
                    Ok(false) => {
                        running.push(i);
                        break;
                    }
                    _ => {}
                }
            }
        }
        running
    }

    /// The peer read from.
    pub fn peer(&self) -> &Peer {
        &self.peer
    }

    /// Copies local slot `i` of a device region into `out`, if no transfer into it is in
    /// flight.
    pub fn download(&self, i: u32, out: &mut [u8]) -> Result<()> {
        match self.in_flight.get(i as usize) {
            Some(None) => self.region.download(i, out),
            _ => Err(Error::Refused("the local slot has a transfer in flight")),
        }
    }

    /// Local slot `i`'s bytes, if no transfer into it is in flight.
    pub fn slot(&self, i: u32) -> Option<&[u8]> {
        match self.in_flight.get(i as usize) {
            Some(None) => self.region.slot(i),
            _ => None,
        }
    }
}

/// Polls `poll` until it gives a value, spinning a little and then yielding the core between
/// polls (each poll drives the transfers); a transfer from `peer` that takes over `timeout` is
/// [`Error::Stalled`].
pub(crate) fn wait_for<T>(
    peer: &str,
    timeout: Duration,
    mut poll: impl FnMut() -> Result<Option<T>>,
) -> Result<T> {
    let start = Instant::now();
    let mut spins = 0u32;
    loop {
        if let Some(v) = poll()? {
            return Ok(v);
        }
        if start.elapsed() > timeout {
            return Err(Error::Stalled {
                peer: peer.to_owned(),
                ms: timeout.as_millis(),
            });
        }
        spins += 1;
        if spins > 64 {
            std::thread::yield_now();
        }
    }
}

impl Drop for Reader {
    fn drop(&mut self) {
        let mut stuck = !self.settle(DROP_WAIT).is_empty();
        let agent = self.region.agent.clone();
        let capi = &agent.capi;
        let (_g, raw) = agent.locked();
        for (_, req) in self.requests.drain() {
            // SAFETY: a live agent and its request, finished (or being given up on: NIXL then
            // tries to cancel it and says whether it could).
            let released = unsafe { (capi.release_xfer_req)(raw, req) } == 0;
            if released {
                // SAFETY: released above, not used again.
                unsafe { (capi.destroy_xfer_req)(req) };
            } else {
                stuck = true;
            }
        }
        // SAFETY: prepared in `new`, no request uses them any more.
        unsafe {
            (capi.release_xfer_dlist_handle)(raw, self.local);
            (capi.release_xfer_dlist_handle)(raw, self.remote);
        }
        if stuck {
            self.region.leak_memory();
        }
    }
}

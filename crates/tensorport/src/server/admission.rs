//! Admission: who gets a producer place and a pool (`open_session`, with the memory budget and
//! idle eviction), which submissions become requests (`admit`), and device buffer registration.
//! Every refusal is a protocol error code and a message that says what to do.

use std::collections::HashMap;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nix::sys::epoll::{EpollEvent, EpollFlags};
use tensorport_shm::ring::CqWriter;
use tensorport_shm::{HostPool, SlotTable};
use tensorport_wire::{
    validate_view, ErrorCode, Hello, PoolBounds, PoolLayout, RawDeviceHandle, RawTensorView,
    ServerMsg, SlotRef, TensorDesc, Welcome, MAX_DEVICE_BUFFERS,
};

use crate::conn::FrameWriter;

/// The longest device buffer a producer may register (1 TiB: more than any GPU holds, and far
/// from overflowing the arithmetic on offsets, lengths and the semaphores after them).
pub(crate) const MAX_DEVICE_BUFFER_LEN: u64 = 1 << 40;
use crate::device::DeviceTensor;
use crate::fast::{IdSet, ServerRing};
use crate::lock;
use crate::server::budget::Charge;
use crate::server::outbox::Outbox;
use crate::server::request::{Request, Responder};
use crate::server::session::{DeviceEntry, Session, SessionState};
use crate::server::shared::Shared;

/// Releases a reservation in `Shared::producers` when dropped, unless disarmed.
struct Reservation<'a>(&'a AtomicU32, bool);

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        if self.1 {
            self.0.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

/// Closes the producer session that has been idle longest, if one has been idle (nothing in
/// flight, no submit or answer) for `idle_eviction`; returns whether it did.
pub(crate) fn evict_idle(shared: &Shared, short_of: &str) -> bool {
    let after = shared.config.idle_eviction;
    if after.is_zero() {
        return false;
    }
    let victim = lock(&shared.sessions)
        .values()
        .filter(|s| s.is_alive())
        .filter_map(|s| {
            let st = lock(&s.state);
            let idle = st.last_active.elapsed();
            (st.in_flight.is_empty() && idle >= after).then(|| (idle, s.clone()))
        })
        .max_by_key(|(idle, _)| *idle);
    let Some((idle, s)) = victim else {
        return false;
    };
    tracing::warn!(
        session = s.id,
        producer = %s.name,
        idle_s = idle.as_secs_f64(),
        "closing an idle session to make room for a new producer: {short_of}"
    );
    let _ = s.post(&ServerMsg::Error {
        code: ErrorCode::TooManySessions.as_u16(),
        request_id: None,
        fatal: true,
        message: format!(
            "closed: idle for {:.0} s while {short_of} and another producer asked for it",
            idle.as_secs_f64()
        ),
    });
    s.kill();
    true
}

/// Charges `want` bytes to the pools' budget; when it is spent, idle sessions give their pools
/// up (the longest idle first, as for places) until the charge fits or none is idle.
fn charge_making_room(
    shared: &Shared,
    want: u64,
) -> std::result::Result<Charge, (ErrorCode, String)> {
    let spent = |used: u64| {
        (
            ErrorCode::MemoryBudget,
            format!(
                "the server's memory for pools is spent ({used} of {} bytes reserved; this pool needs {want}); try again later, or start the server with a larger memory budget",
                shared.budget.limit()
            ),
        )
    };
    let mut used = match shared.budget.charge(want) {
        Ok(c) => return Ok(c),
        Err(used) => used,
    };
    if want > shared.budget.limit() {
        return Err(spent(used));
    }
    // Each round closes one idle session; its pool is given back once its reader has let go.
    for _ in 0..shared.config.max_sessions {
        if !evict_idle(shared, "the memory for pools was spent") {
            break;
        }
        let deadline = Instant::now() + Duration::from_secs(2);
        while Instant::now() < deadline {
            match shared.budget.charge(want) {
                Ok(c) => return Ok(c),
                Err(u) => used = u,
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }
    Err(spent(used))
}

/// What admission answers with when it refuses: the code and the reason.
type Refusal = (ErrorCode, String);

/// Creates the pool, registers the session, sends `Welcome` (with the fd) and the first grant.
pub(crate) fn open_session(
    shared: &Arc<Shared>,
    hello: &Hello,
    pid: u32,
    version: u16,
    stream: UnixStream,
) -> std::result::Result<Arc<Session>, Refusal> {
    let mut reservation = reserve_place(shared)?;
    let (slots, slot_size) = pool_shape(&shared.config, hello);
    // Charge the budget before a byte is reserved: the pool's size as HostPool will make it.
    let want = HostPool::size_for(slots, slot_size).map_or(u64::MAX, |(_, len)| len);
    if want > shared.max_session_bytes {
        return Err((
            ErrorCode::MemoryBudget,
            format!(
                "a pool of {want} bytes ({slots} slots of {slot_size}) is over the {} bytes one producer may have; ask for fewer or smaller slots",
                shared.max_session_bytes
            ),
        ));
    }
    let charge = charge_making_room(shared, want)?;
    let (session, grant) = build_session(shared, hello, pid, version, &stream, charge)?;
    // Registered before the producer hears of it, so that once its `connect` returns the
    // session is in the table (status, places) — nothing can be submitted before the Welcome.
    register(shared, &session)?;
    if let Err(e) = send_welcome(stream, &session, &grant) {
        unregister(shared, &session);
        return Err(handshake_write(e));
    }
    // Counted, like every later socket message, so a producer on the queues that only polls
    // (`Producer::poll`) reads the first grants too.
    session.note_socket_write();
    // From here the reservation is released by `close_session`.
    reservation.1 = false;
    shared
        .counters
        .sessions_opened
        .fetch_add(1, Ordering::Relaxed);
    tracing::info!(
        session = session.id,
        producer = %hello.name,
        pid,
        slots,
        slot_size = session.bounds.slot_size,
        "producer connected"
    );
    Ok(session)
}

/// Reserves a place among the producers before anything is built; when all are taken, an idle
/// session may give its place up (it leaves through its reader thread, so this waits for it).
fn reserve_place(shared: &Shared) -> std::result::Result<Reservation<'_>, Refusal> {
    if shared.is_draining() {
        return Err((ErrorCode::Draining, "the server is draining".into()));
    }
    let max = shared.config.max_sessions;
    let take = || {
        shared
            .producers
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                (n < max).then_some(n + 1)
            })
            .is_ok()
    };
    let mut placed = take();
    if !placed && evict_idle(shared, "every producer place was taken") {
        let deadline = Instant::now() + Duration::from_secs(2);
        while !placed && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(2));
            placed = take();
        }
    }
    if !placed {
        return Err((
            ErrorCode::TooManySessions,
            format!("the server has its maximum of {max} producers; try again later, or start the server with room for more producers"),
        ));
    }
    Ok(Reservation(&shared.producers, true))
}

/// The slots and slot size a producer gets: what it asked for within the server's limits, or
/// the server's defaults.
fn pool_shape(cfg: &super::ServerConfig, hello: &Hello) -> (u32, u64) {
    let slots = match hello.want_slots {
        0 => cfg.slots_per_session,
        n => n.min(cfg.max_slots_per_session),
    }
    .max(1);
    let slot_size = match hello.want_slot_size {
        0 => cfg.slot_size,
        n => n.min(cfg.max_slot_size),
    };
    (slots, slot_size)
}

/// The session's pool (pinned if the server pins), queues and state, and the slots first
/// granted; nothing registered yet.
fn build_session(
    shared: &Arc<Shared>,
    hello: &Hello,
    pid: u32,
    version: u16,
    stream: &UnixStream,
    charge: Charge,
) -> std::result::Result<(Arc<Session>, Vec<SlotRef>), Refusal> {
    let cfg = &shared.config;
    let (slots, slot_size) = pool_shape(cfg, hello);
    let internal = |e: String| (ErrorCode::Internal, e);
    let id = shared.next_session.fetch_add(1, Ordering::SeqCst);
    let mut pool = HostPool::create("tensorport-pool", slots, slot_size)
        .map_err(|e| internal(e.to_string()))?;
    if let Some(pin) = &cfg.pin {
        pool.pin_with(pin.as_ref())
            .map_err(|e| internal(e.to_string()))?;
    }
    let max_in_flight = match cfg.max_in_flight {
        0 => slots.saturating_mul(2),
        n => n,
    };
    let mut table = SlotTable::new(slots);
    let grant: Vec<SlotRef> = table
        .grant_free()
        .into_iter()
        .map(|(slot, generation)| SlotRef { slot, generation })
        .collect();
    // Protocol 2: the hot path moves to shared-memory queues. Every submission occupies at most
    // one submission entry until the server takes it, and every completion entry answers a
    // request in flight or grants a slot, so these sizes never make a side wait on the other.
    let ring = if version >= 2 && cfg.rings {
        let cq = slots.saturating_add(max_in_flight).saturating_add(8);
        Some(ServerRing::create(max_in_flight.max(8), cq).map_err(|e| internal(e.to_string()))?)
    } else {
        None
    };
    let outbox_stream = stream
        .try_clone()
        .map_err(|e| internal(format!("dup socket: {e}")))?;
    let session = Arc::new(Session {
        id,
        shard: shared.least_loaded_shard(),
        version,
        name: hello.name.clone(),
        pid,
        bounds: PoolBounds {
            slot_count: pool.slot_count(),
            slot_size: pool.slot_size(),
        },
        pool: Arc::new(pool),
        _charge: charge,
        max_in_flight,
        state: Mutex::new(SessionState {
            slots: table,
            cq: CqWriter::default(),
            devices: HashMap::new(),
            in_flight: IdSet::with_capacity_and_hasher(
                max_in_flight.min(4096) as usize,
                Default::default(),
            ),
            submitted: 0,
            last_active: Instant::now(),
            share: Default::default(),
            completed: 0,
            errors: 0,
        }),
        outbox: Outbox::new(outbox_stream, cfg.max_queued_output)
            .map_err(|e| internal(e.to_string()))?,
        alive: AtomicBool::new(true),
        ring,
        shared: shared.clone(),
    });
    Ok((session, grant))
}

/// Puts the session in the server's table and its queue on its shard's epoll set.
fn register(shared: &Shared, session: &Arc<Session>) -> std::result::Result<(), Refusal> {
    let sh = &shared.shards[session.shard];
    {
        let mut sessions = lock(&shared.sessions);
        sessions.insert(session.id, session.clone());
        sh.sessions.fetch_add(1, Ordering::SeqCst);
    }
    if let Some(r) = &session.ring {
        if let Err(e) = sh.epoll.add(
            &r.to_server,
            EpollEvent::new(EpollFlags::EPOLLIN, session.id),
        ) {
            unregister(shared, session);
            return Err((ErrorCode::Internal, format!("epoll_ctl: {e}")));
        }
        sh.ring_generation.fetch_add(1, Ordering::SeqCst);
        sh.wake_consumer();
    }
    Ok(())
}

/// Undoes [`register`] for a session whose handshake failed.
fn unregister(shared: &Shared, session: &Session) {
    let sh = &shared.shards[session.shard];
    let mut sessions = lock(&shared.sessions);
    sessions.remove(&session.id);
    sh.sessions.fetch_sub(1, Ordering::SeqCst);
    drop(sessions);
    if let Some(r) = &session.ring {
        let _ = sh.epoll.delete(&r.to_server);
        sh.ring_generation.fetch_add(1, Ordering::SeqCst);
    }
}

/// Writes the handshake on the session's own thread, blocking (with the write timeout): the
/// Welcome carries the descriptors and nothing else waits on it; then the first grants.
fn send_welcome(stream: UnixStream, session: &Session, grant: &[SlotRef]) -> crate::Result<()> {
    let mut fds = vec![session.pool.fd()];
    if let Some(r) = &session.ring {
        fds.extend(r.fds());
    }
    let mut writer = FrameWriter::new(stream);
    let welcome = ServerMsg::Welcome(Welcome {
        version: session.version,
        session_id: session.id,
        pool: PoolLayout {
            slot_count: session.pool.slot_count(),
            slot_size: session.pool.slot_size(),
            pool_len: session.pool.len(),
        },
        max_in_flight: session.max_in_flight,
        fds: fds.len() as u8,
    });
    writer.send(&welcome, &fds)?;
    // Nothing reads the slot table's grants but this thread until the Welcome is out, so the
    // grant cannot race a submit.
    for chunk in grant.chunks(tensorport_wire::MAX_GRANT) {
        writer.send(&ServerMsg::Grant(chunk.to_vec()), &[])?;
    }
    Ok(())
}

/// Checks a submission against the session (descriptor, slot state, limits) and makes it a
/// [`Request`].
pub(crate) fn admit(
    shared: &Arc<Shared>,
    session: &Arc<Session>,
    request_id: u64,
    tensor: &RawTensorView<'_>,
) -> std::result::Result<Request, (ErrorCode, String)> {
    let r = admit_locked(
        shared,
        session,
        &mut lock(&session.state),
        request_id,
        tensor,
    )?;
    count_submitted(shared, 1, r.desc().byte_len());
    Ok(r)
}

/// Adds admitted requests to the server's totals (once per batch on the queues).
pub(crate) fn count_submitted(shared: &Shared, requests: u64, bytes: u64) {
    shared
        .counters
        .submitted
        .fetch_add(requests, Ordering::Relaxed);
    shared.counters.bytes.fetch_add(bytes, Ordering::Relaxed);
}

/// [`admit`] under the session's lock, held by the caller (who may admit several in a row),
/// without counting it in the server's totals ([`count_submitted`]). The session's idle clock
/// is not stamped: a session with requests in flight is never idle, and answering stamps it.
pub(crate) fn admit_locked(
    shared: &Arc<Shared>,
    session: &Arc<Session>,
    st: &mut SessionState,
    request_id: u64,
    tensor: &RawTensorView<'_>,
) -> std::result::Result<Request, (ErrorCode, String)> {
    if shared.is_draining() {
        return Err((ErrorCode::Draining, "the server is draining".into()));
    }
    let desc = {
        let devices = &st.devices;
        validate_view(tensor, &session.bounds, &|b| {
            devices.get(&b).map(|e| e.imported.len())
        })
        .map_err(|e| (e.code(), e.to_string()))?
    };
    // One look-up of the id on the way in (the set is the in-flight check); every refusal
    // after it takes the id out again.
    if !st.in_flight.insert(request_id) {
        return Err((
            ErrorCode::DuplicateRequest,
            format!("request {request_id} is already in flight"),
        ));
    }
    let device = match claim(shared, session, st, &desc) {
        Ok(device) => device,
        Err(why) => {
            st.in_flight.remove(&request_id);
            return Err(why);
        }
    };
    st.submitted += 1;
    Ok(Request {
        desc,
        device,
        responder: Some(Responder {
            session: session.clone(),
            request_id,
            answered: false,
        }),
    })
}

/// For [`admit_locked`], with the request's id already in the in-flight set: checks the
/// session's limit and takes the slot or device buffer the descriptor names.
fn claim(
    shared: &Shared,
    session: &Session,
    st: &mut SessionState,
    desc: &TensorDesc,
) -> std::result::Result<Option<Box<DeviceTensor>>, (ErrorCode, String)> {
    if st.in_flight.len() > session.max_in_flight as usize {
        return Err((
            ErrorCode::TooManyInFlight,
            format!("{} requests already in flight", st.in_flight.len() - 1),
        ));
    }
    let slot = desc.slot();
    if !desc.is_device() {
        st.slots
            .submit(slot.slot, slot.generation)
            .map_err(|e| (ErrorCode::SlotNotLeased, e.to_string()))?;
        // Paced: only host slots are held back and counted, so only their submits make a
        // session active (a producer of device tensors alone would pin the floor).
        if let Some(p) = &shared.pacer {
            st.share.submitted(Instant::now(), p.floor(), &p.pace);
        }
        return Ok(None);
    }
    let e = st
        .devices
        .get_mut(&slot.slot)
        .expect("validated: registered");
    if e.in_flight || e.generation != slot.generation {
        return Err((
            ErrorCode::SlotNotLeased,
            format!(
                "device buffer {} is {} at generation {}, not free at {}",
                slot.slot,
                if e.in_flight { "in flight" } else { "free" },
                e.generation,
                slot.generation
            ),
        ));
    }
    if e.imported.timeline() != desc.timeline().is_some() {
        let why = if e.imported.timeline() {
            "is timeline-fenced: each submit needs a Timeline fence"
        } else {
            "is event-fenced: submits carry no fence"
        };
        return Err((
            ErrorCode::Unsupported,
            format!("device buffer {} {why}", slot.slot),
        ));
    }
    e.in_flight = true;
    Ok(Some(Box::new(DeviceTensor {
        buffer: e.imported.clone(),
        offset: desc.offset(),
        len: desc.byte_len(),
        timeline: desc.timeline(),
    })))
}

pub(crate) fn register_device(
    shared: &Arc<Shared>,
    session: &Arc<Session>,
    buffer: u32,
    len: u64,
    handle: &RawDeviceHandle,
    fd: Option<std::os::fd::OwnedFd>,
) -> std::result::Result<(), (ErrorCode, String)> {
    let importer = shared.config.device.as_ref().ok_or((
        ErrorCode::Unsupported,
        "this server takes no device buffers (it was started without a GPU)".to_string(),
    ))?;
    if buffer >= MAX_DEVICE_BUFFERS || len == 0 || len > MAX_DEVICE_BUFFER_LEN {
        return Err((
            ErrorCode::OutOfBounds,
            format!("device buffer {buffer} of {len} bytes (buffers 0..{MAX_DEVICE_BUFFERS}, 1 byte to {MAX_DEVICE_BUFFER_LEN})"),
        ));
    }
    if lock(&session.state).devices.contains_key(&buffer) {
        return Err((
            ErrorCode::DuplicateRequest,
            format!("device buffer {buffer} is already registered"),
        ));
    }
    if matches!(handle, RawDeviceHandle::VmmPosixFd) && fd.is_none() {
        return Err((
            ErrorCode::Malformed,
            format!("device buffer {buffer}: a VMM handle needs its file descriptor attached"),
        ));
    }
    let imported = importer
        .import(len, handle, fd)
        .map_err(|e| (e.code(), format!("cannot open device buffer {buffer}: {e}")))?;
    let release_event = imported.release_event_handle();
    lock(&session.state).devices.insert(
        buffer,
        DeviceEntry {
            imported,
            generation: 0,
            in_flight: false,
        },
    );
    tracing::info!(
        session = session.id,
        buffer,
        len,
        "device buffer registered"
    );
    let _ = session.post(&ServerMsg::DeviceRegistered {
        buffer,
        release_event,
    });
    Ok(())
}

/// A write of the handshake failed: the producer left (or stopped reading) before it was told
/// its pool.
fn handshake_write(e: crate::Error) -> (ErrorCode, String) {
    let why = match e {
        crate::Error::ServerGone => "the producer closed its connection".to_string(),
        e => e.to_string(),
    };
    (
        ErrorCode::Internal,
        format!("writing the Welcome and first grants: {why}"),
    )
}

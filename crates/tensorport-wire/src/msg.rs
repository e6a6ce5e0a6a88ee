//! Messages, as they travel (postcard inside a frame), and their decoders.
//!
//! `Raw*` types are exactly what a peer sent: only their encoding has been checked. The decoders
//! here also check the length of every string and list; [`crate::validate`] checks descriptors.
//!
//! Compatibility rule: variant 0 of [`ClientMsg`] is `Hello` and [`Hello`]'s layout is frozen for
//! every protocol version, so any two versions can negotiate. New variants are only appended.

use serde::{Deserialize, Serialize};

use crate::{WireError, MAX_DIMS, MAX_GRANT, MAX_MESSAGE_LEN, MAX_NAME_LEN};

/// A slot of a session's pool, and the generation it is granted under. A slot's generation grows
/// by one each time the server takes it back, so a reference to an earlier grant is stale.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct SlotRef {
    /// Index of the slot in the pool, from 0.
    pub slot: u32,
    /// Generation the slot was granted under.
    pub generation: u32,
}

/// What a connecting peer intends to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Role {
    /// Submits tensors; gets a pool.
    Producer,
    /// Asks for status, drains or stops the server; gets no pool.
    Control,
}

/// First message of every connection, client to server. Its layout never changes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    /// Must be [`crate::MAGIC`].
    pub magic: [u8; 4],
    /// Oldest protocol version the client speaks.
    pub min_version: u16,
    /// Newest protocol version the client speaks.
    pub max_version: u16,
    /// Producer or control.
    pub role: Role,
    /// A name for logs and status (at most [`MAX_NAME_LEN`] bytes).
    #[serde(deserialize_with = "crate::bounded::string::<_, crate::bounded::Name>")]
    pub name: String,
    /// Slots the client would like (0: the server's default). The server may give fewer.
    pub want_slots: u32,
    /// Bytes per slot the client would like (0: the server's default). The server may give less.
    pub want_slot_size: u64,
}

/// Where a tensor's bytes are, as a peer says.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum RawLocation {
    /// In a slot of the session's host pool.
    HostSlot(SlotRef),
    /// In a device buffer the client registered (`RegisterDevice`), under the generation the
    /// server last released it with (0 at first).
    DeviceBuffer(SlotRef),
}

/// How a client shares a device buffer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum RawDeviceHandle {
    /// Legacy CUDA IPC: a `cuIpcGetMemHandle` of the buffer (from `cuMemAlloc`) and a
    /// `cuIpcGetEventHandle` of an interprocess event the client records after writing the buffer
    /// and before each `Submit` (64 bytes each).
    LegacyIpc {
        /// The memory handle.
        #[serde(deserialize_with = "crate::bounded::vec::<_, _, crate::bounded::Handle>")]
        memory: Vec<u8>,
        /// The "ready" event handle.
        #[serde(deserialize_with = "crate::bounded::vec::<_, _, crate::bounded::Handle>")]
        event: Vec<u8>,
    },
    /// Legacy CUDA IPC with timeline fences: a `cuIpcGetMemHandle` of an allocation that holds
    /// the buffer's `len` bytes followed by two 64-bit semaphores, "ready" at byte `len` (the
    /// client writes a growing value there on its stream after writing the buffer, and puts the
    /// value in the descriptor's `Timeline` fence) and "released" at `len + 8` (the server writes
    /// the same value there on its stream after its reads).
    LegacyIpcTimeline {
        /// The memory handle.
        #[serde(deserialize_with = "crate::bounded::vec::<_, _, crate::bounded::Handle>")]
        memory: Vec<u8>,
    },
    /// A VMM allocation (`cuMemCreate`) exported as a POSIX file descriptor, which is attached
    /// (`SCM_RIGHTS`) to the `RegisterDevice` frame; fenced by timeline values, with the two
    /// semaphores after the buffer's `len` bytes as for `LegacyIpcTimeline`.
    VmmPosixFd,
}

/// A GPU-side fence a consumer must wait on before reading (device path; refused on host slots).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum RawFence {
    /// A `cuIpcGetEventHandle` handle (64 bytes).
    CudaIpcEvent(
        #[serde(deserialize_with = "crate::bounded::vec::<_, _, crate::bounded::Handle>")] Vec<u8>,
    ),
    /// Wait until a shared 64-bit semaphore reaches `value`.
    Timeline {
        /// Which semaphore of the session.
        semaphore: u32,
        /// Value to wait for.
        value: u64,
    },
}

/// A tensor descriptor as a peer sent it. Check it with [`crate::validate`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RawTensorDesc {
    /// [`crate::DType`] number.
    pub dtype: u8,
    /// Dimensions, outermost first.
    #[serde(deserialize_with = "crate::bounded::vec::<_, _, crate::bounded::Shape>")]
    pub shape: Vec<u64>,
    /// Strides in elements; `None` means row-major contiguous.
    #[serde(deserialize_with = "crate::bounded::opt_vec::<_, _, crate::bounded::Strides>")]
    pub strides: Option<Vec<u64>>,
    /// Byte offset of element 0 inside the slot.
    pub offset: u64,
    /// Bytes covered from `offset`.
    pub len: u64,
    /// Where the bytes are.
    pub location: RawLocation,
    /// What to wait on before reading.
    pub fence: Option<RawFence>,
}

/// Messages from a client to the server.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ClientMsg {
    /// Opens the session. Must come first, once.
    Hello(Hello),
    /// Hands a written slot to the server. The client may not touch the slot until it is granted
    /// again.
    Submit {
        /// Chosen by the client, unique among its requests in flight; the result carries it.
        request_id: u64,
        /// The tensor.
        tensor: RawTensorDesc,
    },
    /// Gives a granted slot back unused.
    Return(SlotRef),
    /// Asks for a [`ServerMsg::Status`].
    Status,
    /// Asks the server to finish the work in flight, refuse new sessions and exit (control only).
    Drain,
    /// Ends the session cleanly.
    Goodbye,
    /// Shares a device buffer of `len` bytes with the server, once; the server answers
    /// `DeviceRegistered` (or an error).
    RegisterDevice {
        /// The client's number for the buffer (at most [`crate::MAX_DEVICE_BUFFERS`] per session).
        buffer: u32,
        /// Bytes in the buffer.
        len: u64,
        /// How to open it.
        handle: RawDeviceHandle,
    },
}

impl ClientMsg {
    /// The message's name, for errors that quote it.
    pub fn name(&self) -> &'static str {
        match self {
            ClientMsg::Hello(_) => "Hello",
            ClientMsg::Submit { .. } => "Submit",
            ClientMsg::Return(_) => "Return",
            ClientMsg::Status => "Status",
            ClientMsg::Drain => "Drain",
            ClientMsg::Goodbye => "Goodbye",
            ClientMsg::RegisterDevice { .. } => "RegisterDevice",
        }
    }
}

/// Layout of a session's pool, sent in `Welcome` with the pool's file descriptor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolLayout {
    /// Number of slots.
    pub slot_count: u32,
    /// Bytes per slot; slot `i` starts at byte `i * slot_size` of the pool.
    pub slot_size: u64,
    /// Bytes in the pool (at least `slot_count * slot_size`).
    pub pool_len: u64,
}

/// The server's answer to `Hello`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Welcome {
    /// The protocol version chosen for this session.
    pub version: u16,
    /// The session's id, unique in this server's life.
    pub session_id: u64,
    /// The pool's layout (all zero for a control session).
    pub pool: PoolLayout,
    /// Most requests the session may have in flight (submitted, result not yet sent).
    pub max_in_flight: u32,
    /// Number of file descriptors attached to this frame (1 for a producer: the pool's memfd).
    pub fds: u8,
}

/// The outcome of one request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Outcome {
    /// The handler's answer (e.g. class scores as little-endian f32).
    Ok(Vec<u8>),
    /// The handler failed on this request.
    Err {
        /// [`crate::ErrorCode`] number.
        code: u16,
        /// What went wrong (at most [`MAX_MESSAGE_LEN`] bytes).
        #[serde(deserialize_with = "crate::bounded::string::<_, crate::bounded::Message>")]
        message: String,
    },
}

/// Per-session figures in a status report.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct SessionStatus {
    /// Session id.
    pub session_id: u64,
    /// The client's name from `Hello`.
    #[serde(deserialize_with = "crate::bounded::string::<_, crate::bounded::Name>")]
    pub name: String,
    /// The client's pid (from the socket's peer credentials).
    pub pid: u32,
    /// Slots in the pool.
    pub slots: u32,
    /// Slots with the client now (granted, not submitted).
    pub granted: u32,
    /// Requests submitted whose result was not sent yet.
    pub in_flight: u32,
    /// Requests submitted since the session began.
    pub submitted: u64,
    /// Results sent.
    pub completed: u64,
    /// Errors sent to the session.
    pub errors: u64,
}

/// Server-wide counters in a status report.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct Counters {
    /// Requests accepted.
    pub submitted: u64,
    /// Results sent.
    pub completed: u64,
    /// Tensor bytes handed over (sum of descriptor lengths).
    pub bytes: u64,
    /// Error frames sent for bad messages.
    pub protocol_errors: u64,
    /// Sessions opened.
    pub sessions_opened: u64,
    /// Sessions that ended with a dead or broken peer and were reclaimed.
    pub sessions_reclaimed: u64,
    /// Connections refused (limit, uid, handshake).
    pub connections_refused: u64,
    /// Batches handed to the consumer by `recv_batch`.
    pub batches: u64,
    /// Requests in those batches (mean fill = `batched / batches`).
    pub batched: u64,
}

/// The answer to `Status`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct StatusReport {
    /// Server process id.
    pub pid: u32,
    /// Milliseconds since the server started.
    pub uptime_ms: u64,
    /// Whether the server is draining.
    pub draining: bool,
    /// Open producer sessions (the first 256).
    #[serde(deserialize_with = "crate::bounded::vec::<_, _, crate::bounded::Sessions>")]
    pub sessions: Vec<SessionStatus>,
    /// Totals since start.
    pub totals: Counters,
}

/// Messages from the server to a client.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ServerMsg {
    /// The answer to `Hello`; a producer's carries the pool's fd.
    Welcome(Welcome),
    /// These slots are the client's to write (at most [`MAX_GRANT`]).
    Grant(
        #[serde(deserialize_with = "crate::bounded::vec::<_, _, crate::bounded::Grants>")]
        Vec<SlotRef>,
    ),
    /// The result of a request.
    Result {
        /// The request's id.
        request_id: u64,
        /// What came of it.
        outcome: Outcome,
    },
    /// Something the client sent was refused.
    Error {
        /// [`crate::ErrorCode`] number.
        code: u16,
        /// The request it concerns, if any.
        request_id: Option<u64>,
        /// Whether the server closes the connection after this frame.
        fatal: bool,
        /// What went wrong (at most [`MAX_MESSAGE_LEN`] bytes).
        #[serde(deserialize_with = "crate::bounded::string::<_, crate::bounded::Message>")]
        message: String,
    },
    /// The answer to `Status`.
    Status(StatusReport),
    /// The server drains: finish, submit nothing new.
    Draining,
    /// A device buffer is open in the server. Before writing the buffer again after a
    /// `DeviceReleased`, the client makes its stream wait on `release_event` (a
    /// `cuIpcGetEventHandle`, 64 bytes), which the server records once it is done reading; for a
    /// timeline buffer `release_event` is empty and the client waits on the "released"
    /// semaphore instead.
    DeviceRegistered {
        /// The client's buffer number.
        buffer: u32,
        /// The server's "released" event.
        #[serde(deserialize_with = "crate::bounded::vec::<_, _, crate::bounded::Handle>")]
        release_event: Vec<u8>,
    },
    /// The server has enqueued everything that reads this buffer (and recorded its release
    /// event after it); the buffer is the client's again under the new generation.
    DeviceReleased(SlotRef),
}

fn decode<'a, T: Deserialize<'a>>(bytes: &'a [u8]) -> Result<T, WireError> {
    crate::bounded::take_overrun();
    let (v, rest) = postcard::take_from_bytes::<T>(bytes).map_err(|e| {
        match crate::bounded::take_overrun() {
            Some(o) => o.into_error(),
            None => WireError::Malformed(e.to_string()),
        }
    })?;
    if !rest.is_empty() {
        return Err(WireError::Malformed(format!(
            "{} trailing bytes after the message",
            rest.len()
        )));
    }
    Ok(v)
}

fn check_len(what: &'static str, len: usize, max: usize) -> Result<(), WireError> {
    if len > max {
        Err(WireError::TooLong { what, len, max })
    } else {
        Ok(())
    }
}

fn check_handle(what: &'static str, h: &[u8]) -> Result<(), WireError> {
    if h.len() != 64 {
        return Err(WireError::Malformed(format!(
            "{what} of {} bytes, expected 64",
            h.len()
        )));
    }
    Ok(())
}

fn check_desc_sizes(t: &RawTensorDesc) -> Result<(), WireError> {
    if t.shape.len() > MAX_DIMS {
        return Err(WireError::BadRank(t.shape.len()));
    }
    if let Some(s) = &t.strides {
        check_len("strides", s.len(), MAX_DIMS)?;
    }
    if let Some(RawFence::CudaIpcEvent(h)) = &t.fence {
        if h.len() != 64 {
            return Err(WireError::Malformed(format!(
                "IPC event handle of {} bytes, expected 64",
                h.len()
            )));
        }
    }
    Ok(())
}

/// Decodes one frame payload from a client, checking sizes of every string and list.
pub fn decode_client(payload: &[u8]) -> Result<ClientMsg, WireError> {
    decode_client_naming(payload).map_err(|(e, _)| e)
}

/// [`decode_client`], and when a `Submit` decodes but fails the size checks, its `request_id`
/// beside the error, so the refusal can name the request.
pub fn decode_client_naming(payload: &[u8]) -> Result<ClientMsg, (WireError, Option<u64>)> {
    let msg: ClientMsg = decode(payload).map_err(|e| {
        // A Submit refused for a size (its rank, say) while decoding: its id came first.
        let id = match e {
            WireError::Malformed(_) => None,
            _ => submit_request_id(payload),
        };
        (e, id)
    })?;
    let id = match &msg {
        ClientMsg::Submit { request_id, .. } => Some(*request_id),
        _ => None,
    };
    check_client_sizes(&msg).map_err(|e| (e, id))?;
    Ok(msg)
}

/// The `request_id` of a Submit from the first bytes of its payload (the variant's index, then
/// the id), however the rest decodes.
fn submit_request_id(payload: &[u8]) -> Option<u64> {
    const SUBMIT: u32 = 1;
    match postcard::take_from_bytes::<(u32, u64)>(payload) {
        Ok(((SUBMIT, id), _)) => Some(id),
        _ => None,
    }
}

fn check_client_sizes(msg: &ClientMsg) -> Result<(), WireError> {
    match msg {
        ClientMsg::Hello(h) => check_len("client name", h.name.len(), MAX_NAME_LEN)?,
        ClientMsg::Submit { tensor, .. } => check_desc_sizes(tensor)?,
        ClientMsg::RegisterDevice {
            handle: RawDeviceHandle::LegacyIpc { memory, event },
            ..
        } => {
            check_handle("IPC memory handle", memory)?;
            check_handle("IPC event handle", event)?;
        }
        ClientMsg::RegisterDevice {
            handle: RawDeviceHandle::LegacyIpcTimeline { memory },
            ..
        } => check_handle("IPC memory handle", memory)?,
        _ => {}
    }
    Ok(())
}

/// Decodes one frame payload from a server, checking sizes of every string and list.
pub fn decode_server(payload: &[u8]) -> Result<ServerMsg, WireError> {
    let msg: ServerMsg = decode(payload)?;
    match &msg {
        ServerMsg::Grant(g) => check_len("grant", g.len(), MAX_GRANT)?,
        ServerMsg::Error { message, .. } => {
            check_len("error message", message.len(), MAX_MESSAGE_LEN)?
        }
        ServerMsg::Result {
            outcome: Outcome::Err { message, .. },
            ..
        } => check_len("error message", message.len(), MAX_MESSAGE_LEN)?,
        ServerMsg::DeviceRegistered { release_event, .. } if !release_event.is_empty() => {
            check_handle("IPC event handle", release_event)?
        }
        _ => {}
    }
    Ok(msg)
}

/// Picks the newest version both sides speak, or says why there is none.
pub fn negotiate(hello: &Hello) -> Result<u16, WireError> {
    if hello.magic != crate::MAGIC {
        return Err(WireError::BadMagic);
    }
    let lo = hello.min_version.max(crate::MIN_PROTOCOL_VERSION);
    let hi = hello.max_version.min(crate::PROTOCOL_VERSION);
    if lo > hi {
        return Err(WireError::VersionMismatch {
            peer_min: hello.min_version,
            peer_max: hello.max_version,
            our_min: crate::MIN_PROTOCOL_VERSION,
            our_max: crate::PROTOCOL_VERSION,
        });
    }
    Ok(hi)
}

/// Cuts `message` to at most [`MAX_MESSAGE_LEN`] bytes on a character boundary.
pub fn clip_message(mut message: String) -> String {
    if message.len() > MAX_MESSAGE_LEN {
        let mut cut = MAX_MESSAGE_LEN;
        while !message.is_char_boundary(cut) {
            cut -= 1;
        }
        message.truncate(cut);
    }
    message
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{encode_frame, ErrorCode, MAX_FRAME_LEN};
    use proptest::prelude::*;

    fn hello() -> Hello {
        Hello {
            magic: crate::MAGIC,
            min_version: 1,
            max_version: 1,
            role: Role::Producer,
            name: "p".into(),
            want_slots: 0,
            want_slot_size: 0,
        }
    }

    #[test]
    fn roundtrip_client_messages() {
        let msgs = vec![
            ClientMsg::Hello(hello()),
            ClientMsg::Submit {
                request_id: 42,
                tensor: RawTensorDesc {
                    dtype: 0,
                    shape: vec![3, 224, 224],
                    strides: None,
                    offset: 0,
                    len: 3 * 224 * 224 * 4,
                    location: RawLocation::HostSlot(SlotRef {
                        slot: 3,
                        generation: 9,
                    }),
                    fence: None,
                },
            },
            ClientMsg::Return(SlotRef {
                slot: 1,
                generation: 2,
            }),
            ClientMsg::Status,
            ClientMsg::Drain,
            ClientMsg::Goodbye,
        ];
        for m in msgs {
            let f = encode_frame(&m).unwrap();
            assert_eq!(decode_client(&f[4..]).unwrap(), m);
        }
    }

    #[test]
    fn hello_layout_is_frozen() {
        // Variant 0, magic, versions 1..=1, role 0, name "p", 0, 0: if this changes, old and new
        // peers can no longer negotiate.
        let f = encode_frame(&ClientMsg::Hello(hello())).unwrap();
        assert_eq!(
            &f[4..],
            &[0, b'T', b'P', b'R', b'T', 1, 1, 0, 1, b'p', 0, 0]
        );
    }

    #[test]
    fn negotiation() {
        // A protocol-1 client gets protocol 1; a client that speaks up to 5 gets our newest.
        assert_eq!(negotiate(&hello()).unwrap(), 1);
        let mut h = hello();
        h.max_version = 5;
        assert_eq!(negotiate(&h).unwrap(), crate::PROTOCOL_VERSION);
        h.min_version = crate::PROTOCOL_VERSION + 1;
        assert_eq!(
            negotiate(&h).unwrap_err().code(),
            ErrorCode::VersionMismatch
        );
        h = hello();
        h.magic = *b"HTTP";
        assert_eq!(negotiate(&h).unwrap_err(), WireError::BadMagic);
    }

    #[test]
    fn long_strings_are_refused() {
        let mut h = hello();
        h.name = "x".repeat(MAX_NAME_LEN + 1);
        let f = encode_frame(&ClientMsg::Hello(h)).unwrap();
        assert_eq!(
            decode_client(&f[4..]).unwrap_err().code(),
            ErrorCode::TooLong
        );
    }

    #[test]
    fn trailing_bytes_are_refused() {
        let mut f = encode_frame(&ClientMsg::Status).unwrap();
        f.push(0);
        assert_eq!(
            decode_client(&f[4..]).unwrap_err().code(),
            ErrorCode::Malformed
        );
    }

    #[test]
    fn clip_keeps_char_boundaries() {
        let s = clip_message("é".repeat(MAX_MESSAGE_LEN));
        assert!(s.len() <= MAX_MESSAGE_LEN);
        assert!(s.chars().all(|c| c == 'é'));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]
        #[test]
        fn decoding_arbitrary_bytes_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = decode_client(&bytes);
            let _ = decode_server(&bytes);
            if let Ok(ClientMsg::Submit { tensor, .. }) = decode_client(&bytes) {
                let _ = crate::validate(&tensor, &crate::PoolBounds { slot_count: 8, slot_size: 1 << 20 });
            }
        }

        #[test]
        fn framing_arbitrary_bytes_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..4096), chunk in 1usize..300) {
            let _ = crate::frame::for_each_frame(&bytes, chunk, MAX_FRAME_LEN, |p| {
                let _ = decode_client(p);
            });
        }

        #[test]
        fn validate_never_panics(dtype in any::<u8>(), shape in proptest::collection::vec(any::<u64>(), 0..10),
                                 strides in proptest::option::of(proptest::collection::vec(any::<u64>(), 0..10)),
                                 offset in any::<u64>(), len in any::<u64>(), slot in any::<u32>()) {
            let raw = RawTensorDesc { dtype, shape, strides, offset, len,
                location: RawLocation::HostSlot(SlotRef { slot, generation: 0 }), fence: None };
            let pool = crate::PoolBounds { slot_count: 16, slot_size: 1 << 16 };
            if let Ok(d) = crate::validate(&raw, &pool) {
                // Everything a checked descriptor covers is inside the slot.
                prop_assert!(d.offset() + d.byte_len() <= pool.slot_size);
                prop_assert!(d.numel() * d.dtype().size() <= d.byte_len() || !d.is_contiguous());
                prop_assert!(d.slot().slot < pool.slot_count);
            }
        }
    }
}

//! The tensorport control protocol, as pure functions from bytes to checked messages.
//!
//! Nothing here does I/O and nothing here is `unsafe`. Bytes that arrive from a peer go through
//! three steps, each of which can only return an error, never panic:
//!
//! 1. [`frame::FrameBuffer`] splits a byte stream into frames (`u32` little-endian length, then
//!    the payload) and refuses a length over the limit *before* allocating anything for it.
//! 2. [`msg::decode_client`] / [`msg::decode_server`] turn one payload into a raw message with
//!    postcard and check the sizes of every string and list in it.
//! 3. [`desc::validate`] turns a raw tensor descriptor into a [`desc::TensorDesc`] whose dtype is
//!    known, whose element count does not overflow, and whose bytes (with strides) lie inside the
//!    slot it names. Only a `TensorDesc` is ever used to form a pointer.
//!
//! The protocol is specified in `docs/protocol.md`; the constants below are part of it.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

#[macro_use]
mod numbered;
mod bounded;
pub mod desc;
pub mod entry;
pub mod error;
pub mod frame;
pub mod msg;

pub use desc::{
    validate, validate_in, validate_view, DType, Location, PoolBounds, RawTensorView, Strides,
    TensorDesc, MAX_DIMS,
};
pub use error::{ErrorCode, WireError};
pub use frame::{
    encode_frame, encode_frame_into, for_each_frame, parse_header, FrameBuffer, FRAME_HEADER_LEN,
};
pub use msg::*;

/// The protocol version this crate speaks. A peer negotiates it in the handshake. Version 2 adds
/// the shared-memory submission and completion queues (a producer's `Welcome` may then carry four
/// descriptors: pool, queues, server doorbell, producer doorbell); version 3 carries device-buffer
/// submissions and their releases on those queues too; version 1 is the socket alone.
pub const PROTOCOL_VERSION: u16 = 3;
/// The first version whose queues carry device buffers (submissions and `DeviceReleased`).
pub const DEVICE_QUEUES_VERSION: u16 = 3;
/// The oldest protocol version this crate can speak.
pub const MIN_PROTOCOL_VERSION: u16 = 1;
/// First four bytes of every `Hello`: tells a tensorport server from anything else on a socket.
pub const MAGIC: [u8; 4] = *b"TPRT";
/// Hard ceiling on a frame's payload length, whatever a peer announces. Larger frames are refused
/// unread and the connection is closed.
pub const MAX_FRAME_LEN: u32 = 1 << 20;
/// Longest client name accepted in `Hello`, in bytes.
pub const MAX_NAME_LEN: usize = 64;
/// Longest error message a peer may send, in bytes.
pub const MAX_MESSAGE_LEN: usize = 1024;
/// Most slot references one `Grant` may carry.
pub const MAX_GRANT: usize = 4096;
/// Most device buffers one session may register.
pub const MAX_DEVICE_BUFFERS: u32 = 256;

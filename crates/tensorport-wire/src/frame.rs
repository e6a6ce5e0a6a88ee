//! Length-prefixed frames: `u32` little-endian payload length, then the payload.
//!
//! [`FrameBuffer`] is a pure state machine: the caller reads bytes from wherever it likes into
//! [`FrameBuffer::spare`], reports how many with [`FrameBuffer::commit`], and takes complete
//! frames from [`FrameBuffer::next_frame`]. A length over the limit is an error as soon as its
//! four bytes are in, before any memory is set aside for the frame.

use serde::Serialize;

use crate::{WireError, MAX_FRAME_LEN};

/// Bytes in a frame header.
pub const FRAME_HEADER_LEN: usize = 4;

/// Bytes the buffer asks for at least, when it has room to ask.
const READ_CHUNK: usize = 16 * 1024;

/// Serializes `msg` into one complete frame (header and payload).
///
/// Fails with [`WireError::FrameTooLarge`] if the payload would exceed [`MAX_FRAME_LEN`]; the
/// caller sent something too big (a result, say), which is its own error to report.
pub fn encode_frame<T: Serialize>(msg: &T) -> Result<Vec<u8>, WireError> {
    let mut out = Vec::with_capacity(64);
    encode_frame_into(msg, &mut out)?;
    Ok(out)
}

/// Like [`encode_frame`], appending to `out` (which is cleared first) so a caller can reuse one
/// buffer and allocate nothing per message.
pub fn encode_frame_into<T: Serialize>(msg: &T, out: &mut Vec<u8>) -> Result<(), WireError> {
    out.clear();
    out.extend_from_slice(&[0u8; FRAME_HEADER_LEN]);
    let taken = std::mem::take(out);
    let mut buf = postcard::to_extend(msg, taken)
        .map_err(|e| WireError::Malformed(format!("cannot encode: {e}")))?;
    let len = buf.len() - FRAME_HEADER_LEN;
    if len > MAX_FRAME_LEN as usize {
        return Err(WireError::FrameTooLarge {
            len: len as u64,
            max: MAX_FRAME_LEN,
        });
    }
    buf[..FRAME_HEADER_LEN].copy_from_slice(&(len as u32).to_le_bytes());
    *out = buf;
    Ok(())
}

/// Splits a byte stream into frames as a reader would, taking it in reads of at most `chunk`
/// bytes, and calls `each` with every complete payload. Stops at the first framing error.
pub fn for_each_frame(
    mut stream: &[u8],
    chunk: usize,
    max: u32,
    mut each: impl FnMut(&[u8]),
) -> Result<(), WireError> {
    let mut fb = FrameBuffer::new(max);
    while !stream.is_empty() {
        let n = fb.feed(stream, chunk.max(1));
        stream = &stream[n..];
        while let Some(p) = fb.next_frame()? {
            each(p);
        }
    }
    Ok(())
}

/// Reads a frame header. Returns the payload length, checked against `max`.
pub fn parse_header(header: [u8; FRAME_HEADER_LEN], max: u32) -> Result<usize, WireError> {
    let len = u32::from_le_bytes(header);
    if len == 0 {
        return Err(WireError::EmptyFrame);
    }
    if len > max.min(MAX_FRAME_LEN) {
        return Err(WireError::FrameTooLarge {
            len: len as u64,
            max: max.min(MAX_FRAME_LEN),
        });
    }
    Ok(len as usize)
}

/// Accumulates bytes from a stream and yields complete frame payloads.
#[derive(Debug)]
pub struct FrameBuffer {
    buf: Vec<u8>,
    /// First byte not yet consumed.
    start: usize,
    /// One past the last byte received.
    end: usize,
    max: u32,
}

impl FrameBuffer {
    /// A buffer that refuses payloads longer than `max` (capped at [`MAX_FRAME_LEN`]).
    pub fn new(max: u32) -> FrameBuffer {
        FrameBuffer {
            buf: vec![0; READ_CHUNK],
            start: 0,
            end: 0,
            max: max.min(MAX_FRAME_LEN),
        }
    }

    /// Bytes received but not yet returned as part of a frame.
    pub fn pending(&self) -> usize {
        self.end - self.start
    }

    /// Room to read the next bytes into. Never empty. Grows only to hold one whole frame whose
    /// header has already been checked against the limit.
    pub fn spare(&mut self) -> &mut [u8] {
        let pending = self.pending();
        // Space the frame in progress needs, if its header is in (its length was checked in
        // `next_frame`, which the caller runs before reading more).
        let need = if pending >= FRAME_HEADER_LEN {
            let mut h = [0u8; FRAME_HEADER_LEN];
            h.copy_from_slice(&self.buf[self.start..self.start + FRAME_HEADER_LEN]);
            match parse_header(h, self.max) {
                Ok(len) => FRAME_HEADER_LEN + len,
                Err(_) => FRAME_HEADER_LEN,
            }
        } else {
            FRAME_HEADER_LEN
        };
        if self.start > 0 && (self.buf.len() - self.end < READ_CHUNK || self.start == self.end) {
            self.buf.copy_within(self.start..self.end, 0);
            self.end = pending;
            self.start = 0;
        }
        let want = need.max(pending + READ_CHUNK.min(FRAME_HEADER_LEN + self.max as usize));
        if self.buf.len() < self.start + want {
            self.buf.resize(self.start + want, 0);
        }
        &mut self.buf[self.end..]
    }

    /// Marks `n` bytes of [`FrameBuffer::spare`] as received.
    ///
    /// `n` larger than the spare room is clamped (a caller bug cannot make the buffer lie).
    pub fn commit(&mut self, n: usize) {
        self.end = (self.end + n).min(self.buf.len());
    }

    /// Copies up to `most` bytes of `input` into the buffer (as a read would) and returns how
    /// many it took: fewer when the frame in progress needs no more room than that.
    pub fn feed(&mut self, input: &[u8], most: usize) -> usize {
        let spare = self.spare();
        let n = most.min(spare.len()).min(input.len());
        spare[..n].copy_from_slice(&input[..n]);
        self.commit(n);
        n
    }

    /// The next complete frame's payload, `Ok(None)` if more bytes are needed, or an error if the
    /// stream is broken (the connection must then be closed).
    pub fn next_frame(&mut self) -> Result<Option<&[u8]>, WireError> {
        if self.pending() < FRAME_HEADER_LEN {
            return Ok(None);
        }
        let mut h = [0u8; FRAME_HEADER_LEN];
        h.copy_from_slice(&self.buf[self.start..self.start + FRAME_HEADER_LEN]);
        let len = parse_header(h, self.max)?;
        if self.pending() < FRAME_HEADER_LEN + len {
            return Ok(None);
        }
        let from = self.start + FRAME_HEADER_LEN;
        self.start = from + len;
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
            // The payload is still in place: resetting the indices does not move bytes.
            return Ok(Some(&self.buf[from..from + len]));
        }
        Ok(Some(&self.buf[from..from + len]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frames(bytes: &[u8], chunk: usize) -> Vec<Vec<u8>> {
        let mut out = Vec::new();
        for_each_frame(bytes, chunk, MAX_FRAME_LEN, |f| out.push(f.to_vec())).unwrap();
        out
    }

    #[test]
    fn frames_survive_any_split() {
        let payloads: Vec<Vec<u8>> = (1..40u32)
            .map(|i| vec![i as u8; (i * 997) as usize])
            .collect();
        let mut stream = Vec::new();
        for p in &payloads {
            stream.extend_from_slice(&(p.len() as u32).to_le_bytes());
            stream.extend_from_slice(p);
        }
        for chunk in [1, 3, 4, 5, 1000, 65536] {
            assert_eq!(frames(&stream, chunk), payloads, "chunk {chunk}");
        }
    }

    #[test]
    fn oversize_is_refused_before_allocation() {
        let mut fb = FrameBuffer::new(1024);
        fb.feed(&u32::MAX.to_le_bytes(), 4);
        let err = fb.next_frame().unwrap_err();
        assert_eq!(err.code(), crate::ErrorCode::FrameTooLarge);
        // The buffer did not grow towards the announced 4 GiB.
        assert!(fb.spare().len() < 64 * 1024);
    }

    #[test]
    fn empty_frame_is_an_error() {
        let mut fb = FrameBuffer::new(1024);
        fb.feed(&0u32.to_le_bytes(), 4);
        assert_eq!(fb.next_frame().unwrap_err(), WireError::EmptyFrame);
    }

    #[test]
    fn encode_roundtrip_header() {
        let f = encode_frame(&(7u32, 9u64)).unwrap();
        let len = parse_header(f[..4].try_into().unwrap(), MAX_FRAME_LEN).unwrap();
        assert_eq!(len, f.len() - 4);
        let v: (u32, u64) = postcard::from_bytes(&f[4..]).unwrap();
        assert_eq!(v, (7, 9));
    }
}

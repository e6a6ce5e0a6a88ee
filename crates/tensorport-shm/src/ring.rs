//! The hot path in shared memory: a submission queue (producer → server) and a completion
//! queue (server → producer), one of each per session, in one sealed memfd.
//!
//! Each queue is single-producer single-consumer: a ring of fixed-size entries and two
//! free-running `u64` positions, the writer's `tail` and the reader's `head`. The writer fills an
//! entry, then publishes it with a release store of `tail + 1`; the reader loads `tail` with
//! acquire, copies the entry out, and gives the space back with a release store of `head + 1`.
//! Every word in the mapping is read and written as an atomic, so a peer that scribbles on the
//! memory can make values wrong, never make this process's reads undefined.
//!
//! **Untrusted peer.** Each side keeps its own position in private memory and never re-reads it
//! from the mapping; the peer's position is checked on every load (`0 ≤ tail − head ≤ capacity`)
//! and a violation is [`RingError::Corrupt`], which the caller turns into closing the session.
//! Entries are copied out once and only the copy is used (the caller validates it further).
//!
//! **Sleepers.** A side that is about to sleep sets its `waiting` word, issues a `SeqCst` fence,
//! and looks at the queue once more before sleeping; a writer publishes, fences, and rings the
//! peer's doorbell (an eventfd, owned by the caller) only if the peer's word is set. One of the
//! two always sees the other, so no wake-up is lost, and a busy peer costs no system call.
//!
//! Layout (all little-endian `u64` words; offsets in bytes; part of the protocol, see
//! `docs/protocol.md`):
//!
//! | offset | word | written by |
//! | --- | --- | --- |
//! | 0 | magic `"TPRING01"` | server, once |
//! | 8 | layout version (1) | server, once |
//! | 16 / 24 | submission / completion capacity (entries, powers of two) | server, once |
//! | 32 / 40 | submission / completion entry size in bytes (192 / 256) | server, once |
//! | 128 | submission tail | producer |
//! | 256 | submission head | server |
//! | 384 | completion tail | server |
//! | 512 | completion head | producer |
//! | 640 | server waiting (0/1) | server |
//! | 768 | producer waiting (0/1) | producer |
//! | 896 | messages sent on the socket (counter) | server |
//! | 1024 | submission entries, then completion entries | |

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::map::Prefetch;
use crate::{HostPool, Result, ShmError};

// The entries' codec is the wire crate's (beside the socket's frames); the queues are ours.
pub use tensorport_wire::entry::{
    CqHeader, SqEntry, CQ_DEVICE_RELEASED, CQ_ENTRY_WORDS, CQ_GRANT, CQ_HEADER_WORDS,
    CQ_INLINE_BYTES, CQ_RESULT, SQ_ENTRY_WORDS, TIMELINE_WORD,
};
/// Most dimensions a submission entry holds.
pub const RING_MAX_DIMS: usize = tensorport_wire::MAX_DIMS;

/// First word of a ring mapping.
pub const RING_MAGIC: u64 = u64::from_le_bytes(*b"TPRING01");
/// Version of the layout above.
pub const RING_LAYOUT_VERSION: u64 = 1;
/// Bytes before the first submission entry.
pub const RING_HEADER_BYTES: usize = 1024;
/// Largest ring accepted from a peer (entries per queue).
pub const MAX_RING_ENTRIES: u64 = 1 << 16;

const OFF_MAGIC: usize = 0;
const OFF_VERSION: usize = 8;
const OFF_SQ_CAP: usize = 16;
const OFF_CQ_CAP: usize = 24;
const OFF_SQ_ENTRY: usize = 32;
const OFF_CQ_ENTRY: usize = 40;
const OFF_SQ_TAIL: usize = 128;
const OFF_SQ_HEAD: usize = 256;
const OFF_CQ_TAIL: usize = 384;
const OFF_CQ_HEAD: usize = 512;
const OFF_SERVER_WAITING: usize = 640;
const OFF_PRODUCER_WAITING: usize = 768;
const OFF_SOCKET_SEQ: usize = 896;

/// Why a ring operation failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RingError {
    /// The peer wrote a position that cannot be (it moved backwards or past the capacity).
    #[error("the peer corrupted the {queue} queue: {what}")]
    Corrupt {
        /// "submission" or "completion".
        queue: &'static str,
        /// What was wrong.
        what: String,
    },
}

/// A session's two queues in one sealed memfd, mapped by both sides.
#[derive(Debug)]
pub struct RingMem {
    mem: HostPool,
    sq_cap: u64,
    cq_cap: u64,
}

fn ring_len(sq_cap: u64, cq_cap: u64) -> Option<u64> {
    let sq = sq_cap.checked_mul(SQ_ENTRY_WORDS as u64 * 8)?;
    let cq = cq_cap.checked_mul(CQ_ENTRY_WORDS as u64 * 8)?;
    (RING_HEADER_BYTES as u64).checked_add(sq)?.checked_add(cq)
}

impl RingMem {
    /// Creates the queues (server side): capacities are rounded up to powers of two.
    pub fn create(sq_entries: u32, cq_entries: u32) -> Result<RingMem> {
        let sq_cap = (sq_entries.max(2) as u64).next_power_of_two();
        let cq_cap = (cq_entries.max(2) as u64).next_power_of_two();
        if sq_cap > MAX_RING_ENTRIES || cq_cap > MAX_RING_ENTRIES {
            return Err(ShmError::BadLayout(format!(
                "rings of {sq_cap}/{cq_cap} entries (at most {MAX_RING_ENTRIES})"
            )));
        }
        let len = ring_len(sq_cap, cq_cap).expect("bounded above");
        let mem = HostPool::create("tensorport-ring", 1, len)?;
        let r = RingMem {
            mem,
            sq_cap,
            cq_cap,
        };
        let m = r.mem.mapping();
        m.atomic_u64(OFF_VERSION)
            .store(RING_LAYOUT_VERSION, Ordering::Relaxed);
        m.atomic_u64(OFF_SQ_CAP).store(sq_cap, Ordering::Relaxed);
        m.atomic_u64(OFF_CQ_CAP).store(cq_cap, Ordering::Relaxed);
        m.atomic_u64(OFF_SQ_ENTRY)
            .store(SQ_ENTRY_WORDS as u64 * 8, Ordering::Relaxed);
        m.atomic_u64(OFF_CQ_ENTRY)
            .store(CQ_ENTRY_WORDS as u64 * 8, Ordering::Relaxed);
        m.atomic_u64(OFF_MAGIC).store(RING_MAGIC, Ordering::Release);
        Ok(r)
    }

    /// Maps queues received from the server (producer side), after checking the seals, the
    /// header, and that the file holds every entry the header announces.
    pub fn open(fd: OwnedFd) -> Result<RingMem> {
        let st = nix::sys::stat::fstat(&fd).map_err(crate::sys("fstat"))?;
        let size = st.st_size as u64;
        let max = ring_len(MAX_RING_ENTRIES, MAX_RING_ENTRIES).expect("constant");
        if size < RING_HEADER_BYTES as u64 || size > max.next_multiple_of(crate::page_size()) {
            return Err(ShmError::BadLayout(format!("a ring file of {size} bytes")));
        }
        let mem = HostPool::open(fd, 1, size)?;
        let m = mem.mapping();
        let word = |o| m.atomic_u64(o).load(Ordering::Acquire);
        let bad = |what: String| Err(ShmError::BadLayout(format!("ring header: {what}")));
        if word(OFF_MAGIC) != RING_MAGIC {
            return bad("bad magic".into());
        }
        if word(OFF_VERSION) != RING_LAYOUT_VERSION {
            return bad(format!("layout version {}", word(OFF_VERSION)));
        }
        let (sq_cap, cq_cap) = (word(OFF_SQ_CAP), word(OFF_CQ_CAP));
        let pow2 = |c: u64| c.is_power_of_two() && c <= MAX_RING_ENTRIES;
        if !pow2(sq_cap) || !pow2(cq_cap) {
            return bad(format!("capacities {sq_cap}/{cq_cap}"));
        }
        if word(OFF_SQ_ENTRY) != SQ_ENTRY_WORDS as u64 * 8
            || word(OFF_CQ_ENTRY) != CQ_ENTRY_WORDS as u64 * 8
        {
            return bad("entry sizes".into());
        }
        if ring_len(sq_cap, cq_cap).is_none_or(|l| l > size) {
            return bad(format!("{sq_cap}/{cq_cap} entries do not fit {size} bytes"));
        }
        Ok(RingMem {
            mem,
            sq_cap,
            cq_cap,
        })
    }

    /// The memfd, to send to the producer.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.mem.fd()
    }

    /// Submission queue capacity in entries.
    pub fn sq_capacity(&self) -> u64 {
        self.sq_cap
    }

    /// Completion queue capacity in entries.
    pub fn cq_capacity(&self) -> u64 {
        self.cq_cap
    }

    fn w(&self, off: usize) -> &AtomicU64 {
        self.mem.mapping().atomic_u64(off)
    }

    fn sq_word(&self, pos: u64, i: usize) -> &AtomicU64 {
        let e = (pos & (self.sq_cap - 1)) as usize;
        self.w(RING_HEADER_BYTES + (e * SQ_ENTRY_WORDS + i) * 8)
    }

    /// Starts fetching submission entry `pos`'s first line (see [`Mapping::prefetch`]).
    fn prefetch_sq(&self, pos: u64) {
        let e = (pos & (self.sq_cap - 1)) as usize;
        self.mem
            .mapping()
            .prefetch(RING_HEADER_BYTES + e * SQ_ENTRY_WORDS * 8, Prefetch::Read);
    }

    /// Starts fetching completion entry `pos`'s first line to write it.
    fn prefetch_cq(&self, pos: u64) {
        let e = (pos & (self.cq_cap - 1)) as usize;
        let base = RING_HEADER_BYTES + self.sq_cap as usize * SQ_ENTRY_WORDS * 8;
        self.mem
            .mapping()
            .prefetch(base + e * CQ_ENTRY_WORDS * 8, Prefetch::Write);
    }

    fn cq_word(&self, pos: u64, i: usize) -> &AtomicU64 {
        let e = (pos & (self.cq_cap - 1)) as usize;
        let base = RING_HEADER_BYTES + self.sq_cap as usize * SQ_ENTRY_WORDS * 8;
        self.w(base + (e * CQ_ENTRY_WORDS + i) * 8)
    }

    /// Says whether the server is (about to be) asleep; see the module docs.
    pub fn set_server_waiting(&self, on: bool) {
        self.w(OFF_SERVER_WAITING)
            .store(on as u64, Ordering::SeqCst);
    }

    /// Whether the server asked to be woken.
    pub fn server_waiting(&self) -> bool {
        self.w(OFF_SERVER_WAITING).load(Ordering::SeqCst) != 0
    }

    /// Says whether the producer is (about to be) asleep.
    pub fn set_producer_waiting(&self, on: bool) {
        self.w(OFF_PRODUCER_WAITING)
            .store(on as u64, Ordering::SeqCst);
    }

    /// Whether the producer asked to be woken.
    pub fn producer_waiting(&self) -> bool {
        self.w(OFF_PRODUCER_WAITING).load(Ordering::SeqCst) != 0
    }

    /// Counts a message the server has just written to the session's socket, so a busy producer
    /// can tell without a system call that the socket has something for it.
    pub fn note_socket_message(&self) {
        self.w(OFF_SOCKET_SEQ).fetch_add(1, Ordering::Release);
    }

    /// Messages the server says it wrote to the socket so far.
    pub fn socket_messages(&self) -> u64 {
        self.w(OFF_SOCKET_SEQ).load(Ordering::Acquire)
    }
}

impl AsFd for RingMem {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.mem.fd()
    }
}

fn corrupt<T>(queue: &'static str, what: String) -> std::result::Result<T, RingError> {
    Err(RingError::Corrupt { queue, what })
}

/// One of a session's two queues: where its positions live and how many entries it holds.
#[derive(Debug, Clone, Copy)]
enum Queue {
    Submission,
    Completion,
}

impl Queue {
    fn name(self) -> &'static str {
        match self {
            Queue::Submission => "submission",
            Queue::Completion => "completion",
        }
    }
    fn head_off(self) -> usize {
        match self {
            Queue::Submission => OFF_SQ_HEAD,
            Queue::Completion => OFF_CQ_HEAD,
        }
    }
    fn tail_off(self) -> usize {
        match self {
            Queue::Submission => OFF_SQ_TAIL,
            Queue::Completion => OFF_CQ_TAIL,
        }
    }
    fn cap(self, r: &RingMem) -> u64 {
        match self {
            Queue::Submission => r.sq_cap,
            Queue::Completion => r.cq_cap,
        }
    }
}

/// A writer's position, and the reader's as last loaded: the shared word is read again only
/// when the queue looks full, so the two cores do not trade its cache line on every entry.
/// Entries written but not yet published lie between `tail` (what the reader may see) and
/// `next` (where the next one goes).
#[derive(Debug, Default)]
struct WriteCursor {
    tail: u64,
    next: u64,
    head: u64,
}

impl WriteCursor {
    /// Free entries (an error if the reader's position cannot be).
    fn space(&mut self, r: &RingMem, q: Queue) -> std::result::Result<u64, RingError> {
        let cap = q.cap(r);
        if self.next.wrapping_sub(self.head) < cap {
            return Ok(cap - self.next.wrapping_sub(self.head));
        }
        let (head, tail) = (r.w(q.head_off()).load(Ordering::Acquire), self.next);
        let used = tail.wrapping_sub(head);
        if used > cap {
            return corrupt(
                q.name(),
                format!("head {head} against tail {tail} (capacity {cap})"),
            );
        }
        self.head = head;
        Ok(cap - used)
    }

    /// The entry at `next` is written: the next goes after it (not yet published).
    fn advance(&mut self) {
        self.next = self.next.wrapping_add(1);
    }

    /// Publishes every entry written (one store of the shared word, however many).
    fn publish(&mut self, r: &RingMem, q: Queue) {
        if self.tail != self.next {
            self.tail = self.next;
            r.w(q.tail_off()).store(self.tail, Ordering::Release);
        }
    }
}

/// A reader's position, and the writer's as last loaded (see [`WriteCursor`]).
#[derive(Debug, Default)]
struct ReadCursor {
    head: u64,
    tail: u64,
}

impl ReadCursor {
    /// Entries waiting, loading the writer's position only when the cached one says none are
    /// (`fresh`: load it anyway, for a side about to sleep).
    fn waiting(
        &mut self,
        r: &RingMem,
        q: Queue,
        fresh: bool,
    ) -> std::result::Result<u64, RingError> {
        if self.tail != self.head && !fresh {
            return Ok(self.tail.wrapping_sub(self.head));
        }
        let (cap, head) = (q.cap(r), self.head);
        let tail = r.w(q.tail_off()).load(Ordering::Acquire);
        let n = tail.wrapping_sub(head);
        if n > cap {
            return corrupt(
                q.name(),
                format!("tail {tail} against head {head} (capacity {cap})"),
            );
        }
        self.tail = tail;
        Ok(n)
    }

    /// Gives the entry at `head` back (after copying it out).
    fn release(&mut self, r: &RingMem, q: Queue) {
        self.head = self.head.wrapping_add(1);
        r.w(q.head_off()).store(self.head, Ordering::Release);
    }
}

/// The producer's end of the submission queue.
#[derive(Debug, Default)]
pub struct SqWriter(WriteCursor);

impl SqWriter {
    /// Publishes `e`; `Ok(false)` if the queue is full.
    pub fn push(&mut self, r: &RingMem, e: &SqEntry) -> std::result::Result<bool, RingError> {
        if self.0.space(r, Queue::Submission)? == 0 {
            return Ok(false);
        }
        // Only the words the entry uses: the header, `rank` dimensions, strides if given.
        let (w, t) = (e.to_words(), self.0.next);
        for (i, &v) in w.iter().enumerate().take(5) {
            r.sq_word(t, i).store(v, Ordering::Relaxed);
        }
        let (rank, strides) = SqEntry::words_used(w[2]);
        for d in 0..rank {
            let (size, stride) = SqEntry::dim_words(d);
            r.sq_word(t, size).store(w[size], Ordering::Relaxed);
            if strides {
                r.sq_word(t, stride).store(w[stride], Ordering::Relaxed);
            }
        }
        if SqEntry::has_timeline(w[2]) {
            r.sq_word(t, TIMELINE_WORD)
                .store(w[TIMELINE_WORD], Ordering::Relaxed);
        }
        self.0.advance();
        self.0.publish(r, Queue::Submission);
        Ok(true)
    }
}

/// Entries a reader starts fetching ahead of the one it copies out: the next entries of a
/// burst are written by the producer's core, and each is a cache miss; fetched together, their
/// misses overlap instead of coming one after another.
const SQ_LOOKAHEAD: u64 = 4;

/// The server's end of the submission queue.
#[derive(Debug, Default)]
pub struct SqReader(ReadCursor, /* fetched ahead up to (exclusive) */ u64);

impl SqReader {
    /// Entries published and not yet taken (always loads the writer's tail: for a side about
    /// to sleep); an error if that tail cannot be.
    pub fn available(&mut self, r: &RingMem) -> std::result::Result<u64, RingError> {
        self.0.waiting(r, Queue::Submission, true)
    }

    /// Starts fetching what the next [`SqReader::pop`] reads first: the entry at the head and,
    /// when the writer's position as last loaded says nothing waits, that position. For a
    /// reader that serves several queues in turn, called for the next queue while it works on
    /// this one, so those misses come in meanwhile. A hint: it reads nothing and changes nothing.
    pub fn prefetch_head(&self, r: &RingMem) {
        if self.0.tail == self.0.head {
            r.mem
                .mapping()
                .prefetch(Queue::Submission.tail_off(), Prefetch::Read);
        }
        r.prefetch_sq(self.0.head);
    }

    /// Copies out the next entry, if any, and gives its space back.
    pub fn pop(&mut self, r: &RingMem) -> std::result::Result<Option<SqEntry>, RingError> {
        let n = self.0.waiting(r, Queue::Submission, false)?;
        if n == 0 {
            return Ok(None);
        }
        let h = self.0.head;
        // The next few published entries start arriving while this one is copied and checked.
        // (Positions count up from 0 and never wrap; the mark never trails the head, as every
        // pop leaves it past the entry it takes.)
        let end = h + n.min(SQ_LOOKAHEAD + 1);
        for pos in self.1.max(h + 1)..end {
            r.prefetch_sq(pos);
        }
        self.1 = self.1.max(end);
        // The words the entry says it uses (each read once; unused ones stay zero).
        let mut w = [0u64; SQ_ENTRY_WORDS];
        for (i, v) in w.iter_mut().enumerate().take(5) {
            *v = r.sq_word(h, i).load(Ordering::Relaxed);
        }
        let (rank, strides) = SqEntry::words_used(w[2]);
        for d in 0..rank {
            let (size, stride) = SqEntry::dim_words(d);
            w[size] = r.sq_word(h, size).load(Ordering::Relaxed);
            if strides {
                w[stride] = r.sq_word(h, stride).load(Ordering::Relaxed);
            }
        }
        if SqEntry::has_timeline(w[2]) {
            w[TIMELINE_WORD] = r.sq_word(h, TIMELINE_WORD).load(Ordering::Relaxed);
        }
        self.0.release(r, Queue::Submission);
        Ok(Some(SqEntry::from_words(&w)))
    }
}

/// The server's end of the completion queue.
#[derive(Debug, Default)]
pub struct CqWriter(WriteCursor);

impl CqWriter {
    /// Publishes a completion with `payload` inline (at most [`CQ_INLINE_BYTES`]); `Ok(false)`
    /// if the queue is full (the caller sends it on the socket instead).
    pub fn push(
        &mut self,
        r: &RingMem,
        h: &CqHeader,
        payload: &[u8],
    ) -> std::result::Result<bool, RingError> {
        let written = self.stage(r, h, payload)?;
        self.publish(r);
        Ok(written)
    }

    /// Publishes every completion [`CqWriter::stage`]d since the last publication, at once.
    pub fn publish(&mut self, r: &RingMem) {
        self.0.publish(r, Queue::Completion);
    }

    /// Writes a completion without publishing it: the reader sees it, with every one staged
    /// before it, at the next [`CqWriter::publish`] (or [`CqWriter::push`]). `Ok(false)` if the
    /// queue is full, counting staged entries.
    pub fn stage(
        &mut self,
        r: &RingMem,
        h: &CqHeader,
        payload: &[u8],
    ) -> std::result::Result<bool, RingError> {
        assert!(payload.len() <= CQ_INLINE_BYTES, "inline result too long");
        if self.0.space(r, Queue::Completion)? == 0 {
            return Ok(false);
        }
        let t = self.0.next;
        let header = CqHeader {
            len: payload.len() as u32,
            ..*h
        };
        for (i, word) in header.to_words().into_iter().enumerate() {
            r.cq_word(t, i).store(word, Ordering::Relaxed);
        }
        for (i, chunk) in payload.chunks(8).enumerate() {
            let mut b = [0u8; 8];
            b[..chunk.len()].copy_from_slice(chunk);
            r.cq_word(t, CQ_HEADER_WORDS + i)
                .store(u64::from_le_bytes(b), Ordering::Relaxed);
        }
        self.0.advance();
        // A batch's next answer goes there: its line (last read by the producer's core) is
        // fetched for writing meanwhile.
        r.prefetch_cq(self.0.next);
        Ok(true)
    }
}

/// The producer's end of the completion queue.
#[derive(Debug, Default)]
pub struct CqReader(ReadCursor);

impl CqReader {
    /// Completions published and not yet taken (always loads the writer's tail); an error if
    /// that tail cannot be.
    pub fn available(&mut self, r: &RingMem) -> std::result::Result<u64, RingError> {
        self.0.waiting(r, Queue::Completion, true)
    }

    /// Copies out the next completion, its inline bytes into `payload`; gives its space back.
    pub fn pop(
        &mut self,
        r: &RingMem,
        payload: &mut [u8; CQ_INLINE_BYTES],
    ) -> std::result::Result<Option<CqHeader>, RingError> {
        if self.0.waiting(r, Queue::Completion, false)? == 0 {
            return Ok(None);
        }
        let h0 = self.0.head;
        let mut w = [0u64; CQ_HEADER_WORDS];
        for (i, v) in w.iter_mut().enumerate() {
            *v = r.cq_word(h0, i).load(Ordering::Relaxed);
        }
        let h = CqHeader::from_words(&w);
        let len = h.len as usize;
        for i in 0..len.div_ceil(8) {
            let b = r
                .cq_word(h0, CQ_HEADER_WORDS + i)
                .load(Ordering::Relaxed)
                .to_le_bytes();
            let n = (len - i * 8).min(8);
            payload[i * 8..i * 8 + n].copy_from_slice(&b[..n]);
        }
        self.0.release(r, Queue::Completion);
        Ok(Some(h))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    fn reopen(r: &RingMem) -> RingMem {
        RingMem::open(r.fd().try_clone_to_owned().unwrap()).unwrap()
    }

    fn entry(i: u64) -> SqEntry {
        let mut e = SqEntry {
            request_id: i,
            slot: i as u32 % 7,
            generation: (i * 3) as u32,
            dtype: 3,
            rank: 2,
            has_strides: i.is_multiple_of(2),
            offset: 64,
            len: 4096 + i,
            ..SqEntry::default()
        };
        e.shape[..2].copy_from_slice(&[32, i]);
        if e.has_strides {
            e.strides[..2].copy_from_slice(&[i, 1]);
        }
        e
    }

    #[test]
    fn entries_cross_the_mapping_intact_and_in_order() {
        let server = RingMem::create(5, 3).unwrap();
        assert_eq!((server.sq_capacity(), server.cq_capacity()), (8, 4));
        let producer = reopen(&server);
        let (mut sw, mut sr) = (SqWriter::default(), SqReader::default());
        let (mut cw, mut cr) = (CqWriter::default(), CqReader::default());
        let mut buf = [0u8; CQ_INLINE_BYTES];
        for round in 0..5u64 {
            for i in 0..8 {
                assert!(sw.push(&producer, &entry(round * 8 + i)).unwrap());
            }
            assert!(!sw.push(&producer, &entry(99)).unwrap(), "full at capacity");
            for i in 0..8 {
                assert_eq!(sr.pop(&server).unwrap(), Some(entry(round * 8 + i)));
            }
            assert_eq!(sr.pop(&server).unwrap(), None);
            for i in 0..4u64 {
                let payload: Vec<u8> = (0..(i * 50) as u8).collect();
                let h = CqHeader {
                    flags: CQ_GRANT | CQ_RESULT,
                    len: 0,
                    request_id: round * 4 + i,
                    slot: i as u32,
                    generation: round as u32,
                };
                assert!(cw.push(&server, &h, &payload).unwrap());
            }
            assert!(!cw.push(&server, &CqHeader::default(), &[]).unwrap());
            for i in 0..4u64 {
                let h = cr.pop(&producer, &mut buf).unwrap().unwrap();
                assert_eq!(h.request_id, round * 4 + i);
                assert_eq!((h.slot, h.generation), (i as u32, round as u32));
                assert_eq!(h.len as u64, i * 50);
                let want: Vec<u8> = (0..(i * 50) as u8).collect();
                assert_eq!(&buf[..h.len as usize], &want[..]);
            }
            assert_eq!(cr.pop(&producer, &mut buf).unwrap(), None);
        }
    }

    #[test]
    fn interleaved_pushes_and_pops_stay_in_order_across_the_lookahead() {
        // Pops that fetch ahead while the producer keeps publishing, in bursts of every length
        // up to the capacity, many times round the ring: nothing is skipped, repeated or torn.
        let server = RingMem::create(8, 4).unwrap();
        let producer = reopen(&server);
        let (mut sw, mut sr) = (SqWriter::default(), SqReader::default());
        let (mut sent, mut got) = (0u64, 0u64);
        for step in 0..400u64 {
            let burst = step % 9;
            for _ in 0..burst {
                if sw.push(&producer, &entry(sent)).unwrap() {
                    sent += 1;
                }
            }
            // Take some, not always all: the reader's lookahead spans pushes that come later.
            for _ in 0..(step % 5 + 1) {
                match sr.pop(&server).unwrap() {
                    Some(e) => {
                        assert_eq!(e, entry(got));
                        got += 1;
                    }
                    None => break,
                }
            }
        }
        while let Some(e) = sr.pop(&server).unwrap() {
            assert_eq!(e, entry(got));
            got += 1;
        }
        assert_eq!(got, sent);
        assert!(
            sent > 400,
            "the ring went round many times ({sent} entries)"
        );
    }

    #[test]
    fn a_peer_that_moves_a_position_is_caught() {
        let server = RingMem::create(4, 4).unwrap();
        let producer = reopen(&server);
        // A producer's tail far ahead of anything it could have published.
        producer.w(OFF_SQ_TAIL).store(1000, Ordering::SeqCst);
        let mut sr = SqReader::default();
        assert!(matches!(sr.pop(&server), Err(RingError::Corrupt { .. })));
        // A tail behind the head (moved backwards) is as bad.
        producer.w(OFF_SQ_TAIL).store(u64::MAX, Ordering::SeqCst);
        assert!(sr.pop(&server).is_err());
        // A completion head the server never reached: caught when the server next needs it
        // (its cached head says the queue is full after `capacity` entries).
        producer.w(OFF_CQ_HEAD).store(7, Ordering::SeqCst);
        let mut cw = CqWriter::default();
        for _ in 0..server.cq_capacity() {
            assert!(cw.push(&server, &CqHeader::default(), &[]).unwrap());
        }
        assert!(cw.push(&server, &CqHeader::default(), &[]).is_err());
    }

    #[test]
    fn staged_completions_appear_together_at_publish_and_count_against_space() {
        let server = RingMem::create(4, 4).unwrap();
        let producer = reopen(&server);
        let (mut cw, mut cr) = (CqWriter::default(), CqReader::default());
        let mut bytes = [0u8; CQ_INLINE_BYTES];
        let h = |i: u64| CqHeader {
            flags: CQ_RESULT,
            request_id: i,
            ..CqHeader::default()
        };
        for i in 0..3 {
            assert!(cw.stage(&server, &h(i), &[i as u8; 9]).unwrap());
        }
        // Nothing is visible before the publication.
        assert_eq!(cr.available(&producer).unwrap(), 0);
        assert!(cr.pop(&producer, &mut bytes).unwrap().is_none());
        cw.publish(&server);
        assert_eq!(cr.available(&producer).unwrap(), 3);
        // A push publishes what was staged before it, in order.
        assert!(cw.stage(&server, &h(3), &[]).unwrap());
        for i in 0..3 {
            let got = cr.pop(&producer, &mut bytes).unwrap().unwrap();
            assert_eq!((got.request_id, got.len), (i, 9));
            assert_eq!(bytes[..9], [i as u8; 9]);
        }
        assert!(cw.push(&server, &h(4), &[]).unwrap());
        assert_eq!(cr.available(&producer).unwrap(), 2);
        // Staged entries take space: four slots, two unread, two staged, then full.
        assert!(cw.stage(&server, &h(5), &[]).unwrap());
        assert!(cw.stage(&server, &h(6), &[]).unwrap());
        assert!(!cw.stage(&server, &h(7), &[]).unwrap());
        cw.publish(&server);
        let ids: Vec<u64> = std::iter::from_fn(|| cr.pop(&producer, &mut bytes).unwrap())
            .map(|h| h.request_id)
            .collect();
        assert_eq!(ids, [3, 4, 5, 6]);
    }

    #[test]
    fn open_refuses_a_bad_header_or_a_short_file() {
        let r = RingMem::create(4, 4).unwrap();
        r.w(OFF_SQ_CAP).store(1 << 20, Ordering::SeqCst);
        assert!(RingMem::open(r.fd().try_clone_to_owned().unwrap()).is_err());
        r.w(OFF_SQ_CAP).store(4, Ordering::SeqCst);
        r.w(OFF_MAGIC).store(0, Ordering::SeqCst);
        assert!(RingMem::open(r.as_fd().try_clone_to_owned().unwrap()).is_err());
        // A pool is sealed but has no ring header.
        let pool = HostPool::create("not-a-ring", 1, 4096).unwrap();
        assert!(RingMem::open(pool.fd().try_clone_to_owned().unwrap()).is_err());
    }

    #[test]
    fn waiting_flags_are_shared() {
        let server = RingMem::create(2, 2).unwrap();
        let producer = reopen(&server);
        assert!(!producer.server_waiting());
        server.set_server_waiting(true);
        assert!(producer.server_waiting());
        producer.set_producer_waiting(true);
        assert!(server.producer_waiting());
    }
}

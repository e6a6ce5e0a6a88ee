//! The session state machine and admission, tested in process: a real server's shared state, a
//! session opened over a socket pair (protocol 1, so every answer is a socket message the test
//! reads back), and submissions made straight into `admit`.

use std::io::Read;
use std::os::unix::net::UnixStream;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tensorport_wire::{
    decode_server, ErrorCode, FrameBuffer, Hello, Outcome, RawLocation, RawTensorView, Role,
    ServerMsg, SlotRef, MAGIC, MAX_FRAME_LEN,
};

use super::admission::{admit, evict_idle, open_session};
use super::session::{Answer, Session};
use super::*;

struct Fixture {
    _dir: tempfile::TempDir,
    server: Server,
}

fn server(tune: impl FnOnce(&mut ServerConfig)) -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = ServerConfig::new(dir.path().join("s.sock"));
    cfg.slots_per_session = 2;
    cfg.slot_size = 4096;
    cfg.max_in_flight = 3;
    tune(&mut cfg);
    let server = Server::bind(cfg).unwrap();
    Fixture { _dir: dir, server }
}

fn hello(slots: u32, slot_size: u64) -> Hello {
    Hello {
        magic: MAGIC,
        min_version: 1,
        max_version: 1,
        role: Role::Producer,
        name: "unit".into(),
        want_slots: slots,
        want_slot_size: slot_size,
    }
}

/// A producer session over a socket pair: the server's side, and the producer's end with a
/// frame buffer to read what the server sends.
struct Peer {
    session: Arc<Session>,
    end: UnixStream,
    buf: FrameBuffer,
}

impl Peer {
    fn open(f: &Fixture) -> Peer {
        Peer::try_open(f, hello(0, 0)).unwrap()
    }

    fn try_open(f: &Fixture, h: Hello) -> std::result::Result<Peer, (ErrorCode, String)> {
        let (ours, end) = UnixStream::pair().unwrap();
        end.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        let session = open_session(&f.server.shared, &h, 1, 1, ours)?;
        let mut p = Peer {
            session,
            end,
            buf: FrameBuffer::new(MAX_FRAME_LEN),
        };
        assert!(matches!(p.next(), ServerMsg::Welcome(_)));
        Ok(p)
    }

    /// The next message the server sent.
    fn next(&mut self) -> ServerMsg {
        loop {
            if let Some(p) = self.buf.next_frame().unwrap() {
                return decode_server(p).unwrap();
            }
            let n = self.end.read(self.buf.spare()).unwrap();
            assert!(n > 0, "the server closed the session");
            self.buf.commit(n);
        }
    }

    fn grants(&mut self) -> Vec<SlotRef> {
        match self.next() {
            ServerMsg::Grant(g) => g,
            other => panic!("expected a grant, got {other:?}"),
        }
    }

    fn submit(
        &self,
        f: &Fixture,
        request_id: u64,
        slot: SlotRef,
    ) -> std::result::Result<Request, (ErrorCode, String)> {
        let location = RawLocation::HostSlot(slot);
        let view = RawTensorView {
            dtype: tensorport_wire::DType::U8 as u8,
            shape: &[16],
            strides: None,
            offset: 0,
            len: 16,
            location: &location,
            fence: None,
        };
        admit(&f.server.shared, &self.session, request_id, &view)
    }
}

/// The same slot under its next generation, as the server grants it again.
fn regranted(g: SlotRef) -> SlotRef {
    SlotRef {
        generation: g.generation + 1,
        ..g
    }
}

fn code<T>(r: std::result::Result<T, (ErrorCode, String)>) -> ErrorCode {
    match r {
        Ok(_) => panic!("expected a refusal"),
        Err((c, _)) => c,
    }
}

#[test]
fn respond_all_answers_each_request_once_in_order_across_sessions() {
    let f = server(|_| {});
    let (mut p, mut q) = (Peer::open(&f), Peer::open(&f));
    let (gp, gq) = (p.grants(), q.grants());
    let before = f.server.shared.counters.completed.load(Ordering::SeqCst);
    // Two of p's, then one of q's: two runs, one session each.
    let a = p.submit(&f, 1, gp[0]).unwrap();
    let b = p.submit(&f, 2, gp[1]).unwrap();
    let c = q.submit(&f, 9, gq[0]).unwrap();
    let mut answers = vec![
        (a, b"one".to_vec()),
        (b, b"two".to_vec()),
        (c, b"nine".to_vec()),
    ];
    f.server.respond_all(&mut answers).unwrap();
    assert!(answers.is_empty(), "the batch is emptied for reuse");
    // Each producer gets its slots back, then its results, in order, each once.
    for (peer, granted, ids) in [
        (&mut p, &gp[..], &[1u64, 2][..]),
        (&mut q, &gq[..1], &[9][..]),
    ] {
        for (g, &id) in granted.iter().zip(ids) {
            let again = peer.grants();
            assert_eq!(again, [regranted(*g)]);
            match peer.next() {
                ServerMsg::Result {
                    request_id,
                    outcome: Outcome::Ok(bytes),
                } => {
                    assert_eq!(request_id, id);
                    let want: &[u8] = match id {
                        1 => b"one",
                        2 => b"two",
                        _ => b"nine",
                    };
                    assert_eq!(bytes, want);
                }
                other => panic!("{other:?}"),
            }
        }
    }
    assert_eq!(
        f.server.shared.counters.completed.load(Ordering::SeqCst),
        before + 3
    );
    // A request over the frame limit in a batch is failed, the others answered, and the error
    // says so.
    let d = p.submit(&f, 3, regranted(gp[0])).unwrap();
    let e = p.submit(&f, 4, regranted(gp[1])).unwrap();
    let mut answers = vec![(d, vec![0u8; MAX_FRAME_LEN as usize]), (e, b"ok".to_vec())];
    assert!(matches!(
        f.server.respond_all(&mut answers),
        Err(Error::ResultTooLarge(_))
    ));
    let mut outcomes = Vec::new();
    while outcomes.len() < 2 {
        if let ServerMsg::Result {
            request_id,
            outcome,
        } = p.next()
        {
            outcomes.push((request_id, matches!(outcome, Outcome::Ok(_))));
        }
    }
    assert_eq!(outcomes, [(3, false), (4, true)]);
}

#[test]
fn a_slot_goes_granted_submitted_answered_and_granted_again() {
    let f = server(|_| {});
    let mut p = Peer::open(&f);
    let g = p.grants();
    assert_eq!(g.len(), 2);
    let req = p.submit(&f, 7, g[0]).unwrap();
    // Submitted: the same slot cannot be submitted again, under any id.
    assert_eq!(code(p.submit(&f, 8, g[0])), ErrorCode::SlotNotLeased);
    req.respond(b"ok").unwrap();
    // The slot comes back under the next generation, then the result.
    let again = p.grants();
    assert_eq!(again[0].slot, g[0].slot);
    assert_eq!(again[0].generation, g[0].generation + 1);
    match p.next() {
        ServerMsg::Result {
            request_id: 7,
            outcome: Outcome::Ok(b),
        } => assert_eq!(b, b"ok"),
        other => panic!("{other:?}"),
    }
    // The old generation is stale; the new one is good.
    assert_eq!(code(p.submit(&f, 9, g[0])), ErrorCode::SlotNotLeased);
    p.submit(&f, 9, again[0]).unwrap().respond(b"").unwrap();
    let st = p.session.status();
    assert_eq!((st.submitted, st.completed, st.in_flight), (2, 2, 0));
}

#[test]
fn every_request_is_answered_exactly_once() {
    let f = server(|_| {});
    let mut p = Peer::open(&f);
    let g = p.grants();
    // Dropped unanswered: a failure, and the slot back.
    drop(p.submit(&f, 1, g[0]).unwrap());
    let g0 = p.grants()[0];
    match p.next() {
        ServerMsg::Result {
            request_id: 1,
            outcome: Outcome::Err { code, .. },
        } => assert_eq!(ErrorCode::from_u16(code), ErrorCode::HandlerFailed),
        other => panic!("{other:?}"),
    }
    // Released first, answered later through the responder.
    let responder = p.submit(&f, 2, g0).unwrap().release();
    assert!(matches!(p.next(), ServerMsg::Grant(_)));
    responder.respond(b"late").unwrap();
    assert!(matches!(p.next(), ServerMsg::Result { request_id: 2, .. }));
    // A second answer for a settled request sends nothing and counts nothing.
    let shared = &f.server.shared;
    let before = shared.counters.completed.load(Ordering::SeqCst);
    p.session.answer(2, Answer::Ok(b"again"), None).unwrap();
    assert_eq!(shared.counters.completed.load(Ordering::SeqCst), before);
    // A result over the frame limit is answered with a failure and reported to the caller.
    let big = vec![0u8; MAX_FRAME_LEN as usize];
    let r = p.submit(&f, 3, g[1]).unwrap().respond(&big);
    assert!(matches!(r, Err(Error::ResultTooLarge(_))), "{r:?}");
    assert!(matches!(p.next(), ServerMsg::Grant(_)));
    match p.next() {
        ServerMsg::Result {
            request_id: 3,
            outcome: Outcome::Err { message, .. },
        } => assert!(message.contains("over the frame limit"), "{message}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(p.session.status().completed, 3);
}

#[test]
fn admission_refuses_duplicates_over_limit_and_while_draining() {
    let f = server(|c| {
        c.slots_per_session = 4;
        c.max_in_flight = 2;
    });
    let mut p = Peer::open(&f);
    let g = p.grants();
    let _a = p.submit(&f, 1, g[0]).unwrap();
    assert_eq!(code(p.submit(&f, 1, g[1])), ErrorCode::DuplicateRequest);
    let _b = p.submit(&f, 2, g[1]).unwrap();
    assert_eq!(code(p.submit(&f, 3, g[2])), ErrorCode::TooManyInFlight);
    // A slot never granted, a slot out of the pool.
    let never = SlotRef {
        slot: g[3].slot,
        generation: g[3].generation + 5,
    };
    assert_eq!(code(p.submit(&f, 4, never)), ErrorCode::TooManyInFlight);
    drop(_b);
    assert_eq!(code(p.submit(&f, 4, never)), ErrorCode::SlotNotLeased);
    // A refused request is not left in flight: its id may come again.
    assert_eq!(p.session.status().in_flight, 1);
    let _c = p.submit(&f, 4, g[2]).unwrap();
    assert_eq!(code(p.submit(&f, 3, g[3])), ErrorCode::TooManyInFlight);
    drop(_c);
    let outside = SlotRef {
        slot: 99,
        generation: 0,
    };
    assert_eq!(code(p.submit(&f, 5, outside)), ErrorCode::OutOfBounds);
    f.server.drain();
    assert_eq!(code(p.submit(&f, 6, g[3])), ErrorCode::Draining);
    assert_eq!(code(Peer::try_open(&f, hello(0, 0))), ErrorCode::Draining);
}

#[test]
fn pools_are_charged_to_the_budget_and_given_back() {
    let f = server(|c| {
        c.memory_budget = 60 << 10;
        c.max_session_bytes = 40 << 10;
    });
    // Over the per-session cap.
    assert_eq!(
        code(Peer::try_open(&f, hello(16, 4096))),
        ErrorCode::MemoryBudget
    );
    let a = Peer::try_open(&f, hello(8, 4096)).unwrap();
    let used = f.server.pool_memory().0;
    assert!(used >= 8 * 4096, "{used}");
    // The rest of the budget cannot hold another such pool.
    assert_eq!(
        code(Peer::try_open(&f, hello(8, 4096))),
        ErrorCode::MemoryBudget
    );
    reader::close_session(&f.server.shared, &a.session, true);
    drop(a);
    assert_eq!(f.server.pool_memory().0, 0);
    Peer::try_open(&f, hello(8, 4096)).unwrap();
}

#[test]
fn a_full_server_evicts_the_longest_idle_session_only() {
    let f = server(|c| {
        c.max_sessions = 2;
        c.idle_eviction = Duration::from_millis(1);
    });
    let mut old = Peer::open(&f);
    std::thread::sleep(Duration::from_millis(5));
    let mut busy = Peer::open(&f);
    let g = busy.grants();
    let _held = busy.submit(&f, 1, g[0]).unwrap();
    std::thread::sleep(Duration::from_millis(5));
    // Both places are taken; the busy one has a request in flight, so the idle one goes.
    assert!(evict_idle(&f.server.shared, "test"));
    assert!(!old.session.is_alive());
    assert!(busy.session.is_alive());
    old.grants();
    match old.next() {
        ServerMsg::Error { code, fatal, .. } => {
            assert_eq!(ErrorCode::from_u16(code), ErrorCode::TooManySessions);
            assert!(fatal);
        }
        other => panic!("{other:?}"),
    }
    // Nothing else is idle.
    reader::close_session(&f.server.shared, &old.session, false);
    assert!(!evict_idle(&f.server.shared, "test"));
}

#[test]
fn sessions_are_dealt_to_the_consumer_with_the_fewest() {
    let f = server(|c| c.consumers = 3);
    let peers: Vec<Peer> = (0..6).map(|_| Peer::open(&f)).collect();
    let mut per = [0; 3];
    for p in &peers {
        per[p.session.shard] += 1;
    }
    assert_eq!(per, [2, 2, 2]);
    // One leaves shard 1: the next newcomer fills the gap.
    let leaving = peers.iter().find(|p| p.session.shard == 1).unwrap();
    reader::close_session(&f.server.shared, &leaving.session, true);
    assert_eq!(Peer::open(&f).session.shard, 1);
}

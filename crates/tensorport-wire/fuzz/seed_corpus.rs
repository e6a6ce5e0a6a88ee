//! `cargo +nightly run --bin seed-corpus` (from this folder) writes the seed corpus: a valid frame
//! of every client and server message, a few broken ones, and sample descriptors.

use tensorport_wire::*;

fn main() {
    let desc = RawTensorDesc {
        dtype: 0,
        shape: vec![3, 224, 224],
        strides: None,
        offset: 0,
        len: 3 * 224 * 224 * 4,
        location: RawLocation::HostSlot(SlotRef {
            slot: 2,
            generation: 7,
        }),
        fence: None,
    };
    let clients = vec![
        ClientMsg::Hello(Hello {
            magic: MAGIC,
            min_version: 1,
            max_version: 1,
            role: Role::Producer,
            name: "seed".into(),
            want_slots: 8,
            want_slot_size: 1 << 20,
        }),
        ClientMsg::Submit {
            request_id: 1,
            tensor: desc.clone(),
        },
        ClientMsg::Submit {
            request_id: 2,
            tensor: RawTensorDesc {
                strides: Some(vec![1, 16]),
                shape: vec![16, 8],
                dtype: 4,
                len: 512,
                fence: Some(RawFence::Timeline {
                    semaphore: 0,
                    value: 3,
                }),
                ..desc.clone()
            },
        },
        ClientMsg::Return(SlotRef {
            slot: 1,
            generation: 0,
        }),
        ClientMsg::Status,
        ClientMsg::Drain,
        ClientMsg::Goodbye,
    ];
    let servers = vec![
        ServerMsg::Welcome(Welcome {
            version: 1,
            session_id: 9,
            pool: PoolLayout {
                slot_count: 8,
                slot_size: 1 << 20,
                pool_len: 8 << 20,
            },
            max_in_flight: 16,
            fds: 1,
        }),
        ServerMsg::Grant(vec![SlotRef {
            slot: 0,
            generation: 1,
        }]),
        ServerMsg::Result {
            request_id: 1,
            outcome: Outcome::Ok(vec![1, 2, 3, 4]),
        },
        ServerMsg::Error {
            code: 7,
            request_id: Some(1),
            fatal: false,
            message: "out of bounds".into(),
        },
        ServerMsg::Status(StatusReport::default()),
        ServerMsg::Draining,
    ];
    let dir = std::path::Path::new("corpus/frames");
    std::fs::create_dir_all(dir).unwrap();
    let mut all = vec![0u8]; // read-size byte, then every frame back to back
    for (i, m) in clients.iter().enumerate() {
        let f = encode_frame(m).unwrap();
        let mut seed = vec![(i * 7) as u8];
        seed.extend(&f);
        std::fs::write(dir.join(format!("client-{i}")), &seed).unwrap();
        all.extend(f);
    }
    for (i, m) in servers.iter().enumerate() {
        let mut seed = vec![3u8];
        seed.extend(encode_frame(m).unwrap());
        std::fs::write(dir.join(format!("server-{i}")), &seed).unwrap();
    }
    std::fs::write(dir.join("stream"), &all).unwrap();
    std::fs::write(dir.join("oversize"), [1, 0xff, 0xff, 0xff, 0xff]).unwrap();
    std::fs::write(dir.join("http"), b"\x05GET / HTTP/1.1\r\n\r\n").unwrap();
    let dir = std::path::Path::new("corpus/descriptor");
    std::fs::create_dir_all(dir).unwrap();
    // dtype, rank, strides?, slot-size selector, then little-endian u64 fields (even = small).
    let mut plain = vec![0u8, 3, 0, 15];
    for v in [3u64 << 41, 224 << 41, 224 << 41, 0, (602112u64) << 41, 2 << 41] {
        plain.extend(v.to_le_bytes());
    }
    std::fs::write(dir.join("plain"), &plain).unwrap();
    let mut strided = vec![4u8, 2, 1, 0];
    for v in [16u64 << 41, 8 << 41, 1 << 41, 16 << 41, 0, 512 << 41, 1 << 41] {
        strided.extend(v.to_le_bytes());
    }
    std::fs::write(dir.join("strided"), &strided).unwrap();
    let mut overflow = vec![0u8, 2, 0, 1];
    for v in [u64::MAX, u64::MAX, 1, 1, 0] {
        overflow.extend(v.to_le_bytes());
    }
    std::fs::write(dir.join("overflow"), &overflow).unwrap();
    // Queue entries: a valid submission (as words, then a completion header), a strided one,
    // and one with rank 200. Even words are shifted right by 44 in the target: these are odd.
    let dir = std::path::Path::new("corpus/ring_entry");
    std::fs::create_dir_all(dir).unwrap();
    let entry = |rank: u8, strides: bool| {
        let mut e = entry::SqEntry {
            request_id: 7,
            slot: 1,
            generation: 3,
            dtype: 0,
            rank,
            has_strides: strides,
            offset: 0,
            len: 3 * 224 * 224 * 4,
            ..Default::default()
        };
        e.shape[..3].copy_from_slice(&[3, 224, 224]);
        e.strides[..3].copy_from_slice(&[1, 672, 3]);
        let mut b: Vec<u8> = e.to_words().iter().flat_map(|w| (w | 1).to_le_bytes()).collect();
        let h = entry::CqHeader {
            flags: entry::CQ_GRANT | entry::CQ_RESULT,
            len: 8,
            request_id: 7,
            slot: 1,
            generation: 4,
        };
        b.extend(h.to_words().iter().flat_map(|w| w.to_le_bytes()));
        b
    };
    std::fs::write(dir.join("plain"), entry(3, false)).unwrap();
    std::fs::write(dir.join("strided"), entry(3, true)).unwrap();
    std::fs::write(dir.join("rank200"), entry(200, false)).unwrap();
    println!("seed corpus written under corpus/");
}

//! What a peer may hold: slow readers, dictionaries, silent and flooding connections, half-sent
//! messages, and the gateway's memory with every limit pushed.

use super::*;

#[test]
fn a_remote_producer_that_stops_reading_is_dropped_and_harms_no_one() {
    use arrow_flight::encode::FlightDataEncoderBuilder;
    use arrow_flight::FlightClient;
    use futures::StreamExt;
    use tensorport_bridge::schema::TensorLayout;

    // A server that answers every request with an empty result.
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("s.sock");
    let server = Arc::new(Server::bind(ServerConfig::new(&sock)).unwrap());
    let stop = Arc::new(AtomicBool::new(false));
    let handler = {
        let (server, stop) = (server.clone(), stop.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                if let Ok(Some(r)) = server.recv_timeout(Duration::from_millis(50)) {
                    let _ = r.respond(&[]);
                }
            }
        })
    };
    let token = dir.path().join("token");
    run_ok(Command::new(BIN).arg("token").arg(&token));
    let log = dir.path().join("gateway.log");
    let (mut gateway, url) = spawn_gateway(
        "127.0.0.1:0",
        &sock,
        &token,
        &["--peer-timeout".into(), "2".into()],
        std::fs::File::create(&log).unwrap().into(),
    );
    // A client that streams tensors without end and never reads a result: once its receive
    // window (64 KiB) and the gateway's queue are full of results, the gateway waits
    // --peer-timeout, then drops it.
    let t = tokio::runtime::Runtime::new().unwrap();
    let bearer = tensorport_bridge::auth::Token::read(&token)
        .unwrap()
        .bearer();
    let unread = t.block_on(async {
        let channel = tonic::transport::Endpoint::from_shared(url.clone())
            .unwrap()
            .initial_stream_window_size(65_535)
            .initial_connection_window_size(65_535)
            .connect()
            .await
            .unwrap();
        let mut c = FlightClient::new(channel);
        c.add_header("authorization", &bearer).unwrap();
        let layout = TensorLayout::new(tensorport::DType::U8, &[4]).unwrap();
        let schema = layout.schema();
        let batches = futures::stream::iter(0u64..).map(move |k| {
            let ids: Vec<u64> = (k * 64..(k + 1) * 64).collect();
            Ok(layout
                .batch(&ids, arrow_buffer::Buffer::from_vec(vec![7u8; 64 * 4]))
                .unwrap())
        });
        let data = FlightDataEncoderBuilder::new()
            .with_schema(schema)
            .build(batches);
        c.do_exchange(data).await.unwrap()
    });
    wait_until(
        "the reader-less stream has a session",
        Duration::from_secs(60),
        || server.status().sessions.len() == 1,
    );
    wait_until(
        "the gateway drops the producer that stopped reading",
        Duration::from_secs(120),
        || server.status().sessions.is_empty(),
    );
    let said = std::fs::read_to_string(&log).unwrap();
    assert!(said.contains("left its results unread"), "{said}");
    // The gateway and the server go on serving others.
    let out = dir.path().join("next.jsonl");
    run_ok(
        Command::new(BIN)
            .args(["produce", "--gateway", &url, "--synthetic", "32"])
            .args(["--image-size", &SIZE.to_string(), "--token-file"])
            .arg(&token)
            .arg("-o")
            .arg(&out),
    );
    let lines = std::fs::read_to_string(&out).unwrap();
    assert_eq!(lines.lines().count(), 32);
    assert!(!lines.contains("\"error\""), "{lines}");
    drop(unread);
    drop(t);
    let _ = gateway.kill();
    let _ = gateway.wait();
    stop.store(true, Ordering::Relaxed);
    handler.join().unwrap();
}

/// A memory figure of process `pid` in KiB: `VmHWM` (its peak) or `VmRSS` (resident now).
fn status_kib(pid: u32, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find(|l| l.strip_prefix(field).is_some_and(|r| r.starts_with(':')))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// The gateway's peak memory in KiB.
fn peak_kib(pid: u32) -> u64 {
    status_kib(pid, "VmHWM")
}

/// Arrow dictionaries, which a general Arrow reader absorbs and keeps for the stream's life:
/// a schema of 40 dictionary fields followed by a 4 MiB dictionary for each and no record batch
/// is ended at its schema, and so is a tensor schema followed by dictionary batches; the
/// gateway's peak memory stays far below the 160 MiB a stream offers; a remote producer is
/// served afterwards.
#[test]
fn dictionary_batches_end_the_stream_and_cost_no_memory() {
    use arrow_array::{ArrayRef, DictionaryArray, StringArray, UInt32Array};
    use arrow_flight::encode::{DictionaryHandling, FlightDataEncoderBuilder};
    use arrow_flight::{FlightClient, FlightData};
    use arrow_schema::{DataType, Field, Schema};
    use futures::TryStreamExt;
    use tensorport_bridge::schema::TensorLayout;

    let f = Fixture::new();
    let pid = f.gateway.as_ref().unwrap().id();
    let token = tensorport_bridge::auth::Token::read(&f.token()).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let encode = |b: arrow_array::RecordBatch, dict| -> Vec<FlightData> {
        rt.block_on(
            FlightDataEncoderBuilder::new()
                .with_schema(b.schema())
                .with_dictionary_handling(dict)
                .build(futures::stream::iter([Ok(b)]))
                .try_collect(),
        )
        .unwrap()
    };
    let is = |m: &FlightData, h: arrow_ipc::MessageHeader| {
        arrow_ipc::root_as_message(&m.data_header).is_ok_and(|x| x.header_type() == h)
    };
    // 40 dictionary fields, a 4 MiB dictionary each.
    let fields: Vec<Field> = (0..40)
        .map(|k| {
            Field::new(
                format!("d{k}"),
                DataType::Dictionary(Box::new(DataType::UInt32), Box::new(DataType::Utf8)),
                false,
            )
        })
        .collect();
    let columns: Vec<ArrayRef> = (0..40)
        .map(|k| {
            let values = StringArray::from(vec![format!("{k}").repeat(4 << 20)]);
            Arc::new(
                DictionaryArray::try_new(UInt32Array::from(vec![0u32]), Arc::new(values)).unwrap(),
            ) as ArrayRef
        })
        .collect();
    let db = arrow_array::RecordBatch::try_new(Arc::new(Schema::new(fields)), columns).unwrap();
    let dict_stream: Vec<FlightData> = encode(db, DictionaryHandling::Resend)
        .into_iter()
        .filter(|m| !is(m, arrow_ipc::MessageHeader::RecordBatch))
        .collect();
    assert_eq!(dict_stream.len(), 41, "a schema and 40 dictionaries");
    let layout = TensorLayout::new(tensorport::DType::F32, &[3, SIZE as u64, SIZE as u64]).unwrap();
    let good = layout
        .batch(&[0], arrow_buffer::Buffer::from_vec(expected(0)))
        .unwrap();
    let mut tensor_then_dicts = vec![encode(good, DictionaryHandling::Hydrate).remove(0)];
    tensor_then_dicts.extend(dict_stream[1..].iter().cloned());
    let send = |msgs: Vec<FlightData>| {
        rt.block_on(async {
            let channel = tonic::transport::Endpoint::from_shared(f.url.clone())
                .unwrap()
                .connect()
                .await
                .unwrap();
            let mut c = FlightClient::new(channel);
            c.add_header("authorization", &token.bearer()).unwrap();
            match c
                .do_exchange(futures::stream::iter(msgs.into_iter().map(Ok)))
                .await
            {
                Err(e) => e.to_string(),
                Ok(s) => match s.try_collect::<Vec<_>>().await {
                    Err(e) => e.to_string(),
                    Ok(v) => format!("answered {} batches", v.len()),
                },
            }
        })
    };
    let before = peak_kib(pid);
    for round in 0..5 {
        let e = send(dict_stream.clone());
        assert!(
            e.contains("the stream does not decode"),
            "round {round}: {e}"
        );
        let e = send(tensor_then_dicts.clone());
        assert!(e.contains("dictionary"), "round {round}: {e}");
    }
    let after = peak_kib(pid);
    println!(
        "10 streams offering 40 dictionaries of 4 MiB each: gateway peak {} -> {} MiB",
        before >> 10,
        after >> 10
    );
    assert!(
        after < before + (100 << 10),
        "the gateway's peak grew from {before} to {after} KiB"
    );
    run_ok(&mut f.producer("after-dictionaries", 16, &[]));
    assert_each_input_once(&f.lines("after-dictionaries"), 16);
}

fn fds_of(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count())
}

/// 500 TCP connections that never speak: the gateway keeps at most its connection caps open
/// (each newcomer past a cap closes the oldest silent one), closes the ones it kept once they
/// have gone `--auth-timeout` without a call carrying the token, and its descriptors come
/// back; a remote producer is then served.
#[test]
fn silent_connections_are_capped_and_closed_at_their_deadline() {
    let f = Fixture::with_gateway_args(&[
        "--auth-timeout".into(),
        "1".into(),
        "--max-connections".into(),
        "40".into(),
        "--max-connections-per-host".into(),
        "20".into(),
    ]);
    let pid = f.gateway.as_ref().unwrap().id();
    let addr = f.url.trim_start_matches("http://").to_string();
    std::thread::sleep(Duration::from_millis(200));
    let fds0 = fds_of(pid);
    let silent: Vec<std::net::TcpStream> = (0..500)
        .filter_map(|_| std::net::TcpStream::connect(&addr).ok())
        .collect();
    // Past the cap each newcomer closes the oldest silent one, which ends as its task wakes.
    wait_until(
        "the gateway to hold no more than its per-host cap",
        Duration::from_secs(10),
        || fds_of(pid) <= fds0 + 20 + 8,
    );
    // Every one is closed by the gateway: at once over the cap, at the deadline otherwise.
    for mut c in silent.into_iter().step_by(25) {
        c.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        // The server's HTTP/2 preface may come first; then the end.
        let mut rest = Vec::new();
        let t = Instant::now();
        let r = std::io::Read::read_to_end(&mut c, &mut rest);
        assert!(
            r.is_ok() || t.elapsed() < Duration::from_secs(25),
            "a silent connection was held: {r:?} after {:?}",
            t.elapsed()
        );
    }
    wait_until(
        "the gateway's descriptors to come back",
        Duration::from_secs(30),
        || fds_of(pid) <= fds0 + 2,
    );
    run_ok(&mut f.producer("after-silence", 16, &[]));
    assert_each_input_once(&f.lines("after-silence"), 16);
    assert!(
        f.gateway_log().contains("to make room"),
        "{}",
        f.gateway_log()
    );
}

/// A flood of connections without the token from the producers' own address (some silent,
/// some sending HTTP/2's preface and nothing more) keeps both caps full; remote producers with
/// the token still get through, each with every input once: the oldest connections without
/// the token make room for them.
#[test]
fn a_flood_of_tokenless_connections_does_not_lock_producers_out() {
    use std::io::Write;
    let f = Fixture::with_gateway_args(&[
        "--max-connections".into(),
        "12".into(),
        "--max-connections-per-host".into(),
        "8".into(),
    ]);
    let addr = f.url.trim_start_matches("http://").to_string();
    let stop = Arc::new(AtomicBool::new(false));
    let connected = Arc::new(std::sync::atomic::AtomicU32::new(0));
    let flood = {
        let (stop, connected) = (stop.clone(), connected.clone());
        std::thread::spawn(move || {
            let mut open = std::collections::VecDeque::new();
            let start = Instant::now();
            let mut made = 0u32;
            // Bounded in count and time.
            while !stop.load(Ordering::Relaxed)
                && made < 20_000
                && start.elapsed() < Duration::from_secs(120)
            {
                if let Ok(mut c) = std::net::TcpStream::connect(&addr) {
                    if made.is_multiple_of(2) {
                        let _ = c.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n");
                    }
                    open.push_back(c);
                    made += 1;
                    connected.store(made, Ordering::Relaxed);
                }
                if open.len() > 32 {
                    open.pop_front();
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            made
        })
    };
    // Both caps full before the producers come (12 in all; the flood keeps up to 32 open).
    wait_until(
        "the flood to fill the caps",
        Duration::from_secs(60),
        || connected.load(Ordering::Relaxed) >= 20,
    );
    for k in 0..3 {
        let name = format!("through-the-flood-{k}");
        run_ok(&mut f.producer(&name, 16, &[]));
        assert_each_input_once(&f.lines(&name), 16);
    }
    stop.store(true, Ordering::Relaxed);
    let made = flood.join().unwrap();
    assert!(made >= 20, "the flood made only {made} connections");
    // The caps were full: room was made.
    assert!(
        f.gateway_log().contains("to make room"),
        "{}",
        f.gateway_log()
    );
}

/// A fast flood of connections from the producers' own address that each make a call without
/// the token (as a client with no token or a wrong one does) and stay open, reconnecting at
/// once: the address's cap is full the whole time, yet every single attempt of a producer with
/// the token (`--retries 0`) gets through — the connections that called without the token make
/// room first, never one still in its handshake.
#[test]
fn single_attempts_get_through_a_flood_of_tokenless_calls() {
    let f = Fixture::with_gateway_args(&[
        "--max-connections".into(),
        "64".into(),
        "--max-connections-per-host".into(),
        "8".into(),
    ]);
    let url = f.url.clone();
    let stop = Arc::new(AtomicBool::new(false));
    let called = Arc::new(std::sync::atomic::AtomicU32::new(0));
    let flood = {
        let (stop, called) = (stop.clone(), called.clone());
        std::thread::spawn(move || {
            let rt = tokio::runtime::Runtime::new().unwrap();
            rt.block_on(async {
                let mut open = std::collections::VecDeque::new();
                let start = Instant::now();
                // Bounded in count and time.
                while !stop.load(Ordering::Relaxed)
                    && called.load(Ordering::Relaxed) < 20_000
                    && start.elapsed() < Duration::from_secs(120)
                {
                    let endpoint = tonic::transport::Endpoint::from_shared(url.clone()).unwrap();
                    if let Ok(channel) = endpoint.connect().await {
                        let mut c = arrow_flight::FlightClient::new(channel);
                        let refused = c.list_flights(Vec::<u8>::new()).await.is_err();
                        if refused {
                            called.fetch_add(1, Ordering::Relaxed);
                        }
                        open.push_back(c);
                    }
                    if open.len() > 16 {
                        open.pop_front();
                    }
                }
            })
        })
    };
    wait_until(
        "the flood to fill the address's cap",
        Duration::from_secs(60),
        || called.load(Ordering::Relaxed) >= 20,
    );
    let mut failed = Vec::new();
    for k in 0..10 {
        let name = format!("single-{k}");
        let o = f
            .producer(&name, 4, &["--retries", "0"])
            .stdin(std::process::Stdio::null())
            .output()
            .unwrap();
        if !o.status.success() {
            failed.push(String::from_utf8_lossy(&o.stderr).into_owned());
        } else {
            assert_each_input_once(&f.lines(&name), 4);
        }
    }
    stop.store(true, Ordering::Relaxed);
    flood.join().unwrap();
    let calls = called.load(Ordering::Relaxed);
    assert!(calls >= 20, "the flood made only {calls} calls");
    assert!(
        failed.is_empty(),
        "{} of 10 single attempts failed: {failed:?}",
        failed.len()
    );
    assert!(
        f.gateway_log().contains("to make room"),
        "the cap was never full: {}",
        f.gateway_log()
    );
}

/// The gateway's resident memory in KiB.
fn rss_kib(pid: u32) -> u64 {
    status_kib(pid, "VmRSS")
}

/// A stream (raw HTTP/2, as tonic's client cannot leave a message half sent) that sends its
/// schema and then 30 MiB of a message announced as 60 MiB, and nothing more, on a gateway with
/// one place: it holds the place and the memory only until `--peer-timeout`, then both are
/// given back together, and a remote producer is served.
#[test]
fn a_stream_left_half_sent_gives_back_its_place_and_its_memory() {
    let f = Fixture::with_gateway_args(&[
        "--max-remotes".into(),
        "1".into(),
        "--peer-timeout".into(),
        "3".into(),
    ]);
    let pid = f.gateway.as_ref().unwrap().id();
    let token = tensorport_bridge::auth::Token::read(&f.token()).unwrap();
    let addr = f.url.trim_start_matches("http://").to_string();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let schema_msg = tensor_schema_message(&rt);
    std::thread::sleep(Duration::from_millis(200));
    let before = rss_kib(pid);
    let (held, ended) = rt.block_on(async {
        let (resp, send) = half_sent(&addr, &token.bearer(), &schema_msg, 60 << 20, 30 << 20).await;
        // While it is held: the gateway has read most of it.
        let t = Instant::now();
        let mut held = 0;
        while t.elapsed() < Duration::from_secs(20) {
            held = held.max(rss_kib(pid));
            if held > before + (20 << 10) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // The gateway ends the stream at its peer timeout: the response's end (its trailers)
        // comes while this side still holds the stream open.
        let ended = tokio::time::timeout(Duration::from_secs(60), async {
            let mut body = resp.await.unwrap().into_body();
            while let Some(chunk) = body.data().await {
                if chunk.is_err() {
                    return None;
                }
            }
            body.trailers().await.ok().flatten()
        })
        .await;
        drop(send);
        (held, ended)
    });
    let trailers = ended.expect("the gateway held the half-sent stream for a minute");
    let status = trailers
        .as_ref()
        .and_then(|t| t.get("grpc-message"))
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
        .unwrap_or_default();
    assert!(
        status.contains("gives%20its%20place%20back") || status.contains("gives its place back"),
        "the stream ended otherwise: {trailers:?}"
    );
    assert!(
        held > before + (20 << 10),
        "the gateway did not take the message in ({before} -> {held} KiB): the test proves nothing"
    );
    // What the stream took at most (sampling may have caught the growth before its top), and
    // at least half of it comes back (the allocator may keep some for reuse).
    let held = held.max(peak_kib(pid));
    let back_to = before + (held - before) / 2;
    let t = Instant::now();
    while rss_kib(pid) > back_to {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "the half-sent message's memory was not given back: {} -> {held} -> {} KiB\n{}",
            before,
            rss_kib(pid),
            f.gateway_log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    println!(
        "gateway RSS {} MiB, {} MiB while the stream held 30 MiB, {} MiB after",
        before >> 10,
        held >> 10,
        rss_kib(pid) >> 10
    );
    // The one place is free again.
    run_ok(&mut f.producer("after-half-sent", 16, &[]));
    assert_each_input_once(&f.lines("after-half-sent"), 16);
}

/// Opens a raw HTTP/2 DoExchange stream to `addr`, sends `first` (a whole message) and then
/// `sent` bytes of a message announced as `declared` bytes, and leaves it there: the stream and
/// its connection stay open as long as the returned handles live.
async fn half_sent(
    addr: &str,
    bearer: &str,
    first: &arrow_flight::FlightData,
    declared: u32,
    sent: usize,
) -> (h2::client::ResponseFuture, h2::SendStream<bytes::Bytes>) {
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (client, conn) = h2::client::handshake(tcp).await.unwrap();
    tokio::spawn(conn);
    let mut client = client.ready().await.unwrap();
    let req = http::Request::builder()
        .method("POST")
        .uri(format!(
            "http://{addr}/arrow.flight.protocol.FlightService/DoExchange"
        ))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .header("authorization", bearer)
        .body(())
        .unwrap();
    let (resp, mut send) = client.send_request(req, false).unwrap();
    let body = prost::Message::encode_to_vec(first);
    let mut frame = vec![0u8];
    frame.extend((body.len() as u32).to_be_bytes());
    frame.extend(body);
    frame.push(0);
    frame.extend(declared.to_be_bytes());
    // A stream the gateway refuses (no place) is reset: what is left is not sent.
    let mut ok = send.send_data(frame.into(), false).is_ok();
    let mut left = sent;
    while ok && left > 0 {
        let n = left.min(1 << 20);
        ok = send
            .send_data(bytes::Bytes::from(vec![7u8; n]), false)
            .is_ok();
        left -= n;
    }
    (resp, send)
}

/// Every limit at once: a gateway with 4 places and 4 MiB tensors, and 12 streams, each with its
/// schema and then all but a little of the largest message the gateway takes, held there. Four
/// hold places (and what they sent), eight are refused; the gateway's peak memory stays within
/// the bound docs/scale-out.md states for these settings (4 × (two messages of 5 MiB and the
/// 8 MiB window) = 72 MiB over its own), and a remote producer is served once they are gone.
#[test]
fn the_gateways_memory_stays_within_its_stated_bound_with_every_limit_pushed() {
    let f = Fixture::with_gateway_args(&[
        "--max-remotes".into(),
        "4".into(),
        "--max-tensor-mib".into(),
        "4".into(),
        "--peer-timeout".into(),
        "30".into(),
    ]);
    let pid = f.gateway.as_ref().unwrap().id();
    let token = tensorport_bridge::auth::Token::read(&f.token()).unwrap();
    let addr = f.url.trim_start_matches("http://").to_string();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let schema_msg = tensor_schema_message(&rt);
    std::thread::sleep(Duration::from_millis(200));
    let before = peak_kib(pid);
    // The largest message taken: the tensor limit and 1 MiB.
    let declared = (5u32 << 20) - 64;
    let streams = rt.block_on(async {
        let mut v = Vec::new();
        for _ in 0..12 {
            v.push(
                half_sent(
                    &addr,
                    &token.bearer(),
                    &schema_msg,
                    declared,
                    (5 << 20) - 4096,
                )
                .await,
            );
        }
        // Time for the gateway to take in what it will.
        tokio::time::sleep(Duration::from_secs(3)).await;
        v
    });
    let peak = peak_kib(pid);
    let bound = (4 * (2 * 5 + 8)) << 10;
    println!(
        "12 streams holding 5 MiB messages on 4 places: gateway peak {} -> {} MiB (stated bound {} MiB over its own)",
        before >> 10,
        peak >> 10,
        bound >> 10
    );
    assert!(
        peak <= before + bound,
        "the gateway's peak grew by {} KiB, over the stated bound of {bound} KiB",
        peak - before
    );
    drop(streams);
    drop(rt);
    run_ok(&mut f.producer("after-limits", 16, &[]));
    assert_each_input_once(&f.lines("after-limits"), 16);
}

/// The schema message of a stream of this test's tensors, as a Flight client sends it first.
fn tensor_schema_message(rt: &tokio::runtime::Runtime) -> arrow_flight::FlightData {
    use arrow_flight::encode::FlightDataEncoderBuilder;
    use futures::TryStreamExt;
    use tensorport_bridge::schema::TensorLayout;
    let layout = TensorLayout::new(tensorport::DType::F32, &[3, SIZE as u64, SIZE as u64]).unwrap();
    let good = layout
        .batch(&[0], arrow_buffer::Buffer::from_vec(expected(0)))
        .unwrap();
    rt.block_on(
        FlightDataEncoderBuilder::new()
            .with_schema(good.schema())
            .build(futures::stream::iter([Ok(good)]))
            .try_collect::<Vec<_>>(),
    )
    .unwrap()
    .remove(0)
}

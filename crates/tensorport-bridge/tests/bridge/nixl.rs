//! Remote producers on NIXL: every input once, the gateway's UCX confined, a killed producer,
//! set-ups that lie.

use super::*;

/// NIXL from PyPI's nixl-cu13 wheel (scripts/fetch-nixl.sh, run here the first time, into the
/// checkout's target/nixl, where this process's own NIXL calls find it too) and UCX on its TCP
/// transport, for the gateway and the producers; `None` (the test says so and skips) where it
/// cannot be fetched.
fn nixl_env() -> Option<Vec<(String, String)>> {
    static DIR: std::sync::OnceLock<Option<PathBuf>> = std::sync::OnceLock::new();
    let dir = DIR.get_or_init(|| match tensorport_nixl::fetch_into_checkout() {
        Ok(dir) => Some(dir),
        Err(why) => {
            eprintln!("SKIPPED: NIXL could not be fetched (scripts/fetch-nixl.sh: {why})");
            None
        }
    });
    let dir = dir.as_ref()?;
    Some(vec![
        ("TENSORPORT_NIXL".into(), dir.display().to_string()),
        ("UCX_TLS".into(), tensorport_nixl::tcp_transports().into()),
        ("UCX_WARN_UNUSED_ENV_VARS".into(), "n".into()),
    ])
}

#[test]
fn nixl_producers_every_input_once_and_intact_beside_a_flight_one() {
    let Some(env) = nixl_env() else { return };
    let f = Fixture::with(&[], env);
    let mut a = f
        .producer("nixl-a", 300, &["--transport", "nixl"])
        .spawn()
        .unwrap();
    let mut b = f
        .producer(
            "nixl-b",
            200,
            &["--transport", "nixl", "--batch", "16", "--in-flight", "48"],
        )
        .spawn()
        .unwrap();
    let mut c = f.producer("flight", 100, &[]).spawn().unwrap();
    for p in [&mut a, &mut b, &mut c] {
        assert!(p.wait().unwrap().success(), "{}", f.gateway_log());
    }
    assert_each_input_once(&f.lines("nixl-a"), 300);
    assert_each_input_once(&f.lines("nixl-b"), 200);
    assert_each_input_once(&f.lines("flight"), 100);
    let mut got = f.received("nixl-a");
    got.sort_unstable();
    assert_eq!(
        got,
        (0..300).collect::<Vec<_>>(),
        "the server got each tensor once"
    );
    assert_eq!(f.seen.lock().unwrap().torn, 0, "no torn tensor");
    assert!(
        f.gateway_log().contains("NIXL stream"),
        "{}",
        f.gateway_log()
    );
    wait_until("the sessions close", Duration::from_secs(30), || {
        f.sessions() == 0
    });
}

/// The TCP addresses process `pid` listens on, from /proc/net/tcp{,6} and its descriptors.
fn listening(pid: u32) -> Vec<std::net::SocketAddr> {
    use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
    let inodes: HashSet<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| {
            d.flatten()
                .filter_map(|e| std::fs::read_link(e.path()).ok())
                .filter_map(|l| {
                    let l = l.to_string_lossy().into_owned();
                    l.strip_prefix("socket:[")
                        .and_then(|x| x.strip_suffix(']'))
                        .map(str::to_string)
                })
                .collect()
        })
        .unwrap_or_default();
    let mut out = Vec::new();
    for table in ["tcp", "tcp6"] {
        let text = std::fs::read_to_string(format!("/proc/{pid}/net/{table}")).unwrap_or_default();
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            // local address, state (0A: listening), inode.
            if f.len() < 10 || f[3] != "0A" || !inodes.contains(f[9]) {
                continue;
            }
            let (addr, port) = f[1].split_once(':').unwrap();
            let port = u16::from_str_radix(port, 16).unwrap();
            // The kernel prints each 32-bit word of the address in the host's (little-endian)
            // byte order.
            let words: Vec<u32> = (0..addr.len() / 8)
                .map(|k| {
                    u32::from_str_radix(&addr[8 * k..8 * k + 8], 16)
                        .unwrap()
                        .swap_bytes()
                })
                .collect();
            let ip = match words[..] {
                [v4] => IpAddr::V4(Ipv4Addr::from(v4)),
                [a, b, c, d] => IpAddr::V6(Ipv6Addr::from(
                    (u128::from(a) << 96)
                        | (u128::from(b) << 64)
                        | (u128::from(c) << 32)
                        | u128::from(d),
                )),
                _ => continue,
            };
            out.push(SocketAddr::new(ip, port));
        }
    }
    out
}

/// Pids of the processes whose parent is `ppid` and whose command line contains `needle`.
fn children_of(ppid: u32, needle: &str) -> Vec<u32> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        let parent = stat
            .rsplit_once(')')
            .and_then(|(_, r)| r.split_whitespace().nth(1))
            .and_then(|p| p.parse::<u32>().ok());
        let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        if parent == Some(ppid) && String::from_utf8_lossy(&cmd).contains(needle) {
            out.push(pid);
        }
    }
    out
}

/// A gateway listening on loopback confines NIXL's UCX to loopback: its NIXL stream's reader
/// process listens on loopback only (UCX's listener; sockets it inherited aside), where UCX left
/// alone listens on the machine's network address; the gateway itself runs no UCX.
#[test]
fn the_gateways_ucx_listens_only_on_the_flight_interface() {
    let Some(env) = nixl_env() else { return };
    let f = Fixture::with(&[], env);
    let pid = f.gateway.as_ref().unwrap().id();
    // What the gateway listens on before any stream (Flight, and whatever this test process
    // let it inherit), which its children inherit too.
    let before = listening(pid);
    let mut p = f
        .producer(
            "nixl-listen",
            3000,
            &["--transport", "nixl", "--batch", "1"],
        )
        .spawn()
        .unwrap();
    // UCX's listener comes with the stream's NIXL agent, in its reader process.
    let t = Instant::now();
    let mut seen: Vec<std::net::SocketAddr> = Vec::new();
    while seen.is_empty() && t.elapsed() < Duration::from_secs(60) {
        if let Ok(Some(_)) = p.try_wait() {
            break;
        }
        for child in children_of(pid, "nixl-reader") {
            seen.extend(listening(child).into_iter().filter(|a| !before.contains(a)));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(p.wait().unwrap().success(), "{}", f.gateway_log());
    assert!(!seen.is_empty(), "UCX's listener was never seen");
    assert!(
        seen.iter().all(|a| match a.ip() {
            std::net::IpAddr::V4(v4) => v4.is_loopback(),
            std::net::IpAddr::V6(v6) => {
                v6.is_loopback() || v6.to_ipv4_mapped().is_some_and(|v4| v4.is_loopback())
            }
        }),
        "the reader listens beyond loopback: {seen:?}"
    );
    assert_eq!(listening(pid), before, "the gateway itself listens anew");
    assert_each_input_once(&f.lines("nixl-listen"), 3000);
    assert!(
        f.gateway_log().contains("confined to lo"),
        "{}",
        f.gateway_log()
    );
}

/// A NIXL producer confines its own UCX to the interface it reaches the gateway by (loopback
/// here): what it listens on during its stream is on loopback only, where UCX left alone
/// listens on the machine's network address.
#[test]
fn a_nixl_producers_ucx_listens_only_towards_its_gateway() {
    let Some(env) = nixl_env() else { return };
    let f = Fixture::with(&[], env);
    let mut p = f
        .producer(
            "nixl-own-listen",
            1500,
            &["--transport", "nixl", "--batch", "1"],
        )
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let pid = p.id();
    // Sampled until the producer ends (a watchdog kills it after five minutes).
    let t = Instant::now();
    let mut seen: Vec<std::net::SocketAddr> = Vec::new();
    while !matches!(p.try_wait(), Ok(Some(_))) {
        if t.elapsed() > Duration::from_secs(300) {
            let _ = p.kill();
            break;
        }
        for a in listening(pid) {
            if !seen.contains(&a) {
                seen.push(a);
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let o = p.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}\n{}", f.gateway_log());
    assert!(!seen.is_empty(), "UCX's listener was never seen");
    assert!(
        seen.iter().all(|a| match a.ip() {
            std::net::IpAddr::V4(v4) => v4.is_loopback(),
            std::net::IpAddr::V6(v6) => {
                v6.is_loopback() || v6.to_ipv4_mapped().is_some_and(|v4| v4.is_loopback())
            }
        }),
        "the producer listens beyond loopback: {seen:?}"
    );
    assert_each_input_once(&f.lines("nixl-own-listen"), 1500);
}

/// A gateway listening on every address was not told which interface NIXL may use: it
/// refuses NIXL streams, saying how to allow them, and serves Flight streams as before.
#[test]
fn a_gateway_on_every_address_refuses_nixl_until_told_an_interface() {
    let Some(env) = nixl_env() else { return };
    let mut f = Fixture::with(&["--allow-plaintext".into()], env);
    if let Some(mut g) = f.gateway.take() {
        let _ = g.kill();
        let _ = g.wait();
    }
    f.start_gateway("0.0.0.0:0");
    // Reached over loopback: the producer refuses plain http:// to any other address.
    f.url = f.url.replace("0.0.0.0", "127.0.0.1");
    let o = f
        .producer("nixl-refused", 8, &["--transport", "nixl"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "a NIXL stream was served");
    assert!(err.contains("--nixl-interface"), "{err}");
    run_ok(&mut f.producer("flight-beside", 8, &[]));
    assert_each_input_once(&f.lines("flight-beside"), 8);
}

#[test]
fn a_killed_nixl_producer_is_reclaimed_and_the_next_is_served() {
    let Some(env) = nixl_env() else { return };
    let f = Fixture::with(&[], env);
    let victim = f.victim(&["--transport", "nixl"]);
    f.kill_victim(victim, Duration::from_secs(60));
    f.serves_next(&["--transport", "nixl"]);
}

/// A producer whose set-up describes slots it never registered, names slots past its set-up,
/// or sends metadata that is not NIXL's: the gateway ends that stream with an error that says
/// so, nothing reaches the server, and the next producer is served.
#[test]
fn a_nixl_set_up_that_lies_is_refused_and_harms_no_one() {
    use tensorport_bridge::nixl::{slot_batch, Hello, Outbound};
    use tensorport_bridge::remote::{connect, Exchange};
    use tensorport_bridge::schema::TensorLayout;

    let Some(env) = nixl_env() else { return };
    // GPU memory allowed, so that a set-up claiming it gets as far as the server.
    let f = Fixture::with(&["--nixl-device".into()], env);
    let layout = TensorLayout::new(tensorport::DType::F32, &[3, SIZE as u64, SIZE as u64]).unwrap();
    let out = Outbound::new(&format!("liar-{}", std::process::id()), 4, &layout, None).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let cfg = f.remote_config("liar");
    let outcome = |hello: Hello, rows: Vec<(u64, u32)>| {
        rt.block_on(async {
            let mut client = connect(&cfg).await.unwrap();
            let schema = hello.schema();
            let mut ex = Exchange::open_with(&mut client, schema.clone(), "liar", 4)
                .await
                .unwrap();
            ex.send(slot_batch(&schema, &rows).unwrap()).await.unwrap();
            ex.finish();
            let mut answered = 0;
            loop {
                match tokio::time::timeout(Duration::from_secs(60), ex.results()).await {
                    Ok(Some(Ok(r))) => answered += r.len(),
                    Ok(Some(Err(e))) => return (answered, Some(e.to_string())),
                    Ok(None) => return (answered, None),
                    Err(_) => panic!("the gateway neither answered nor ended the stream"),
                }
            }
        })
    };
    // Slots past what the agent registered: NIXL refuses to prepare reads of them.
    let mut beyond = out.hello().clone();
    beyond.slots.base += 1 << 30;
    let (n, err) = outcome(beyond, vec![(0, 0)]);
    assert_eq!(n, 0);
    assert!(
        err.as_deref().is_some_and(|e| e.contains("NIXL")),
        "{err:?}"
    );
    // A slot past the set-up's count.
    let (n, err) = outcome(out.hello().clone(), vec![(0, 9)]);
    assert_eq!(n, 0);
    assert!(
        err.as_deref().is_some_and(|e| e.contains("slot 9")),
        "{err:?}"
    );
    // Slots said to be on a GPU, to a gateway whose server takes no device tensors (and here,
    // without a GPU, whose GPU does not open).
    let mut on_gpu = out.hello().clone();
    on_gpu.slots.memory = tensorport_nixl::Memory::Device(0);
    let (n, err) = outcome(on_gpu, vec![(0, 0)]);
    assert_eq!(n, 0);
    assert!(
        err.as_deref().is_some_and(|e| e.contains("device tensors")),
        "{err:?}"
    );
    // Metadata that is not NIXL's.
    let mut junk = out.hello().clone();
    junk.metadata = vec![0x5a; 300];
    let (n, err) = outcome(junk, vec![(0, 0)]);
    assert_eq!(n, 0);
    assert!(err.is_some());
    assert_eq!(
        f.received("liar").len(),
        0,
        "nothing from a liar reached the server"
    );
    run_ok(&mut f.producer("next", 32, &["--transport", "nixl"]));
    assert_each_input_once(&f.lines("next"), 32);
    wait_until("the sessions close", Duration::from_secs(30), || {
        f.sessions() == 0
    });
}

/// NIXL metadata changed one byte at a time (one of the changes makes UCX abort the process
/// that loads it: a worker address whose version byte is wrong) while a NIXL producer and a
/// Flight producer stream beside them: each changed set-up ends its own stream at most, the
/// gateway lives through every one, the two producers get every input once, and the next NIXL
/// producer is served.
#[test]
fn nixl_metadata_that_aborts_ucx_ends_only_its_own_stream() {
    use tensorport_bridge::nixl::{slot_batch, Hello, Outbound};
    use tensorport_bridge::remote::{connect, Exchange};
    use tensorport_bridge::schema::TensorLayout;

    let Some(mut env) = nixl_env() else { return };
    // A changed address makes UCX try to connect where it says: once, not 25 times.
    env.push(("UCX_TCP_MAX_CONN_RETRIES".into(), "1".into()));
    let mut f = Fixture::with(&[], env);
    let layout = TensorLayout::new(tensorport::DType::F32, &[3, SIZE as u64, SIZE as u64]).unwrap();
    let out = Outbound::new(&format!("mutant-{}", std::process::id()), 4, &layout, None).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let cfg = f.remote_config("mutant");
    let mut beside_nixl = f
        .producer(
            "beside-nixl",
            2000,
            &["--transport", "nixl", "--batch", "1"],
        )
        .spawn()
        .unwrap();
    let mut beside_flight = f
        .producer("beside-flight", 2000, &["--batch", "1"])
        .spawn()
        .unwrap();
    let md = out.hello().metadata.clone();
    let mut ended = 0;
    // Six changed set-ups at a time (each stream's reader process starts NIXL and UCX anew).
    let positions: Vec<usize> = (0..md.len()).collect();
    for chunk in positions.chunks(6) {
        let one = |pos: usize| {
            let mut h: Hello = out.hello().clone();
            h.metadata[pos] ^= 0xff;
            let cfg = &cfg;
            async move {
                let mut client = connect(cfg).await.unwrap();
                let schema = h.schema();
                // The places of the last round's streams come back as their sessions close: a
                // full gateway is waited out, as a producer does (a minute at most).
                let t = Instant::now();
                let mut ex = loop {
                    match Exchange::open_with(&mut client, schema.clone(), "mutant", 4).await {
                        Ok(ex) => break ex,
                        Err(e) if e.to_string().contains("at most") => {
                            assert!(t.elapsed() < Duration::from_secs(60), "byte {pos}: {e}");
                            tokio::time::sleep(Duration::from_millis(100)).await;
                        }
                        Err(e) => panic!("byte {pos}: {e}"),
                    }
                };
                let _ = ex.send(slot_batch(&schema, &[(0, 0)]).unwrap()).await;
                ex.finish();
                match tokio::time::timeout(Duration::from_secs(60), ex.results()).await {
                    Ok(Some(Ok(r))) => r.len(),
                    Ok(_) => 0,
                    Err(_) => {
                        panic!("byte {pos}: the gateway neither answered nor ended the stream")
                    }
                }
            }
        };
        let answered = rt.block_on(futures::future::join_all(chunk.iter().map(|&p| one(p))));
        ended += answered.iter().filter(|&&n| n == 0).count();
        let gateway = f.gateway.as_mut().unwrap();
        assert!(
            gateway.try_wait().unwrap().is_none(),
            "bytes {chunk:?} of the metadata ended the gateway:\n{}",
            f.gateway_log()
        );
    }
    assert!(ended > 0, "no changed set-up was refused");
    for p in [&mut beside_nixl, &mut beside_flight] {
        assert!(p.wait().unwrap().success(), "{}", f.gateway_log());
    }
    assert_each_input_once(&f.lines("beside-nixl"), 2000);
    assert_each_input_once(&f.lines("beside-flight"), 2000);
    assert!(
        f.gateway_log().contains("NIXL reader process failed"),
        "{}",
        f.gateway_log()
    );
    run_ok(&mut f.producer("after-mutants", 32, &["--transport", "nixl"]));
    assert_each_input_once(&f.lines("after-mutants"), 32);
}

/// One stream with the set-up `hello`, named `name`, asking for producer slot 0 into pool slot
/// 0: the first results message's length (0 if none), or the error the gateway ended it with.
/// A minute's watchdog.
fn one_read(
    cfg: &tensorport_bridge::remote::RemoteConfig,
    hello: &tensorport_bridge::nixl::Hello,
    name: &str,
) -> Result<usize, String> {
    use tensorport_bridge::nixl::slot_batch;
    use tensorport_bridge::remote::{connect, Exchange};
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let mut client = connect(cfg).await.unwrap();
        let schema = hello.schema();
        let mut ex = Exchange::open_with(&mut client, schema.clone(), name, 4)
            .await
            .unwrap();
        let _ = ex.send(slot_batch(&schema, &[(0, 0)]).unwrap()).await;
        ex.finish();
        match tokio::time::timeout(Duration::from_secs(60), ex.results()).await {
            Ok(Some(Ok(r))) => Ok(r.len()),
            Ok(Some(Err(e))) => Err(e.to_string()),
            Ok(None) => Ok(0),
            Err(_) => panic!("the gateway neither answered nor ended the stream"),
        }
    })
}

/// The machine's first IPv4 interface other than loopback, and its address.
fn network_interface() -> Option<(String, std::net::Ipv4Addr)> {
    nix::ifaddrs::getifaddrs().ok()?.find_map(|i| {
        let ip = i.address.as_ref()?.as_sockaddr_in()?.ip();
        (!ip.is_loopback()).then_some((i.interface_name, ip))
    })
}

/// NIXL metadata that names another host than the one the stream came from: the stream comes
/// over loopback, and the producer's UCX worker address names the machine's network address
/// (where its UCX listens). The gateway's reader, on that network interface, does not connect
/// there (a reader that connected wherever the metadata said would serve the stream): the
/// stream ends with an error that names the refused address, the gateway lives on, and a
/// Flight producer beside it is served.
#[test]
fn nixl_metadata_naming_another_host_is_not_connected_to() {
    use tensorport_bridge::nixl::{Hello, Outbound};
    use tensorport_bridge::schema::TensorLayout;

    let Some(mut env) = nixl_env() else { return };
    let Some((iface, ip)) = network_interface() else {
        eprintln!("SKIPPED: no network interface besides loopback");
        return;
    };
    env.push(("UCX_TCP_MAX_CONN_RETRIES".into(), "1".into()));
    let args = [
        "--allow-plaintext".to_string(),
        "--nixl-interface".into(),
        iface,
    ];
    let mut f = Fixture::with(&args, env);
    if let Some(mut g) = f.gateway.take() {
        let _ = g.kill();
        let _ = g.wait();
    }
    f.start_gateway("0.0.0.0:0");
    f.url = f.url.replace("0.0.0.0", "127.0.0.1");
    let layout = TensorLayout::new(tensorport::DType::F32, &[3, SIZE as u64, SIZE as u64]).unwrap();
    let out = Outbound::new(
        &format!("elsewhere-{}", std::process::id()),
        4,
        &layout,
        None,
    )
    .unwrap();
    let h: Hello = out.hello().clone();
    assert!(
        h.metadata.windows(4).any(|w| w == ip.octets()),
        "the producer's metadata names {ip}"
    );
    let answered = one_read(&f.remote_config("elsewhere"), &h, "elsewhere").unwrap_or(0);
    assert_eq!(
        answered,
        0,
        "a stream from 127.0.0.1 was read from {ip}:\n{}",
        f.gateway_log()
    );
    assert!(
        f.gateway_log()
            .contains(&format!("refused to connect to {ip}:")),
        "{}",
        f.gateway_log()
    );
    let gateway = f.gateway.as_mut().unwrap();
    assert!(gateway.try_wait().unwrap().is_none(), "{}", f.gateway_log());
    run_ok(&mut f.producer("flight-beside", 8, &[]));
    assert_each_input_once(&f.lines("flight-beside"), 8);
}

/// A NIXL set-up of GPU memory at a gateway not given --nixl-device: such streams are read in
/// the gateway's own process, so it refuses the stream before loading any of it, saying how to
/// allow it, and serves the next NIXL producer.
#[test]
fn nixl_streams_of_gpu_memory_are_refused_unless_allowed() {
    use tensorport_bridge::nixl::{Hello, Outbound};
    use tensorport_bridge::schema::TensorLayout;

    let Some(env) = nixl_env() else { return };
    let mut f = Fixture::with(&[], env);
    let layout = TensorLayout::new(tensorport::DType::F32, &[3, SIZE as u64, SIZE as u64]).unwrap();
    let out = Outbound::new(&format!("device-{}", std::process::id()), 4, &layout, None).unwrap();
    let mut h: Hello = out.hello().clone();
    h.slots.memory = tensorport_nixl::Memory::Device(0);
    let said = match one_read(&f.remote_config("device"), &h, "device") {
        Err(e) => e,
        Ok(n) => panic!("a stream of GPU memory was not refused ({n} answered)"),
    };
    assert!(said.contains("--nixl-device"), "{said}");
    assert!(
        f.received("device").is_empty(),
        "a tensor reached the server"
    );
    let gateway = f.gateway.as_mut().unwrap();
    assert!(gateway.try_wait().unwrap().is_none(), "{}", f.gateway_log());
    run_ok(&mut f.producer("after-device", 16, &["--transport", "nixl"]));
    assert_each_input_once(&f.lines("after-device"), 16);
}

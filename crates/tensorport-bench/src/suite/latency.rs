//! Latency runs, in the parent: one producer child and one answering side per peer, round trips
//! timed by the child.

use super::*;

pub(super) fn samples(out: std::process::Output, who: &str) -> CliResult<Vec<f64>> {
    if !out.status.success() {
        return Err(CliError::new(format!(
            "the {who} latency child failed: {}",
            out.status
        )));
    }
    let v: Vec<f64> = String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .filter_map(|x| x.parse().ok())
        .collect();
    if v.is_empty() {
        return Err(CliError::new(format!(
            "the {who} latency child measured nothing"
        )));
    }
    Ok(v)
}

/// A server for the latency runs: one producer, one consumer.
pub(super) fn tp_server(sock: &Path, size: usize, poll: bool) -> CliResult<Server> {
    let mut cfg = ServerConfig::new(sock);
    cfg.slot_size = size as u64;
    cfg.spin = if poll { FOREVER } else { Duration::ZERO };
    Ok(Server::bind(cfg)?)
}

pub(super) fn tp_latency(cx: &Ctx, size: usize, poll: bool) -> CliResult<Vec<f64>> {
    let dir = socket_dir()?;
    let sock = dir.path().join("lat.sock");
    let (me, kid) = cx.pair();
    if let Some(c) = me {
        pin(c)?;
    }
    let server = tp_server(&sock, size, poll)?;
    let child = cx.child(Role::TpPing, &sock.to_string_lossy(), size, poll, kid)?;
    for _ in 0..cx.round_trips + WARMUP {
        let r = server
            .recv_timeout(Duration::from_secs(10))?
            .ok_or_else(|| CliError::new("the tensorport latency producer stopped"))?;
        std::hint::black_box(r.bytes().first());
        r.respond(&[])?;
    }
    cx.unpin();
    samples(child.wait_with_output()?, "tensorport")
}

pub(super) fn ice_latency(cx: &Ctx, size: usize, poll: bool) -> CliResult<Vec<f64>> {
    let tag = format!("tp-bench-{}-lat-{size}-{poll}", std::process::id());
    let (me, kid) = cx.pair();
    if let Some(c) = me {
        pin(c)?;
    }
    let node = ice_node()?;
    let ping = ice_data(&node, &format!("{tag}/ping"), 1)?;
    let pong = ice_data(&node, &format!("{tag}/pong"), 1)?;
    let sub = ice(ping.subscriber_builder().create(), "subscriber")?;
    let publisher = ice_publisher(&pong, 8)?;
    let (notifier, listener) = if poll {
        (None, None)
    } else {
        let to_me = ice_event(&node, &format!("{tag}/ping-ev"))?;
        let to_child = ice_event(&node, &format!("{tag}/pong-ev"))?;
        (
            Some(ice(to_child.notifier_builder().create(), "notifier")?),
            Some(ice(to_me.listener_builder().create(), "listener")?),
        )
    };
    let child = cx.child(Role::IcePing, &tag, size, poll, kid)?;
    for i in 0..cx.round_trips + WARMUP {
        ice_recv(
            &sub,
            listener.as_ref(),
            Instant::now() + Duration::from_secs(10),
        )?;
        ice_send(&publisher, 8, i)?;
        if let Some(n) = &notifier {
            ice(n.notify(), "notify")?;
        }
    }
    cx.unpin();
    samples(child.wait_with_output()?, "iceoryx2")
}

pub(super) fn uds_latency(cx: &Ctx, size: usize) -> CliResult<Vec<f64>> {
    let dir = socket_dir()?;
    let sock = dir.path().join("lat.sock");
    let (me, kid) = cx.pair();
    if let Some(c) = me {
        pin(c)?;
    }
    let listener = UnixListener::bind(&sock)?;
    let child = cx.child(Role::UdsPing, &sock.to_string_lossy(), size, false, kid)?;
    let (mut s, _) = listener.accept()?;
    let mut buf = vec![0u8; size];
    for _ in 0..cx.round_trips + WARMUP {
        s.read_exact(&mut buf)?;
        s.write_all(&[0u8; 8])?;
    }
    cx.unpin();
    samples(child.wait_with_output()?, "Unix socket")
}

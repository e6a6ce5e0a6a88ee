//! The pinned host path: producers' pools registered with the GPU, DMA to the device.

use super::*;

pub(crate) fn pinned_four_producers() {
    let (_dir, sock) = socket_dir();
    let maps0 = pool_mappings();
    let srv = GpuServer::start(&sock);
    let mut kids = spawn_checked_producers(&sock, 4, 1000);
    assert!(eventually(PATIENCE, || live_registrations() == 4));
    wait_all_ok(&mut kids, Duration::from_secs(120));
    println!(
        "  {} tensors through the GPU, {} torn",
        srv.verified.load(Ordering::SeqCst),
        srv.torn.load(Ordering::SeqCst)
    );
    assert_eq!(srv.verified.load(Ordering::SeqCst), 4000);
    assert_eq!(srv.torn.load(Ordering::SeqCst), 0);
    assert!(eventually(PATIENCE, || srv
        .server
        .status()
        .sessions
        .is_empty()
        && live_registrations() == 0
        && pool_mappings() == maps0));
}

pub(crate) fn killed_producer() {
    let (_dir, sock) = socket_dir();
    let maps0 = pool_mappings();
    let srv = GpuServer::start(&sock);
    let mut k = spawn_child(
        "producer",
        &[
            socket_env(&sock),
            ("TP_ID", "9".into()),
            ("TP_COUNT", "100000".into()),
        ],
    );
    assert!(eventually(PATIENCE, || srv.verified.load(Ordering::SeqCst) > 200));
    assert_eq!(live_registrations(), 1);
    k.kill9();
    assert!(
        eventually(PATIENCE, || live_registrations() == 0
            && pool_mappings() == maps0),
        "registrations {} mappings {}",
        live_registrations(),
        pool_mappings()
    );
    assert_eq!(srv.torn.load(Ordering::SeqCst), 0);
    assert_eq!(srv.server.status().totals.sessions_reclaimed, 1);
}

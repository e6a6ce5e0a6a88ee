//! Sequences of messages, not single frames: each input is one producer session on a real
//! socket to a real server (`tests/support/session_ops.rs` turns bytes into messages), and after
//! it the server must have answered every request it admitted exactly once and given every pool
//! back. A panic in any server thread aborts (the hook below), so libFuzzer sees it.
#![no_main]

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use libfuzzer_sys::fuzz_target;

#[path = "../../tests/support/session_ops.rs"]
mod session_ops;

struct Fixture {
    socket: PathBuf,
    server: Arc<tensorport::Server>,
}

fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        let hook = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            hook(info);
            std::process::abort();
        }));
        let dir = std::env::temp_dir().join(format!("tensorport-fuzz-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let socket = dir.join("s.sock");
        let (server, _stop) = session_ops::sequence_server(&socket);
        Fixture { socket, server }
    })
}

fuzz_target!(|data: &[u8]| {
    let f = fixture();
    session_ops::play(&f.socket, data);
    session_ops::assert_settled(&f.server, Duration::from_secs(30));
});

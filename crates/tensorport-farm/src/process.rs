//! What a tensorport process sets up for itself: signal handling (drain on the first signal,
//! exit on the second), SIGXFSZ caught, and dying with the farm that started it.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;

/// The environment variable a farm sets in its children: its own pid.
pub const FARM_PID_ENV: &str = "TENSORPORT_FARM_PID";

/// Installs SIGINT/SIGTERM handlers: the first sets the returned flag (drain), a second one
/// exits the process at once with status 130.
pub fn stop_flag() -> Arc<AtomicBool> {
    use signal_hook::consts::{SIGINT, SIGTERM};
    use signal_hook::flag;
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [SIGINT, SIGTERM] {
        // Registered first, so it sees the flag as it was before this signal.
        let r = flag::register_conditional_shutdown(sig, 130, stop.clone())
            .and_then(|_| flag::register(sig, stop.clone()));
        if let Err(e) = r {
            tracing::warn!("cannot install a handler for signal {sig}: {e}");
        }
    }
    stop
}

/// A write past the file size limit (`ulimit -f`; memfd pools count) raises SIGXFSZ, whose
/// default action kills the process: catch it, so the call fails with EFBIG and the caller can
/// refuse or report it.
pub fn catch_sigxfsz() {
    let flag = Arc::new(AtomicBool::new(false));
    if let Err(e) = signal_hook::flag::register(signal_hook::consts::SIGXFSZ, flag) {
        tracing::warn!("cannot catch SIGXFSZ: {e}");
    }
}

/// When started by a farm ([`FARM_PID_ENV`] set), asks the kernel to send us SIGTERM if the
/// farm dies, so no producer or server outlives it.
pub fn die_with_farm() {
    let Some(pid) = std::env::var(FARM_PID_ENV)
        .ok()
        .and_then(|p| p.parse::<i32>().ok())
    else {
        return;
    };
    if let Err(e) = nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGTERM) {
        tracing::warn!("cannot set the parent-death signal: {e}");
    }
    // The farm may have died before the line above took effect.
    if nix::unistd::getppid().as_raw() != pid {
        std::process::exit(1);
    }
}

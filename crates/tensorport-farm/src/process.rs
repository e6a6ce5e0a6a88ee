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

/// When started by a farm ([`FARM_PID_ENV`] set), sends itself SIGTERM once the farm process
/// has died, so no producer or server outlives it. A thread watches the parent pid: the
/// kernel's parent-death signal would fire when the *thread* that started this process ends,
/// which for a farm started from a Python thread is long before the process does.
pub fn die_with_farm() {
    let Some(pid) = std::env::var(FARM_PID_ENV)
        .ok()
        .and_then(|p| p.parse::<i32>().ok())
    else {
        return;
    };
    let orphaned = move || nix::unistd::getppid().as_raw() != pid;
    // The farm may have died before this process got here.
    if orphaned() {
        std::process::exit(1);
    }
    let watch = std::thread::Builder::new()
        .name("farm-watch".into())
        .spawn(move || {
            while !orphaned() {
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
            let _ = nix::sys::signal::raise(nix::sys::signal::Signal::SIGTERM);
        });
    if let Err(e) = watch {
        tracing::warn!("cannot watch the farm process: {e}");
    }
}

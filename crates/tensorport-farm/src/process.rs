//! How a server or farm is told to stop ([`Stop`], which the binary connects to SIGINT and
//! SIGTERM), SIGXFSZ caught, and dying with the farm that started a process.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

/// The environment variable a farm sets in its children: its own pid.
pub const FARM_PID_ENV: &str = "TENSORPORT_FARM_PID";

/// How a caller tells a server ([`crate::serve::run`]) or a farm ([`crate::farm::run`]) to
/// stop: the first request drains (the work in flight finishes, no new work is taken), a second
/// stops at once. Clones share their requests. The library installs no signal handler: the
/// `tensorport` binary connects SIGINT and SIGTERM to one ([`Stop::on_signals`]); a program
/// that embeds a server calls [`Stop::request`] itself.
#[derive(Debug, Clone, Default)]
pub struct Stop(Arc<AtomicUsize>);

impl Stop {
    pub fn new() -> Stop {
        Stop::default()
    }

    /// Asks to stop (again); returns how many requests there have been.
    pub fn request(&self) -> usize {
        self.0.fetch_add(1, Ordering::SeqCst) + 1
    }

    /// Whether a stop was asked for: drain.
    pub fn draining(&self) -> bool {
        self.0.load(Ordering::SeqCst) >= 1
    }

    /// Whether a second stop was asked for: at once.
    pub fn at_once(&self) -> bool {
        self.0.load(Ordering::SeqCst) >= 2
    }

    /// Makes every SIGINT and SIGTERM a request (a thread waits for them). With
    /// `exit_on_second`, the second exits the process at once with status 130 (a server has
    /// nothing to clean up; a farm ends its children itself and so asks for no exit).
    pub fn on_signals(&self, exit_on_second: bool) -> std::io::Result<()> {
        use signal_hook::consts::{SIGINT, SIGTERM};
        let mut signals = signal_hook::iterator::Signals::new([SIGINT, SIGTERM])?;
        let stop = self.clone();
        std::thread::Builder::new()
            .name("signals".into())
            .spawn(move || {
                for _ in signals.forever() {
                    if stop.request() >= 2 && exit_on_second {
                        std::process::exit(130);
                    }
                }
            })?;
        Ok(())
    }
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

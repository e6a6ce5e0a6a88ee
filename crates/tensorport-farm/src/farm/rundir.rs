//! The farm's private socket directory: made 0700 under `$XDG_RUNTIME_DIR` (or the temporary
//! directory), marked with the farm's pid, and — since a farm killed with `SIGKILL` cannot
//! remove its own — the stale ones of this user's earlier farms removed when a new farm starts.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// Names of farm directories start with this.
const PREFIX: &str = "tensorport-farm-";
/// The file in a farm directory that holds its farm's pid.
const PID_FILE: &str = "farm.pid";

/// A new private directory for a farm's sockets (removed when dropped), after removing stale
/// ones of this user's earlier farms in `base`.
pub(super) fn create(base: &Path) -> std::io::Result<tempfile::TempDir> {
    for stale in stale_dirs(base) {
        match std::fs::remove_dir_all(&stale) {
            Ok(()) => tracing::info!("removed {}: its farm is gone", stale.display()),
            Err(e) => tracing::debug!("could not remove {}: {e}", stale.display()),
        }
    }
    // 0700, as docs/operations.md says the socket's directory must be (tempfile would leave it
    // to the umask: 0755).
    let dir = tempfile::Builder::new()
        .prefix(PREFIX)
        .permissions(std::fs::Permissions::from_mode(0o700))
        .tempdir_in(base)?;
    std::fs::write(
        dir.path().join(PID_FILE),
        format!("{}\n", std::process::id()),
    )?;
    Ok(dir)
}

/// Farm directories in `base` that this user owns (real directories, not links) whose farm is
/// gone: the pid they name is not a live process, and no server answers on a socket in them.
fn stale_dirs(base: &Path) -> Vec<PathBuf> {
    let me = nix::unistd::geteuid().as_raw();
    let Ok(entries) = std::fs::read_dir(base) else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with(PREFIX))
        .map(|e| e.path())
        .filter(|p| std::fs::symlink_metadata(p).is_ok_and(|m| m.is_dir() && m.uid() == me))
        .filter(|p| is_stale(p))
        .collect()
}

fn is_stale(dir: &Path) -> bool {
    let pid = std::fs::read_to_string(dir.join(PID_FILE))
        .ok()
        .and_then(|s| s.trim().parse::<i32>().ok());
    let Some(pid) = pid else {
        // Being made right now, or not ours to judge.
        return false;
    };
    if pid <= 0 || process_alive(pid) {
        return false;
    }
    // The pid may be reused by then; a listening socket is what says a farm still lives here.
    let answering = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .any(|e| {
            e.path().extension().is_some_and(|x| x == "sock")
                && std::os::unix::net::UnixStream::connect(e.path()).is_ok()
        });
    !answering
}

fn process_alive(pid: i32) -> bool {
    use nix::errno::Errno;
    match nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None) {
        Ok(()) => true,
        Err(Errno::ESRCH) => false,
        // EPERM: it exists, under another user.
        Err(_) => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dead_farms_directory_is_removed_and_a_live_ones_kept() {
        let base = tempfile::tempdir().unwrap();
        // A farm that is gone: a pid no process has (pid_max is below 2^22 on Linux).
        let dead = base.path().join(format!("{PREFIX}dead"));
        std::fs::create_dir(&dead).unwrap();
        std::fs::write(dead.join(PID_FILE), "4194304\n").unwrap();
        std::fs::write(dead.join("tensorport.sock"), "").unwrap();
        // This process is alive.
        let live = base.path().join(format!("{PREFIX}live"));
        std::fs::create_dir(&live).unwrap();
        std::fs::write(live.join(PID_FILE), format!("{}\n", std::process::id())).unwrap();
        // No pid file: left alone.
        let unknown = base.path().join(format!("{PREFIX}unknown"));
        std::fs::create_dir(&unknown).unwrap();
        // Not a farm's.
        let other = base.path().join("something-else");
        std::fs::create_dir(&other).unwrap();
        std::fs::write(other.join(PID_FILE), "4194304\n").unwrap();

        let fresh = create(base.path()).unwrap();
        assert!(!dead.exists());
        assert!(live.exists() && unknown.exists() && other.exists());
        let mode = std::fs::metadata(fresh.path())
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o700);
        let pid = std::fs::read_to_string(fresh.path().join(PID_FILE)).unwrap();
        assert_eq!(pid.trim(), std::process::id().to_string());
    }

    #[test]
    fn a_dead_pid_with_a_listening_socket_is_kept() {
        let base = tempfile::tempdir().unwrap();
        let dir = base.path().join(format!("{PREFIX}reused"));
        std::fs::create_dir(&dir).unwrap();
        std::fs::write(dir.join(PID_FILE), "4194304\n").unwrap();
        let _listener =
            std::os::unix::net::UnixListener::bind(dir.join("tensorport.sock")).unwrap();
        assert!(stale_dirs(base.path()).is_empty());
    }
}

//! Where the socket lives, and binding it safely.
//!
//! Default path: `$TENSORPORT_SOCKET`, else `$XDG_RUNTIME_DIR/tensorport/tensorport.sock`, else
//! `/tmp/tensorport-<uid>/tensorport.sock`. The directory is created 0700; an existing one must be
//! owned by this user and writable by no one else. The socket file is made 0600. A socket file
//! left by a dead server (connect is refused) is replaced; a live one is never taken over.

use std::fs::{self, DirBuilder};
use std::io::ErrorKind;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};

use crate::{BindError, ConnectError, Error};

/// Environment variable that overrides the default socket path.
pub const SOCKET_ENV: &str = "TENSORPORT_SOCKET";

/// The socket path to use when none is given: see the module docs.
pub fn default_socket_path() -> PathBuf {
    if let Some(p) = std::env::var_os(SOCKET_ENV).filter(|p| !p.is_empty()) {
        return PathBuf::from(p);
    }
    if let Some(dir) = std::env::var_os("XDG_RUNTIME_DIR").filter(|p| !p.is_empty()) {
        return Path::new(&dir).join("tensorport").join("tensorport.sock");
    }
    let uid = nix::unistd::geteuid().as_raw();
    PathBuf::from(format!("/tmp/tensorport-{uid}/tensorport.sock"))
}

/// Makes sure `dir` exists, belongs to us, and no one else can write it. A symbolic link in its
/// place must be ours too: in a shared directory such as /tmp, another user could plant one at
/// our default path to choose where our socket goes, and swap it later.
fn ensure_private_dir(dir: &Path) -> Result<(), BindError> {
    let me = nix::unistd::geteuid().as_raw();
    if let Ok(link) = fs::symlink_metadata(dir) {
        if link.file_type().is_symlink() && link.uid() != me {
            return Err(BindError::UnsafeDir {
                path: dir.to_owned(),
                problem: format!(
                    "is a symbolic link owned by uid {}, not by you (uid {me}); remove it, or choose another socket path",
                    link.uid()
                ),
            });
        }
    }
    match DirBuilder::new().recursive(true).mode(0o700).create(dir) {
        Ok(()) => {}
        Err(e) => {
            return Err(BindError::UnsafeDir {
                path: dir.to_owned(),
                problem: format!("cannot be created: {e}"),
            })
        }
    }
    let md = fs::metadata(dir)
        .map_err(Error::io("stat socket directory"))
        .map_err(BindError::failed)?;
    if md.uid() != me {
        return Err(BindError::UnsafeDir {
            path: dir.to_owned(),
            problem: format!("belongs to uid {}, not to you (uid {me})", md.uid()),
        });
    }
    let mode = md.permissions().mode();
    if mode & 0o022 != 0 {
        return Err(BindError::UnsafeDir {
            path: dir.to_owned(),
            problem: format!("is writable by others (mode {:o})", mode & 0o7777),
        });
    }
    Ok(())
}

/// Binds a listening socket at `path` as described in the module docs.
pub fn bind_listener(path: &Path) -> Result<UnixListener, BindError> {
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    ensure_private_dir(dir)?;
    match fs::symlink_metadata(path) {
        Ok(md) if md.file_type().is_socket() => match UnixStream::connect(path) {
            Ok(_) => return Err(BindError::AddrInUse(path.to_owned())),
            Err(e)
                if e.kind() == ErrorKind::ConnectionRefused || e.kind() == ErrorKind::NotFound =>
            {
                tracing::info!(path = %path.display(), "replacing stale socket of a dead server");
                let _ = fs::remove_file(path);
            }
            Err(e) => return Err(BindError::failed(Error::io("probe existing socket")(e))),
        },
        Ok(_) => return Err(BindError::NotASocket(path.to_owned())),
        Err(e) if e.kind() == ErrorKind::NotFound => {}
        Err(e) => return Err(BindError::failed(Error::io("stat socket path")(e))),
    }
    let listener = UnixListener::bind(path).map_err(|e| {
        if e.kind() == ErrorKind::AddrInUse {
            BindError::AddrInUse(path.to_owned())
        } else {
            BindError::failed(Error::io("bind socket")(e))
        }
    })?;
    fs::set_permissions(path, fs::Permissions::from_mode(0o600))
        .map_err(Error::io("chmod socket 0600"))
        .map_err(BindError::failed)?;
    Ok(listener)
}

/// Connects to a server at `path`, mapping "nothing there" to [`ConnectError::NoServer`].
pub fn connect(path: &Path) -> Result<UnixStream, ConnectError> {
    UnixStream::connect(path).map_err(|source| match source.kind() {
        ErrorKind::NotFound | ErrorKind::ConnectionRefused => ConnectError::NoServer {
            path: path.to_owned(),
            source,
        },
        _ => ConnectError::failed(Error::Io {
            what: "connect to server",
            source,
        }),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stale_socket_is_replaced_live_is_not() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("run").join("t.sock");
        let l = bind_listener(&sock).unwrap();
        let mode = fs::metadata(&sock).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let dmode = fs::metadata(sock.parent().unwrap())
            .unwrap()
            .permissions()
            .mode()
            & 0o777;
        assert_eq!(dmode, 0o700);
        assert!(matches!(bind_listener(&sock), Err(BindError::AddrInUse(_))));
        drop(l); // socket file stays, nobody listens: stale
        let _l2 = bind_listener(&sock).unwrap();
    }

    #[test]
    fn refuses_non_socket_and_open_dirs() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("file");
        fs::write(&f, b"x").unwrap();
        assert!(matches!(bind_listener(&f), Err(BindError::NotASocket(_))));
        let open = dir.path().join("open");
        fs::create_dir(&open).unwrap();
        fs::set_permissions(&open, fs::Permissions::from_mode(0o777)).unwrap();
        assert!(matches!(
            bind_listener(&open.join("s.sock")),
            Err(BindError::UnsafeDir { .. })
        ));
    }

    #[test]
    fn refuses_another_users_symlink_and_directory() {
        if !nix::unistd::geteuid().is_root() {
            eprintln!("SKIPPED: giving files to another uid needs root");
            return;
        }
        let nobody = 65534;
        let dir = tempfile::tempdir().unwrap();
        // A directory of ours, reached through a link another user planted.
        let mine = dir.path().join("mine");
        fs::create_dir(&mine).unwrap();
        fs::set_permissions(&mine, fs::Permissions::from_mode(0o700)).unwrap();
        let link = dir.path().join("planted");
        std::os::unix::fs::symlink(&mine, &link).unwrap();
        std::os::unix::fs::lchown(&link, Some(nobody), Some(nobody)).unwrap();
        match bind_listener(&link.join("s.sock")) {
            Err(BindError::UnsafeDir { problem, .. }) => {
                assert!(
                    problem.contains("symbolic link owned by uid 65534"),
                    "{problem}"
                )
            }
            other => panic!("expected UnsafeDir, got {other:?}"),
        }
        // Our own link is fine.
        let own = dir.path().join("own-link");
        std::os::unix::fs::symlink(&mine, &own).unwrap();
        drop(bind_listener(&own.join("s.sock")).unwrap());
        // A directory another user owns.
        let theirs = dir.path().join("theirs");
        fs::create_dir(&theirs).unwrap();
        fs::set_permissions(&theirs, fs::Permissions::from_mode(0o700)).unwrap();
        std::os::unix::fs::chown(&theirs, Some(nobody), Some(nobody)).unwrap();
        match bind_listener(&theirs.join("s.sock")) {
            Err(BindError::UnsafeDir { problem, .. }) => {
                assert!(problem.contains("belongs to uid 65534"), "{problem}")
            }
            other => panic!("expected UnsafeDir, got {other:?}"),
        }
    }

    #[test]
    fn connect_to_nothing_says_what_to_do() {
        let dir = tempfile::tempdir().unwrap();
        let e = connect(&dir.path().join("none.sock")).unwrap_err();
        assert!(e.to_string().contains("tensorport serve"), "{e}");
    }
}

//! Who may use a gateway: a shared secret (a bearer token), and TLS with optional client
//! certificates around it (see [`crate::tls`]). The uid check of the local socket stops at the
//! host; across hosts, a peer is whoever holds the token.
//!
//! A remote producer sends `authorization: Bearer <token>` with every call (the header Arrow
//! Flight clients in every language can set); the gateway compares it in constant time, and
//! refuses a call without it before reading a byte of its stream.

use std::io::Read;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::Path;

/// The request header that carries the token.
pub const HEADER: &str = "authorization";
/// Shortest token taken, in bytes.
pub const MIN_TOKEN: usize = 16;

/// Why a token could not be read or made.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TokenError {
    /// The file could not be read or written.
    #[error("token file {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// What failed.
        #[source]
        source: std::io::Error,
    },
    /// Others may read the file.
    #[error("token file {0} may be read by other users; make it private (chmod 600 {0})")]
    Readable(String),
    /// Not a regular file (a link, FIFO, device or directory).
    #[error("token file {0} is not a regular file (links, FIFOs and devices are refused)")]
    NotAFile(String),
    /// Another user owns the file.
    #[error("token file {0} belongs to uid {1}, not to this user")]
    NotOwned(String, u32),
    /// Too short to be a secret, or not one line of text.
    #[error("token file {0} must hold one line of at least {MIN_TOKEN} characters (`tensorport-bridge token FILE` writes one)")]
    Weak(String),
}

/// A shared secret. Its `Debug` does not show it.
#[derive(Clone)]
pub struct Token(String);

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Token(..)")
    }
}

impl Token {
    /// A token from its text (surrounding whitespace removed).
    pub fn new(text: &str) -> Option<Token> {
        let t = text.trim();
        (t.len() >= MIN_TOKEN && !t.contains(['\n', '\r']) && t.is_ascii())
            .then(|| Token(t.to_string()))
    }

    /// Reads a token from a file only its owner can read.
    pub fn read(path: &Path) -> Result<Token, TokenError> {
        let shown = path.display().to_string();
        let io = |source| TokenError::Io {
            path: shown.clone(),
            source,
        };
        // The checks are made on the file opened, not on the path (which could be swapped
        // between a check and the open); a FIFO or device is refused without blocking on it.
        let f = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(nix::libc::O_NOFOLLOW | nix::libc::O_NONBLOCK | nix::libc::O_CLOEXEC)
            .open(path)
            .map_err(io)?;
        let meta = f.metadata().map_err(io)?;
        if !meta.file_type().is_file() {
            return Err(TokenError::NotAFile(shown));
        }
        let me = nix::unistd::geteuid().as_raw();
        if meta.uid() != me {
            return Err(TokenError::NotOwned(shown, meta.uid()));
        }
        if meta.mode() & 0o077 != 0 {
            return Err(TokenError::Readable(shown));
        }
        let mut text = String::new();
        f.take(4096).read_to_string(&mut text).map_err(io)?;
        Token::new(&text).ok_or(TokenError::Weak(shown))
    }

    /// Writes a new random token (32 bytes from the kernel, as hex) to a new file of mode 0600.
    pub fn generate(path: &Path) -> Result<Token, TokenError> {
        let shown = path.display().to_string();
        let io = |source| TokenError::Io {
            path: shown.clone(),
            source,
        };
        let mut raw = [0u8; 32];
        std::fs::File::open("/dev/urandom")
            .and_then(|mut f| f.read_exact(&mut raw))
            .map_err(io)?;
        let text: String = raw.iter().map(|b| format!("{b:02x}")).collect();
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(path)
            .map_err(io)?;
        std::io::Write::write_all(&mut f, format!("{text}\n").as_bytes()).map_err(io)?;
        Ok(Token(text))
    }

    /// The header value a client sends.
    pub fn bearer(&self) -> String {
        format!("Bearer {}", self.0)
    }

    /// Whether a header value carries this token; takes the same time wherever the first
    /// difference is.
    pub fn admits(&self, header: Option<&[u8]>) -> bool {
        let Some(value) = header.and_then(|h| h.strip_prefix(b"Bearer ")) else {
            return false;
        };
        let want = self.0.as_bytes();
        if value.len() != want.len() {
            return false;
        }
        value
            .iter()
            .zip(want)
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn only_the_exact_bearer_token_is_admitted() {
        let t = Token::new("0123456789abcdef0123").unwrap();
        assert!(t.admits(Some(t.bearer().as_bytes())));
        assert!(!t.admits(None));
        assert!(!t.admits(Some(b"Bearer 0123456789abcdef012")));
        assert!(!t.admits(Some(b"Bearer 0123456789abcdef0124")));
        assert!(!t.admits(Some(b"0123456789abcdef0123")));
        assert!(!t.admits(Some(b"Basic 0123456789abcdef0123")));
        assert!(!format!("{t:?}").contains("0123"));
    }

    #[test]
    fn weak_or_readable_token_files_are_refused() {
        assert!(Token::new("short").is_none());
        assert!(Token::new("0123456789abcdef\n0123456789").is_none());
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("token");
        let t = Token::generate(&p).unwrap();
        assert_eq!(Token::read(&p).unwrap().bearer(), t.bearer());
        assert!(Token::generate(&p).is_err(), "never overwrites");
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert!(matches!(Token::read(&p), Err(TokenError::Readable(_))));
        let w = dir.path().join("weak");
        std::fs::write(&w, "abc\n").unwrap();
        std::fs::set_permissions(&w, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert!(matches!(Token::read(&w), Err(TokenError::Weak(_))));
    }

    /// The checks hold for the file that is read: a link to a private token is refused (it
    /// could be swapped after a check), and a FIFO is refused at once, never waited on.
    #[test]
    fn links_and_fifos_are_refused_without_blocking() {
        let dir = tempfile::tempdir().unwrap();
        let real = dir.path().join("token");
        Token::generate(&real).unwrap();
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&real, &link).unwrap();
        assert!(Token::read(&link).is_err(), "a symbolic link was followed");
        let fifo = dir.path().join("fifo");
        let made = std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap();
        assert!(made.success());
        std::fs::set_permissions(&fifo, std::fs::Permissions::from_mode(0o600)).unwrap();
        let t = std::time::Instant::now();
        assert!(matches!(Token::read(&fifo), Err(TokenError::NotAFile(_))));
        assert!(t.elapsed() < std::time::Duration::from_secs(5));
        assert!(matches!(
            Token::read(dir.path()),
            Err(TokenError::NotAFile(_)) | Err(TokenError::Io { .. })
        ));
    }
}

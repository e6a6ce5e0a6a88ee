//! The farm's results file: one JSON line per input, each line in the file whole or not at all.
//!
//! Lines gather in a buffer and go to the file in batches. If a write fails part way (a full
//! disk, a file size limit), the file is cut back to the end of the last whole line, so a reader
//! never meets a torn line, and the error names the file.

use std::io::Write;
use std::path::{Path, PathBuf};

use crate::error::{ConfigError, Error};

/// Bytes gathered before they are written.
const BATCH: usize = 8 * 1024;

pub struct ResultsFile {
    path: PathBuf,
    file: std::fs::File,
    buf: Vec<u8>,
    /// Bytes in the file, all of them whole lines.
    committed: u64,
    lines: u64,
    pending_lines: u64,
}

impl ResultsFile {
    /// Creates (or empties) the file at `path`.
    pub fn create(path: &Path) -> Result<ResultsFile, Error> {
        let file = std::fs::File::create(path).map_err(|source| ConfigError::Output {
            path: path.to_path_buf(),
            source,
        })?;
        Ok(ResultsFile {
            path: path.to_path_buf(),
            file,
            buf: Vec::with_capacity(BATCH),
            committed: 0,
            lines: 0,
            pending_lines: 0,
        })
    }

    /// Adds one line (without its newline).
    pub fn push(&mut self, line: &str) -> Result<(), Error> {
        self.buf.extend_from_slice(line.as_bytes());
        self.buf.push(b'\n');
        self.pending_lines += 1;
        if self.buf.len() >= BATCH {
            self.flush()?;
        }
        Ok(())
    }

    /// Writes what is gathered. On failure the file keeps only its whole lines.
    pub fn flush(&mut self) -> Result<(), Error> {
        if self.buf.is_empty() {
            return Ok(());
        }
        match self.file.write_all(&self.buf) {
            Ok(()) => {
                self.committed += self.buf.len() as u64;
                self.lines += self.pending_lines;
                self.pending_lines = 0;
                self.buf.clear();
                Ok(())
            }
            Err(e) => {
                let cut = self.file.set_len(self.committed);
                Err(Error::Results(format!(
                    "writing results to {} failed: {e}; {}",
                    self.path.display(),
                    match cut {
                        Ok(()) => format!(
                            "it holds the first {} results, each line whole (free space, or raise the file size limit, and run again)",
                            self.lines
                        ),
                        Err(c) => format!("and cutting it back to its whole lines failed too: {c}"),
                    }
                )))
            }
        }
    }
}

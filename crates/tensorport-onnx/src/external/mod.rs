//! A model's bytes as ONNX Runtime gets them. The server reads the model file once, and every
//! tensor whose data lies in another file ("external data") it reads itself and puts into the
//! model in place of the reference, so ONNX Runtime is handed one self-contained model in memory
//! and opens no file of its own, whatever its version:
//!
//! - a data file is taken only from the model's own folder: its `location` is a relative path
//!   without `..`, which resolved (symbolic links followed) still lies in that folder, and is a
//!   regular file (no FIFO, device or folder); each refusal names the tensor and the file;
//! - the bytes are read, not mapped, so a file rewritten or truncated under a running server
//!   cannot take the server down; its size, inode and time are kept ([`Stamp`]) so such a
//!   change can be noticed and named;
//! - the model and its data together are at most [`MAX_MODEL_BYTES`] (protobuf's limit for
//!   one message), checked before anything is read.
//!
//! Every message of the model that can hold a tensor is walked ([`Kind`]): graphs, their
//! initializers and sparse initializers, nodes' attributes (tensors and subgraphs, to any
//! depth up to [`MAX_DEPTH`]), functions and training graphs.

use std::fs::File;
use std::io::Read;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::path::{Component, Path, PathBuf};

use crate::proto::{put_bytes, Fields, Value};
use crate::spec::MAX_MODEL_BYTES;
use crate::{Error, Result};

/// Nesting of subgraphs walked before a model is refused.
pub const MAX_DEPTH: usize = 64;

/// A file the model was read from, as it was then.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stamp {
    pub path: PathBuf,
    len: u64,
    ino: u64,
    mtime: (i64, i64),
}

impl Stamp {
    fn of(path: &Path, meta: &std::fs::Metadata) -> Stamp {
        Stamp {
            path: path.to_owned(),
            len: meta.len(),
            ino: meta.ino(),
            mtime: (meta.mtime(), meta.mtime_nsec()),
        }
    }

    /// How the file differs from when it was read, if it does.
    pub fn change(&self) -> Option<String> {
        let meta = match std::fs::metadata(&self.path) {
            Ok(m) => m,
            Err(e) => return Some(format!("it is gone ({e})")),
        };
        let now = Stamp::of(&self.path, &meta);
        if now.len != self.len {
            Some(format!("{} bytes, {} when read", now.len, self.len))
        } else if now.ino != self.ino {
            Some("replaced by another file".into())
        } else if now.mtime != self.mtime {
            Some("written to".into())
        } else {
            None
        }
    }
}

/// A model read into memory with its external data.
#[derive(Debug)]
pub struct ModelBytes {
    /// The model, every tensor's data inside it.
    pub bytes: Vec<u8>,
    /// The model file, then each data file, as they were read.
    pub files: Vec<Stamp>,
}

/// Opens `path` for reading without blocking on a FIFO and without following a last
/// symbolic link; refuses anything but a regular file.
fn open_regular(path: &Path) -> std::io::Result<(File, std::fs::Metadata)> {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(nix::libc::O_NONBLOCK | nix::libc::O_NOFOLLOW)
        .open(path)?;
    let meta = f.metadata()?;
    if !meta.is_file() {
        return Err(std::io::Error::other("not a regular file"));
    }
    Ok((f, meta))
}

/// Reads the model at `path` and the external data it names.
pub fn read_model(path: &Path) -> Result<ModelBytes> {
    let unreadable = |source| Error::Unreadable {
        path: path.to_owned(),
        source,
    };
    let meta = std::fs::metadata(path).map_err(unreadable)?;
    if !meta.is_file() {
        return Err(Error::Unfit {
            path: path.to_owned(),
            why: "not a regular file".into(),
        });
    }
    if meta.len() > MAX_MODEL_BYTES {
        return Err(Error::TooLarge {
            path: path.to_owned(),
            size: meta.len(),
            limit: MAX_MODEL_BYTES,
        });
    }
    let (f, meta) = open_regular(path).map_err(unreadable)?;
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    f.take(MAX_MODEL_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(unreadable)?;
    if bytes.len() as u64 > MAX_MODEL_BYTES {
        return Err(Error::TooLarge {
            path: path.to_owned(),
            size: bytes.len() as u64,
            limit: MAX_MODEL_BYTES,
        });
    }
    let folder = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let mut walk = Walk {
        model: path,
        folder,
        root: None,
        total: bytes.len() as u64,
        files: vec![Stamp::of(path, &meta)],
    };
    // What is not well-formed protobuf is refused here: ONNX Runtime never sees a model whose
    // every tensor was not walked.
    let bytes = match walk.message(Kind::Model, &bytes, 0) {
        Ok(Some(inlined)) => inlined,
        Ok(None) => bytes,
        Err(Refusal::Malformed(m)) => {
            return Err(Error::Malformed {
                path: path.to_owned(),
                why: m.to_string(),
            })
        }
        Err(Refusal::Error(e)) => return Err(e),
    };
    Ok(ModelBytes {
        bytes,
        files: walk.files,
    })
}

/// The messages of an ONNX model that hold tensors, or hold messages that do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Model,
    Graph,
    Node,
    Attribute,
    Tensor,
    SparseTensor,
    Function,
    TrainingInfo,
}

impl Kind {
    /// The kind of field `number` of this message, where it can hold a tensor (onnx.proto).
    fn child(self, number: u32) -> Option<Kind> {
        use Kind::*;
        Some(match (self, number) {
            (Model, 7) => Graph,
            (Model, 20) => TrainingInfo,
            (Model, 25) => Function,
            (Graph, 1) => Node,
            (Graph, 5) => Tensor,
            (Graph, 15) => SparseTensor,
            (Node, 5) => Attribute,
            (Attribute, 5 | 10) => Tensor,
            (Attribute, 6 | 11) => Graph,
            (Attribute, 22 | 23) => SparseTensor,
            (SparseTensor, 1 | 2) => Tensor,
            (Function, 7) => Node,
            (Function, 11) => Attribute,
            (TrainingInfo, 1 | 2) => Graph,
            _ => return None,
        })
    }
}

// TensorProto's fields.
const NAME: u32 = 8;
const RAW_DATA: u32 = 9;
const EXTERNAL_DATA: u32 = 13;
const DATA_LOCATION: u32 = 14;
const EXTERNAL: u64 = 1;

enum Refusal {
    /// Not protobuf where the model's structure says a message is.
    Malformed(crate::proto::Malformed),
    Error(Error),
}

impl From<crate::proto::Malformed> for Refusal {
    fn from(m: crate::proto::Malformed) -> Refusal {
        Refusal::Malformed(m)
    }
}

impl From<Error> for Refusal {
    fn from(e: Error) -> Refusal {
        Refusal::Error(e)
    }
}

struct Walk<'p> {
    model: &'p Path,
    folder: &'p Path,
    /// The folder, resolved (once, when the first data file needs it).
    root: Option<PathBuf>,
    /// The model's bytes and the data read so far.
    total: u64,
    files: Vec<Stamp>,
}

impl Walk<'_> {
    /// `msg` (a message of `kind`) with every external tensor's data put in, or `None` where it
    /// has none.
    fn message(
        &mut self,
        kind: Kind,
        msg: &[u8],
        depth: usize,
    ) -> Result<Option<Vec<u8>>, Refusal> {
        if depth > MAX_DEPTH {
            return Err(self
                .refuse(None, format!("subgraphs nested over {MAX_DEPTH} deep"))
                .into());
        }
        if kind == Kind::Tensor {
            return self.tensor(msg);
        }
        let mut fields = Fields::new(msg);
        let mut out: Option<Vec<u8>> = None;
        let mut copied = 0;
        while let Some(f) = fields.next_field()? {
            let changed = match (kind.child(f.number), f.value) {
                (Some(k), Value::Bytes(b)) => self.message(k, b, depth + 1)?,
                _ => None,
            };
            match (changed, &mut out) {
                (Some(new), out) => {
                    let o = out.get_or_insert_with(|| msg[..copied].to_vec());
                    put_bytes(o, f.number, &new);
                }
                (None, Some(o)) => o.extend_from_slice(f.raw),
                (None, None) => {}
            }
            copied += f.raw.len();
        }
        Ok(out)
    }

    /// A tensor with its external data read in as `raw_data`, or `None` where its data is
    /// inside it.
    fn tensor(&mut self, msg: &[u8]) -> Result<Option<Vec<u8>>, Refusal> {
        let mut fields = Fields::new(msg);
        let (mut name, mut external, mut raw) = (None, false, false);
        let mut entries: Vec<(&[u8], &[u8])> = Vec::new();
        while let Some(f) = fields.next_field()? {
            match (f.number, f.value) {
                (NAME, Value::Bytes(b)) => name = Some(String::from_utf8_lossy(b).into_owned()),
                (DATA_LOCATION, Value::Varint(v)) => external = v == EXTERNAL,
                (RAW_DATA, _) => raw = true,
                (EXTERNAL_DATA, Value::Bytes(b)) => {
                    let (mut key, mut value): (&[u8], &[u8]) = (b"", b"");
                    let mut kv = Fields::new(b);
                    while let Some(e) = kv.next_field()? {
                        match (e.number, e.value) {
                            (1, Value::Bytes(k)) => key = k,
                            (2, Value::Bytes(v)) => value = v,
                            _ => {}
                        }
                    }
                    entries.push((key, value));
                }
                _ => {}
            }
        }
        if !external {
            return Ok(None);
        }
        if raw {
            return Err(self
                .refuse(name, "holds its data and names an external file too".into())
                .into());
        }
        let data = self.external(name.as_deref(), &entries)?;
        let mut out = Vec::with_capacity(msg.len() + data.len() + 16);
        let mut fields = Fields::new(msg);
        while let Some(f) = fields.next_field()? {
            if ![EXTERNAL_DATA, DATA_LOCATION].contains(&f.number) {
                out.extend_from_slice(f.raw);
            }
        }
        put_bytes(&mut out, RAW_DATA, &data);
        Ok(Some(out))
    }

    fn refuse(&self, tensor: Option<String>, why: String) -> Error {
        Error::ExternalData {
            path: self.model.to_owned(),
            tensor: tensor.unwrap_or_else(|| "(unnamed)".into()),
            why,
        }
    }

    /// The bytes an external tensor's `location`, `offset` and `length` name, from a file in
    /// the model's folder.
    fn external(&mut self, name: Option<&str>, entries: &[(&[u8], &[u8])]) -> Result<Vec<u8>> {
        let model = self.model;
        let refuse = |why: String| Error::ExternalData {
            path: model.to_owned(),
            tensor: name.unwrap_or("(unnamed)").to_owned(),
            why,
        };
        let get = |key: &[u8]| entries.iter().rev().find(|(k, _)| *k == key).map(|e| e.1);
        let number = |key: &str| -> Result<Option<u64>> {
            get(key.as_bytes())
                .map(|v| {
                    std::str::from_utf8(v)
                        .ok()
                        .and_then(|s| s.trim().parse::<u64>().ok())
                        .ok_or_else(|| {
                            refuse(format!(
                                "its {key} {:?} is not a number",
                                String::from_utf8_lossy(v)
                            ))
                        })
                })
                .transpose()
        };
        let location = get(b"location")
            .ok_or_else(|| refuse("names no external data file (no location)".into()))?;
        let shown = String::from_utf8_lossy(location).into_owned();
        let location = std::str::from_utf8(location)
            .ok()
            .filter(|l| !l.is_empty() && !l.contains('\0'))
            .ok_or_else(|| refuse(format!("its data file {shown:?} is no file name")))?;
        let rel = Path::new(location);
        if !rel
            .components()
            .all(|c| matches!(c, Component::Normal(_) | Component::CurDir))
        {
            return Err(refuse(format!(
                "its data file {location:?} is not a path inside the model's folder (an \
                 absolute path or one with ..); external data is read only from the model's \
                 own folder"
            )));
        }
        let root = match &self.root {
            Some(r) => r.clone(),
            None => {
                let r = self
                    .folder
                    .canonicalize()
                    .map_err(|e| refuse(format!("the model's folder cannot be resolved: {e}")))?;
                self.root = Some(r.clone());
                r
            }
        };
        let file = self.folder.join(rel);
        let resolved = file
            .canonicalize()
            .map_err(|e| refuse(format!("its data file {}: {e}", file.display())))?;
        if !resolved.starts_with(&root) {
            return Err(refuse(format!(
                "its data file {} leads outside the model's folder (to {}, through a symbolic \
                 link); external data is read only from the model's own folder",
                file.display(),
                resolved.display()
            )));
        }
        let (f, meta) = open_regular(&resolved)
            .map_err(|e| refuse(format!("its data file {}: {e}", file.display())))?;
        let offset = number("offset")?.unwrap_or(0);
        let length = match number("length")? {
            Some(n) => n,
            None => meta.len().saturating_sub(offset),
        };
        if offset
            .checked_add(length)
            .is_none_or(|end| end > meta.len())
        {
            return Err(refuse(format!(
                "its data ({length} bytes from byte {offset}) runs past the end of {} ({} bytes)",
                file.display(),
                meta.len()
            )));
        }
        self.total += length;
        if self.total > MAX_MODEL_BYTES {
            return Err(Error::TooLarge {
                path: self.model.to_owned(),
                size: self.total,
                limit: MAX_MODEL_BYTES,
            });
        }
        let mut data = vec![0u8; length as usize];
        f.read_exact_at(&mut data, offset)
            .map_err(|e| refuse(format!("reading {}: {e}", file.display())))?;
        if !self.files.iter().any(|s| s.path == file) {
            self.files.push(Stamp::of(&file, &meta));
        }
        Ok(data)
    }
}

#[cfg(test)]
mod tests;

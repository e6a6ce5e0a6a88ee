//! What can go wrong, per kind of cause a caller can act on.

/// An error from NIXL or from a peer's description of its memory.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// NIXL's C API is not on this machine (the message says how to get it).
    #[error("{0}")]
    NotLoaded(String),
    /// A NIXL call failed (`status` is NIXL's; NIXL logs the details on standard error). A
    /// transfer from a peer that died fails this way.
    #[error("NIXL's {call} failed (status {status})")]
    Call { call: &'static str, status: i32 },
    /// A peer's metadata or memory layout is out of bounds, or a read names memory outside it.
    #[error("refused: {0}")]
    Refused(&'static str),
    /// UCX_TLS names no CUDA transport on a host with NVIDIA GPUs, where NIXL's UCX backend
    /// refuses to start.
    #[error("NIXL's UCX backend refused UCX_TLS={0}: on a host with NVIDIA GPUs add cuda_copy (e.g. UCX_TLS={0},cuda_copy), or leave UCX_TLS unset")]
    Transports(String),
    /// The GPU side failed: device memory could not be allocated, copied or handed over.
    #[error("the GPU: {0}")]
    Cuda(String),
    /// A setting in the environment does not parse (the message names it and what it takes).
    #[error("{0}")]
    Setting(String),
    /// A transfer did not finish in time.
    #[error("a transfer from {peer} did not finish within {ms} ms")]
    Stalled { peer: String, ms: u128 },
}

/// `Result` with [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

//! Where an MPS control daemon is reached: the variables a CUDA process reads, and whether a
//! daemon answers at a pipe directory.

use std::path::Path;

/// The variable naming the pipe directory of the daemon a CUDA process joins.
pub const PIPE_ENV: &str = "CUDA_MPS_PIPE_DIRECTORY";
/// The variable naming the daemon's log directory.
pub const LOG_ENV: &str = "CUDA_MPS_LOG_DIRECTORY";
/// Where a daemon started without [`PIPE_ENV`] keeps its pipes.
pub const DEFAULT_PIPE_DIR: &str = "/tmp/nvidia-mps";

/// Whether a control daemon answers at `pipe`: its `control` endpoint is there, a Unix socket
/// (the CUDA 13 daemon's) or a FIFO (older daemons').
pub fn daemon_at(pipe: &Path) -> bool {
    use std::os::unix::fs::FileTypeExt;
    std::fs::symlink_metadata(pipe.join("control")).is_ok_and(|m| {
        let t = m.file_type();
        t.is_socket() || t.is_fifo()
    })
}

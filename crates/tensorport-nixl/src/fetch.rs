//! NIXL for this checkout's tests and benchmarks: `scripts/fetch-nixl.sh` into `target/nixl`,
//! where [`Capi::load`](crate::Capi::load) looks.

use std::path::{Path, PathBuf};
use std::process::Command;

/// Runs the checkout's `scripts/fetch-nixl.sh` (at most 5 minutes; it does nothing when the wheel
/// is already unpacked) and gives the folder, or the script's reason it could not.
pub fn fetch_into_checkout() -> Result<PathBuf, String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let dest = root.join("target/nixl");
    let out = Command::new("timeout")
        .args(["300", "bash"])
        .arg(root.join("scripts/fetch-nixl.sh"))
        .arg(&dest)
        .output()
        .map_err(|e| format!("cannot run bash: {e}"))?;
    if out.status.success() {
        Ok(dest)
    } else {
        Err(String::from_utf8_lossy(&out.stderr).trim().to_string())
    }
}

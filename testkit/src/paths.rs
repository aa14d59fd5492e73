//! Where the workspace and cargo's target directory are, for tests run from any checkout.

use std::path::{Path, PathBuf};

/// The workspace's root directory: the parent of the package directory cargo (or nextest)
/// names in `CARGO_MANIFEST_DIR` when it runs a test, else of this crate's at build time.
///
/// The run-time value comes first because test binaries in a target directory shared between
/// checkouts (CI's `CARGO_TARGET_DIR`) can be reused by a checkout other than the one that
/// built them; a path baked in at build time then names the other checkout's files, or none.
pub fn workspace_root() -> PathBuf {
    let manifest = std::env::var_os("CARGO_MANIFEST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")));
    manifest.parent().unwrap_or(&manifest).to_path_buf()
}

/// Cargo's target directory of the running test or benchmark (the ancestor of the executable
/// that holds `CACHEDIR.TAG`), else `<workspace>/target`.
pub fn target_dir() -> PathBuf {
    std::env::current_exe()
        .ok()
        .and_then(|exe| {
            exe.ancestors()
                .find(|d| d.join("CACHEDIR.TAG").is_file())
                .map(Path::to_path_buf)
        })
        .unwrap_or_else(|| workspace_root().join("target"))
}

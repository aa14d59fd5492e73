//! The default model for tests and benchmarks.

use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

use crate::kube::workspace_root;

/// Path of the default model, fetched by `scripts/fetch-model.sh` (the same script users run)
/// unless `FERRITE_MODEL` points elsewhere. Panics with the script's error when it fails: a
/// test without its model cannot say anything.
pub fn default_model() -> PathBuf {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        if let Ok(p) = std::env::var("FERRITE_MODEL") {
            return PathBuf::from(p);
        }
        let out = Command::new("bash")
            .arg(workspace_root().join("scripts/fetch-model.sh"))
            .output()
            .expect("run scripts/fetch-model.sh");
        assert!(
            out.status.success(),
            "fetch-model.sh failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        PathBuf::from(String::from_utf8_lossy(&out.stdout).trim().to_string())
    })
    .clone()
}

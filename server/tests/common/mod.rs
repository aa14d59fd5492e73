//! Shared helpers for tests that need the default model.
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

/// Path of the default model, fetched by `scripts/fetch-model.sh` (the same script users run)
/// unless `FERRITE_MODEL` points elsewhere.
pub fn default_model() -> PathBuf {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        if let Ok(p) = std::env::var("FERRITE_MODEL") {
            return PathBuf::from(p);
        }
        let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
        let out = Command::new("bash")
            .arg(root.join("scripts/fetch-model.sh"))
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

//! The default model for tests and benchmarks.

use std::path::PathBuf;
use std::sync::OnceLock;

use crate::tools::tool_path;

/// Path of the default model, fetched by `scripts/fetch-model.sh` (the same script users run)
/// unless `FERRITE_MODEL` points elsewhere. Panics with the script's error when it fails: a
/// test without its model cannot say anything.
pub fn default_model() -> PathBuf {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| PathBuf::from(tool_path("FERRITE_MODEL", "fetch-model.sh")))
        .clone()
}

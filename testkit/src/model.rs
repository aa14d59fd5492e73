//! The default model for tests and benchmarks.

use std::hash::{Hash, Hasher};
use std::path::PathBuf;
use std::process::Command;
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

/// The folder `scripts/lora-adapter.py --seed SEED` wrote for the default model (`peft/` and
/// `adapter.gguf`), made once per version of the script next to the model.
pub fn lora_adapter_dir(seed: u64) -> PathBuf {
    let src = default_model();
    let script = crate::kube::workspace_root().join("scripts/lora-adapter.py");
    let text = std::fs::read(&script).expect("scripts/lora-adapter.py");
    let mut h = std::hash::DefaultHasher::new();
    text.hash(&mut h);
    let out = src.with_file_name(format!("lora-{:016x}-seed{seed}", h.finish()));
    if !out.join("adapter.gguf").exists() {
        // Tests run in parallel processes: each writes its own copy and the first to finish
        // puts it in place.
        let partial = out.with_extension(format!("partial-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&partial);
        let status = Command::new(crate::tools::python())
            .arg(&script)
            .arg(&partial)
            .arg("--model")
            .arg(&src)
            .arg("--seed")
            .arg(seed.to_string())
            .status()
            .expect("run scripts/lora-adapter.py");
        assert!(status.success(), "scripts/lora-adapter.py failed: {status}");
        if std::fs::rename(&partial, &out).is_err() {
            assert!(
                out.join("adapter.gguf").exists(),
                "could not put {} in place",
                out.display()
            );
            let _ = std::fs::remove_dir_all(&partial);
        }
    }
    out
}

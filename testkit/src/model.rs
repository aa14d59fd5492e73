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
    let seed = seed.to_string();
    generated(
        "scripts/lora-adapter.py",
        &format!("lora-{{hash}}-seed{seed}"),
        "adapter.gguf",
        |partial| vec![partial.into(), "--seed".into(), seed.clone().into()],
    )
}

/// The folder holding `scripts/gguf-variants.py VARIANT`'s checkpoint of the default model,
/// `model.gguf`, and with `hf` its Hugging Face form in `hf/`; made once per version of the
/// script next to the model.
pub fn gguf_variant(variant: &str, hf: bool) -> PathBuf {
    let kind = if hf { "gguf-hf" } else { "gguf" };
    generated(
        "scripts/gguf-variants.py",
        &format!("{variant}-{{hash}}-{kind}"),
        "model.gguf",
        |partial| {
            let mut args: Vec<std::ffi::OsString> =
                vec![variant.into(), partial.join("model.gguf").into()];
            if hf {
                args.extend(["--hf".into(), partial.join("hf").into()]);
            }
            args
        },
    )
}

/// Runs `script` (a Python script of the workspace, given `--model` and the default model, and
/// the arguments `args` makes of the folder to write) once per version of the script: its
/// output is the folder `name` (where `{hash}` stands for the script's hash) next to the default
/// model, done when it holds `marker`. Tests run in parallel processes: each writes its own
/// copy and the first to finish puts it in place. Folders of the script's earlier versions are
/// removed (checkpoints take hundreds of megabytes each).
fn generated(
    script: &str,
    name: &str,
    marker: &str,
    args: impl Fn(&std::path::Path) -> Vec<std::ffi::OsString>,
) -> PathBuf {
    let src = default_model();
    let script_path = crate::paths::workspace_root().join(script);
    let text = std::fs::read(&script_path).unwrap_or_else(|e| panic!("{script}: {e}"));
    let mut h = std::hash::DefaultHasher::new();
    text.hash(&mut h);
    let out = src.with_file_name(name.replace("{hash}", &format!("{:016x}", h.finish())));
    if out.join(marker).exists() {
        return out;
    }
    let partial = out.with_extension(format!("partial-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&partial);
    std::fs::create_dir_all(&partial).expect("create the output folder");
    let status = Command::new(crate::tools::python())
        .arg(&script_path)
        .args(args(&partial))
        .arg("--model")
        .arg(&src)
        .status()
        .unwrap_or_else(|e| panic!("run {script}: {e}"));
    assert!(status.success(), "{script} failed: {status}");
    if std::fs::rename(&partial, &out).is_err() {
        assert!(
            out.join(marker).exists(),
            "could not put {} in place",
            out.display()
        );
        let _ = std::fs::remove_dir_all(&partial);
    }
    remove_stale(&out, name);
    out
}

/// Removes the siblings of `out` that match the name pattern `name` with another hash.
fn remove_stale(out: &std::path::Path, name: &str) {
    let (Some(dir), Some((before, after))) = (out.parent(), name.split_once("{hash}")) else {
        return;
    };
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for path in entries.flatten().map(|e| e.path()) {
        let file = path.file_name().unwrap_or_default().to_string_lossy();
        let hash = file
            .strip_prefix(before)
            .and_then(|rest| rest.strip_suffix(after));
        let is_hash =
            hash.is_some_and(|h| h.len() == 16 && h.bytes().all(|b| b.is_ascii_hexdigit()));
        if is_hash && path != out {
            let _ = std::fs::remove_dir_all(&path);
        }
    }
}

//! Runs operator/tests/python/validate.py (Kubernetes' own schemas through PyPI
//! `kubernetes-validate`, strict) on objects the build step makes.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// `FERRITE_TEST_PYTHON` if set, else the venv python `scripts/python-env.sh` prints.
pub fn python() -> String {
    if let Ok(p) = std::env::var("FERRITE_TEST_PYTHON") {
        return p;
    }
    let out = Command::new("bash")
        .arg(root().join("scripts/python-env.sh"))
        .output()
        .unwrap_or_else(|e| panic!("run scripts/python-env.sh: {e}"));
    assert!(
        out.status.success(),
        "python-env.sh failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// A fresh directory for this test process.
pub fn temp_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("ferrite-validate-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&d).expect("temp dir");
    d
}

/// Writes `docs` as one multi-document YAML file.
pub fn write_yaml(dir: &Path, name: &str, docs: &[Value]) -> PathBuf {
    let text: String = docs
        .iter()
        .map(|d| format!("---\n{}", serde_yaml_ng::to_string(d).expect("yaml")))
        .collect();
    let p = dir.join(name);
    std::fs::write(&p, text).expect("write");
    p
}

/// Validates every document in `files` against Kubernetes `version` (e.g. "1.32.0");
/// returns (all passed, the validator's output: one `ok`/`FAIL` line per document).
pub fn kubernetes(version: &str, files: &[PathBuf]) -> (bool, String) {
    let mut cmd = Command::new(python());
    cmd.arg(root().join("operator/tests/python/validate.py"))
        .args(["k8s", version])
        .args(files);
    let out = cmd.output().unwrap_or_else(|e| panic!("run {cmd:?}: {e}"));
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

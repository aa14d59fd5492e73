//! Runs the schema validators on objects the operator's build step and the chart make:
//! testkit/python/validate.py (Kubernetes' own schemas through PyPI `kubernetes-validate`,
//! strict; or a CRD's schema) and the npm models of custom resources
//! (testkit/node/validate-crd-objects.mjs).

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

use crate::paths::workspace_root;
use crate::tools::{node_modules, python};

/// Runs a validator; returns (success, stdout and stderr).
pub fn run_validator(cmd: &mut Command) -> (bool, String) {
    let out = cmd.output().unwrap_or_else(|e| panic!("run {cmd:?}: {e}"));
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

/// Runs validate.py in `mode` (`k8s` with a version, or `crd` with a CRD file) on `files`;
/// its output has one `ok`/`FAIL` line per document.
pub fn validate(mode: &str, target: &str, files: &[PathBuf]) -> (bool, String) {
    run_validator(
        Command::new(python())
            .arg(workspace_root().join("testkit/python/validate.py"))
            .args([mode, target])
            .args(files),
    )
}

/// Validates custom resources (one JSON object per file) with their CRDs' npm models
/// (testkit/node/validate-crd-objects.mjs: ServiceMonitor, PrometheusRule, Certificate,
/// Issuer); its output has one `ok FILE KIND` or `invalid FILE: why` line per file.
pub fn custom_resources(files: &[PathBuf]) -> (bool, String) {
    run_validator(
        Command::new("node")
            .arg(workspace_root().join("testkit/node/validate-crd-objects.mjs"))
            .arg(node_modules())
            .args(files),
    )
}

/// Validates every document in `files` against Kubernetes `version` (e.g. "1.32.0").
pub fn kubernetes(version: &str, files: &[PathBuf]) -> (bool, String) {
    validate("k8s", version, files)
}

/// A directory for this test process (nextest runs each test in its own). The first call also
/// removes the directories of test processes that have ended, so runs do not pile them up in
/// /tmp (nearly a thousand were found after a day's runs); a failed run's files stay until the
/// next run, to be read.
pub fn temp_dir(tag: &str) -> PathBuf {
    static SWEEP: std::sync::Once = std::sync::Once::new();
    SWEEP.call_once(remove_ended_processes_dirs);
    let d = std::env::temp_dir().join(format!("ferrite-validate-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&d).expect("temp dir");
    d
}

/// Removes `ferrite-validate-*-PID` directories whose process no longer runs.
fn remove_ended_processes_dirs() {
    // Without /proc (not Linux) nothing can be told ended.
    if !Path::new("/proc/self").exists() {
        return;
    }
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(rest) = name
            .to_str()
            .and_then(|n| n.strip_prefix("ferrite-validate-"))
        else {
            continue;
        };
        let Some(pid) = rest.rsplit('-').next().and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        let ended = !Path::new(&format!("/proc/{pid}")).exists();
        if ended && pid != std::process::id() {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
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

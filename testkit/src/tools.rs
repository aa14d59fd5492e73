//! Paths the project's setup scripts print (the test Python venv, node modules, the model),
//! unless an environment variable names one already.

use std::process::Command;

use crate::paths::workspace_root;

/// `$env` if set, else what `scripts/<script>` prints (it installs on first use). Panics with
/// the script's error when it fails: a test without its tool cannot say anything.
pub fn tool_path(env: &str, script: &str) -> String {
    if let Ok(p) = std::env::var(env) {
        return p;
    }
    let out = Command::new("bash")
        .arg(workspace_root().join("scripts").join(script))
        .output()
        .unwrap_or_else(|e| panic!("run scripts/{script}: {e}"));
    assert!(
        out.status.success(),
        "{script} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// The venv's python with the official `openai` client, the Helm SDK and the validators
/// (`FERRITE_TEST_PYTHON`, else `scripts/python-env.sh`).
pub fn python() -> String {
    tool_path("FERRITE_TEST_PYTHON", "python-env.sh")
}

/// The npm packages the manifest and dashboard validators load (`FERRITE_NODE_MODULES`, else
/// `scripts/node-env.sh`).
pub fn node_modules() -> String {
    tool_path("FERRITE_NODE_MODULES", "node-env.sh")
}

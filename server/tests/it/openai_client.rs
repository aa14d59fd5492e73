//! The official `openai` Python client (PyPI) against the real binary: runs the pytest suite in
//! `tests/python/`, which starts the server on 127.0.0.1 itself. Two halves, so that nextest
//! runs them side by side (the whole suite was the longest test of the workspace).

use ferrite_testkit::paths::workspace_root;
use std::process::Command;

/// Runs pytest over `args` (files, or `--ignore` options) in `tests/python`.
fn pytest(args: &[&str]) {
    let dir = workspace_root().join("server/tests/python");
    let out = Command::new(ferrite_testkit::tools::python())
        .args(["-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE"])
        .args(args)
        .current_dir(&dir)
        .env("FERRITE_SERVER_BIN", env!("CARGO_BIN_EXE_ferrite-server"))
        .env("FERRITE_MODEL", ferrite_testkit::model::default_model())
        .output()
        .expect("run pytest");
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}");
    eprintln!("{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "pytest failed:\n{stdout}");
    // A suite that collected nothing must not pass silently.
    assert!(stdout.contains(" passed"), "no tests ran:\n{stdout}");
}

/// Structured outputs and tool calling.
const GRAMMAR_FILES: [&str; 2] = ["test_structured.py", "test_tools.py"];

#[test]
fn openai_python_client_suite() {
    let ignore: Vec<String> = GRAMMAR_FILES
        .iter()
        .map(|f| format!("--ignore={f}"))
        .collect();
    let mut args: Vec<&str> = ignore.iter().map(String::as_str).collect();
    args.push(".");
    pytest(&args);
}

#[test]
fn openai_python_client_structured_outputs_and_tools() {
    pytest(&GRAMMAR_FILES);
}

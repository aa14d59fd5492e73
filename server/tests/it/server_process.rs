//! The real binary on 127.0.0.1: readiness gating, model listing, and SIGTERM shutdown.

use crate::common;

use common::server::{free_port, start};

use std::process::Command;
use std::time::Duration;

#[test]
fn serves_probes_and_models_then_exits_cleanly_on_sigterm() {
    let mut s = start(&[]);
    let seen = s.wait_ready();
    assert_eq!(seen.last(), Some(&200));
    assert!(seen.iter().all(|&c| c == 200 || c == 503), "{seen:?}");

    let models: serde_json::Value = ureq::get(&format!("{}/v1/models", s.base))
        .call()
        .expect("models")
        .into_json()
        .expect("json");
    assert_eq!(models["object"], "list");
    assert_eq!(models["data"][0]["id"], "smol");
    assert_eq!(models["data"][0]["max_model_len"], 8192);
    let version: serde_json::Value = ureq::get(&format!("{}/version", s.base))
        .call()
        .expect("version")
        .into_json()
        .expect("json");
    assert_eq!(version["version"], env!("CARGO_PKG_VERSION"));

    s.sigterm();
    let status = s.wait_exit(Duration::from_secs(30));
    assert!(status.success(), "exit status after SIGTERM: {status}");
}

/// Runs the binary to completion on 127.0.0.1, expecting it to fail; returns its stderr.
fn run_failing(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_ferrite-server"))
        .args(args)
        .args(["--host", "127.0.0.1", "--port", &free_port().to_string()])
        .output()
        .expect("run");
    assert!(!out.status.success(), "expected failure for {args:?}");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn bad_model_path_exits_with_a_clear_error() {
    let err = run_failing(&["--model", "/nonexistent/model.gguf"]);
    assert!(err.contains("/nonexistent/model.gguf"), "{err}");
}

#[test]
fn cuda_device_without_the_feature_is_refused() {
    if cfg!(feature = "cuda") {
        return;
    }
    let model = ferrite_testkit::model::default_model();
    let err = run_failing(&[
        "--model",
        model.to_str().expect("utf-8"),
        "--device",
        "cuda:0",
    ]);
    assert!(err.contains("--features cuda"), "{err}");
}

/// A `--lora-modules` adapter that cannot be loaded stops the start, as in vLLM, and the
/// termination message (what Kubernetes shows) names the adapter and why.
#[test]
fn an_adapter_that_does_not_load_stops_the_start_with_the_reason() {
    let model = ferrite_testkit::model::default_model();
    let dir = std::env::temp_dir().join(format!("ferrite-lora-term-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let message = dir.join("termination-log");
    std::fs::write(&message, "").expect("empty termination log");
    let err = run_failing(&[
        "--model",
        model.to_str().expect("utf-8"),
        "--lora-modules",
        "sql=/nonexistent/sql-adapter",
        "--termination-message-path",
        message.to_str().expect("utf-8"),
    ]);
    assert!(err.contains("LoRA adapter sql"), "{err}");
    let written = std::fs::read_to_string(&message).expect("termination log");
    assert!(
        written.starts_with("ModelLoadFailed: LoRA adapter sql")
            && written.contains("/nonexistent/sql-adapter"),
        "{written}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

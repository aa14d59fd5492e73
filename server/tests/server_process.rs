//! The real binary on 127.0.0.1: readiness gating, model listing, and SIGTERM shutdown.

mod common;

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}

struct Server {
    child: Child,
    base: String,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start(extra: &[&str]) -> Server {
    let port = free_port();
    let child = Command::new(env!("CARGO_BIN_EXE_ferrite-server"))
        .args([
            "--model",
            common::default_model().to_str().expect("utf-8 path"),
        ])
        .args(["--host", "127.0.0.1", "--port", &port.to_string()])
        .args(["--served-model-name", "smol", "--kv-cache-memory", "64MiB"])
        .args(extra)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn ferrite-server");
    Server {
        child,
        base: format!("http://127.0.0.1:{port}"),
    }
}

fn wait_ready(s: &mut Server) -> Vec<u16> {
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut seen = Vec::new();
    while Instant::now() < deadline {
        if let Some(status) = s.child.try_wait().expect("try_wait") {
            panic!("server exited early with {status}");
        }
        match ureq::get(&format!("{}/health", s.base)).call() {
            Ok(r) => {
                seen.push(r.status());
                return seen;
            }
            Err(ureq::Error::Status(code, _)) => seen.push(code),
            Err(_) => {}
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("server not ready in time; statuses seen {seen:?}");
}

#[test]
fn serves_probes_and_models_then_exits_cleanly_on_sigterm() {
    let mut s = start(&[]);
    let seen = wait_ready(&mut s);
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

    let pid = s.child.id().to_string();
    let st = Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .expect("kill");
    assert!(st.success());
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(status) = s.child.try_wait().expect("wait") {
            assert!(status.success(), "exit status after SIGTERM: {status}");
            break;
        }
        assert!(Instant::now() < deadline, "no exit after SIGTERM");
        std::thread::sleep(Duration::from_millis(50));
    }
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
    let model = common::default_model();
    let err = run_failing(&[
        "--model",
        model.to_str().expect("utf-8"),
        "--device",
        "cuda:0",
    ]);
    assert!(err.contains("--features cuda"), "{err}");
}

//! Real ferrite-server processes for operator tests: the workspace's binary on the default
//! model, on 127.0.0.1, with a client that loads them.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct Server {
    pub child: Child,
    pub base: String,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}

/// The workspace's ferrite-server binary, built beside this test by `cargo nextest run
/// --workspace`.
pub fn server_binary() -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    let dir = exe.parent().and_then(|d| d.parent()).expect("target dir");
    let bin = dir.join("ferrite-server");
    assert!(
        bin.exists(),
        "{} is missing: run the tests with `cargo nextest run --workspace`",
        bin.display()
    );
    bin
}

pub fn model() -> String {
    if let Ok(p) = std::env::var("FERRITE_MODEL") {
        return p;
    }
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let out = Command::new("bash")
        .arg(root.join("scripts/fetch-model.sh"))
        .output()
        .expect("run scripts/fetch-model.sh");
    assert!(out.status.success(), "fetch-model.sh failed");
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// A server that runs at most 2 sequences at once, so a handful of requests form a queue.
pub fn start_server() -> Server {
    start_server_at("127.0.0.1", free_port(), &[])
}

/// A server on `host:port` that runs at most 2 sequences at once, with `extra` flags.
pub fn start_server_at(host: &str, port: u16, extra: &[&str]) -> Server {
    let child = Command::new(server_binary())
        .args(["--model", &model()])
        .args(["--host", host, "--port", &port.to_string()])
        .args(["--served-model-name", "smol", "--max-num-seqs", "2"])
        .args(extra)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn ferrite-server");
    Server {
        child,
        base: format!("http://{host}:{port}"),
    }
}

pub fn wait_healthy(s: &mut Server) {
    let deadline = Instant::now() + Duration::from_secs(180);
    while Instant::now() < deadline {
        if let Some(status) = s.child.try_wait().expect("try_wait") {
            panic!("server exited early with {status}");
        }
        if ureq::get(&format!("{}/health", s.base)).call().is_ok() {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("server {} not healthy in time", s.base);
}

/// `n` concurrent completions against `base`, each generating `tokens` tokens.
pub fn load(base: &str, n: usize, tokens: u32) -> Vec<std::thread::JoinHandle<u16>> {
    (0..n)
        .map(|i| {
            let url = format!("{base}/v1/completions");
            std::thread::spawn(move || {
                let body = serde_json::json!({
                    "model": "smol",
                    "prompt": format!("Request {i}: write a long story about a lighthouse."),
                    "max_tokens": tokens,
                    "ignore_eos": true,
                    "temperature": 0.0,
                });
                match ureq::post(&url).send_json(body) {
                    Ok(r) => r.status(),
                    Err(ureq::Error::Status(code, _)) => code,
                    Err(_) => 0,
                }
            })
        })
        .collect()
}

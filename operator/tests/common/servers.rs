//! Real ferrite-server processes for operator tests (ferrite-testkit's launcher, on the
//! default model), with a client that loads them.

use std::process::Stdio;

pub use ferrite_testkit::process::free_port;
pub use ferrite_testkit::server::Server;
use ferrite_testkit::server::binary;

/// A server that runs at most 2 sequences at once, so a handful of requests form a queue.
pub fn start_server() -> Server {
    start_server_at("127.0.0.1", free_port(), &[])
}

/// A server on `host:port` that runs at most 2 sequences at once, with `extra` flags.
pub fn start_server_at(host: &str, port: u16, extra: &[&str]) -> Server {
    let mut flags = vec!["--max-num-seqs", "2"];
    flags.extend_from_slice(extra);
    Server::spawn(&binary(), host, port, &flags, Stdio::null())
}

/// Waits until `/health` answers 200.
pub fn wait_healthy(s: &mut Server) {
    s.wait_ready();
}

/// [`start_server`], started and healthy (off the async runtime), and its port on 127.0.0.1.
pub async fn ready_server() -> (Server, u16) {
    let port = free_port();
    let s = tokio::task::spawn_blocking(move || {
        let mut s = start_server_at("127.0.0.1", port, &[]);
        wait_healthy(&mut s);
        s
    })
    .await
    .expect("server task");
    (s, port)
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

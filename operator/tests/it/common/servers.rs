//! Real ferrite-server processes for operator tests (ferrite-testkit's launcher, on the
//! default model), with a client that loads them.

use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

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

/// How long a [`Load`] runs at most if the test never finishes it.
const LOAD_LIMIT: Duration = Duration::from_secs(180);

/// A queue that lasts as long as the test needs it, however fast the engine is: `n` clients
/// each send completions of `tokens` tokens one after another until [`Load::finish`] (or drop).
/// A fixed batch of requests drained in about a second once the engine got faster, before a
/// 1 s scrape could see the queue.
#[derive(Debug)]
pub struct Load {
    stop: Arc<AtomicBool>,
    clients: Vec<JoinHandle<Vec<u16>>>,
}

impl Load {
    /// Starts the clients against `base`. Each stops at its first failed request, at
    /// [`LOAD_LIMIT`], or when the load is finished.
    pub fn start(base: &str, n: usize, tokens: u32) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let clients = (0..n)
            .map(|i| {
                let url = format!("{base}/v1/completions");
                let stop = stop.clone();
                std::thread::spawn(move || {
                    let started = Instant::now();
                    let mut statuses = Vec::new();
                    while !stop.load(Ordering::SeqCst) && started.elapsed() < LOAD_LIMIT {
                        let status = complete(&url, i, tokens);
                        statuses.push(status);
                        if status != 200 {
                            break;
                        }
                    }
                    statuses
                })
            })
            .collect();
        Load { stop, clients }
    }

    /// Stops sending, waits for the requests in flight, and returns every status (blocking).
    pub fn finish(mut self) -> Vec<u16> {
        self.stop.store(true, Ordering::SeqCst);
        std::mem::take(&mut self.clients)
            .into_iter()
            .flat_map(|c| c.join().expect("client thread"))
            .collect()
    }
}

impl Drop for Load {
    /// Clients finish the request they are in (or fail with a stopped server) and exit.
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

/// One completion of `tokens` tokens; its HTTP status, or 0 when the connection failed.
fn complete(url: &str, i: usize, tokens: u32) -> u16 {
    let body = serde_json::json!({
        "model": "smol",
        "prompt": format!("Request {i}: write a long story about a lighthouse."),
        "max_tokens": tokens,
        "ignore_eos": true,
        "temperature": 0.0,
    });
    match ureq::post(url).send_json(body) {
        Ok(r) => r.status(),
        Err(ureq::Error::Status(code, _)) => code,
        Err(_) => 0,
    }
}

//! The real ferrite-server binary on the default model (served as `smol`), on 127.0.0.1, for
//! tests that drive it over HTTP, and a parser for its `/metrics`; for the operator's and the
//! workspace's tests, servers that queue after 2 sequences and a [`Load`] that keeps them busy.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::model::default_model;
use crate::process::free_port;

/// A running ferrite-server, killed on drop.
#[derive(Debug)]
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

/// The workspace's ferrite-server binary, built beside the running test by `cargo nextest run
/// --workspace` (a test of the server crate itself passes `CARGO_BIN_EXE_ferrite-server`).
pub fn binary() -> PathBuf {
    workspace_binary("ferrite-server")
}

/// A binary of a workspace crate (`ferrite-server`, `ferrite-router`, `ferrite-operator`), built
/// beside the running test by `cargo nextest run --workspace`; a test cannot name another
/// crate's binary through `CARGO_BIN_EXE_*`, which covers only its own crate's.
pub fn workspace_binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    let dir = exe.parent().and_then(|d| d.parent()).expect("target dir");
    let bin = dir.join(name);
    assert!(
        bin.exists(),
        "{} is missing: run the tests with `cargo nextest run --workspace`",
        bin.display()
    );
    bin
}

impl Server {
    /// Starts `bin` on the default model at `host:port`, served as `smol`; `extra` flags come
    /// last.
    pub fn spawn(bin: &Path, host: &str, port: u16, extra: &[&str], stdout: Stdio) -> Server {
        Server::spawn_as(bin, "smol", host, port, extra, stdout)
    }

    /// [`Server::spawn`], serving the model under `name`.
    pub fn spawn_as(
        bin: &Path,
        name: &str,
        host: &str,
        port: u16,
        extra: &[&str],
        stdout: Stdio,
    ) -> Server {
        let child = Command::new(bin)
            .arg("--model")
            .arg(default_model())
            .args(["--host", host, "--port", &port.to_string()])
            .args(["--served-model-name", name])
            .args(extra)
            .stdout(stdout)
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn ferrite-server");
        Server {
            child,
            base: format!("http://{host}:{port}"),
        }
    }
}

impl Server {
    /// Polls `/health` until 200; returns every status seen on the way.
    pub fn wait_ready(&mut self) -> Vec<u16> {
        let deadline = Instant::now() + Duration::from_secs(180);
        let mut seen = Vec::new();
        while Instant::now() < deadline {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                panic!("server exited early with {status}");
            }
            match ureq::get(&format!("{}/health", self.base)).call() {
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

    pub fn sigterm(&self) {
        let st = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .expect("kill");
        assert!(st.success());
    }

    pub fn wait_exit(&mut self, within: Duration) -> ExitStatus {
        let deadline = Instant::now() + within;
        loop {
            if let Some(status) = self.child.try_wait().expect("wait") {
                return status;
            }
            assert!(Instant::now() < deadline, "no exit within {within:?}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The value of one metric sample on `/metrics` (the first whose line starts with
    /// `prefix`, e.g. `vllm:num_requests_running{`).
    pub fn metric(&self, prefix: &str) -> f64 {
        let text = ureq::get(&format!("{}/metrics", self.base))
            .call()
            .expect("metrics")
            .into_string()
            .expect("text");
        text.lines()
            .find(|l| l.starts_with(prefix))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no sample {prefix} in:\n{text}"))
    }

    /// Waits until `metric(prefix) == value`.
    pub fn wait_metric(&self, prefix: &str, value: f64, within: Duration) {
        let deadline = Instant::now() + within;
        loop {
            let v = self.metric(prefix);
            if v == value {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{prefix} is {v}, expected {value}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// One scrape of `/metrics`.
    pub fn scrape(&self) -> Metrics {
        let text = ureq::get(&format!("{}/metrics", self.base))
            .call()
            .expect("metrics")
            .into_string()
            .expect("text");
        Metrics::parse(text)
    }

    pub fn post(&self, path: &str, body: &serde_json::Value) -> ureq::Response {
        ureq::post(&format!("{}{path}", self.base))
            .send_json(body.clone())
            .unwrap_or_else(|e| panic!("POST {path}: {e}"))
    }
}

/// One scrape of `/metrics`, parsed into samples.
#[derive(Debug, Clone)]
pub struct Metrics {
    pub text: String,
    samples: Vec<(String, Labels, f64)>,
}

type Labels = Vec<(String, String)>;

impl Metrics {
    pub fn parse(text: String) -> Self {
        let samples = text
            .lines()
            .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
            .filter_map(|l| {
                let (series, value) = l.rsplit_once(' ')?;
                let value: f64 = value.parse().ok()?;
                let (name, labels) = match series.split_once('{') {
                    Some((n, rest)) => (n, rest.trim_end_matches('}')),
                    None => (series, ""),
                };
                let labels = labels
                    .split("\",")
                    .filter(|p| !p.is_empty())
                    .filter_map(|p| {
                        let (k, v) = p.split_once("=\"")?;
                        Some((k.to_string(), v.trim_end_matches('"').to_string()))
                    })
                    .collect();
                Some((name.to_string(), labels, value))
            })
            .collect();
        Self { text, samples }
    }

    /// The value of the one series named `name` whose labels include `labels`.
    pub fn get(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        let found: Vec<f64> = self.matching(name, labels).collect();
        match found.as_slice() {
            [v] => *v,
            _ => panic!(
                "{} series {name} with {labels:?} (want exactly 1) in:\n{}",
                found.len(),
                self.text
            ),
        }
    }

    /// The sum of every series named `name` (0 when there is none): a counter over its labels.
    pub fn sum(&self, name: &str) -> f64 {
        self.sum_where(name, &[])
    }

    /// The sum of every series named `name` whose labels include `labels` (0 when none does).
    pub fn sum_where(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.matching(name, labels).sum()
    }

    /// The values of the series named `name` whose labels include `labels`.
    fn matching<'a>(
        &'a self,
        name: &'a str,
        labels: &'a [(&'a str, &'a str)],
    ) -> impl Iterator<Item = f64> + 'a {
        self.samples
            .iter()
            .filter(move |(n, l, _)| {
                n == name
                    && labels
                        .iter()
                        .all(|(k, v)| l.iter().any(|(lk, lv)| lk == k && lv == v))
            })
            .map(|(_, _, v)| *v)
    }

    /// Whether any series is named `name`.
    pub fn has(&self, name: &str) -> bool {
        self.samples.iter().any(|(n, _, _)| n == name)
    }
}

/// POSTs the JSON `body` to `url` from a blocking thread, for async tests: the status, the
/// JSON answer (`Null` if it is not JSON) and `Retry-After`. Panics on a transport error.
pub async fn post_json(
    url: String,
    body: serde_json::Value,
) -> (u16, serde_json::Value, Option<String>) {
    tokio::task::spawn_blocking(move || {
        let r = match ureq::post(&url)
            .timeout(Duration::from_secs(120))
            .send_json(body)
        {
            Ok(r) => r,
            Err(ureq::Error::Status(_, r)) => r,
            Err(e) => panic!("{url}: {e}"),
        };
        let status = r.status();
        let retry = r.header("retry-after").map(str::to_string);
        (
            status,
            r.into_json().unwrap_or(serde_json::Value::Null),
            retry,
        )
    })
    .await
    .expect("request thread")
}

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

/// [`start_server`], started and healthy (off the async runtime), and its port on 127.0.0.1.
pub async fn ready_server() -> (Server, u16) {
    ready_server_with(&[]).await
}

/// [`ready_server`] with `extra` flags.
pub async fn ready_server_with(extra: &[&str]) -> (Server, u16) {
    let port = free_port();
    let extra: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
    let s = tokio::task::spawn_blocking(move || {
        let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
        let mut s = start_server_at("127.0.0.1", port, &extra);
        s.wait_ready();
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

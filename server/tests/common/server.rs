//! The real server binary on 127.0.0.1, for tests that drive it over HTTP.

use std::io::{BufRead, BufReader, Read};
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}

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

/// Starts the binary on the default model (served as `smol`); `extra` flags come last.
pub fn start(extra: &[&str]) -> Server {
    spawn(extra, Stdio::null())
}

/// The server's log (its stdout), captured to a file.
pub struct Log(PathBuf);

impl Log {
    pub fn lines(&self) -> Vec<String> {
        std::fs::read_to_string(&self.0)
            .unwrap_or_default()
            .lines()
            .map(str::to_string)
            .collect()
    }
}

impl Drop for Log {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Like `start`, keeping the log.
pub fn start_logged(extra: &[&str]) -> (Server, Log) {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let path = std::env::temp_dir().join(format!(
        "ferrite-server-{}-{}.log",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::SeqCst)
    ));
    let file = std::fs::File::create(&path).expect("log file");
    (spawn(extra, Stdio::from(file)), Log(path))
}

fn spawn(extra: &[&str], stdout: Stdio) -> Server {
    let port = free_port();
    let child = Command::new(env!("CARGO_BIN_EXE_ferrite-server"))
        .args([
            "--model",
            super::default_model().to_str().expect("utf-8 path"),
        ])
        .args(["--host", "127.0.0.1", "--port", &port.to_string()])
        .args(["--served-model-name", "smol"])
        .args(extra)
        .stdout(stdout)
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn ferrite-server");
    Server {
        child,
        base: format!("http://127.0.0.1:{port}"),
    }
}

impl Server {
    /// Polls `/health` until 200; returns every status seen on the way.
    pub fn wait_ready(&mut self) -> Vec<u16> {
        let deadline = Instant::now() + Duration::from_secs(120);
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

/// A streaming response read chunk by chunk.
pub struct SseReader {
    lines: BufReader<Box<dyn Read + Send + Sync>>,
}

impl SseReader {
    pub fn new(resp: ureq::Response) -> Self {
        Self {
            lines: BufReader::new(resp.into_reader()),
        }
    }

    /// The next `data:` payload, `None` at `[DONE]` or end of stream.
    pub fn next_chunk(&mut self) -> Option<serde_json::Value> {
        let mut line = String::new();
        loop {
            line.clear();
            if self.lines.read_line(&mut line).ok()? == 0 {
                return None;
            }
            if let Some(data) = line.trim_end().strip_prefix("data: ") {
                if data == "[DONE]" {
                    return None;
                }
                return Some(serde_json::from_str(data).expect("chunk is JSON"));
            }
        }
    }
}

/// Text and finish reason of a streamed completion (choice 0).
pub fn read_stream(mut r: SseReader) -> (String, Option<String>) {
    let mut text = String::new();
    let mut finish = None;
    while let Some(c) = r.next_chunk() {
        if let Some(ch) = c["choices"].get(0) {
            text.push_str(ch["text"].as_str().unwrap_or(""));
            if let Some(f) = ch["finish_reason"].as_str() {
                finish = Some(f.to_string());
            }
        }
    }
    (text, finish)
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
        let found: Vec<f64> = self
            .samples
            .iter()
            .filter(|(n, l, _)| {
                n == name
                    && labels
                        .iter()
                        .all(|(k, v)| l.iter().any(|(lk, lv)| lk == k && lv == v))
            })
            .map(|(_, _, v)| *v)
            .collect();
        match found.as_slice() {
            [v] => *v,
            _ => panic!(
                "{} series {name} with {labels:?} (want exactly 1) in:\n{}",
                found.len(),
                self.text
            ),
        }
    }

    /// Whether any series is named `name`.
    pub fn has(&self, name: &str) -> bool {
        self.samples.iter().any(|(n, _, _)| n == name)
    }
}

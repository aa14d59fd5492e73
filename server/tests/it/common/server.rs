//! The real server binary on 127.0.0.1, for tests that drive it over HTTP: the launcher and
//! the `/metrics` parser are ferrite-testkit's; streaming and logs are this crate's own.

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicUsize, Ordering};

pub use ferrite_testkit::process::free_port;
pub use ferrite_testkit::server::Server;

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
    Server::spawn(&binary(), "127.0.0.1", free_port(), extra, stdout)
}

/// `FERRITE_SERVER_BIN` where a test binary runs away from its build (the GPU check carries
/// both to a GPU machine), else the binary cargo built beside this test.
fn binary() -> PathBuf {
    std::env::var_os("FERRITE_SERVER_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_BIN_EXE_ferrite-server")).to_path_buf())
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

//! A stand-in for the Hugging Face Hub and for a plain web server, on 127.0.0.1: the same
//! routes, headers and status codes the real clients read (`/api/models/...` listings,
//! `/<repo>/resolve/<revision>/<file>` with `x-repo-commit`, `etag` and byte ranges), with a
//! token check, a request log, and two ways to misbehave (a slow link, a connection cut
//! mid-body) for testing resumed downloads. No network is reachable from the tests, and the
//! point is to drive the real `hf-hub` and `object_store` clients.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// One request as the host saw it.
#[derive(Debug, Clone)]
pub struct Seen {
    pub method: String,
    pub path: String,
    pub range: Option<String>,
    pub authorization: Option<String>,
    pub status: u16,
}

#[derive(Debug, Default)]
struct Repo {
    commit: String,
    /// Branches and tags besides the commit itself.
    revisions: Vec<String>,
    files: BTreeMap<String, Blob>,
}

#[derive(Debug, Default)]
struct State {
    repos: Mutex<BTreeMap<String, Repo>>,
    plain: Mutex<BTreeMap<String, Blob>>,
    token: Mutex<Option<String>>,
    seen: Mutex<Vec<Seen>>,
    /// Body bytes per second, 0 for no limit.
    rate: AtomicU64,
    /// Cut the next body after this many bytes (u64::MAX: never).
    cut_after: AtomicU64,
    /// Body bytes sent, all requests together.
    sent: AtomicU64,
    stop: AtomicBool,
}

/// The running host; stops when dropped.
#[derive(Debug)]
pub struct FileHost {
    port: u16,
    state: Arc<State>,
}

impl FileHost {
    pub fn start() -> FileHost {
        let listener = TcpListener::bind("127.0.0.1:0").expect("binding the file host");
        let port = listener.local_addr().expect("address").port();
        let state = Arc::new(State {
            cut_after: AtomicU64::new(u64::MAX),
            ..State::default()
        });
        let s = state.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                if s.stop.load(Ordering::Relaxed) {
                    break;
                }
                let Ok(conn) = conn else { continue };
                let s = s.clone();
                std::thread::spawn(move || serve(conn, &s));
            }
        });
        FileHost { port, state }
    }

    /// `http://127.0.0.1:<port>`, for `HF_ENDPOINT` or an `http://` source.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Publishes `files` as repository `repo` at `commit`, also reachable as `revisions`.
    pub fn add_repo(
        &self,
        repo: &str,
        commit: &str,
        revisions: &[&str],
        files: &[(&str, Vec<u8>)],
    ) {
        let r = Repo {
            commit: commit.into(),
            revisions: revisions.iter().map(|r| r.to_string()).collect(),
            files: files
                .iter()
                .map(|(n, b)| (n.to_string(), Blob::new(b.clone())))
                .collect(),
        };
        lock(&self.state.repos).insert(repo.into(), r);
    }

    /// Announces `sha256` as `file`'s `x-linked-etag`, as the Hub does for a file in LFS (a
    /// wrong one stands in for a corrupted transfer).
    pub fn announce_sha256(&self, repo: &str, file: &str, sha256: &str) {
        if let Some(b) = lock(&self.state.repos)
            .get_mut(repo)
            .and_then(|r| r.files.get_mut(file))
        {
            b.linked = Some(format!("\"{sha256}\""));
        }
    }

    /// Serves `body` at `/<path>` as a plain web server would.
    pub fn add_file(&self, path: &str, body: Vec<u8>) {
        lock(&self.state.plain).insert(path.trim_start_matches('/').into(), Blob::new(body));
    }

    /// Requires `Authorization: Bearer <token>` on every Hub route.
    pub fn require_token(&self, token: &str) {
        *lock(&self.state.token) = Some(token.into());
    }

    /// Limits body bytes to `bytes_per_sec` (0: no limit).
    pub fn throttle(&self, bytes_per_sec: u64) {
        self.state.rate.store(bytes_per_sec, Ordering::Relaxed);
    }

    /// Closes the next response's connection after `bytes` of its body.
    pub fn cut_next_after(&self, bytes: u64) {
        self.state.cut_after.store(bytes, Ordering::Relaxed);
    }

    /// Body bytes sent so far.
    pub fn sent(&self) -> u64 {
        self.state.sent.load(Ordering::Relaxed)
    }

    pub fn requests(&self) -> Vec<Seen> {
        lock(&self.state.seen).clone()
    }
}

impl Drop for FileHost {
    fn drop(&mut self) {
        self.state.stop.store(true, Ordering::Relaxed);
        // Wake the accept loop so it sees the flag.
        let _ = TcpStream::connect(("127.0.0.1", self.port));
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A reply before its body is cut to the requested range.
struct Reply {
    status: u16,
    headers: Vec<(String, String)>,
    body: Arc<Vec<u8>>,
    /// Whether the body is a file that takes byte ranges.
    ranged: bool,
}

fn error(status: u16, code: &str, message: &str) -> Reply {
    Reply {
        status,
        headers: vec![
            ("content-type".into(), "application/json".into()),
            ("x-error-code".into(), code.into()),
        ],
        body: Arc::new(format!("{{\"error\":\"{message}\"}}").into_bytes()),
        ranged: false,
    }
}

fn serve(conn: TcpStream, state: &State) {
    let mut reader = BufReader::new(match conn.try_clone() {
        Ok(c) => c,
        Err(_) => return,
    });
    let mut line = String::new();
    if reader.read_line(&mut line).unwrap_or(0) == 0 {
        return;
    }
    let mut parts = line.split_whitespace();
    let method = parts.next().unwrap_or_default().to_string();
    let target = parts.next().unwrap_or_default().to_string();
    let mut headers = BTreeMap::new();
    loop {
        let mut h = String::new();
        if reader.read_line(&mut h).unwrap_or(0) == 0 || h.trim().is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            headers.insert(k.trim().to_ascii_lowercase(), v.trim().to_string());
        }
    }
    let path = target.split('?').next().unwrap_or_default().to_string();
    let auth = headers.get("authorization").cloned();
    let range = headers.get("range").cloned();
    let reply = route(state, &path, auth.as_deref());
    let status = write_reply(conn, state, &method, reply, range.as_deref());
    lock(&state.seen).push(Seen {
        method,
        path,
        range,
        authorization: auth,
        status,
    });
}

fn route(state: &State, path: &str, auth: Option<&str>) -> Reply {
    let decoded = path.replace("%2F", "/");
    let trimmed = decoded.trim_start_matches('/');
    if let Some(body) = lock(&state.plain).get(trimmed) {
        return file(body, None);
    }
    if let Some(t) = lock(&state.token).as_deref()
        && auth != Some(format!("Bearer {t}").as_str())
    {
        return error(
            401,
            "Unauthorized",
            "Invalid credentials in Authorization header",
        );
    }
    let repos = lock(&state.repos);
    if let Some(rest) = trimmed.strip_prefix("api/models/") {
        let (repo, revision) = match rest.split_once("/revision/") {
            Some((r, rev)) => (r, rev),
            None => (rest, "main"),
        };
        let Some(r) = repos.get(repo) else {
            return error(404, "RepoNotFound", "Repository not found");
        };
        if revision != r.commit && !r.revisions.iter().any(|x| x == revision) {
            return error(404, "RevisionNotFound", "Invalid rev id");
        }
        let siblings: Vec<String> = r
            .files
            .keys()
            .map(|f| format!("{{\"rfilename\":\"{f}\"}}"))
            .collect();
        let body = format!(
            "{{\"id\":\"{repo}\",\"sha\":\"{}\",\"siblings\":[{}]}}",
            r.commit,
            siblings.join(",")
        );
        return Reply {
            status: 200,
            headers: vec![("content-type".into(), "application/json".into())],
            body: Arc::new(body.into_bytes()),
            ranged: false,
        };
    }
    // <org>/<name>/resolve/<revision>/<file>
    let mut parts = trimmed.splitn(5, '/');
    let (org, name, verb, revision, file_name) = (
        parts.next().unwrap_or_default(),
        parts.next().unwrap_or_default(),
        parts.next().unwrap_or_default(),
        parts.next().unwrap_or_default(),
        parts.next().unwrap_or_default(),
    );
    if verb != "resolve" {
        return error(404, "NotFound", "Not found");
    }
    let Some(r) = repos.get(&format!("{org}/{name}")) else {
        return error(404, "RepoNotFound", "Repository not found");
    };
    if revision != r.commit && !r.revisions.iter().any(|x| x == revision) {
        return error(404, "RevisionNotFound", "Invalid rev id");
    }
    match r.files.get(file_name) {
        Some(body) => file(body, Some(&r.commit)),
        None => error(404, "EntryNotFound", "Entry not found"),
    }
}

/// A served file and its content tag, computed once when it is added (the model is 98 MB, and
/// every range request would otherwise hash it again).
#[derive(Debug, Clone)]
struct Blob {
    body: Arc<Vec<u8>>,
    etag: String,
    /// `x-linked-etag`: the sha256 the Hub announces for an LFS file.
    linked: Option<String>,
}

impl Blob {
    fn new(body: Vec<u8>) -> Blob {
        // FNV-1a: a stable content tag; the clients only compare it.
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in &body {
            h = (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3);
        }
        let etag = format!("\"{h:016x}{:08x}\"", body.len());
        Blob {
            body: Arc::new(body),
            etag,
            linked: None,
        }
    }
}

/// A file reply with the headers the Hub sends (`x-repo-commit` when it is in a repository).
fn file(blob: &Blob, commit: Option<&str>) -> Reply {
    let mut headers = vec![
        ("etag".to_string(), blob.etag.clone()),
        ("accept-ranges".into(), "bytes".into()),
        (
            "last-modified".into(),
            "Wed, 25 Nov 2026 10:00:00 GMT".into(),
        ),
        ("content-type".into(), "application/octet-stream".into()),
    ];
    if let Some(c) = commit {
        headers.push(("x-repo-commit".into(), c.into()));
    }
    if let Some(l) = &blob.linked {
        headers.push(("x-linked-etag".into(), l.clone()));
    }
    Reply {
        status: 200,
        headers,
        body: blob.body.clone(),
        ranged: true,
    }
}

/// `bytes=a-` or `bytes=a-b` within `len`.
fn parse_range(range: &str, len: u64) -> Option<(u64, u64)> {
    let spec = range.strip_prefix("bytes=")?;
    let (a, b) = spec.split_once('-')?;
    let start: u64 = a.parse().ok()?;
    let end = if b.is_empty() {
        len.checked_sub(1)?
    } else {
        b.parse::<u64>().ok()?.min(len.checked_sub(1)?)
    };
    (start <= end).then_some((start, end))
}

fn write_reply(
    mut conn: TcpStream,
    state: &State,
    method: &str,
    reply: Reply,
    range: Option<&str>,
) -> u16 {
    let len = reply.body.len() as u64;
    let mut status = reply.status;
    let mut headers = reply.headers;
    let (start, end) = match range.filter(|_| reply.ranged) {
        Some(r) => match parse_range(r, len) {
            Some((a, b)) => {
                status = 206;
                headers.push(("content-range".into(), format!("bytes {a}-{b}/{len}")));
                (a, b + 1)
            }
            None => {
                let head = format!(
                    "HTTP/1.1 416 Range Not Satisfiable\r\ncontent-range: bytes */{len}\r\n\
                     content-length: 0\r\nconnection: close\r\n\r\n"
                );
                let _ = conn.write_all(head.as_bytes());
                return 416;
            }
        },
        None => (0, len),
    };
    let mut head = format!("HTTP/1.1 {status} {}\r\n", reason(status));
    for (k, v) in &headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str(&format!(
        "content-length: {}\r\nconnection: close\r\n\r\n",
        end - start
    ));
    if conn.write_all(head.as_bytes()).is_err() || method == "HEAD" {
        return status;
    }
    // The cut applies to the first body longer than it (not to the Hub's 1-byte probes).
    let cut = state.cut_after.load(Ordering::Relaxed);
    let limit = if end - start > cut {
        state.cut_after.store(u64::MAX, Ordering::Relaxed);
        start + cut
    } else {
        end
    };
    let mut at = start;
    while at < limit {
        let rate = state.rate.load(Ordering::Relaxed);
        let chunk = if rate == 0 {
            1 << 20
        } else {
            (rate / 20).max(1)
        };
        let next = limit.min(at + chunk);
        let Some(bytes) = reply.body.get(at as usize..next as usize) else {
            break;
        };
        if conn.write_all(bytes).is_err() {
            break;
        }
        state.sent.fetch_add(next - at, Ordering::Relaxed);
        at = next;
        if rate != 0 {
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    let _ = conn.flush();
    let _ = conn.shutdown(std::net::Shutdown::Both);
    status
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        206 => "Partial Content",
        401 => "Unauthorized",
        404 => "Not Found",
        _ => "Status",
    }
}

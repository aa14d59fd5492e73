//! `--model` sources that are downloaded first, driven through the real `hf-hub` and
//! `object_store` clients against stand-ins on 127.0.0.1: a Hub (token check, revisions,
//! byte ranges), a plain web server that cuts a connection mid-body, and moto's S3 server.
//! A download killed halfway resumes from its part file; a wrong token or a missing file
//! stops the server with a termination message the operator turns into a status condition.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use ferrite_testkit::hub::FileHost;
use ferrite_testkit::model::default_model;
use ferrite_testkit::process::{Guard, TempDir, eventually_blocking, free_port};
use serde_json::Value;

const COMMIT: &str = "5f2c0d1e9a8b7c6d5e4f3a2b1c0d9e8f7a6b5c4d";
const TOKEN: &str = "hf_right";

/// A ferrite-server fetching `source` into `cache`, with `env` set and its log kept.
struct Fetching {
    guard: Guard,
    base: String,
    log: PathBuf,
    termination: PathBuf,
}

fn launch(source: &str, cache: &Path, env: &[(&str, &str)]) -> Fetching {
    let port = free_port();
    let log = cache.join(format!("server-{port}.log"));
    let termination = cache.join(format!("termination-{port}"));
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_ferrite-server"));
    cmd.args(["--model", source, "--host", "127.0.0.1"])
        .args(["--port", &port.to_string()])
        .arg("--download-dir")
        .arg(cache.join("hub"))
        .arg("--termination-message-path")
        .arg(&termination)
        .args([
            "--kv-cache-memory",
            "64MiB",
            "--max-model-len",
            "1024",
            "--swap-space",
            "0",
        ])
        .env_remove("HF_TOKEN")
        .env_remove("HF_HOME")
        .stdout(Stdio::from(std::fs::File::create(&log).expect("log")))
        .stderr(Stdio::from(
            std::fs::OpenOptions::new()
                .append(true)
                .open(&log)
                .expect("log"),
        ));
    for (k, v) in env {
        cmd.env(k, v);
    }
    Fetching {
        guard: Guard::spawn("ferrite-server", cmd).expect("spawn ferrite-server"),
        base: format!("http://127.0.0.1:{port}"),
        log,
        termination,
    }
}

impl Fetching {
    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits for `/health` to answer 200.
    fn ready(&mut self) {
        let base = self.base.clone();
        let guard = &mut self.guard;
        let log = &self.log;
        eventually_blocking(Duration::from_secs(180), "the server to be ready", || {
            if let Some(s) = guard.exited() {
                panic!(
                    "the server exited with {s}:\n{}",
                    std::fs::read_to_string(log).unwrap_or_default()
                );
            }
            ureq::get(&format!("{base}/health")).call().ok().map(|_| ())
        });
    }

    /// Waits for the server to exit and returns its termination message.
    fn failed(&mut self) -> String {
        let status = self
            .guard
            .wait_timeout(Duration::from_secs(60))
            .unwrap_or_else(|| panic!("the server did not exit:\n{}", self.log()));
        assert!(!status.success(), "the server exited 0:\n{}", self.log());
        std::fs::read_to_string(&self.termination)
            .unwrap_or_else(|e| panic!("no termination message ({e}):\n{}", self.log()))
    }

    /// A short greedy completion, checked to produce text.
    fn complete(&self, model: &str) {
        let body: Value = ureq::post(&format!("{}/v1/completions", self.base))
            .send_json(
                serde_json::json!({"model": model, "prompt": "The capital of France is",
                "max_tokens": 4, "temperature": 0}),
            )
            .expect("completion")
            .into_json()
            .expect("json");
        let text = body["choices"][0]["text"].as_str().unwrap_or_default();
        assert!(!text.is_empty(), "{body}");
    }
}

fn model_bytes() -> Vec<u8> {
    std::fs::read(default_model()).expect("the default model")
}

/// Files under `dir`, relative, sorted.
fn files_under(dir: &Path) -> Vec<String> {
    fn walk(root: &Path, dir: &Path, out: &mut Vec<String>) {
        for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() {
                walk(root, &p, out);
            } else if let Ok(rel) = p.strip_prefix(root) {
                out.push(rel.to_string_lossy().into_owned());
            }
        }
    }
    let mut out = Vec::new();
    walk(dir, dir, &mut out);
    out.sort();
    out
}

/// The pod-restart story: a download killed halfway resumes with a range request from where
/// the part file ends, the server serves under the repository's name, and a third start finds
/// everything in the cache with the Hub gone.
#[test]
fn a_hub_download_killed_halfway_resumes_and_a_complete_one_needs_no_network() {
    let bytes = model_bytes();
    let size = bytes.len() as u64;
    let hub = FileHost::start();
    hub.add_repo(
        "acme/smol",
        COMMIT,
        &["main", "v1"],
        &[("q4/smol.gguf", bytes.clone())],
    );
    hub.require_token(TOKEN);
    hub.throttle(16 << 20);
    let dir = TempDir::new("hub-resume");
    let source = "hf://acme/smol@v1/q4/smol.gguf";
    let env = [("HF_ENDPOINT", hub.url()), ("HF_TOKEN", TOKEN.to_string())];
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();

    let mut first = launch(source, dir.path(), &env);
    eventually_blocking(Duration::from_secs(60), "a third of the model sent", || {
        (hub.sent() > size / 3).then_some(())
    });
    first.guard.kill();
    let sent_before = hub.sent();
    assert!(sent_before < size, "the first start downloaded everything");

    hub.throttle(0);
    let mut second = launch(source, dir.path(), &env);
    second.ready();
    second.complete("acme/smol");
    // The second start asked for the rest only.
    let resumed = hub
        .requests()
        .iter()
        .filter(|r| r.path.ends_with("/resolve/v1/q4/smol.gguf") && r.status == 206)
        .filter_map(|r| {
            r.range
                .as_deref()?
                .strip_prefix("bytes=")?
                .strip_suffix('-')?
                .parse::<u64>()
                .ok()
        })
        .max()
        .unwrap_or(0);
    assert!(
        resumed >= size / 3 && resumed <= sent_before,
        "resumed from byte {resumed}; {sent_before} of {size} were sent before the kill"
    );
    assert!(
        hub.sent() < size + sent_before / 2 + (1 << 20),
        "{} bytes sent in all for a {size}-byte file",
        hub.sent()
    );
    assert!(
        hub.requests()
            .iter()
            .all(|r| r.authorization.as_deref() == Some("Bearer hf_right")),
        "every request carries the token"
    );
    // The Hub's cache layout: the snapshot of the pinned commit holds the file, whole.
    let snapshot = dir
        .path()
        .join("hub/models--acme--smol/snapshots")
        .join(COMMIT)
        .join("q4/smol.gguf");
    assert_eq!(std::fs::read(&snapshot).expect("the snapshot file"), bytes);
    drop(second);

    // A restarted pod whose cache is complete starts with the Hub unreachable.
    drop(hub);
    let mut third = launch(source, dir.path(), &env);
    third.ready();
    third.complete("acme/smol");
    assert!(
        third.log().contains("already downloaded"),
        "{}",
        third.log()
    );
}

/// A wrong token and a missing file each stop the server with `ModelDownloadFailed` and a
/// message that says what to fix.
#[test]
fn a_wrong_token_or_a_missing_file_stops_the_server_with_the_reason() {
    let hub = FileHost::start();
    hub.add_repo(
        "acme/smol",
        COMMIT,
        &["main"],
        &[("smol.gguf", b"GGUF".to_vec())],
    );
    hub.require_token(TOKEN);
    let dir = TempDir::new("hub-errors");
    let url = hub.url();

    for (source, token, expected) in [
        (
            "hf://acme/smol/smol.gguf",
            "hf_wrong",
            &[
                "ModelDownloadFailed: hf://acme/smol/smol.gguf: ",
                "HTTP 401",
                "HF_TOKEN",
            ][..],
        ),
        (
            "hf://acme/smol/other.gguf",
            TOKEN,
            &[
                "ModelDownloadFailed: hf://acme/smol/other.gguf: ",
                "file other.gguf was not found (HTTP 404)",
            ],
        ),
        (
            "hf://acme/smol@v9/smol.gguf",
            TOKEN,
            &[
                "ModelDownloadFailed: hf://acme/smol@v9/smol.gguf: ",
                "HTTP 404",
            ],
        ),
    ] {
        let mut server = launch(
            source,
            dir.path(),
            &[("HF_ENDPOINT", &url), ("HF_TOKEN", token)],
        );
        let message = server.failed();
        assert!(message.starts_with(expected[0]), "{message}");
        for part in expected {
            assert!(message.contains(part), "{part:?} missing from {message}");
        }
    }
    assert!(!dir.path().join("hub/models--acme--smol/snapshots").exists());
}

/// A repository without a file fetches the model folder: weights, configs and tokenizer, not
/// the other formats. Weights that do not load stop the server with `ModelLoadFailed`; a GGUF
/// repository named without its file is refused with the files to choose from.
#[test]
fn a_repository_fetches_the_model_folder_only() {
    let hub = FileHost::start();
    hub.add_repo(
        "acme/tiny",
        COMMIT,
        &["main"],
        &[
            ("config.json", b"{}".to_vec()),
            ("tokenizer.json", b"{}".to_vec()),
            ("model.safetensors", b"not safetensors".to_vec()),
            ("pytorch_model.bin", vec![0; 4096]),
            ("README.md", b"# tiny".to_vec()),
        ],
    );
    hub.add_repo(
        "acme/ggufs",
        COMMIT,
        &["main"],
        &[("a-q4.gguf", vec![1]), ("a-q8.gguf", vec![2])],
    );
    let dir = TempDir::new("hub-folder");
    let url = hub.url();

    let mut folder = launch("hf://acme/tiny", dir.path(), &[("HF_ENDPOINT", &url)]);
    let message = folder.failed();
    assert!(message.starts_with("ModelLoadFailed: "), "{message}");
    let snapshot = dir
        .path()
        .join("hub/models--acme--tiny/snapshots")
        .join(COMMIT);
    assert_eq!(
        files_under(&snapshot),
        ["config.json", "model.safetensors", "tokenizer.json"]
    );
    assert!(
        hub.requests()
            .iter()
            .all(|r| !r.path.ends_with(".bin") && !r.path.ends_with(".md")),
        "{:?}",
        hub.requests()
    );

    let mut ggufs = launch("hf://acme/ggufs", dir.path(), &[("HF_ENDPOINT", &url)]);
    let message = ggufs.failed();
    assert!(
        message.starts_with("ModelDownloadFailed: ")
            && message.contains("hf://acme/ggufs/<file>")
            && message.contains("a-q4.gguf, a-q8.gguf"),
        "{message}"
    );
}

/// A plain web server: a download killed halfway resumes from its part file on the next start
/// (`bytes=N-`), and a connection cut mid-body in that start is resumed by the client's own
/// retry; the file ends up whole and serves under its name.
#[test]
fn an_http_download_resumes_after_a_kill_and_after_a_cut_connection() {
    let bytes = model_bytes();
    let size = bytes.len() as u64;
    let web = FileHost::start();
    web.add_file("models/smol.gguf", bytes.clone());
    web.throttle(16 << 20);
    let dir = TempDir::new("http-source");
    let source = format!("{}/models/smol.gguf", web.url());

    let mut first = launch(&source, dir.path(), &[]);
    eventually_blocking(Duration::from_secs(60), "a third of the model sent", || {
        (web.sent() > size / 3).then_some(())
    });
    first.guard.kill();
    let before = web.sent();

    web.throttle(0);
    web.cut_next_after(10 << 20);
    let mut second = launch(&source, dir.path(), &[]);
    second.ready();
    second.complete("smol");
    let starts: Vec<u64> = web
        .requests()
        .iter()
        .filter(|r| r.method == "GET" && r.status == 206)
        .filter_map(|r| {
            let spec = r.range.as_deref()?.strip_prefix("bytes=")?;
            spec.split('-').next()?.parse().ok()
        })
        .collect();
    // The part file's length (what reached the disk before the kill), then 10 MiB further.
    let resumed = starts.first().copied().unwrap_or(0);
    assert!(
        resumed >= size / 4 && resumed <= before,
        "resumed from {resumed} with {before} sent before the kill; ranges {starts:?}\n{}",
        second.log()
    );
    assert!(
        starts.contains(&(resumed + (10 << 20))),
        "no retry after the cut: {starts:?}\n{}",
        second.log()
    );
    let port = source
        .trim_start_matches("http://")
        .split('/')
        .next()
        .unwrap_or_default();
    let file = dir
        .path()
        .join("hub/objects/http")
        .join(port)
        .join("models/smol.gguf");
    assert_eq!(std::fs::read(file).expect("the downloaded file"), bytes);
}

/// An `s3://` folder from moto's S3 server (PyPI `moto[server]`), with the credentials and
/// endpoint in the environment as the operator passes them from the model's Secret.
#[test]
fn an_s3_folder_downloads_with_credentials_from_the_environment() {
    let python = ferrite_testkit::tools::tool_path("FERRITE_TEST_PYTHON", "python-env.sh");
    let moto = Path::new(&python).with_file_name("moto_server");
    let port = free_port();
    let mut cmd = Command::new(&moto);
    cmd.args(["-H", "127.0.0.1", "-p", &port.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let _moto = Guard::spawn("moto_server", cmd).expect("moto_server (pip install moto[server])");
    let endpoint = format!("http://127.0.0.1:{port}");
    eventually_blocking(Duration::from_secs(30), "moto to listen", || {
        ureq::get(&endpoint).call().ok().map(|_| ())
    });
    let model = default_model();
    let upload = format!(
        "import boto3, sys\n\
         s3 = boto3.client('s3', endpoint_url='{endpoint}', region_name='us-east-1',\n\
                           aws_access_key_id='AKIDTEST', aws_secret_access_key='secret')\n\
         s3.create_bucket(Bucket='weights')\n\
         s3.upload_file(sys.argv[1], 'weights', 'smol/v1/model.gguf')\n\
         s3.put_object(Bucket='weights', Key='smol/v1/README', Body=b'weights for smol')\n\
         s3.put_object(Bucket='weights', Key='smol/v2/model.gguf', Body=b'other')\n"
    );
    let st = Command::new(&python)
        .args(["-c", &upload])
        .arg(&model)
        .status()
        .expect("python");
    assert!(st.success(), "uploading to moto");

    let dir = TempDir::new("s3-source");
    // What the operator passes from the model's Secret.
    let aws = [
        ("AWS_ACCESS_KEY_ID", "AKIDTEST"),
        ("AWS_SECRET_ACCESS_KEY", "secret"),
        ("AWS_REGION", "us-east-1"),
        ("AWS_ENDPOINT_URL", endpoint.as_str()),
        ("AWS_ALLOW_HTTP", "true"),
    ];
    let mut server = launch("s3://weights/smol/v1/", dir.path(), &aws);
    // The folder holds one GGUF and a README: everything under the prefix is fetched, and the
    // GGUF is what loads.
    let folder = dir.path().join("hub/objects/s3/weights/smol/v1");
    eventually_blocking(Duration::from_secs(120), "the folder downloaded", || {
        (files_under(&folder) == ["README", "model.gguf"]).then_some(())
    });
    assert!(!dir.path().join("hub/objects/s3/weights/smol/v2").exists());
    assert_eq!(
        std::fs::read(folder.join("model.gguf")).expect("model"),
        std::fs::read(&model).expect("model")
    );
    server.ready();
    server.complete("v1");
    server.guard.kill();

    // One object by its key serves.
    let mut one = launch("s3://weights/smol/v1/model.gguf", dir.path(), &aws);
    one.ready();
    one.complete("model");
    assert!(one.log().contains("already downloaded"), "{}", one.log());
}

fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Two replicas started at once on one cache (as pods sharing a ReadWriteMany claim): one
/// downloads while the other waits on its lock and then finds the file whole, so the Hub sends
/// the model about once and both serve. (hf-hub's own lock gives up after five seconds, so the
/// second pod used to fail and crash-loop until the first was done.) The file arrives checked
/// against the sha256 the Hub announces for it.
#[test]
fn two_replicas_on_one_cache_download_once() {
    let bytes = model_bytes();
    let size = bytes.len() as u64;
    let hub = FileHost::start();
    hub.add_repo(
        "acme/smol",
        COMMIT,
        &["main"],
        &[("smol.gguf", bytes.clone())],
    );
    hub.announce_sha256("acme/smol", "smol.gguf", &sha256_hex(&bytes));
    // About 10 s for the model: long enough that the second replica arrives mid-download.
    hub.throttle(10 << 20);
    let dir = TempDir::new("hub-shared");
    let source = "hf://acme/smol/smol.gguf";
    let url = hub.url();
    let env = [("HF_ENDPOINT", url.as_str())];
    let mut first = launch(source, dir.path(), &env);
    eventually_blocking(Duration::from_secs(60), "the download to start", || {
        (hub.sent() > 0).then_some(())
    });
    let mut second = launch(source, dir.path(), &env);
    first.ready();
    second.ready();
    second.complete("acme/smol");
    assert!(
        hub.sent() < size + size / 10,
        "{} bytes sent for a {size}-byte model",
        hub.sent()
    );
    let logs = [first.log(), second.log()];
    assert!(
        logs.iter().any(|l| l.contains("sha256 matches")),
        "{logs:?}"
    );
    assert!(
        logs.iter()
            .any(|l| l.contains("downloaded by another replica")),
        "{logs:?}"
    );
}

/// Bytes that do not hash to the sha256 the Hub announced (a corrupted transfer or cache)
/// stop the server with the reason, and the bad blob is removed so the next start fetches it
/// again rather than loading it.
#[test]
fn a_download_that_does_not_match_the_hubs_sha256_is_removed() {
    let hub = FileHost::start();
    hub.add_repo(
        "acme/smol",
        COMMIT,
        &["main"],
        &[("smol.gguf", model_bytes())],
    );
    let wrong = "0".repeat(64);
    hub.announce_sha256("acme/smol", "smol.gguf", &wrong);
    let dir = TempDir::new("hub-sha");
    let url = hub.url();
    let mut server = launch(
        "hf://acme/smol/smol.gguf",
        dir.path(),
        &[("HF_ENDPOINT", &url)],
    );
    let message = server.failed();
    assert!(message.starts_with("ModelDownloadFailed: "), "{message}");
    assert!(message.contains("sha256"), "{message}");
    let blobs = files_under(&dir.path().join("hub/models--acme--smol/blobs"));
    assert!(!blobs.iter().any(|b| b == &wrong), "{blobs:?}");
}

/// A token is never sent over plain HTTP to another machine.
#[test]
fn a_token_is_not_sent_over_plain_http() {
    let dir = TempDir::new("hub-plain");
    let mut server = launch(
        "hf://acme/smol/smol.gguf",
        dir.path(),
        &[
            ("HF_ENDPOINT", "http://hub.example.internal"),
            ("HF_TOKEN", TOKEN),
        ],
    );
    let message = server.failed();
    assert!(message.contains("plain http"), "{message}");
}

/// Two replicas on one cache fetching one http(s) object: one download, both serve.
#[test]
fn two_replicas_share_one_object_download() {
    let bytes = model_bytes();
    let size = bytes.len() as u64;
    let web = FileHost::start();
    web.add_file("models/smol.gguf", bytes);
    web.throttle(10 << 20);
    let dir = TempDir::new("http-shared");
    let source = format!("{}/models/smol.gguf", web.url());
    let mut first = launch(&source, dir.path(), &[]);
    eventually_blocking(Duration::from_secs(60), "the download to start", || {
        (web.sent() > 0).then_some(())
    });
    let mut second = launch(&source, dir.path(), &[]);
    first.ready();
    second.ready();
    second.complete("smol");
    assert!(
        web.sent() < size + size / 10,
        "{} bytes sent for a {size}-byte model",
        web.sent()
    );
}

/// `--model-sha256`: a file that hashes to it serves; one that does not stops the server with
/// the reason in its termination message, a download that does not is removed (the next start
/// fetches it again), and a local file is left where it is.
#[test]
fn weights_that_do_not_match_model_sha256_are_refused() {
    let bytes = model_bytes();
    let right = sha256_hex(&bytes);
    let wrong = "ab".repeat(32);
    let web = FileHost::start();
    web.add_file("models/smol.gguf", bytes);
    let dir = TempDir::new("model-sha256");
    let source = format!("{}/models/smol.gguf", web.url());
    let launch_with =
        |source: &str, sha: &str| launch(source, dir.path(), &[("FERRITE_MODEL_SHA256", sha)]);

    let mut bad = launch_with(&source, &wrong);
    let message = bad.failed();
    assert!(message.starts_with("ModelDownloadFailed: "), "{message}");
    assert!(
        message.contains(&wrong) && message.contains(&right) && message.contains("removed"),
        "{message}"
    );
    let cached = files_under(&dir.path().join("hub"));
    assert!(
        !cached.iter().any(|f| f.ends_with("smol.gguf")),
        "the mismatching download stayed: {cached:?}"
    );

    let mut good = launch_with(&source, &right.to_uppercase());
    good.ready();
    good.complete("smol");
    assert!(
        good.log().contains("sha256 matches --model-sha256"),
        "{}",
        good.log()
    );
    drop(good);

    let local = default_model();
    let mut local_bad = launch_with(local.to_str().expect("utf-8"), &wrong);
    let message = local_bad.failed();
    assert!(message.contains("do not match"), "{message}");
    assert!(!message.contains("removed"), "{message}");
    assert!(local.exists(), "a local model file was removed");
}

//! Requests written to hurt the server, against the real binary: each is refused early with an
//! OpenAI-style error naming the parameter, and the server's memory stays where it was.
//! (Before these limits, one ~1.4 MB completions request of short token lists queued millions
//! of sequences: the server allocated 23.6 GB until the OOM killer ended it.)

use crate::common;

use std::process::Command;
use std::time::Duration;

use common::server::{Server, free_port, start};
use serde_json::{Value, json};

const KEY: &str = "sekrit";

/// Status and JSON body of a POST (the body as raw bytes, so it may be anything).
fn post_raw(s: &Server, path: &str, body: &[u8], key: Option<&str>) -> (u16, Value) {
    let mut req = ureq::post(&format!("{}{path}", s.base))
        .timeout(Duration::from_secs(120))
        .set("Content-Type", "application/json");
    if let Some(k) = key {
        req = req.set("Authorization", &format!("Bearer {k}"));
    }
    let resp = match req.send_bytes(body) {
        Ok(r) => r,
        Err(ureq::Error::Status(_, r)) => r,
        Err(e) => panic!("{path}: {e}"),
    };
    let status = resp.status();
    let text = resp.into_string().unwrap_or_default();
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

/// The server's answer to a completions head announcing `length` bytes of body, none sent.
fn head_only(s: &Server, length: usize) -> String {
    use std::io::{Read, Write};
    let addr = s.base.trim_start_matches("http://");
    let mut conn = std::net::TcpStream::connect(addr).expect("connect");
    conn.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {KEY}\r\n\
         content-type: application/json\r\ncontent-length: {length}\r\n\r\n"
    );
    conn.write_all(head.as_bytes()).expect("write");
    let mut out = vec![0u8; 4096];
    let n = conn.read(&mut out).expect("an answer before the body");
    String::from_utf8_lossy(&out[..n]).into_owned()
}

fn post(s: &Server, path: &str, body: &Value) -> (u16, Value) {
    post_raw(s, path, body.to_string().as_bytes(), Some(KEY))
}

/// The error's `param`, after checking the status and the error shape.
fn refused(status: u16, body: &Value, want: u16) -> String {
    assert_eq!(status, want, "{body}");
    assert!(body["error"]["message"].is_string(), "{body}");
    body["error"]["param"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

fn rss_kib(s: &Server) -> u64 {
    ferrite_testkit::process::memory_kib(s.child.id()).1
}

#[test]
fn fan_out_stop_strings_and_malformed_bodies_are_refused_early() {
    let mut s = start(&[
        "--api-key",
        KEY,
        "--max-queue-len",
        "16",
        "--max-request-sequences",
        "64",
    ]);
    s.wait_ready();
    let before = rss_kib(&s);

    // 300,000 one-token prompts (~1.2 MB of JSON): refused before anything is tokenized.
    let many: Vec<Vec<u32>> = vec![vec![1]; 300_000];
    let (st, body) = post(
        &s,
        "/v1/completions",
        &json!({"prompt": many, "max_tokens": 1}),
    );
    assert_eq!(refused(st, &body, 400), "prompt");
    // prompts × n past the cap names `n`.
    let nine: Vec<&str> = vec!["Hi"; 9];
    let (st, body) = post(&s, "/v1/completions", &json!({"prompt": nine, "n": 8}));
    assert_eq!(refused(st, &body, 400), "n");
    // More sequences than the queue may ever hold is a 400, not a 503 to retry forever.
    let (st, body) = post(
        &s,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "Hi"}], "n": 17}),
    );
    assert_eq!(refused(st, &body, 400), "n");
    // The queue is checked before a grammar is compiled: this request's schema would fail to
    // compile (a 400 naming `response_format`), but the queue refuses it first.
    let bad_schema = json!({"type": "json_schema",
        "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}});
    let (st, body) = post(
        &s,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "Hi"}], "n": 17,
                "response_format": bad_schema}),
    );
    assert_eq!(refused(st, &body, 400), "n");
    let (st, body) = post(
        &s,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "Hi"}], "response_format": bad_schema}),
    );
    assert_eq!(refused(st, &body, 400), "response_format");

    // Stop strings: count and length; stop token ids: count.
    let stops: Vec<String> = (0..17).map(|i| format!("s{i}")).collect();
    let (st, body) = post(
        &s,
        "/v1/completions",
        &json!({"prompt": "Hi", "stop": stops}),
    );
    assert_eq!(refused(st, &body, 400), "stop");
    let long = "x".repeat(1025);
    let (st, body) = post(
        &s,
        "/v1/completions",
        &json!({"prompt": "Hi", "stop": long}),
    );
    assert_eq!(refused(st, &body, 400), "stop");
    let ids: Vec<u32> = (0..257).collect();
    let (st, body) = post(
        &s,
        "/v1/completions",
        &json!({"prompt": "Hi", "stop_token_ids": ids}),
    );
    assert_eq!(refused(st, &body, 400), "stop_token_ids");

    // Bytes after the JSON value, and a body past the limit.
    let (st, body) = post_raw(
        &s,
        "/v1/completions",
        br#"{"prompt": "Hi"} {"prompt": "again"}"#,
        Some(KEY),
    );
    refused(st, &body, 400);
    // Only the head of the large body is sent: the server answers from Content-Length, and a
    // client still writing its body would see its write fail before the 413 arrives.
    let reply = head_only(&s, 3 << 20);
    assert!(reply.starts_with("HTTP/1.1 413"), "{reply}");
    assert!(reply.contains("\"error\""), "{reply}");

    // A refused body is read and dropped while the answer goes out, so that a client that
    // writes its whole body before reading (as ureq, and a router streaming an upload, do)
    // reads the answer instead of a reset connection: an unknown path's 404 (an 8 MiB audio
    // upload a router sent here, say) and a missing key's 401.
    let big = vec![b' '; 8 << 20];
    let near_limit = vec![b' '; 2_000_000];
    for _ in 0..3 {
        let (st, body) = post_raw(&s, "/v1/audio/transcriptions", &big, Some(KEY));
        assert_eq!(st, 404, "{body}");
        let (st, body) = post_raw(&s, "/v1/completions", &near_limit, None);
        assert_eq!(st, 401, "{body}");
    }

    // The tokenizer endpoints spend CPU on the client's text: behind the key too.
    let tok = json!({"prompt": "Hello there"});
    let (st, _) = post_raw(&s, "/tokenize", tok.to_string().as_bytes(), None);
    assert_eq!(st, 401);
    let (st, body) = post(&s, "/tokenize", &tok);
    assert_eq!(st, 200, "{body}");
    assert!(body["count"].as_u64().is_some_and(|c| c > 0), "{body}");

    // Within every limit, the most a request may ask for still works.
    let stops: Vec<String> = (0..16).map(|i| format!("never-{i}")).collect();
    let (st, body) = post(
        &s,
        "/v1/completions",
        &json!({"prompt": vec!["Hi"; 8], "n": 2, "max_tokens": 4, "stop": stops,
                "stop_token_ids": (0..256).collect::<Vec<u32>>()}),
    );
    assert_eq!(st, 200, "{body}");
    assert_eq!(body["choices"].as_array().map(Vec::len), Some(16), "{body}");

    let grown_mib = rss_kib(&s).saturating_sub(before) / 1024;
    println!("server RSS grew by {grown_mib} MiB over the hostile requests");
    assert!(grown_mib < 256, "RSS grew by {grown_mib} MiB");
}

#[test]
fn an_empty_api_key_is_refused_at_start() {
    let model = ferrite_testkit::model::default_model();
    let out = Command::new(env!("CARGO_BIN_EXE_ferrite-server"))
        .args(["--model", model.to_str().expect("utf-8"), "--api-key", ""])
        .args(["--host", "127.0.0.1", "--port", &free_port().to_string()])
        .output()
        .expect("run");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("empty"), "{err}");
}

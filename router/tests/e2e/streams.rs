//! Responses through ferrite-router, on a real API server with real servers (harness in
//! `common.rs`): streams pass through byte for byte and as they are made; a pod that leaves lets
//! its streams finish; a stream whose replica dies goes on on another, and one that cannot ends
//! with an error event; a client that gives up
//! while its request is held leaves nothing behind; and the official `openai` client works
//! through the router unchanged.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::common::*;
use ferrite_testkit::process::eventually;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// One connection through the relay: the first bytes the router sent on it (to tell API
/// requests from the load scraper's), and what the replica sent back, with when it arrived.
#[derive(Debug, Default)]
struct Connection {
    request_start: Vec<u8>,
    response: Vec<(Instant, Vec<u8>)>,
}

type Recording = Arc<Mutex<Vec<Connection>>>;

/// A TCP relay at `listen` in front of `upstream` that records what the upstream sends on
/// each connection, so a test can compare what the router passed on with what it got.
async fn recording_relay(listen: &str, upstream: String) -> Recording {
    let recording: Recording = Arc::default();
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .expect("bind the relay");
    let rec = recording.clone();
    tokio::spawn(async move {
        while let Ok((mut down, _)) = listener.accept().await {
            let Ok(mut up) = tokio::net::TcpStream::connect(&upstream).await else {
                continue;
            };
            let rec = rec.clone();
            let index = {
                let mut r = rec.lock().expect("recording");
                r.push(Connection::default());
                r.len() - 1
            };
            tokio::spawn(async move {
                let (mut down_r, mut down_w) = down.split();
                let (mut up_r, mut up_w) = up.split();
                let requests = async {
                    let mut buf = vec![0u8; 16 << 10];
                    loop {
                        let n = match down_r.read(&mut buf).await {
                            Ok(0) | Err(_) => break,
                            Ok(n) => n,
                        };
                        {
                            let mut r = rec.lock().expect("recording");
                            let start = &mut r[index].request_start;
                            if start.len() < 16 {
                                start.extend_from_slice(&buf[..n.min(16)]);
                            }
                        }
                        if up_w.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                    }
                    let _ = up_w.shutdown().await;
                };
                let responses = async {
                    let mut buf = vec![0u8; 16 << 10];
                    loop {
                        let n = match up_r.read(&mut buf).await {
                            Ok(0) | Err(_) => break,
                            Ok(n) => n,
                        };
                        rec.lock().expect("recording")[index]
                            .response
                            .push((Instant::now(), buf[..n].to_vec()));
                        if down_w.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                    }
                };
                tokio::join!(requests, responses);
            });
        }
    });
    recording
}

/// What the replica sent back on the connections that carried `POST`s (the router's API
/// requests, not the scraper's `GET /metrics`), with when each piece arrived.
fn posted_responses(recording: &Recording) -> Vec<(Instant, Vec<u8>)> {
    recording
        .lock()
        .expect("recording")
        .iter()
        .filter(|c| c.request_start.starts_with(b"POST "))
        .flat_map(|c| c.response.clone())
        .collect()
}

/// Forgets what was recorded so far.
fn clear(recording: &Recording) {
    for c in recording.lock().expect("recording").iter_mut() {
        c.response.clear();
    }
}

/// The body of the one HTTP/1.1 response in `raw` (chunked or with a length), and its
/// content type.
fn response_body(raw: &[u8]) -> (Vec<u8>, String) {
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("response headers");
    let head = String::from_utf8_lossy(&raw[..split]).to_lowercase();
    let mut rest = &raw[split + 4..];
    let content_type = head
        .lines()
        .find_map(|l| l.strip_prefix("content-type:"))
        .unwrap_or_default()
        .trim()
        .to_string();
    if !head.contains("transfer-encoding: chunked") {
        return (rest.to_vec(), content_type);
    }
    let mut body = Vec::new();
    loop {
        let line_end = rest
            .windows(2)
            .position(|w| w == b"\r\n")
            .expect("chunk size");
        let size_text = String::from_utf8_lossy(&rest[..line_end]);
        let size = usize::from_str_radix(size_text.split(';').next().unwrap_or("").trim(), 16)
            .expect("hex chunk size");
        rest = &rest[line_end + 2..];
        if size == 0 {
            return (body, content_type);
        }
        body.extend_from_slice(&rest[..size]);
        rest = &rest[size + 2..];
    }
}

/// A stream's reader: its status and lines once it ends.
type StreamTask = tokio::task::JoinHandle<(u16, Lines)>;

/// A streaming request read line by line on a blocking thread: every line with the time it
/// arrived; `after` is told once `notify_after` events have come.
fn stream(
    url: String,
    body: Value,
    notify_after: usize,
) -> (StreamTask, tokio::sync::oneshot::Receiver<()>) {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let task = tokio::task::spawn_blocking(move || {
        let r = ureq::post(&url)
            .timeout(Duration::from_secs(120))
            .send_json(body)
            .expect("the stream starts");
        let status = r.status();
        let mut reader = BufReader::new(r.into_reader());
        let mut lines = Vec::new();
        let mut tx = Some(tx);
        let mut events = 0;
        loop {
            let mut line = String::new();
            match reader.read_line(&mut line) {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            }
            if line.starts_with("data:") {
                events += 1;
            }
            lines.push((Instant::now(), line));
            if events == notify_after
                && let Some(tx) = tx.take()
            {
                let _ = tx.send(());
            }
        }
        (status, lines)
    });
    (task, rx)
}

/// Every line of a stream, with when it arrived.
type Lines = Vec<(Instant, String)>;

fn text(lines: &[(Instant, String)]) -> String {
    lines.iter().map(|(_, l)| l.as_str()).collect()
}

/// What the client reads from the router is exactly what the replica sent, for a stream and
/// for a plain response, and a stream's events reach the client as the replica makes them
/// (the first arrives before the replica has sent its last).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn streams_pass_through_byte_for_byte_as_they_are_made() {
    let Some((_cluster, client, ns, port)) = chat_service("bytes", json!({})).await else {
        return;
    };
    // The server listens at 127.0.0.1; the pod's address is the relay's.
    let _server = server("127.0.0.1", port, "chat");
    let recording =
        recording_relay(&format!("127.0.0.2:{port}"), format!("127.0.0.1:{port}")).await;
    ready_pod(&client, &ns, "chat", "chat-0", "127.0.0.2").await;
    let base = router(&client, &ns).await;
    wait_ready_replicas(&base, "chat", 1).await;

    let body = json!({"model": "chat", "stream": true, "max_tokens": 48, "ignore_eos": true,
        "temperature": 0, "stream_options": {"include_usage": true},
        "messages": [{"role": "user", "content": "Tell me a story."}]});
    let (task, _) = stream(format!("{base}/v1/chat/completions"), body, 1);
    let (status, lines) = task.await.expect("stream");
    assert_eq!(status, 200);
    let got = text(&lines);
    let recorded = posted_responses(&recording);
    let raw: Vec<u8> = recorded.iter().flat_map(|(_, b)| b.clone()).collect();
    let (sent, content_type) = response_body(&raw);
    assert!(
        content_type.starts_with("text/event-stream"),
        "{content_type}"
    );
    assert_eq!(
        got,
        String::from_utf8(sent).expect("UTF-8"),
        "the stream differs from what the replica sent"
    );
    let events = lines.iter().filter(|(_, l)| l.starts_with("data:")).count();
    assert!(events >= 48, "{events} events:\n{got}");
    assert!(got.ends_with("data: [DONE]\n\n"), "{got}");
    let first_event = lines
        .iter()
        .find(|(_, l)| l.starts_with("data:"))
        .map(|(t, _)| *t)
        .expect("an event");
    let last_upstream = recorded.last().map(|(t, _)| *t).expect("upstream bytes");
    assert!(
        first_event < last_upstream,
        "the first event reached the client only after the replica had finished"
    );

    // A plain response, byte for byte as well.
    clear(&recording);
    let url = format!("{base}/v1/completions");
    let got = tokio::task::spawn_blocking(move || {
        ureq::post(&url)
            .send_json(
                json!({"model": "chat", "prompt": "Hello", "max_tokens": 8, "temperature": 0}),
            )
            .expect("completion")
            .into_string()
            .expect("body")
    })
    .await
    .expect("request");
    let raw: Vec<u8> = posted_responses(&recording)
        .into_iter()
        .flat_map(|(_, b)| b)
        .collect();
    let (sent, content_type) = response_body(&raw);
    assert!(
        content_type.starts_with("application/json"),
        "{content_type}"
    );
    assert_eq!(got.as_bytes(), &sent[..]);
}

/// A pod that leaves (deleted, as in a rollout) drops out of routing but its open stream
/// finishes; a replica that dies mid-stream ends the stream with an OpenAI error event (no
/// `[DONE]`), counted, and the router carries on.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_leaving_pod_finishes_its_streams_and_a_dying_one_ends_them_with_an_error() {
    let Some((_cluster, client, ns, port)) = chat_service("dying", json!({})).await else {
        return;
    };
    let _first = server("127.0.0.1", port, "chat");
    ready_pod(&client, &ns, "chat", "chat-a", "127.0.0.1").await;
    let base = router(&client, &ns).await;
    wait_ready_replicas(&base, "chat", 1).await;
    let long = json!({"model": "chat", "stream": true, "max_tokens": 300, "ignore_eos": true,
        "temperature": 0, "prompt": "Once upon a time"});

    // The pod is deleted while it streams; a new one takes over for new requests.
    let (task, started) = stream(format!("{base}/v1/completions"), long.clone(), 3);
    started.await.expect("three events");
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    pods.delete("chat-a", &DeleteParams::default())
        .await
        .expect("delete the pod");
    let second = server("127.0.0.2", port, "chat");
    ready_pod(&client, &ns, "chat", "chat-b", "127.0.0.2").await;
    let (status, lines) = task.await.expect("stream");
    assert_eq!(status, 200);
    let got = text(&lines);
    assert!(
        got.ends_with("data: [DONE]\n\n"),
        "the stream finished:\n{got}"
    );
    assert!(!got.contains("\"error\""), "{got}");

    // chat-b is the only replica now; it dies mid-stream.
    eventually(WAIT, "chat-a out of routing", async || {
        let v = get(format!("{base}/v1/models")).await;
        (v["data"][0]["ready_replicas"] == 1 && finished(&second.base).await == 0.0).then_some(())
    })
    .await;
    let (task, started) = stream(format!("{base}/v1/completions"), long, 3);
    started.await.expect("three events");
    assert_eq!(
        finished(&second.base).await,
        0.0,
        "the stream runs on chat-b (the first replica is gone from routing)"
    );
    drop(second);
    let (status, lines) = task.await.expect("stream");
    assert_eq!(status, 200);
    let got = text(&lines);
    assert!(
        !got.contains("[DONE]"),
        "a cut stream is not reported complete:\n{got}"
    );
    let last = lines
        .iter()
        .rev()
        .find(|(_, l)| l.starts_with("data:"))
        .map(|(_, l)| l.trim_start_matches("data:").trim())
        .expect("events");
    let event: Value = serde_json::from_str(last).expect("the last event is JSON");
    assert_eq!(event["error"]["type"], "upstream_error", "{event}");
    // The client learns its model failed; which pod, and why, stays in the router's log.
    let message = event["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("failed mid-stream"), "{event}");
    assert!(
        !message.contains("chat-b"),
        "no pod name for clients: {event}"
    );
    let metrics = get_text(format!("{base}/metrics")).await;
    assert_eq!(
        metric_sum(&metrics, "ferrite_router_broken_streams_total", &[]),
        1.0,
        "{metrics}"
    );
    assert_eq!(
        metric_sum(&metrics, "ferrite_router_in_flight_requests", &[]),
        0.0,
        "nothing left open: {metrics}"
    );
    assert_eq!(get_text(format!("{base}/healthz")).await, "ok");
}

/// A client that disconnects while its request is held (the service scaled to zero) drops
/// it: the held gauge goes back to zero, and when a replica turns up it gets nothing from
/// that client; the next request is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_client_that_leaves_while_held_is_dropped() {
    let Some((_cluster, client, ns, port)) = chat_service("leave", json!({"replicas": 0})).await
    else {
        return;
    };
    let base = router_with(&client, &ns, config(), false).await;
    let held_series = "ferrite_router_held_requests";
    let addr = base.trim_start_matches("http://").to_string();
    let body = json!({"model": "chat", "prompt": "Hello", "max_tokens": 4}).to_string();
    let mut conn = TcpStream::connect(&addr).expect("connect to the router");
    write!(
        conn,
        "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .expect("send the request");
    eventually(WAIT, "the request to be held", async || {
        let m = get_text(format!("{base}/metrics")).await;
        (metric_sum(&m, held_series, &[("inferenceservice", "chat")]) == 1.0).then_some(())
    })
    .await;
    conn.shutdown(std::net::Shutdown::Both).expect("disconnect");
    drop(conn);
    eventually(WAIT, "the held request to be dropped", async || {
        let m = get_text(format!("{base}/metrics")).await;
        (metric_sum(&m, held_series, &[("inferenceservice", "chat")]) == 0.0).then_some(())
    })
    .await;

    let server = server("127.0.0.1", port, "chat");
    ready_pod(&client, &ns, "chat", "chat-0", "127.0.0.1").await;
    wait_ready_replicas(&base, "chat", 1).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let metrics = get_text(format!("{base}/metrics")).await;
    assert_eq!(
        metric_sum(&metrics, "ferrite_router_routing_decisions_total", &[]),
        0.0,
        "the dropped request was never sent: {metrics}"
    );
    let served = get_text(format!("{}/metrics", server.base)).await;
    assert_eq!(metric_sum(&served, "vllm:request_success_total", &[]), 0.0);
    let (status, body, _) = post(
        format!("{base}/v1/completions"),
        json!({"model": "chat", "prompt": "Hello", "max_tokens": 4}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
}

const OPENAI_SCRIPT: &str = r#"
import sys, openai
base, key = sys.argv[1], sys.argv[2]
client = openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0)
ids = [m.id for m in client.models.list().data]
assert ids == ["chat"], ids
print("models ok")
c = client.completions.create(model="chat", prompt="The capital of France is", max_tokens=4, temperature=0)
assert c.model == "chat" and c.choices[0].text, c
print("completion ok")
r = client.chat.completions.create(model="chat", max_tokens=8, temperature=0,
    messages=[{"role": "user", "content": "Say hi"}])
plain = r.choices[0].message.content
assert plain, r
print("chat ok")
parts, usage = [], None
for chunk in client.chat.completions.create(model="chat", max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True}, messages=[{"role": "user", "content": "Say hi"}]):
    if chunk.choices and chunk.choices[0].delta.content:
        parts.append(chunk.choices[0].delta.content)
    if chunk.usage:
        usage = chunk.usage
assert "".join(parts) == plain, (parts, plain)
assert usage and usage.completion_tokens == r.usage.completion_tokens, usage
print("stream ok")
try:
    client.completions.create(model="nope", prompt="x", max_tokens=1)
    raise SystemExit("an unknown model was accepted")
except openai.NotFoundError as e:
    assert e.body["param"] == "model", e.body
print("not found ok")
try:
    openai.OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0).completions.create(
        model="chat", prompt="x", max_tokens=1)
    raise SystemExit("a wrong key was accepted")
except openai.AuthenticationError:
    pass
print("auth ok")
"#;

/// The official `openai` Python client through the router, unchanged: models, completions,
/// chat, a stream with usage equal to the plain answer, OpenAI's errors for an unknown model
/// (the router's 404) and a wrong key (the replica's 401, passed through).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_client_works_through_the_router() {
    let Some((_cluster, client, ns, port)) = chat_service("openai", json!({})).await else {
        return;
    };
    let key = "sk-router-test";
    let _server = server_with("127.0.0.1", port, "chat", &["--api-key", key]);
    ready_pod(&client, &ns, "chat", "chat-0", "127.0.0.1").await;
    let base = router(&client, &ns).await;
    wait_ready_replicas(&base, "chat", 1).await;
    let py = ferrite_testkit::tools::python();
    let out = tokio::task::spawn_blocking(move || {
        Command::new(py)
            .args(["-c", OPENAI_SCRIPT, &base, key])
            .output()
            .expect("run python")
    })
    .await
    .expect("python thread");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    for step in [
        "models",
        "completion",
        "chat",
        "stream",
        "not found",
        "auth",
    ] {
        assert!(stdout.contains(&format!("{step} ok")), "{stdout}\n{stderr}");
    }
}

/// The data of each event of a stream, parsed (`[DONE]` as the string).
fn events(lines: &Lines) -> Vec<Value> {
    lines
        .iter()
        .filter_map(|(_, l)| l.strip_prefix("data:"))
        .map(|d| serde_json::from_str(d.trim()).unwrap_or_else(|_| Value::from(d.trim())))
        .collect()
}

/// Which of `servers` is running a request now (by its `/metrics`).
async fn running_on(servers: &[ferrite_testkit::server::Server]) -> usize {
    eventually(WAIT, "the stream running on one replica", async || {
        for (i, s) in servers.iter().enumerate() {
            let text = get_text(format!("{}/metrics", s.base)).await;
            if metric_sum(&text, "vllm:num_requests_running", &[]) >= 1.0 {
                return Some(i);
            }
        }
        None
    })
    .await
}

/// A replica killed mid-stream (its pod still listed Ready, as before the kubelet notices):
/// the router resumes the stream on another with the text so far, and the client reads one
/// stream: every event under one id, the greedy text an unbroken request gives, as many token
/// events as `max_tokens`, and usage counting them all. Completions, then chat.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stream_survives_the_death_of_its_replica() {
    let Some((_cluster, client, ns, port)) = chat_service("resume", json!({})).await else {
        return;
    };
    let mut servers: Vec<_> = ["127.0.0.1", "127.0.0.2", "127.0.0.3"]
        .iter()
        .map(|ip| server(ip, port, "chat"))
        .collect();
    for (i, ip) in ["127.0.0.1", "127.0.0.2", "127.0.0.3"].iter().enumerate() {
        ready_pod(&client, &ns, "chat", &format!("chat-{i}"), ip).await;
    }
    let base = router(&client, &ns).await;
    wait_ready_replicas(&base, "chat", 3).await;
    let cases = [
        (
            "/v1/completions",
            json!({"model": "chat", "prompt": "Once upon a time", "max_tokens": 64,
                   "ignore_eos": true, "temperature": 0}),
        ),
        (
            "/v1/chat/completions",
            json!({"model": "chat", "max_tokens": 48, "ignore_eos": true, "temperature": 0,
                   "messages": [{"role": "user", "content": "Tell me about lighthouses."}]}),
        ),
    ];
    for (resumed, (path, request)) in cases.into_iter().enumerate() {
        let chat = path.contains("chat");
        let max = request["max_tokens"].as_u64().expect("max_tokens");
        // What an unbroken request gives, straight from a replica.
        let (status, whole, _) = post(format!("{}{path}", servers[0].base), request.clone()).await;
        assert_eq!(status, 200, "{whole}");
        let whole_text = if chat {
            whole["choices"][0]["message"]["content"].clone()
        } else {
            whole["choices"][0]["text"].clone()
        };
        let mut streamed = request.clone();
        streamed["stream"] = json!(true);
        streamed["stream_options"] = json!({"include_usage": true});
        let (task, started) = stream(format!("{base}{path}"), streamed, 10);
        started.await.expect("ten events");
        let victim = running_on(&servers).await;
        drop(servers.remove(victim));
        let (status, lines) = task.await.expect("stream");
        assert_eq!(status, 200);
        let got = text(&lines);
        assert!(
            got.ends_with("data: [DONE]\n\n"),
            "{path}: not finished:\n{got}"
        );
        assert!(!got.contains("\"error\""), "{path}:\n{got}");
        let evs = events(&lines);
        let ids: std::collections::BTreeSet<String> = evs
            .iter()
            .filter_map(|e| e["id"].as_str().map(String::from))
            .collect();
        assert_eq!(ids.len(), 1, "{path}: one stream, one id: {ids:?}");
        let choices: Vec<&Value> = evs
            .iter()
            .map(|e| &e["choices"][0])
            .filter(|c| c.is_object())
            .collect();
        let piece = |c: &Value| {
            if chat {
                c["delta"]["content"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string()
            } else {
                c["text"].as_str().unwrap_or_default().to_string()
            }
        };
        let roles = choices
            .iter()
            .filter(|c| !c["delta"]["role"].is_null())
            .count();
        assert_eq!(roles, usize::from(chat), "{path}: one role event");
        // The finish event comes on its own, with no text.
        let tokens = choices
            .iter()
            .filter(|c| c["finish_reason"].is_null() && c["delta"]["role"].is_null())
            .count();
        assert_eq!(
            tokens as u64, max,
            "{path}: one event per token, {max} in all"
        );
        assert_eq!(
            choices.len(),
            tokens + roles + 1,
            "{path}: and one finish event"
        );
        let joined: String = choices.iter().map(|c| piece(c)).collect();
        assert_eq!(
            Value::from(joined),
            whole_text,
            "{path}: the text of an unbroken run"
        );
        let usage = &evs
            .iter()
            .rev()
            .find(|e| e["usage"].is_object())
            .expect("usage")["usage"];
        assert_eq!(usage["completion_tokens"], max, "{path}: {usage}");
        assert_eq!(
            usage["prompt_tokens"], whole["usage"]["prompt_tokens"],
            "{path}: {usage}"
        );
        let metrics = get_text(format!("{base}/metrics")).await;
        assert_eq!(
            metric_sum(&metrics, "ferrite_router_resumed_streams_total", &[]),
            (resumed + 1) as f64,
            "{metrics}"
        );
        assert_eq!(
            metric_sum(&metrics, "ferrite_router_broken_streams_total", &[]),
            0.0
        );
    }
}

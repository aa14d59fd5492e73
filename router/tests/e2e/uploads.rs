//! Form uploads (`/v1/audio/transcriptions`, `/translations`) through the router, on a real API
//! server with real ferrite-servers behind it: the `model` form field routes the request, the
//! file is streamed on, and a form whose `model` is missing, late or unknown, or whose body is
//! too large, is refused with OpenAI's error JSON. ferrite-server has no audio models: it
//! answers the path with its own 404 (and reads the body it refused, so that the answer is not
//! lost to a reset connection), which reaches the client as the replica's answer. The routed
//! file (2 MiB) is larger than the router may hold (128 KiB here): it can only have been
//! streamed; that it arrives whole and in order is `multipart::Upload`'s unit test.

use super::common::*;
use serde_json::Value;

const BOUNDARY: &str = "ferrite-test-boundary";

/// A form with `fields` in order; a field with a file name is a file.
fn form(fields: &[(&str, Option<&str>, &[u8])]) -> Vec<u8> {
    let mut out = Vec::new();
    for (name, file, value) in fields {
        out.extend_from_slice(format!("--{BOUNDARY}\r\n").as_bytes());
        let disposition = match file {
            Some(f) => format!(
                "Content-Disposition: form-data; name=\"{name}\"; filename=\"{f}\"\r\n\
                 Content-Type: audio/wav\r\n\r\n"
            ),
            None => format!("Content-Disposition: form-data; name=\"{name}\"\r\n\r\n"),
        };
        out.extend_from_slice(disposition.as_bytes());
        out.extend_from_slice(value);
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(format!("--{BOUNDARY}--\r\n").as_bytes());
    out
}

/// POSTs `body` with `content_type` to `url`: the status and the JSON answer.
async fn upload(url: String, content_type: String, body: Vec<u8>) -> (u16, Value) {
    tokio::task::spawn_blocking(move || {
        let r = ureq::post(&url)
            .set("Content-Type", &content_type)
            .send_bytes(&body);
        match r {
            Ok(r) | Err(ureq::Error::Status(_, r)) => {
                (r.status(), r.into_json().unwrap_or(Value::Null))
            }
            Err(e) => panic!("{url}: {e}"),
        }
    })
    .await
    .expect("request thread")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forms_are_routed_by_their_model_field_and_their_files_streamed_on() {
    let Some((_cluster, client, ns)) = cluster_with_crd("uploads").await else {
        return;
    };
    let ports = services(&client, &ns, &["chat", "code"]).await;
    let (chat_port, code_port) = (ports[0], ports[1]);
    let _chat = server("127.0.0.1", chat_port, "chat");
    let _code = server("127.0.0.1", code_port, "code");
    ready_pod(&client, &ns, "chat", "chat-0", "127.0.0.1").await;
    ready_pod(&client, &ns, "code", "code-0", "127.0.0.1").await;
    let mut config = config();
    config.limits.max_buffered_bytes = 128 << 10;
    config.limits.max_upload = 8 << 20;
    let base = router_with(&client, &ns, config, false).await;
    wait_ready_replicas(&base, "chat", 1).await;
    wait_ready_replicas(&base, "code", 1).await;
    let url = format!("{base}/v1/audio/transcriptions");
    let multipart = format!("multipart/form-data; boundary={BOUNDARY}");
    let audio = vec![7u8; 2 << 20];

    // The model first (as the openai SDK sends it), then the file: the replica of `code`
    // answers (ferrite-server serves no audio: its 404 for the path).
    let body = form(&[
        ("model", None, b"code"),
        ("language", None, b"en"),
        ("file", Some("speech.wav"), &audio),
    ]);
    let (status, answer) = upload(url.clone(), multipart.clone(), body).await;
    assert_eq!(status, 404, "{answer}");
    let message = answer["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("/v1/audio/transcriptions"),
        "the replica's answer for the path: {answer}"
    );
    let metrics = get_text(format!("{base}/metrics")).await;
    let to = |model: &str| {
        metric_sum(
            &metrics,
            "ferrite_router_requests_total",
            &[("model_name", model)],
        )
    };
    assert_eq!((to("code"), to("chat")), (1.0, 0.0), "{metrics}");

    // Refused before any replica sees them, in OpenAI's error shape.
    let cases: [(&str, Vec<u8>, String, u16, &str); 4] = [
        (
            "the file before the model",
            form(&[("file", Some("a.wav"), b"RIFF"), ("model", None, b"chat")]),
            multipart.clone(),
            400,
            "before the file",
        ),
        (
            "no model",
            form(&[("file", Some("a.wav"), b"RIFF")]),
            multipart.clone(),
            400,
            "model",
        ),
        (
            "an unknown model",
            form(&[
                ("model", None, b"whisper-9"),
                ("file", Some("a.wav"), b"RIFF"),
            ]),
            multipart.clone(),
            404,
            "does not exist",
        ),
        (
            "not a form",
            form(&[("model", None, b"chat")]),
            "application/octet-stream".to_string(),
            400,
            "multipart",
        ),
    ];
    for (what, body, content_type, want, says) in cases {
        let (status, answer) = upload(url.clone(), content_type, body).await;
        assert_eq!(status, want, "{what}: {answer}");
        let message = answer["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains(says), "{what}: {answer}");
    }
    // A body announced over --max-upload-body is refused from its head, before any of it is
    // read (the client need not send it).
    let addr = base.trim_start_matches("http://").to_string();
    let answer = tokio::task::spawn_blocking(move || {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(&addr).expect("connect");
        let head = format!(
            "POST /v1/audio/transcriptions HTTP/1.1\r\nHost: {addr}\r\n\
             Content-Type: multipart/form-data; boundary={BOUNDARY}\r\n\
             Content-Length: {}\r\n\r\n",
            9 << 20
        );
        s.write_all(head.as_bytes()).expect("head");
        let mut out = String::new();
        let _ = s.read_to_string(&mut out);
        out
    })
    .await
    .expect("request thread");
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    assert!(answer.contains("larger than"), "{answer}");
}

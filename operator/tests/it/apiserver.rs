//! A scripted API server on kube-rs's `tower-test` mock: each expected request (method and
//! path) gets a canned reply, and anything out of script is recorded as a failure and answered
//! with a 500. The verifier ends when the client is dropped.

use http::{Method, Request, Response, StatusCode};
use http_body_util::BodyExt;
use kube::Client;
use kube::client::Body;
use serde_json::{Value, json};

pub type Handle = tower_test::mock::Handle<Request<Body>, Response<Body>>;

/// How to answer one request, given its JSON body (`Null` when empty).
pub type Reply = Box<dyn FnOnce(&Value) -> (StatusCode, Value) + Send>;

/// One expected request.
pub struct Step {
    pub method: Method,
    pub path: String,
    pub reply: Reply,
}

/// A request as the server saw it.
#[derive(Debug, Clone)]
pub struct Seen {
    pub method: Method,
    /// Path and query.
    pub uri: String,
    pub body: Value,
}

impl Seen {
    pub fn is_write(&self) -> bool {
        self.method != Method::GET
    }
}

/// What the verifier saw, and every deviation from the script.
#[derive(Debug, Default)]
pub struct Transcript {
    pub seen: Vec<Seen>,
    pub errors: Vec<String>,
}

impl Transcript {
    /// Bodies of the requests to paths ending in `suffix` with `method`.
    pub fn bodies(&self, method: Method, suffix: &str) -> Vec<&Value> {
        self.seen
            .iter()
            .filter(|s| {
                s.method == method && s.uri.split('?').next().unwrap_or("").ends_with(suffix)
            })
            .map(|s| &s.body)
            .collect()
    }

    pub fn assert_clean(&self) {
        assert!(
            self.errors.is_empty(),
            "the API server saw requests out of script:\n{}\nall requests:\n{}",
            self.errors.join("\n"),
            self.summary()
        );
    }

    pub fn summary(&self) -> String {
        self.seen
            .iter()
            .map(|s| format!("{} {}", s.method, s.uri))
            .collect::<Vec<_>>()
            .join("\n")
    }
}

pub fn step(method: Method, path: impl Into<String>, reply: Reply) -> Step {
    Step {
        method,
        path: path.into(),
        reply,
    }
}

/// 404 with a Kubernetes `Status`, as the API server sends.
pub fn not_found() -> Reply {
    status_reply(StatusCode::NOT_FOUND, "NotFound")
}

pub fn status_reply(code: StatusCode, reason: &'static str) -> Reply {
    Box::new(move |_| {
        (
            code,
            json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                   "reason": reason, "message": format!("mock: {reason}"), "code": code.as_u16()}),
        )
    })
}

/// The `Status` a successful DELETE answers with.
pub fn deleted() -> Reply {
    ok(json!({"kind": "Status", "apiVersion": "v1", "status": "Success", "metadata": {}}))
}

pub fn ok(value: Value) -> Reply {
    Box::new(move |_| (StatusCode::OK, value))
}

/// Answers a write with its own body, given a uid and resourceVersion as the server would.
pub fn echo() -> Reply {
    Box::new(|body| {
        let mut b = body.clone();
        if let Some(meta) = b.get_mut("metadata").and_then(Value::as_object_mut) {
            meta.entry("uid").or_insert(json!("child-uid"));
            meta.entry("resourceVersion").or_insert(json!("1"));
            meta.entry("generation").or_insert(json!(1));
        }
        (StatusCode::OK, b)
    })
}

/// A mock client and the task answering it from `script`.
pub fn start(script: Vec<Step>) -> (Client, tokio::task::JoinHandle<Transcript>) {
    let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let client = Client::new(service, "default");
    let task = tokio::spawn(serve(handle, script));
    (client, task)
}

async fn serve(mut handle: Handle, script: Vec<Step>) -> Transcript {
    let mut t = Transcript::default();
    let mut steps = script.into_iter();
    while let Some((req, send)) = handle.next_request().await {
        let method = req.method().clone();
        let uri = req.uri().to_string();
        let path = req.uri().path().to_string();
        let bytes = match req.into_body().collect().await {
            Ok(b) => b.to_bytes(),
            Err(e) => {
                t.errors
                    .push(format!("{method} {uri}: reading the body: {e}"));
                Default::default()
            }
        };
        let body: Value = if bytes.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&bytes).unwrap_or(Value::Null)
        };
        t.seen.push(Seen {
            method: method.clone(),
            uri: uri.clone(),
            body: body.clone(),
        });
        let (code, reply) = match steps.next() {
            Some(s) if s.method == method && s.path == path => (s.reply)(&body),
            Some(s) => {
                t.errors.push(format!(
                    "expected {} {}, got {method} {uri}",
                    s.method, s.path
                ));
                (StatusCode::INTERNAL_SERVER_ERROR, json!({}))
            }
            None => {
                t.errors.push(format!("unexpected {method} {uri}"));
                (StatusCode::INTERNAL_SERVER_ERROR, json!({}))
            }
        };
        let response = Response::builder()
            .status(code)
            .header("content-type", "application/json")
            .body(Body::from(serde_json::to_vec(&reply).unwrap_or_default()));
        match response {
            Ok(r) => send.send_response(r),
            Err(e) => t.errors.push(format!("building a response: {e}")),
        }
    }
    for s in steps {
        t.errors
            .push(format!("never requested: {} {}", s.method, s.path));
    }
    t
}

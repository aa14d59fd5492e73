//! The OpenAI endpoint: find the InferenceService serving the request's `model`, hold the
//! request while it has no ready replica (waking it through the scale subresource), pick a
//! replica with its policy, and pass the response through chunk by chunk.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::task::{Context, Poll, ready};
use std::time::{Duration, Instant};

use axum::Json;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use ferrite_operator::crd::InferenceService;
use http_body::{Body as HttpBody, Frame, SizeHint};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::client::legacy::Client as HttpClient;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use kube::api::{Api, Patch, PatchParams};
use prometheus::Histogram;
use serde_json::{Value, json};

use crate::load::{Loads, Open};
use crate::metrics::Metrics;
use crate::policy::{self, Replica, Request};
use crate::prefix;
use crate::recent::RecentKeys;
use crate::registry::{Registry, Service};
use crate::work;

/// The router's settings.
#[derive(Debug, Clone)]
pub struct Config {
    /// Characters of the prompt that make the prefix key.
    pub prefix_chars: usize,
    /// Slack of prefix affinity's load bound.
    pub epsilon: f64,
    /// Largest request body accepted.
    pub max_body: usize,
    /// Time to connect to a replica.
    pub connect_timeout: Duration,
    /// How long a replica that refused a connection sits out, unless a scrape reaches it
    /// first.
    pub set_aside: Duration,
}

/// Shared by every request.
pub struct App {
    pub registry: Registry,
    pub loads: Loads,
    pub metrics: Metrics,
    pub config: Config,
    /// Writes the scale subresource to wake a service scaled to zero; absent: only wait.
    pub kube: Option<kube::Client>,
    /// Set on SIGTERM: `/readyz` fails so no new traffic arrives while streams finish.
    pub draining: AtomicBool,
    client: HttpClient<HttpConnector, Full<Bytes>>,
    turn: AtomicU64,
    /// Prefix keys routed lately.
    recent: RecentKeys,
}

impl std::fmt::Debug for App {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("App").field("config", &self.config).finish()
    }
}

impl App {
    pub fn new(
        registry: Registry,
        loads: Loads,
        metrics: Metrics,
        config: Config,
        kube: Option<kube::Client>,
    ) -> App {
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(config.connect_timeout));
        connector.set_nodelay(true);
        let client = HttpClient::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(60))
            .build(connector);
        App {
            registry,
            loads,
            metrics,
            config,
            kube,
            draining: AtomicBool::new(false),
            client,
            turn: AtomicU64::new(0),
            recent: RecentKeys::default(),
        }
    }
}

/// An OpenAI-style error.
pub fn error(
    status: StatusCode,
    kind: &str,
    message: impl Into<String>,
    param: Option<&str>,
) -> Response {
    let body = json!({"error": {
        "message": message.into(),
        "type": kind,
        "param": param,
        "code": status.as_u16(),
    }});
    (status, Json(body)).into_response()
}

/// `GET /v1/models`: every model, with how many replicas are ready.
pub async fn models(State(app): State<Arc<App>>) -> Response {
    let data: Vec<Value> = app
        .registry
        .all()
        .into_iter()
        .map(|s| {
            let state = match (s.endpoints.len(), s.replicas) {
                (0, 0) => "scaled-to-zero",
                (0, _) => "starting",
                _ => "ready",
            };
            json!({
                "id": s.model,
                "object": "model",
                "created": 0,
                "owned_by": format!("{}/{}", s.namespace, s.name),
                "ready_replicas": s.endpoints.len(),
                "replicas": s.replicas,
                "state": state,
            })
        })
        .collect();
    Json(json!({"object": "list", "data": data})).into_response()
}

/// `POST /v1/completions` and `/v1/chat/completions`.
pub async fn forward(
    State(app): State<Arc<App>>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let parsed: Value = match serde_json::from_slice(&body) {
        Ok(v @ Value::Object(_)) => v,
        Ok(_) => {
            return error(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                "the body must be a JSON object",
                None,
            );
        }
        Err(e) => {
            return error(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                format!("invalid JSON body: {e}"),
                None,
            );
        }
    };
    let Some(model) = parsed
        .get("model")
        .and_then(Value::as_str)
        .map(str::to_string)
    else {
        return error(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "`model` is required",
            Some("model"),
        );
    };
    let Some(mut svc) = app.registry.find(&model) else {
        // Not the client's string: any client could otherwise mint series without end.
        app.metrics
            .requests
            .with_label_values(&["", "none", "unknown_model"])
            .inc();
        return error(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            format!("The model `{model}` does not exist."),
            Some("model"),
        );
    };
    let policy_label = svc.policy.as_str();
    if svc.endpoints.is_empty() {
        svc = match hold(&app, svc).await {
            Ok(s) => s,
            Err(timeout) => {
                app.metrics
                    .requests
                    .with_label_values(&[&model, policy_label, "cold_start_timeout"])
                    .inc();
                let mut r = error(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "service_unavailable",
                    format!(
                        "The model `{model}` has no ready replica after {}s; it is starting, retry later.",
                        timeout.as_secs()
                    ),
                    None,
                );
                r.headers_mut()
                    .insert(header::RETRY_AFTER, HeaderValue::from(30u32));
                return r;
            }
        };
    }
    let key = prefix::key(&parsed, app.config.prefix_chars);
    let work = work::estimate(&parsed);
    // Asked once per request (a retry is the same request).
    let known = key.as_deref().is_some_and(|k| app.recent.seen(k));
    // A chat stream opens with the role event before its first token.
    let preamble = u64::from(uri.path().ends_with("/chat/completions"));
    let path = uri
        .path_and_query()
        .map_or(uri.path(), |p| p.as_str())
        .to_string();
    let mut tried: Option<String> = None;
    for attempt in 0..2 {
        let untried: Vec<_> = svc
            .endpoints
            .iter()
            .filter(|e| tried.as_deref() != Some(e.name.as_str()))
            .collect();
        // Replicas that just refused a connection sit out, unless none is left.
        let reachable: Vec<_> = untried
            .iter()
            .copied()
            .filter(|e| !app.loads.is_set_aside(&e.base_url))
            .collect();
        let candidates = if reachable.is_empty() {
            untried
        } else {
            reachable
        };
        let replicas: Vec<Replica> = candidates
            .iter()
            .map(|e| Replica {
                name: e.name.clone(),
                load: app.loads.get(&e.base_url),
            })
            .collect();
        let request = Request {
            key: key.as_deref(),
            work: work.total(),
            turn: app.turn.fetch_add(1, Ordering::Relaxed),
            known,
        };
        let Some(d) = policy::pick(svc.policy, &replicas, request, app.config.epsilon) else {
            break;
        };
        let ep = candidates[d.index];
        app.metrics
            .decisions
            .with_label_values(&[&model, policy_label, d.affinity.as_str()])
            .inc();
        let open = app.loads.open(&ep.base_url, work, preamble);
        let in_flight = app.metrics.in_flight.with_label_values(&[&model, &ep.name]);
        in_flight.inc();
        let gauge = GaugeGuard(in_flight);
        let started = Instant::now();
        let url = format!("{}{}", ep.base_url, path);
        let result = send(&app, &method, &url, &headers, body.clone()).await;
        let retry_reason = match &result {
            Err(_) => {
                app.loads.set_aside(&ep.base_url, app.config.set_aside);
                Some("connect")
            }
            Ok(r) if r.status() == StatusCode::SERVICE_UNAVAILABLE => Some("unavailable"),
            Ok(_) => None,
        };
        if let (Some(reason), 0) = (retry_reason, attempt)
            && svc.endpoints.len() > 1
        {
            tracing::info!(model, pod = %ep.name, reason, "retrying on another replica");
            app.metrics
                .retries
                .with_label_values(&[&model, reason])
                .inc();
            tried = Some(ep.name.clone());
            continue;
        }
        app.metrics
            .upstream_headers
            .with_label_values(&[&model])
            .observe(started.elapsed().as_secs_f64());
        return match result {
            Ok(resp) => {
                let outcome = if resp.status().is_success() {
                    "success"
                } else if resp.status().is_client_error() {
                    "client_error"
                } else {
                    "upstream_error"
                };
                app.metrics
                    .requests
                    .with_label_values(&[&model, policy_label, outcome])
                    .inc();
                let (parts, incoming) = resp.into_parts();
                let event_stream = parts
                    .headers
                    .get(header::CONTENT_TYPE)
                    .and_then(|v| v.to_str().ok())
                    .is_some_and(|v| v.starts_with("text/event-stream"));
                let tracked = Tracked {
                    inner: incoming,
                    open,
                    event_stream,
                    _gauge: gauge,
                    started,
                    duration: Some(app.metrics.upstream_duration.with_label_values(&[&model])),
                    broken: event_stream.then(|| BrokenStream {
                        counter: app.metrics.broken_streams.with_label_values(&[&model]),
                        replica: ep.name.clone(),
                    }),
                    ended: false,
                };
                Response::from_parts(parts, Body::new(tracked))
            }
            Err(e) => {
                app.metrics
                    .requests
                    .with_label_values(&[&model, policy_label, "upstream_error"])
                    .inc();
                error(
                    StatusCode::BAD_GATEWAY,
                    "upstream_error",
                    format!("replica {} is unreachable: {e}", ep.name),
                    None,
                )
            }
        };
    }
    app.metrics
        .requests
        .with_label_values(&[&model, policy_label, "upstream_error"])
        .inc();
    error(
        StatusCode::SERVICE_UNAVAILABLE,
        "service_unavailable",
        format!("no replica of `{model}` answered"),
        None,
    )
}

/// Headers passed to the replica: what the OpenAI API reads; hop-by-hop headers stay here.
const FORWARDED: [header::HeaderName; 3] =
    [header::CONTENT_TYPE, header::AUTHORIZATION, header::ACCEPT];

async fn send(
    app: &App,
    method: &Method,
    url: &str,
    headers: &HeaderMap,
    body: Bytes,
) -> Result<hyper::Response<Incoming>, String> {
    let mut req = hyper::Request::builder().method(method.clone()).uri(url);
    for name in FORWARDED
        .iter()
        .chain([&header::HeaderName::from_static("x-request-id")])
    {
        for v in headers.get_all(name) {
            req = req.header(name, v);
        }
    }
    let req = req.body(Full::new(body)).map_err(|e| e.to_string())?;
    app.client.request(req).await.map_err(|e| e.to_string())
}

/// Holds a request until `svc` has a ready replica or its cold-start timeout passes, waking
/// the service through its scale subresource if it is scaled to zero. A client that
/// disconnects drops this future, and with it the hold.
async fn hold(app: &App, svc: Service) -> Result<Service, Duration> {
    let timeout = svc.cold_start_timeout;
    let deadline = tokio::time::Instant::now() + timeout;
    let gauge = app
        .metrics
        .held
        .with_label_values(&[&svc.namespace, &svc.name, &svc.model]);
    gauge.inc();
    let _held = GaugeGuard(gauge);
    let started = Instant::now();
    let histogram = app.metrics.cold_start.with_label_values(&[&svc.model]);
    let mut changes = app.registry.changes();
    let mut woken = false;
    loop {
        if let Some(s) = app.registry.find(&svc.model) {
            if !s.endpoints.is_empty() {
                histogram.observe(started.elapsed().as_secs_f64());
                return Ok(s);
            }
            if s.replicas == 0 && !woken {
                woken = wake(app, &s).await;
            }
        }
        tokio::select! {
            r = changes.changed() => if r.is_err() { break },
            _ = tokio::time::sleep_until(deadline) => break,
        }
    }
    histogram.observe(started.elapsed().as_secs_f64());
    Err(timeout)
}

/// Sets `spec.replicas` to 1 through the scale subresource (what `kubectl scale` does), so
/// a service scaled to zero starts; with autoscaling on, the autoscaler takes it from there.
async fn wake(app: &App, svc: &Service) -> bool {
    let Some(client) = &app.kube else {
        return false;
    };
    let api: Api<InferenceService> = Api::namespaced(client.clone(), &svc.namespace);
    let patch = Patch::Merge(json!({"spec": {"replicas": 1}}));
    match api
        .patch_scale(&svc.name, &PatchParams::default(), &patch)
        .await
    {
        Ok(_) => {
            tracing::info!(namespace = %svc.namespace, name = %svc.name, "scaled from zero for a held request");
            true
        }
        Err(e) => {
            tracing::warn!(namespace = %svc.namespace, name = %svc.name, error = %e, "could not scale from zero; waiting");
            false
        }
    }
}

/// Decrements a gauge when dropped.
struct GaugeGuard(prometheus::IntGauge);

impl Drop for GaugeGuard {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// A replica's response body on its way to the client: frames pass through as they come;
/// the request stays counted against the replica until the body ends or the client leaves.
struct Tracked {
    inner: Incoming,
    /// Counted against the replica until the body ends; an event stream's events tell it
    /// how far the replica has got.
    open: Open,
    event_stream: bool,
    _gauge: GaugeGuard,
    started: Instant,
    duration: Option<Histogram>,
    /// Set for event streams: a replica lost mid-stream ends the stream with an error event.
    broken: Option<BrokenStream>,
    ended: bool,
}

/// What an event stream needs to fail cleanly when its replica goes away.
struct BrokenStream {
    counter: prometheus::IntCounter,
    replica: String,
}

impl BrokenStream {
    /// The last event of a stream whose replica failed, as vLLM reports errors inside a
    /// stream: OpenAI's clients raise it as an API error, where a cut connection would
    /// surface as a transport error with no reason.
    fn event(&self, e: &hyper::Error) -> Bytes {
        let body = json!({"error": {
            "message": format!("replica {} failed mid-stream: {e}", self.replica),
            "type": "upstream_error",
            "param": null,
            "code": StatusCode::BAD_GATEWAY.as_u16(),
        }});
        Bytes::from(format!("data: {body}\n\n"))
    }
}

impl Tracked {
    /// The replica's body ended: nothing more to pass on, and its duration is known.
    fn finish(&mut self) {
        self.ended = true;
        if let Some(h) = self.duration.take() {
            h.observe(self.started.elapsed().as_secs_f64());
        }
    }
}

/// Server-sent events that start in `chunk`: its `data:` fields at the start of a line.
fn events_in(chunk: &[u8]) -> u64 {
    let mut n = u64::from(chunk.starts_with(b"data:"));
    n += chunk
        .windows(6)
        .filter(|w| w[0] == b'\n' && &w[1..] == b"data:")
        .count() as u64;
    n
}

impl HttpBody for Tracked {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        if self.ended {
            return Poll::Ready(None);
        }
        let frame = ready!(Pin::new(&mut self.inner).poll_frame(cx));
        match frame {
            None => {
                self.finish();
                Poll::Ready(None)
            }
            Some(Err(e)) if self.broken.is_some() => {
                self.ended = true;
                let event = self.broken.as_ref().map(|b| {
                    b.counter.inc();
                    tracing::warn!(replica = %b.replica, error = %e, "replica failed mid-stream");
                    b.event(&e)
                });
                Poll::Ready(event.map(|b| Ok(Frame::data(b))))
            }
            Some(Ok(frame)) => {
                if self.event_stream
                    && let Some(data) = frame.data_ref()
                {
                    let events = events_in(data);
                    self.open.events(events);
                }
                // hyper reads a body of known length no further than its last byte, so
                // its end shows here rather than as a final `None`.
                if self.inner.is_end_stream() {
                    self.finish();
                }
                Poll::Ready(Some(Ok(frame)))
            }
            other => Poll::Ready(other),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.ended || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        if self.broken.is_some() {
            // The error event may add bytes the replica never announced.
            SizeHint::default()
        } else {
            self.inner.size_hint()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::events_in;

    #[test]
    fn events_are_counted_by_their_data_lines() {
        assert_eq!(events_in(b"data: {\"a\":1}\n\n"), 1);
        assert_eq!(events_in(b"data: {}\n\ndata: {}\n\ndata: [DONE]\n\n"), 3);
        // A field inside a JSON string is not at the start of a line.
        assert_eq!(events_in(b"data: {\"text\":\"data: x\"}\n\n"), 1);
        assert_eq!(events_in(b": keep-alive\n\n"), 0);
        assert_eq!(events_in(b""), 0);
    }
}

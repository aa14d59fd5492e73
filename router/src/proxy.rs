//! The OpenAI endpoint: admit the request within the router's limits, read what routing needs
//! from its body, find the InferenceService serving its `model`, hold it while the service has
//! no ready replica (waking it through the scale subresource), pick a replica with its policy,
//! and pass the response through chunk by chunk.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::task::{Context, Poll, ready};
use std::time::{Duration, Instant};

use axum::Json;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http_body::{Body as HttpBody, Frame, SizeHint};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::client::legacy::Client as HttpClient;
use hyper_util::client::legacy::connect::HttpConnector;
use prometheus::Histogram;
use serde_json::{Value, json};
use tokio::sync::OwnedSemaphorePermit;

use crate::candidates::candidates;
use crate::flow::{self, Admit, Ask, Dispatched, FlowConfig, Flows};
use crate::limits::{LimitConfig, Limits, Refusal};
use crate::load::{Loads, Open};
use crate::members::Endpoint;
use crate::metrics::Metrics;
use crate::multipart::{self, Head, Upload};
use crate::parse::{self, Api, Parsed};
use crate::peers::{PeerConfig, Peers};
use crate::policy::{self, Replica, Request};
use crate::quota::{self, Charge, Quotas, Throttled};
use crate::recent::RecentKeys;
use crate::registry::{Registry, Service};
use crate::resume::{self, Transcript};
use crate::ring::{Ring, Rings};
use crate::tenants::{Tenant, Tenants};
use crate::wake::{self, Wakes};

/// The router's settings.
#[derive(Debug, Clone)]
pub struct Config {
    /// Characters of the prompt that make the prefix key.
    pub prefix_chars: usize,
    /// Slack of prefix affinity's load bound.
    pub epsilon: f64,
    /// What the router may hold at once (bodies, open and held requests).
    pub limits: LimitConfig,
    /// Time to connect to a replica.
    pub connect_timeout: Duration,
    /// Time for a request's body to arrive.
    pub body_read_timeout: Duration,
    /// How long a replica that refused a connection sits out, unless a scrape reaches it
    /// first.
    pub set_aside: Duration,
    /// With tenants (`--tenants`): the namespace of the Secrets holding their API keys. Every
    /// request then needs a tenant's key, may use only the tenant's models, and is held to
    /// its limits; `None`: no authentication here (a cluster with a gateway of its own).
    pub tenants: Option<String>,
    /// With tenants: this router's replicas. Each then enforces its share of every tenant's
    /// limits, following the tenant's traffic on each ([`crate::peers`]); `None`: this replica
    /// enforces them whole.
    pub peers: Option<PeerConfig>,
    /// Flow control: requests for a service whose replicas are all saturated wait here, in
    /// priority order and fair across tenants; `None`: they go to the replicas at once.
    pub flow: Option<FlowConfig>,
}

/// Shared by every request.
pub struct App {
    pub registry: Registry,
    pub loads: Loads,
    pub metrics: Metrics,
    pub config: Config,
    pub limits: Limits,
    /// Writes the scale subresource to wake a service scaled to zero; absent: only wait.
    pub kube: Option<kube::Client>,
    /// One wake per service at a time.
    pub wakes: Wakes,
    /// Set on SIGTERM: `/readyz` fails so no new traffic arrives while streams finish.
    pub draining: AtomicBool,
    client: HttpClient<HttpConnector, Full<Bytes>>,
    /// For form uploads, streamed as they arrive.
    upload_client: HttpClient<HttpConnector, Upload>,
    turn: AtomicU64,
    /// Draws for split names whose request has no prefix key.
    draws: AtomicU64,
    /// Prefix keys routed lately.
    recent: RecentKeys,
    /// Each service's hash ring, rebuilt when its replicas change.
    pub rings: Rings,
    /// The tenants and their keys, when they are on.
    pub tenants: Option<Tenants>,
    /// Each tenant's limits.
    pub quotas: Quotas,
    /// The router's replicas, among which the limits are split.
    pub peers: Option<Peers>,
    /// The queues of saturated services, with flow control on.
    pub flows: Option<Arc<Flows>>,
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
        tenants: Option<Tenants>,
        peers: Option<Peers>,
    ) -> App {
        let client = ferrite_api::scrape::pod_client(config.connect_timeout);
        let upload_client = ferrite_api::scrape::pod_client(config.connect_timeout);
        App {
            registry,
            loads,
            metrics,
            limits: Limits::new(config.limits),
            flows: config.flow.map(Flows::new),
            config,
            kube,
            wakes: Wakes::default(),
            draining: AtomicBool::new(false),
            client,
            upload_client,
            turn: AtomicU64::new(0),
            draws: AtomicU64::new(0),
            recent: RecentKeys::default(),
            rings: Rings::default(),
            tenants,
            quotas: Quotas::default(),
            peers,
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

/// An error the client should retry after `secs` (`Retry-After`).
fn retry_after(status: StatusCode, kind: &str, message: impl Into<String>, secs: u64) -> Response {
    let mut r = error(status, kind, message, None);
    r.headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from(secs));
    r
}

/// A 429 for a service too busy to queue for (the openai SDK retries it after `secs`).
fn too_busy(message: impl Into<String>, secs: u64) -> Response {
    retry_after(
        StatusCode::TOO_MANY_REQUESTS,
        "rate_limit_error",
        message,
        secs,
    )
}

/// A 503 the client should retry after `secs`.
fn unavailable(message: impl Into<String>, secs: u64) -> Response {
    retry_after(
        StatusCode::SERVICE_UNAVAILABLE,
        "service_unavailable",
        message,
        secs,
    )
}

fn invalid(message: impl Into<String>, param: Option<&str>) -> Response {
    error(
        StatusCode::BAD_REQUEST,
        "invalid_request_error",
        message,
        param,
    )
}

/// `GET /v1/models`: every model, with how many replicas are ready, then each adapter a
/// service declares (and holds: the oldest declarer of a name) with `parent` set to its
/// model, as vLLM lists them.
///
/// With tenants, the request needs a tenant's key (401), and the list holds only the services
/// the tenant may use: one tenant does not learn another's models.
pub async fn models(State(app): State<Arc<App>>, headers: HeaderMap) -> Response {
    let tenant = match authenticate(&app, &headers) {
        Ok(t) => t,
        Err(message) => return unauthorized(&app, message),
    };
    let mut services = app.registry.all();
    if let Some(t) = &tenant {
        services.retain(|s| {
            t.may_use(&s.namespace, &s.name, &s.model, &s.model)
                || s.adapters
                    .iter()
                    .chain(&s.aliases)
                    .any(|a| t.models.contains(a))
        });
    }
    let adapters: Vec<Value> = services
        .iter()
        .flat_map(|s| s.adapters.iter().map(move |a| (s, a)))
        .filter(|(s, a)| {
            app.registry
                .find(a)
                .is_some_and(|h| h.adapter.is_some() && h.id() == s.id())
        })
        .map(|(s, a)| {
            json!({
                "id": a,
                "object": "model",
                "created": 0,
                "owned_by": s.id(),
                "parent": s.model,
                "root": a,
            })
        })
        .collect();
    // Each alias its holder answers to, with the served name it stands for as `root`.
    let aliases: Vec<Value> = services
        .iter()
        .flat_map(|s| s.aliases.iter().map(move |a| (s, a)))
        .filter(|(s, a)| {
            app.registry
                .find(a)
                .is_some_and(|h| h.id() == s.id() && h.adapter.is_none() && h.model != **a)
        })
        .map(|(s, a)| {
            json!({
                "id": a,
                "object": "model",
                "created": 0,
                "owned_by": s.id(),
                "root": s.model,
            })
        })
        .collect();
    let data: Vec<Value> = services
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
        .chain(adapters)
        .chain(aliases)
        .collect();
    Json(json!({"object": "list", "data": data})).into_response()
}

/// `POST /v1/completions` and `/v1/chat/completions`.
pub async fn forward(State(app): State<Arc<App>>, req: axum::extract::Request) -> Response {
    forward_as(app, req, Api::Generation).await
}

/// `POST /v1/embeddings`.
pub async fn forward_pooling(State(app): State<Arc<App>>, req: axum::extract::Request) -> Response {
    forward_as(app, req, Api::Pooling).await
}

/// Any other `POST` with a JSON body that names a `model` (`/tokenize`, `/detokenize`, and
/// the rest of `/v1/*`): passed to a replica of that model's service, whose server answers
/// for whether it serves the path.
pub async fn forward_other(State(app): State<Arc<App>>, req: axum::extract::Request) -> Response {
    forward_as(app, req, Api::Other).await
}

/// `POST /v1/audio/transcriptions` and `/v1/audio/translations`: a `multipart/form-data` body
/// whose `model` field comes before the file. Admitted within `--max-upload-body` → the head
/// read up to the `model` field (bounded) → the service resolved, its tenant's access and
/// limits checked, a dispatch → one replica, the head and then the rest of the body streamed to
/// it as it arrives (no retry: the body is not kept).
pub async fn forward_upload(State(app): State<Arc<App>>, req: axum::extract::Request) -> Response {
    let (mut parts, body) = req.into_parts();
    let head_limit = multipart::HEAD_LIMIT;
    let admission = match app
        .limits
        .admit_upload(content_length(&parts.headers), head_limit)
    {
        Ok(a) => a,
        Err(Refusal::BodyTooLarge) => {
            return error(
                StatusCode::PAYLOAD_TOO_LARGE,
                "invalid_request_error",
                format!(
                    "the request body is larger than {} bytes",
                    app.limits.config.max_upload
                ),
                None,
            );
        }
        Err(r) => return refused(&app, r),
    };
    let tenant = match authenticate(&app, &parts.headers) {
        Ok(t) => t,
        Err(message) => return unauthorized(&app, message),
    };
    let Some(boundary) = parts
        .headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(multipart::boundary)
    else {
        return invalid("the body must be multipart/form-data with a boundary", None);
    };
    let timeout = app.config.body_read_timeout;
    let (head, rest, model) = match read_head(body, &boundary, timeout).await {
        Ok(read) => read,
        Err(response) => return response,
    };
    let parsed = Parsed {
        model: Some(model.clone()),
        model_at: None,
        key: None,
        // The audio's length is not known here: one request's worth.
        work: crate::work::Work {
            prompt: 1.0,
            output: 0.0,
        },
    };
    let Routed {
        svc,
        mut dispatched,
        charge,
    } = match route(&app, &model, &parsed, &mut parts.headers, tenant.as_deref()).await {
        Ok(r) => r,
        Err(response) => return *response,
    };
    let ring = ring_of(&app, &svc);
    let Some(ep) = pick(&app, &svc, &ring, &parsed, None, false, None) else {
        count_request(&app, &svc, "upstream_error");
        return unavailable(format!("no replica of `{}` answered", svc.model), 1);
    };
    let open = app.loads.open(&ep.base_url, parsed.work, 0);
    if let Some(d) = dispatched.as_mut() {
        d.placed();
    }
    let model_name = svc.model.as_str();
    let gauge = GaugeGuard::inc(
        app.metrics
            .in_flight
            .with_label_values(&[model_name, &ep.name]),
    );
    let started = Instant::now();
    let path = parts
        .uri
        .path_and_query()
        .map_or(parts.uri.path(), |p| p.as_str());
    let upload = Upload::new(head, rest, app.limits.config.max_upload, timeout);
    let mut request = hyper::Request::builder()
        .method(parts.method.clone())
        .uri(format!("{}{}", ep.base_url, path));
    for (name, value) in forwarded(&parts.headers) {
        request = request.header(name, value);
    }
    let request = match request.body(upload) {
        Ok(r) => r,
        Err(e) => return upstream_error(&app, &svc, ep, "building the request", e),
    };
    // The head's reservation goes now: the rest is never held.
    drop(admission.body);
    let resp = match app.upload_client.request(request).await {
        Ok(r) => r,
        Err(e) => return upstream_error(&app, &svc, ep, "replica unreachable", e),
    };
    app.metrics
        .upstream_headers
        .with_label_values(&[model_name])
        .observe(started.elapsed().as_secs_f64());
    if let Some(refused) = refused_key(&app, &svc, resp.status()) {
        return refused;
    }
    count_request(&app, &svc, outcome(resp.status()));
    let tracking = Tracking {
        open,
        gauge,
        slots: Slots {
            _open: admission.open,
            flow: dispatched,
        },
        started,
        charge,
        resumer: None,
    };
    relay(&app, &svc, ep, resp, tracking)
}

/// Reads a form's body up to its `model` field: the bytes read, the rest of the body, and the
/// model; or the answer for a form without one in its head, or one that did not arrive.
async fn read_head(
    body: axum::body::Body,
    boundary: &str,
    timeout: Duration,
) -> Result<(Bytes, axum::body::Body, String), Response> {
    use http_body_util::BodyExt;
    let mut body = body;
    let mut head = Vec::new();
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        match multipart::find_model(&head, boundary) {
            Head::Model(m) => return Ok((Bytes::from(head), body, m)),
            Head::Missing(why) => return Err(invalid(why, Some("model"))),
            Head::More => {}
        }
        let frame = match tokio::time::timeout_at(deadline, body.frame()).await {
            Err(_) => {
                return Err(error(
                    StatusCode::REQUEST_TIMEOUT,
                    "invalid_request_error",
                    "the request body did not arrive in time",
                    None,
                ));
            }
            Ok(None) => return Err(invalid("the form has no `model` field", Some("model"))),
            Ok(Some(Err(_))) => return Err(invalid("could not read the request body", None)),
            Ok(Some(Ok(frame))) => frame,
        };
        if let Ok(data) = frame.into_data() {
            head.extend_from_slice(&data);
        }
        if head.len() > multipart::HEAD_LIMIT {
            // The frame that crossed the limit may still hold the field, near its start.
            return match multipart::find_model(&head, boundary) {
                Head::Model(m) => Ok((Bytes::from(head), body, m)),
                _ => Err(invalid(
                    "the `model` field must come first, within the first 64 KiB",
                    Some("model"),
                )),
            };
        }
    }
}

/// Where a request goes once its `model` is known.
struct Routed {
    svc: Service,
    /// Its dispatch, with flow control.
    dispatched: Option<Dispatched>,
    /// Its tenant's charge, with tenants.
    charge: Option<TenantCharge>,
}

/// The steps from a request's `model` to its service, for JSON bodies and forms alike: the
/// tenant's access and limits → the member of a split → the service, held while it wakes →
/// the credential its pods get → the dispatch, waiting while it is saturated. Or the answer
/// that ends the request.
async fn route(
    app: &App,
    model: &str,
    parsed: &Parsed,
    headers: &mut HeaderMap,
    tenant: Option<&Tenant>,
) -> Result<Routed, Box<Response>> {
    let charge = match tenant {
        Some(t) => Some(admit_tenant(app, t, model, parsed)?),
        None => None,
    };
    // A name several services share by weight: one of them, by the prefix key.
    let target = split_member(app, model, parsed, headers).map_err(|m| invalid(m, None))?;
    let svc = resolve(app, target.as_deref().unwrap_or(model)).await?;
    credential(app, &svc, headers).await?;
    // Waits here while every replica is saturated.
    let dispatched = dispatch(app, &svc, tenant, parsed.work.total()).await?;
    let charge = charge.map(|c| TenantCharge {
        charge: c,
        tenant: tenant.map(|t| t.name.clone()).unwrap_or_default(),
        model: svc.model.clone(),
        prompt: parsed.work.prompt,
    });
    Ok(Routed {
        svc,
        dispatched,
        charge,
    })
}

/// The `Authorization` a replica of `svc` gets. Without tenants, the client's: it holds the
/// service's key, if the service has one. With tenants, never the client's (a tenant's key is
/// the router's to check): the service's own key where `spec.auth` names one, else none.
async fn credential(
    app: &App,
    svc: &Service,
    headers: &mut HeaderMap,
) -> Result<(), Box<Response>> {
    let Some(tenants) = &app.tenants else {
        return Ok(());
    };
    headers.remove(header::AUTHORIZATION);
    let Some(secret) = &svc.api_key else {
        return Ok(());
    };
    match tenants.service_keys.get(&svc.namespace, secret).await {
        Ok(key) => {
            headers.insert(header::AUTHORIZATION, key.header().clone());
            Ok(())
        }
        Err(e) => {
            tracing::warn!(service = %svc.id(), error = %e, "no API key to send the service");
            count_request(app, svc, "upstream_error");
            Err(Box::new(unavailable(
                format!(
                    "`{}` cannot be reached through this router: its API key: {e}",
                    svc.model
                ),
                5,
            )))
        }
    }
}

/// A replica's 401 to the key the router sent for its service (the Secret was rotated since
/// it was read): not the tenant's to fix, so a 503; the key is read again for the next request.
fn refused_key(app: &App, svc: &Service, status: StatusCode) -> Option<Response> {
    let (Some(tenants), Some(secret)) = (&app.tenants, &svc.api_key) else {
        return None;
    };
    if status != StatusCode::UNAUTHORIZED {
        return None;
    }
    tenants.service_keys.forget(&svc.namespace, secret);
    count_request(app, svc, "upstream_error");
    Some(unavailable(
        format!(
            "`{}` refused the router's copy of its API key; it is read again",
            svc.model
        ),
        1,
    ))
}

/// A tenant's access to `model` and its limits for this request: the charge, or the 403/429.
fn admit_tenant(
    app: &App,
    t: &Tenant,
    model: &str,
    parsed: &Parsed,
) -> Result<Charge, Box<Response>> {
    // One lookup for the access check and the series' model name (tenants off: none).
    let found = app.registry.find(model);
    // Before any hold: a tenant may not wake a service it may not use.
    if let Some(refusal) = refuse_access(app, t, model, found.as_ref()) {
        return Err(Box::new(refusal));
    }
    // Tenants' series name the served model, never the client's string (an unknown name is
    // "", as in the router's own request counts).
    let served = found.map(|s| s.model).unwrap_or_default();
    let now = Instant::now();
    let share = app.peers.as_ref().map_or(1.0, |p| {
        p.record(&t.name, parsed.work.total(), now);
        p.share(&t.name)
    });
    let limits = t.limits.share(share);
    match app.quotas.admit(&t.name, limits, parsed.work.total(), now) {
        Ok(c) => {
            count_tenant(app, t, &served, "admitted");
            Ok(c)
        }
        Err(throttled) => Err(Box::new(throttle(app, t, &served, &throttled))),
    }
}

/// A request to an endpoint of kind `api`, as its steps: admit (bounded) → read and parse the
/// body (bounded) → resolve the service (holding while it wakes) → attempt a replica, again on
/// another only if the first provably did not take the request.
async fn forward_as(app: Arc<App>, req: axum::extract::Request, api: Api) -> Response {
    let (mut parts, body) = req.into_parts();
    let admission = match app.limits.admit(content_length(&parts.headers)) {
        Ok(a) => a,
        Err(r) => {
            // A body within the limit is taken and dropped while the 503 goes out, so that its
            // client reads the refusal; one over it gets its 413 and the connection closes.
            if r == Refusal::Busy {
                ferrite_net::discard_body(
                    body,
                    app.limits.config.max_body,
                    app.config.body_read_timeout,
                );
            }
            return refused(&app, r);
        }
    };
    let tenant = match authenticate(&app, &parts.headers) {
        Ok(t) => t,
        Err(message) => {
            let response = unauthorized(&app, message);
            // Read and dropped, as a busy refusal's, so that the client reads the 401.
            ferrite_net::discard_body(
                body,
                app.limits.config.max_body,
                app.config.body_read_timeout,
            );
            return response;
        }
    };
    let read = ferrite_net::read_body(
        body,
        app.limits.config.max_body,
        app.config.body_read_timeout,
    );
    let body = match read.await {
        Ok(b) => b,
        Err(e) => return unreadable(&app, e),
    };
    let parsed = match parse::parse_as(&body, app.config.prefix_chars, api) {
        Ok(p) => p,
        Err(e) => return invalid(e.to_string(), None),
    };
    let Some(model) = parsed.model.as_deref() else {
        return invalid("`model` is required", Some("model"));
    };
    let Routed {
        svc,
        dispatched,
        charge,
    } = match route(&app, model, &parsed, &mut parts.headers, tenant.as_deref()).await {
        Ok(r) => r,
        Err(response) => return *response,
    };
    let body = served_body(body, &parsed, model, &svc);
    // A stream that can be resumed on another replica keeps its body (and the body's place in
    // the buffered-bytes budget) until it ends.
    let mut admission = admission;
    let seed = resume::Kind::of_path(parts.uri.path())
        .filter(|k| api == Api::Generation && resume::resumable(*k, &body))
        .map(|kind| ResumeSeed {
            kind,
            body: body.clone(),
            _reservation: admission.body.take(),
        });
    let slots = Slots {
        _open: admission.open,
        flow: dispatched,
    };
    // Otherwise the body's reservation (`admission.body`) is given back when this returns,
    // with the response head: the body is no longer needed once a replica answered.
    attempt(&app, &svc, &parsed, &parts, body, slots, charge, seed).await
}

/// What a resumable stream keeps from its request.
struct ResumeSeed {
    kind: resume::Kind,
    body: Bytes,
    _reservation: Option<OwnedSemaphorePermit>,
}

/// What a request holds while it is open: its place among the router's open requests, and
/// with flow control, its flow's dispatch.
struct Slots {
    _open: OwnedSemaphorePermit,
    flow: Option<Dispatched>,
}

/// With flow control on: a dispatch for this request, at once when `svc` has room and
/// nothing waits for it, else after waiting its turn; a 429 when the queue is full and this
/// request is the one shed, a 503 when it waited too long.
async fn dispatch(
    app: &App,
    svc: &Service,
    tenant: Option<&Tenant>,
    work: f64,
) -> Result<Option<Dispatched>, Response> {
    let Some(flows) = &app.flows else {
        return Ok(None);
    };
    let id = svc.id();
    let ask = Ask {
        service: &id,
        flow: tenant.map_or("", |t| t.name.as_str()),
        priority: tenant.map_or(0, |t| t.priority),
        cost: work,
    };
    let started = Instant::now();
    let outcome = match flows.admit(ask, room(app, svc, flows.config()), started) {
        Admit::Go(d) => Ok(d),
        Admit::Wait(w) => w.until_dispatched().await,
        Admit::Refused(r) => Err(r),
    };
    app.metrics
        .queue_duration
        .with_label_values(&[&svc.model, ask.flow])
        .observe(started.elapsed().as_secs_f64());
    let refusal = match outcome {
        Ok(d) => return Ok(Some(d)),
        Err(r) => r,
    };
    let (label, response) = match refusal {
        flow::Refused::Shed => (
            "shed",
            too_busy(
                format!(
                    "The model `{}` is saturated and too many requests wait for it; retry later.",
                    svc.model
                ),
                2,
            ),
        ),
        flow::Refused::TimedOut => (
            "queue_timeout",
            unavailable(
                format!(
                    "The model `{}` stayed saturated for {}s while this request waited.",
                    svc.model,
                    flows.config().max_wait.as_secs()
                ),
                5,
            ),
        ),
    };
    count_request(app, svc, label);
    if let Some(t) = tenant {
        count_tenant(app, t, &svc.model, label);
    }
    Err(response)
}

/// What `svc`'s ready replicas take before they are saturated.
fn room(app: &App, svc: &Service, config: &FlowConfig) -> flow::Room {
    let urls: Vec<&str> = svc.endpoints.iter().map(|e| e.base_url.as_str()).collect();
    app.loads.room(&urls, config)
}

/// Dispatches what each waiting service's room takes, whenever a request queues or ends (and
/// every `tick`, as the scrapes move), for as long as `app` lives.
pub async fn pump(app: std::sync::Weak<App>, tick: Duration) {
    loop {
        let Some(flows) = app.upgrade().and_then(|a| a.flows.clone()) else {
            return;
        };
        tokio::select! {
            _ = flows.wake.notified() => {}
            _ = tokio::time::sleep(tick) => {}
        }
        let Some(app) = app.upgrade() else { return };
        for id in flows.waiting_services() {
            if let Some(svc) = app.registry.find(&id) {
                flows.pump(&id, room(&app, &svc, flows.config()), Instant::now());
            }
        }
    }
}

/// `body` as the replica serving `svc` takes it: a request that named an alias of the service
/// (`spec.model.aliases`) goes on with `model` rewritten to its served name, which the server
/// knows (so moving an alias restarts no pod). Served names, `namespace/name` and adapters'
/// names pass as they are.
fn served_body(body: Bytes, parsed: &Parsed, asked: &str, svc: &Service) -> Bytes {
    let passes = asked == svc.model || asked == svc.id() || svc.adapter.is_some();
    match (&parsed.model_at, passes) {
        (Some(at), false) => parse::with_model(&body, at.clone(), &svc.model)
            .map(Bytes::from)
            .unwrap_or(body),
        _ => body,
    }
}

/// The header that pins a request for a split name to one of its services (for testing a
/// canary): `namespace/name`.
pub const PIN_HEADER: &str = "x-ferrite-service";

/// For a served name several services share by weight (`spec.routing.weight`), the
/// `namespace/name` of the one this request goes to: the pinned one, else by the prompt's
/// prefix key (so a prefix always reaches one service and its caches), else at random; each
/// in proportion to its weight. `None` for a name one service holds. A pin naming a service
/// outside the split is refused (the message).
fn split_member(
    app: &App,
    model: &str,
    parsed: &Parsed,
    headers: &HeaderMap,
) -> Result<Option<String>, String> {
    let group = app.registry.split(model);
    if group.is_empty() {
        return Ok(None);
    }
    if let Some(pin) = headers.get(PIN_HEADER) {
        let pin = pin.to_str().unwrap_or_default();
        return match group.iter().find(|(id, _)| id == pin) {
            Some((id, _)) => Ok(Some(id.clone())),
            None => Err(format!(
                "{PIN_HEADER}: `{pin}` is not one of the services sharing `{model}`"
            )),
        };
    }
    let draw = match &parsed.key {
        Some(k) => ferrite_api::hash::fnv1a(k.as_bytes()),
        None => app.draws.fetch_add(1, Ordering::Relaxed),
    };
    let Some(id) = policy::weighted(&group, draw) else {
        return Ok(None);
    };
    app.metrics
        .split_requests
        .with_label_values(&[model, id])
        .inc();
    Ok(Some(id.to_string()))
}

/// The request's tenant from its bearer key (`None` with tenants off); without a key, or with
/// one no tenant holds, the 401's message.
fn authenticate(app: &App, headers: &HeaderMap) -> Result<Option<Arc<Tenant>>, &'static str> {
    let Some(tenants) = &app.tenants else {
        return Ok(None);
    };
    let key = ferrite_net::bearer(headers)
        .map(str::trim)
        .filter(|k| !k.is_empty());
    match key.and_then(|k| tenants.directory().authenticate(k)) {
        Some(t) => Ok(Some(t)),
        None if key.is_none() => {
            Err("an API key is required: send it as `Authorization: Bearer <key>`")
        }
        None => Err("Incorrect API key provided."),
    }
}

/// The 401 for a request without a tenant's key, counted.
fn unauthorized(app: &App, message: &str) -> Response {
    app.metrics.unauthorized.inc();
    error(
        StatusCode::UNAUTHORIZED,
        "authentication_error",
        message,
        None,
    )
}

/// A 403 when `tenant` may not use `svc`, the service serving `model` (an unknown model is
/// left to [`resolve`]'s 404).
fn refuse_access(
    app: &App,
    tenant: &Tenant,
    model: &str,
    svc: Option<&Service>,
) -> Option<Response> {
    let svc = svc?;
    if tenant.may_use(&svc.namespace, &svc.name, &svc.model, model) {
        return None;
    }
    count_tenant(app, tenant, &svc.model, "forbidden");
    Some(error(
        StatusCode::FORBIDDEN,
        "permission_error",
        format!("Tenant `{}` may not use the model `{model}`.", tenant.name),
        Some("model"),
    ))
}

/// 429 for a request over one of its tenant's limits, with `Retry-After` (unless it can never
/// pass) and the `x-ratelimit-*` headers.
fn throttle(app: &App, tenant: &Tenant, model: &str, t: &Throttled) -> Response {
    count_tenant(
        app,
        tenant,
        model,
        &format!("throttled_{}", t.limit.as_str()),
    );
    let message = match (t.limit, t.retry_after) {
        (quota::Limit::Tokens, None) => format!(
            "Request too large for tenant `{}`: it may take more tokens than its limit per \
             minute. Lower max_tokens or the prompt.",
            tenant.name
        ),
        (limit, _) => format!(
            "Rate limit reached for tenant `{}` on {} ({}).",
            tenant.name,
            limit.as_str(),
            match limit {
                quota::Limit::Requests => "requests per minute",
                quota::Limit::Tokens => "tokens per minute",
                quota::Limit::Concurrent => "requests open at once",
            }
        ),
    };
    let mut r = match t.retry_after {
        Some(after) => too_busy(message, after.as_secs_f64().ceil().max(1.0) as u64),
        // It can never pass: no point retrying.
        None => error(
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limit_error",
            message,
            None,
        ),
    };
    add_rate_headers(r.headers_mut(), &t.state);
    r
}

fn add_rate_headers(h: &mut HeaderMap, state: &quota::State) {
    for (name, value) in quota::headers(state) {
        if let Ok(v) = HeaderValue::from_str(&value) {
            h.insert(name, v);
        }
    }
}

fn count_tenant(app: &App, tenant: &Tenant, model: &str, outcome: &str) {
    app.metrics
        .tenant_requests
        .with_label_values(&[&tenant.name, model, outcome])
        .inc();
}

/// A tenant's charge for one request, settled when its response ends.
struct TenantCharge {
    charge: Charge,
    tenant: String,
    /// The served model, the tokens series' other label.
    model: String,
    /// The prompt's estimated tokens, which a stream's output is added to.
    prompt: f64,
}

/// Anything the router does not route: OpenAI's 404 body rather than an empty one.
pub async fn no_route(req: axum::extract::Request) -> Response {
    error(
        StatusCode::NOT_FOUND,
        "invalid_request_error",
        format!("no route for {} {}", req.method(), req.uri().path()),
        None,
    )
}

/// A replica's management endpoint, which the router never forwards.
pub async fn not_for_clients(req: axum::extract::Request) -> Response {
    error(
        StatusCode::FORBIDDEN,
        "permission_error",
        format!(
            "{} is not served through the router: adapters are declared in the \
             InferenceService's spec.model.adapters",
            req.uri().path()
        ),
        None,
    )
}

/// The body's announced length, if it has one.
fn content_length(headers: &HeaderMap) -> Option<u64> {
    headers
        .get(header::CONTENT_LENGTH)?
        .to_str()
        .ok()?
        .parse()
        .ok()
}

fn refused(app: &App, r: Refusal) -> Response {
    let reason = match r {
        Refusal::BodyTooLarge => {
            return error(
                StatusCode::PAYLOAD_TOO_LARGE,
                "invalid_request_error",
                format!(
                    "the request body is larger than {} bytes",
                    app.limits.config.max_body
                ),
                None,
            );
        }
        Refusal::Busy => "busy",
        Refusal::HoldFull => "hold_full",
    };
    app.metrics.refused.with_label_values(&[reason]).inc();
    match r {
        Refusal::HoldFull => unavailable(
            "too many requests are waiting for this model to start; retry later",
            10,
        ),
        _ => unavailable("the router is at its request limit; retry shortly", 1),
    }
}

/// A body that could not be read: over the limit (chunked, so only seen while reading), too
/// slow, or cut off.
fn unreadable(app: &App, e: ferrite_net::BodyError) -> Response {
    match e {
        ferrite_net::BodyError::TooLarge => refused(app, Refusal::BodyTooLarge),
        ferrite_net::BodyError::TimedOut => error(
            StatusCode::REQUEST_TIMEOUT,
            "invalid_request_error",
            "the request body did not arrive in time",
            None,
        ),
        ferrite_net::BodyError::Broken => invalid("could not read the request body", None),
    }
}

/// The service for `model`, once it has a ready replica: held (and woken) while it has none,
/// refused at once when it is degraded or too many requests already wait for it.
async fn resolve(app: &App, model: &str) -> Result<Service, Response> {
    let Some(svc) = app.registry.find(model) else {
        // Not the client's string: any client could otherwise mint series without end.
        app.metrics
            .requests
            .with_label_values(&["", "none", "unknown_model"])
            .inc();
        return Err(error(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            format!("The model `{model}` does not exist."),
            Some("model"),
        ));
    };
    if !svc.endpoints.is_empty() {
        return Ok(svc);
    }
    let outcome = |o: &str| {
        app.metrics
            .requests
            .with_label_values(&[&svc.model, svc.policy.as_str(), o])
            .inc();
    };
    if let Some(reason) = &svc.degraded {
        outcome("degraded");
        return Err(degraded(&svc.model, reason));
    }
    let _slot = match app.limits.hold(&svc.id()) {
        Ok(slot) => slot,
        Err(r) => {
            outcome("hold_full");
            return Err(refused(app, r));
        }
    };
    match hold(app, svc.clone()).await {
        Held::Ready(s) => Ok(*s),
        Held::Degraded(reason) => {
            outcome("degraded");
            Err(degraded(&svc.model, &reason))
        }
        Held::TimedOut(timeout) => {
            outcome("cold_start_timeout");
            Err(unavailable(
                format!(
                    "The model `{}` has no ready replica after {}s; it is starting, retry later.",
                    svc.model,
                    timeout.as_secs()
                ),
                30,
            ))
        }
    }
}

/// The client learns that the service cannot start and its condition's reason; the details
/// (pod names, messages) stay in the InferenceService's status, for its owner.
fn degraded(model: &str, reason: &str) -> Response {
    unavailable(
        format!(
            "The model `{model}` cannot start ({reason}); its InferenceService's status says why."
        ),
        60,
    )
}

/// Sends the request to a replica the policy picks; if that one did not start on it
/// ([`retry_reason`]), once more to another.
#[allow(clippy::too_many_arguments)]
async fn attempt(
    app: &Arc<App>,
    svc: &Service,
    parsed: &Parsed,
    parts: &axum::http::request::Parts,
    body: Bytes,
    mut slots: Slots,
    charge: Option<TenantCharge>,
    seed: Option<ResumeSeed>,
) -> Response {
    let model = svc.model.as_str();
    let key = affinity_key(svc, parsed);
    // Asked once per request (a retry is the same request).
    let known = key.as_deref().is_some_and(|k| app.recent.seen(k));
    // A chat stream opens with the role event before its first token.
    let preamble = u64::from(parts.uri.path().ends_with("/chat/completions"));
    let path = parts
        .uri
        .path_and_query()
        .map_or(parts.uri.path(), |p| p.as_str());
    let ring = ring_of(app, svc);
    let mut tried: Option<String> = None;
    for attempt in 0..2 {
        let Some(ep) = pick(
            app,
            svc,
            &ring,
            parsed,
            key.as_deref(),
            known,
            tried.as_deref(),
        ) else {
            break;
        };
        let open = app.loads.open(&ep.base_url, parsed.work, preamble);
        if let Some(d) = slots.flow.as_mut() {
            d.placed();
        }
        let gauge = GaugeGuard::inc(app.metrics.in_flight.with_label_values(&[model, &ep.name]));
        let started = Instant::now();
        let url = format!("{}{}", ep.base_url, path);
        let result = send(app, &parts.method, &url, &parts.headers, body.clone()).await;
        let can_retry = attempt == 0 && svc.endpoints.len() > 1;
        let answered = || {
            app.metrics
                .upstream_headers
                .with_label_values(&[model])
                .observe(started.elapsed().as_secs_f64())
        };
        let result = match (svc.adapter.as_deref(), result) {
            // ferrite-server refuses a model it does not serve with 400 (`param: "model"`), as
            // it does a bad request: the small error body tells them apart, so that a client's
            // bad request neither costs a retry nor sets the replica aside.
            (Some(adapter), Ok(resp)) if resp.status() == StatusCode::BAD_REQUEST => {
                let (head, bytes) = match read_error(resp).await {
                    Ok(read) => read,
                    Err(e) => return upstream_error(app, svc, ep, "unreadable error body", e),
                };
                if refused_model(&bytes) {
                    app.loads
                        .set_aside_for(&ep.base_url, adapter, app.config.set_aside);
                    if can_retry {
                        count_retry(app, model, ep, "adapter_not_loaded");
                        tried = Some(ep.name.clone());
                        continue;
                    }
                }
                answered();
                count_request(app, svc, outcome(head.status));
                return Response::from_parts(head, Body::from(bytes));
            }
            (_, result) => result,
        };
        if let Some(reason) = retry_reason(app, ep, svc.adapter.as_deref(), &result)
            && can_retry
        {
            count_retry(app, model, ep, reason);
            tried = Some(ep.name.clone());
            continue;
        }
        answered();
        let resp = match result {
            Ok(resp) => resp,
            Err(e) => return upstream_error(app, svc, ep, "replica unreachable", e),
        };
        if let Some(refused) = refused_key(app, svc, resp.status()) {
            return refused;
        }
        count_request(app, svc, outcome(resp.status()));
        let resumer = seed.map(|seed| {
            Box::new(Resumer {
                app: app.clone(),
                svc: svc.clone(),
                parsed: parsed.clone(),
                method: parts.method.clone(),
                path: path.to_string(),
                headers: parts.headers.clone(),
                body: seed.body,
                _reservation: seed._reservation,
                transcript: Transcript::new(seed.kind),
                replica: ep.name.clone(),
                base_url: ep.base_url.clone(),
                pending: None,
            })
        });
        let tracking = Tracking {
            open,
            gauge,
            slots,
            started,
            charge,
            resumer,
        };
        return relay(app, svc, ep, resp, tracking);
    }
    count_request(app, svc, "upstream_error");
    unavailable(format!("no replica of `{model}` answered"), 1)
}

/// The request's prefix-affinity key. An adapter's requests are affine among themselves: the
/// replica's prefix cache keys its blocks by adapter, so the same prompt under another adapter
/// shares nothing.
fn affinity_key(svc: &Service, parsed: &Parsed) -> Option<String> {
    match (&svc.adapter, &parsed.key) {
        (Some(a), Some(k)) => Some(format!("{a}\u{1f}{k}")),
        (_, k) => k.clone(),
    }
}

/// `svc`'s hash ring over its ready replicas (rebuilt only when they change).
fn ring_of(app: &App, svc: &Service) -> Arc<Ring> {
    let names: Vec<&str> = svc.endpoints.iter().map(|e| e.name.as_str()).collect();
    app.rings.get(&svc.id(), &names)
}

/// The replica the service's policy picks among those not tried and not set aside, counted
/// as a routing decision.
fn pick<'a>(
    app: &App,
    svc: &'a Service,
    ring: &Ring,
    parsed: &Parsed,
    key: Option<&str>,
    known: bool,
    tried: Option<&str>,
) -> Option<&'a Endpoint> {
    let mut candidates = candidates(&svc.endpoints, tried, |e| {
        app.loads.is_set_aside(&e.base_url)
            || svc
                .adapter
                .as_deref()
                .is_some_and(|a| app.loads.is_set_aside_for(&e.base_url, a))
    });
    // With flow control, a saturated replica takes nothing while another has room.
    if let Some(flows) = &app.flows {
        let has_room = |e: &&Endpoint| app.loads.room(&[&e.base_url], flows.config()).free > 0;
        if candidates.iter().any(has_room) {
            candidates.retain(has_room);
        }
    }
    let replicas: Vec<Replica> = candidates
        .iter()
        .map(|e| Replica {
            name: e.name.clone(),
            load: app.loads.get(&e.base_url),
        })
        .collect();
    let request = Request {
        key,
        work: parsed.work.total(),
        turn: app.turn.fetch_add(1, Ordering::Relaxed),
        known,
    };
    let d = match &svc.adapter {
        Some(adapter) => {
            let ready_for: Vec<bool> = candidates
                .iter()
                .map(|e| app.loads.holds(&e.base_url, adapter))
                .collect();
            let eps = app.config.epsilon;
            policy::pick_preferring(svc.policy, ring, &replicas, request, eps, &ready_for)?
        }
        None => policy::pick(svc.policy, ring, &replicas, request, app.config.epsilon)?,
    };
    app.metrics
        .decisions
        .with_label_values(&[&svc.model, svc.policy.as_str(), d.affinity.as_str()])
        .inc();
    Some(candidates[d.index])
}

/// Largest error body read from a replica, and how long it may take: a replica's output is
/// not trusted.
const ERROR_BODY_LIMIT: usize = 16 << 10;
const ERROR_BODY_TIMEOUT: Duration = Duration::from_secs(5);

/// A replica's whole (error) response, its body read within [`ERROR_BODY_LIMIT`] and
/// [`ERROR_BODY_TIMEOUT`].
async fn read_error(
    resp: hyper::Response<Incoming>,
) -> Result<(axum::http::response::Parts, Bytes), String> {
    use http_body_util::{BodyExt, Limited};
    let (head, body) = resp.into_parts();
    let read = Limited::new(body, ERROR_BODY_LIMIT).collect();
    match tokio::time::timeout(ERROR_BODY_TIMEOUT, read).await {
        Ok(Ok(collected)) => Ok((head, collected.to_bytes())),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err("timed out".to_string()),
    }
}

/// Whether an OpenAI error body refuses the request's `model` (`"param": "model"`, as
/// ferrite-server answers a model it does not serve), rather than something else in it.
fn refused_model(body: &[u8]) -> bool {
    // Only the one field is read (as `parse.rs` reads requests), not a whole JSON tree.
    #[derive(serde::Deserialize)]
    struct Refusal {
        error: Error,
    }
    #[derive(serde::Deserialize)]
    struct Error {
        param: Option<String>,
    }
    serde_json::from_slice::<Refusal>(body).is_ok_and(|r| r.error.param.as_deref() == Some("model"))
}

/// Why a replica's answer is worth one try elsewhere: it refused the connection (it then sits
/// out a while) or answered 503, so it did not start on the request; or, for an adapter's
/// request, answered 404 (vLLM's "no such model"): a replica that started before the adapter
/// was declared serves it only once the operator's adapter sync has loaded it there, and it
/// sits out that adapter's requests a while. ferrite-server refuses with 400 instead
/// ([`refused_model`]).
fn retry_reason(
    app: &App,
    ep: &Endpoint,
    adapter: Option<&str>,
    result: &Result<hyper::Response<Incoming>, SendError>,
) -> Option<&'static str> {
    match result {
        Err(e) if e.is_connect() => {
            app.loads.set_aside(&ep.base_url, app.config.set_aside);
            Some("connect")
        }
        Ok(r) if r.status() == StatusCode::SERVICE_UNAVAILABLE => Some("unavailable"),
        Ok(r) if r.status() == StatusCode::NOT_FOUND => {
            let adapter = adapter?;
            app.loads
                .set_aside_for(&ep.base_url, adapter, app.config.set_aside);
            Some("adapter_not_loaded")
        }
        _ => None,
    }
}

/// The `outcome` label of a replica's answer.
fn outcome(status: StatusCode) -> &'static str {
    if status.is_success() {
        "success"
    } else if status.is_client_error() {
        "client_error"
    } else {
        "upstream_error"
    }
}

/// 502 for a replica that could not be reached or read; the replica and the cause go to the
/// log, not to the client.
fn upstream_error(
    app: &App,
    svc: &Service,
    ep: &Endpoint,
    what: &str,
    cause: impl std::fmt::Display,
) -> Response {
    let model = svc.model.as_str();
    tracing::warn!(model, pod = %ep.name, error = %cause, "{what}");
    count_request(app, svc, "upstream_error");
    error(
        StatusCode::BAD_GATEWAY,
        "upstream_error",
        format!("the model `{model}` could not be reached"),
        None,
    )
}

fn count_retry(app: &App, model: &str, ep: &Endpoint, reason: &str) {
    tracing::info!(model, pod = %ep.name, reason, "retrying on another replica");
    app.metrics
        .retries
        .with_label_values(&[model, reason])
        .inc();
}

fn count_request(app: &App, svc: &Service, outcome: &str) {
    app.metrics
        .requests
        .with_label_values(&[&svc.model, svc.policy.as_str(), outcome])
        .inc();
}

/// What stays with a request while its replica answers.
struct Tracking {
    open: Open,
    gauge: GaugeGuard,
    slots: Slots,
    started: Instant,
    charge: Option<TenantCharge>,
    /// For a stream that can be resumed on another replica.
    resumer: Option<Box<Resumer>>,
}

/// What resuming a stream on another replica needs, and where the stream stands.
struct Resumer {
    app: Arc<App>,
    svc: Service,
    parsed: Parsed,
    method: Method,
    path: String,
    headers: HeaderMap,
    body: Bytes,
    _reservation: Option<OwnedSemaphorePermit>,
    transcript: Transcript,
    /// The replica streaming now.
    replica: String,
    base_url: String,
    /// The request to another replica, while it is on its way.
    pending: Option<Pin<Box<dyn Future<Output = Resubmitted> + Send>>>,
}

/// The new replica and its response, or why there is none.
type Resubmitted = Result<(Endpoint, hyper::Response<Incoming>), String>;

/// Sends the continuation `body` to a replica of `svc` other than `failed` (which sits out):
/// its answer must be a 200 event stream.
async fn resubmit(
    app: Arc<App>,
    svc: Service,
    parsed: Parsed,
    failed: (String, String),
    request: (Method, String, HeaderMap),
    body: Bytes,
) -> Resubmitted {
    let (failed_name, failed_url) = failed;
    app.loads.set_aside(&failed_url, app.config.set_aside);
    // The replicas as they are now: the failed one may be gone, another may have come.
    let svc = app.registry.find(&svc.id()).unwrap_or(svc);
    let key = affinity_key(&svc, &parsed);
    let ring = ring_of(&app, &svc);
    let ep = pick(
        &app,
        &svc,
        &ring,
        &parsed,
        key.as_deref(),
        true,
        Some(&failed_name),
    )
    .filter(|e| e.name != failed_name)
    .cloned()
    .ok_or("no other replica")?;
    let (method, path, headers) = request;
    let url = format!("{}{}", ep.base_url, path);
    let resp = send(&app, &method, &url, &headers, body)
        .await
        .map_err(|e| e.to_string())?;
    let stream = resp
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"));
    if resp.status() != StatusCode::OK || !stream {
        return Err(format!("{} answered {}", ep.name, resp.status()));
    }
    Ok((ep, resp))
}

/// Passes the replica's response on, its body tracked until it ends.
fn relay(
    app: &App,
    svc: &Service,
    ep: &Endpoint,
    resp: hyper::Response<Incoming>,
    mut t: Tracking,
) -> Response {
    let model = svc.model.as_str();
    let (mut parts, incoming) = resp.into_parts();
    if let Some(c) = &t.charge {
        add_rate_headers(&mut parts.headers, &c.charge.state);
    }
    let usage = t.charge.map(|charge| Usage {
        succeeded: parts.status.is_success(),
        charge,
        tail: Vec::new(),
        counter: app.metrics.tenant_tokens.clone(),
    });
    let event_stream = parts
        .headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"));
    if !(event_stream && parts.status.is_success()) {
        t.resumer = None;
    }
    let tracked = Tracked {
        inner: incoming,
        open: t.open,
        event_stream,
        _gauge: t.gauge,
        slots: t.slots,
        started: t.started,
        duration: Some(app.metrics.upstream_duration.with_label_values(&[model])),
        broken: event_stream.then(|| BrokenStream {
            counter: app.metrics.broken_streams.with_label_values(&[model]),
            replica: ep.name.clone(),
            model: model.to_string(),
        }),
        ended: false,
        usage,
        resumer: t.resumer,
        events_before: 0,
    };
    Response::from_parts(parts, Body::new(tracked))
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
) -> Result<hyper::Response<Incoming>, SendError> {
    let mut req = hyper::Request::builder().method(method.clone()).uri(url);
    for (name, value) in forwarded(headers) {
        req = req.header(name, value);
    }
    let req = req
        .body(Full::new(body))
        .map_err(|e| SendError::Request(e.to_string()))?;
    app.client.request(req).await.map_err(SendError::Client)
}

/// The request headers passed to a replica: [`FORWARDED`] and `x-request-id`. With tenants,
/// `Authorization` is the service's own key by now, never the tenant's ([`credential`]).
fn forwarded(
    headers: &HeaderMap,
) -> impl Iterator<Item = (&'static header::HeaderName, &HeaderValue)> {
    static REQUEST_ID: header::HeaderName = header::HeaderName::from_static("x-request-id");
    FORWARDED
        .iter()
        .chain([&REQUEST_ID])
        .flat_map(move |name| headers.get_all(name).iter().map(move |v| (name, v)))
}

/// Why a request did not get a response from its replica.
#[derive(Debug, thiserror::Error)]
enum SendError {
    #[error("building the request: {0}")]
    Request(String),
    #[error(transparent)]
    Client(hyper_util::client::legacy::Error),
}

impl SendError {
    /// The connection was never made, so the replica cannot have seen the request: the one
    /// case a retry cannot run a generation twice.
    fn is_connect(&self) -> bool {
        matches!(self, SendError::Client(e) if e.is_connect())
    }
}

/// How a hold ended.
enum Held {
    Ready(Box<Service>),
    /// The service turned Degraded while requests waited: no point waiting on.
    Degraded(String),
    TimedOut(Duration),
}

/// Holds a request until `svc` has a ready replica or its cold-start timeout passes, waking
/// the service through its scale subresource if it is scaled to zero (one write per service,
/// whatever the number held). A client that disconnects drops this future, and with it the
/// hold.
async fn hold(app: &App, svc: Service) -> Held {
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
    let id = svc.id();
    let outcome = loop {
        if let Some(s) = app.registry.find(&id) {
            if !s.endpoints.is_empty() {
                break Held::Ready(Box::new(s));
            }
            if let Some(reason) = s.degraded {
                break Held::Degraded(reason);
            }
            if s.replicas == 0 {
                wake(app, &s).await;
            }
        }
        let retry = tokio::time::sleep(wake::FIRST_BACKOFF);
        tokio::select! {
            r = changes.changed() => if r.is_err() { break Held::TimedOut(timeout) },
            // A failed wake is retried after its backoff, even if nothing changes.
            _ = retry => {}
            _ = tokio::time::sleep_until(deadline) => break Held::TimedOut(timeout),
        }
    };
    histogram.observe(started.elapsed().as_secs_f64());
    outcome
}

/// Scales `svc` up from zero, unless another held request already is (or did lately).
async fn wake(app: &App, svc: &Service) {
    let Some(client) = &app.kube else {
        return;
    };
    let id = svc.id();
    if !app.wakes.claim(&id, tokio::time::Instant::now()) {
        return;
    }
    app.metrics.wakes.with_label_values(&[&svc.model]).inc();
    let ok = wake::scale_up(client, &svc.namespace, &svc.name).await;
    app.wakes.done(&id, ok, tokio::time::Instant::now());
}

/// Decrements a gauge when dropped.
struct GaugeGuard(prometheus::IntGauge);

impl GaugeGuard {
    fn inc(gauge: prometheus::IntGauge) -> Self {
        gauge.inc();
        Self(gauge)
    }
}

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
    /// The request's place among those open (and its flow's dispatch): given back when the
    /// response ends.
    slots: Slots,
    started: Instant,
    duration: Option<Histogram>,
    /// Set for event streams: a replica lost mid-stream ends the stream with an error event.
    broken: Option<BrokenStream>,
    ended: bool,
    /// A tenant's request: what it used, read as the body passes.
    usage: Option<Usage>,
    /// A stream that can be resumed on another replica if this one fails.
    resumer: Option<Box<Resumer>>,
    /// Events of replicas that failed before the one streaming now.
    events_before: u64,
}

/// Reads what a tenant's request used from its response: the `usage.total_tokens` a replica
/// reports at the end of a body (or of a stream with `include_usage`), else for a stream the
/// prompt estimate and one token per event, else the estimate. A replica's word is capped at
/// [`USAGE_CAP`] times the estimate: a pod's output is not trusted with another's quota.
struct Usage {
    charge: TenantCharge,
    succeeded: bool,
    /// The body's last bytes, where the usage is.
    tail: Vec<u8>,
    counter: prometheus::IntCounterVec,
}

/// The most a replica's reported usage may exceed the request's estimate by.
const USAGE_CAP: f64 = 4.0;
/// Bytes of a body's end kept to find its usage in.
const TAIL: usize = 4096;

impl Usage {
    fn keep(&mut self, data: &[u8]) {
        self.tail.extend_from_slice(data);
        if self.tail.len() > TAIL {
            self.tail.drain(..self.tail.len() - TAIL);
        }
    }

    /// Settles the charge; `events` are the stream's events (0 for a whole body).
    fn settle(&mut self, events: u64, preamble: u64) {
        let estimate = self.charge.charge.estimate();
        let used = if !self.succeeded {
            0.0
        } else if let Some(total) = reported_total(&self.tail) {
            total.min(estimate.max(1.0) * USAGE_CAP)
        } else if events > 0 {
            // The last events are the finish chunk and `[DONE]`.
            let tokens = events.saturating_sub(preamble + 1) as f64;
            (self.charge.prompt + tokens).min(estimate)
        } else {
            estimate
        };
        self.charge.charge.settle(used);
    }
}

impl Drop for Usage {
    fn drop(&mut self) {
        let used = self.charge.charge.tokens();
        self.counter
            .with_label_values(&[&self.charge.tenant, &self.charge.model])
            .inc_by(used.round() as u64);
    }
}

/// The last `"total_tokens": N` in `tail`.
fn reported_total(tail: &[u8]) -> Option<f64> {
    const FIELD: &[u8] = b"\"total_tokens\":";
    let at = tail.windows(FIELD.len()).rposition(|w| w == FIELD)? + FIELD.len();
    let digits: String = tail[at..]
        .iter()
        .skip_while(|b| b.is_ascii_whitespace())
        .take_while(|b| b.is_ascii_digit())
        .map(|&b| b as char)
        .collect();
    digits.parse::<u64>().ok().map(|n| n as f64)
}

impl Drop for Tracked {
    /// A client that left mid-stream is charged what was streamed until then, not the whole
    /// estimate.
    fn drop(&mut self) {
        if !self.ended {
            self.settle();
        }
    }
}

/// What an event stream needs to fail cleanly when its replica goes away.
struct BrokenStream {
    counter: prometheus::IntCounter,
    replica: String,
    model: String,
}

impl BrokenStream {
    /// The last event of a stream whose replica failed, as vLLM reports errors inside a
    /// stream: OpenAI's clients raise it as an API error, where a cut connection would
    /// surface as a transport error with no reason.
    fn event(&self) -> Bytes {
        let body = json!({"error": {
            "message": format!("the model `{}` failed mid-stream", self.model),
            "type": "upstream_error",
            "param": null,
            "code": StatusCode::BAD_GATEWAY.as_u16(),
        }});
        Bytes::from(format!("data: {body}\n\n"))
    }
}

impl Tracked {
    /// The error event that ends an event stream whose replica failed (counted), or `None`
    /// for a body that is not an event stream.
    fn broken_event(&mut self, cause: &dyn std::fmt::Display) -> Option<Frame<Bytes>> {
        let b = self.broken.as_ref()?;
        self.ended = true;
        b.counter.inc();
        tracing::warn!(replica = %b.replica, error = %cause, "replica failed mid-stream");
        Some(Frame::data(b.event()))
    }

    /// Starts resuming the stream on another replica after `cause`, if it can be resumed.
    fn try_resume(&mut self, cause: &hyper::Error) -> bool {
        let Some(r) = self.resumer.as_mut() else {
            return false;
        };
        if !r.transcript.can_resume() {
            return false;
        }
        let Some(body) = r.transcript.resume_body(&r.body) else {
            return false;
        };
        tracing::warn!(replica = %r.replica, error = %cause, tokens = r.transcript.tokens(),
                       "replica failed mid-stream; resuming the stream on another");
        let fut = resubmit(
            r.app.clone(),
            r.svc.clone(),
            r.parsed.clone(),
            (r.replica.clone(), r.base_url.clone()),
            (r.method.clone(), r.path.clone(), r.headers.clone()),
            Bytes::from(body),
        );
        r.pending = Some(Box::pin(fut));
        true
    }

    /// Streams on from `ep`'s response: its load, its in-flight series, its body.
    fn switch_to(&mut self, ep: Endpoint, resp: hyper::Response<Incoming>) {
        let Some(r) = self.resumer.as_mut() else {
            return;
        };
        r.transcript.resumed();
        let model = r.svc.model.as_str();
        r.app
            .metrics
            .resumed_streams
            .with_label_values(&[model])
            .inc();
        tracing::info!(from = %r.replica, to = %ep.name, "stream resumed");
        self.events_before += self.open.seen();
        // The resumed stream's role event is not passed on: no preamble.
        self.open = r.app.loads.open(&ep.base_url, r.parsed.work, 0);
        self._gauge = GaugeGuard::inc(
            r.app
                .metrics
                .in_flight
                .with_label_values(&[model, &ep.name]),
        );
        if let Some(b) = self.broken.as_mut() {
            b.replica = ep.name.clone();
        }
        r.replica = ep.name;
        r.base_url = ep.base_url;
        self.inner = resp.into_body();
    }

    /// Settles a tenant's charge from what the body showed so far.
    fn settle(&mut self) {
        let (events, preamble) = (self.events_before + self.open.seen(), self.open.preamble());
        if let Some(u) = self.usage.as_mut() {
            u.settle(events, preamble);
            if let Some(d) = self.slots.flow.as_mut() {
                d.settle(u.charge.charge.tokens());
            }
        }
    }

    /// The replica's body ended: nothing more to pass on, and its duration is known.
    fn finish(&mut self) {
        self.ended = true;
        self.settle();
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
        let this = &mut *self;
        loop {
            if this.ended {
                return Poll::Ready(None);
            }
            // A resume on its way: the next frames come from its replica.
            if let Some(r) = this.resumer.as_mut()
                && let Some(pending) = r.pending.as_mut()
            {
                let result = ready!(pending.as_mut().poll(cx));
                r.pending = None;
                match result {
                    Ok((ep, resp)) => {
                        this.switch_to(ep, resp);
                        continue;
                    }
                    Err(why) => return Poll::Ready(this.broken_event(&why).map(Ok)),
                }
            }
            let frame = ready!(Pin::new(&mut this.inner).poll_frame(cx));
            return match frame {
                None => {
                    this.finish();
                    // A last event the replica never ended goes on as it is.
                    let rest = this.resumer.as_mut().map(|r| r.transcript.take_held());
                    match rest.filter(|b| !b.is_empty()) {
                        Some(b) => Poll::Ready(Some(Ok(Frame::data(b)))),
                        None => Poll::Ready(None),
                    }
                }
                Some(Err(e)) => {
                    if this.try_resume(&e) {
                        continue;
                    }
                    match this.broken_event(&e) {
                        Some(event) => Poll::Ready(Some(Ok(event))),
                        None => Poll::Ready(Some(Err(e))),
                    }
                }
                Some(Ok(frame)) => {
                    // A resumable stream's events go on whole, as its transcript reads them.
                    let frame = match (this.resumer.as_mut(), frame.into_data()) {
                        (Some(r), Ok(data)) => {
                            let out = r.transcript.pass(&data);
                            if out.is_empty() && !this.inner.is_end_stream() {
                                continue;
                            }
                            Frame::data(out)
                        }
                        (_, Ok(data)) => Frame::data(data),
                        (_, Err(frame)) => frame,
                    };
                    if this.event_stream
                        && let Some(data) = frame.data_ref()
                    {
                        let events = events_in(data);
                        this.open.events(events);
                    }
                    if let (Some(u), Some(data)) = (this.usage.as_mut(), frame.data_ref()) {
                        u.keep(data);
                    }
                    // hyper reads a body of known length no further than its last byte, so
                    // its end shows here rather than as a final `None`.
                    if this.inner.is_end_stream() {
                        this.finish();
                    }
                    Poll::Ready(Some(Ok(frame)))
                }
            };
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
    fn only_a_refusal_of_the_model_is_taken_for_a_missing_adapter() {
        let refused = br#"{"error":{"code":400,"message":"The model `sql` does not exist.","param":"model","type":"invalid_request_error"}}"#;
        assert!(super::refused_model(refused));
        let bad = br#"{"error":{"code":400,"message":"max_tokens must be positive","param":"max_tokens","type":"invalid_request_error"}}"#;
        assert!(!super::refused_model(bad));
        assert!(!super::refused_model(br#"{"error":{"message":"x"}}"#));
        assert!(!super::refused_model(b"not json"));
        assert!(!super::refused_model(br#"{"error":"param model"}"#));
    }

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

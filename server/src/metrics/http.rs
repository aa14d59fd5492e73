//! HTTP request metrics (`http_requests_total`, `http_request_duration_seconds`), labelled by
//! route template rather than raw path so that label cardinality stays bounded.

use std::time::Instant;

use axum::extract::{MatchedPath, Request, State};
use axum::middleware::Next;
use axum::response::Response;
use prometheus::{HistogramOpts, HistogramVec, IntCounterVec, Opts, Registry};

use super::MetricsError;

#[derive(Debug, Clone)]
pub struct HttpMetrics {
    requests: IntCounterVec,
    duration: HistogramVec,
}

impl HttpMetrics {
    pub fn new(registry: &Registry) -> Result<Self, MetricsError> {
        let requests = IntCounterVec::new(
            Opts::new(
                "http_requests_total",
                "HTTP requests by route, method and status.",
            ),
            &["handler", "method", "status"],
        )?;
        let duration = HistogramVec::new(
            HistogramOpts::new(
                "http_request_duration_seconds",
                "Time to produce the response head, by route and method, in seconds.",
            ),
            &["handler", "method"],
        )?;
        registry.register(Box::new(requests.clone()))?;
        registry.register(Box::new(duration.clone()))?;
        Ok(Self { requests, duration })
    }
}

/// The `method` label, from a closed set: a client's made-up method (HTTP allows any token)
/// must not mint a new series (300 of them added ~4,500 lines to `/metrics`).
fn method_label(m: &axum::http::Method) -> &'static str {
    use axum::http::Method;
    match *m {
        Method::GET => "GET",
        Method::POST => "POST",
        Method::PUT => "PUT",
        Method::DELETE => "DELETE",
        Method::HEAD => "HEAD",
        Method::OPTIONS => "OPTIONS",
        Method::PATCH => "PATCH",
        _ => "other",
    }
}

/// Middleware recording every request. Streaming responses are timed to their first byte; their
/// full length shows in `vllm:e2e_request_latency_seconds`.
pub async fn record(State(m): State<HttpMetrics>, req: Request, next: Next) -> Response {
    let handler = req
        .extensions()
        .get::<MatchedPath>()
        .map(|p| p.as_str().to_string())
        .unwrap_or_else(|| "unmatched".into());
    let method = method_label(req.method());
    let started = Instant::now();
    let resp = next.run(req).await;
    m.duration
        .with_label_values(&[&handler, method])
        .observe(started.elapsed().as_secs_f64());
    m.requests
        .with_label_values(&[&handler, method, &resp.status().as_u16().to_string()])
        .inc();
    resp
}

//! ferrite-router: one OpenAI-compatible endpoint for every InferenceService it watches.
//! Requests go to the service whose served model name matches `model`, to a replica picked by
//! the service's policy ([`policy`]) from the load it scrapes ([`load`]); requests for a
//! service with no ready replica are held while it scales from zero ([`proxy`]).

pub mod load;
pub mod metrics;
pub mod policy;
pub mod prefix;
pub mod proxy;
pub mod registry;

use std::sync::Arc;
use std::sync::atomic::Ordering;

use axum::Router;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::{get, post};

pub use proxy::{App, Config};

/// The HTTP routes: the OpenAI API, health, and metrics.
pub fn routes(app: Arc<App>) -> Router {
    let limit = app.config.max_body;
    Router::new()
        .route("/v1/completions", post(proxy::forward))
        .route("/v1/chat/completions", post(proxy::forward))
        .route("/v1/models", get(proxy::models))
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .layer(DefaultBodyLimit::max(limit))
        .with_state(app)
}

/// Ready once the watch caches are listed (the caller starts serving only then), and not
/// while draining.
async fn readyz(State(app): State<Arc<App>>) -> impl IntoResponse {
    if app.draining.load(Ordering::SeqCst) {
        (StatusCode::SERVICE_UNAVAILABLE, "draining")
    } else {
        (StatusCode::OK, "ok")
    }
}

async fn metrics(State(app): State<Arc<App>>) -> impl IntoResponse {
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4",
        )],
        app.metrics.render(),
    )
}

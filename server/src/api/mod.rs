//! The OpenAI-compatible HTTP layer. It knows requests, never tensors: everything model-side
//! goes through the engine handle.

pub mod adapters;
pub mod chat;
pub mod completions;
pub mod embeddings;
pub mod error;
pub mod extract;
pub mod generate;
pub mod lora;
pub mod protocol;
pub mod response;
pub mod state;
pub mod structured;
pub mod tokenize;
pub mod tool_parse;
pub mod tools;
pub mod validate;

use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Json, Response};
use axum::routing::{get, post};
use axum::{Extension, Router};

use crate::metrics::http::HttpMetrics;
use error::ApiError;
use state::AppState;

/// All routes. `/v1/*` and the tokenizer endpoints (which spend CPU on the client's text) sit
/// behind the API key when one is set; probes, `/version` and `/metrics` stay open.
pub fn router(state: Arc<AppState>, http: HttpMetrics, body_read_timeout: Duration) -> Router {
    let v1 = Router::new()
        .route("/v1/models", get(models))
        .route("/v1/completions", post(completions::completions))
        .route("/v1/chat/completions", post(chat::chat_completions))
        .route("/v1/embeddings", post(embeddings::embeddings))
        .route("/tokenize", post(tokenize::tokenize))
        .route("/detokenize", post(tokenize::detokenize))
        .route("/v1/load_lora_adapter", post(lora::load_adapter))
        .route("/v1/unload_lora_adapter", post(lora::unload_adapter))
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            require_api_key,
        ));
    Router::new()
        .merge(v1)
        .route("/health", get(health))
        .route("/version", get(version))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        .layer(Extension(extract::BodyTimeout(body_read_timeout)))
        .layer(middleware::from_fn_with_state(
            http,
            crate::metrics::http::record,
        ))
        .with_state(state)
}

/// 200 once the model is loaded and warm and the server is not draining; 503 otherwise.
async fn health(State(s): State<Arc<AppState>>) -> impl IntoResponse {
    if s.is_ready() {
        (StatusCode::OK, "")
    } else if s.is_draining() {
        (StatusCode::SERVICE_UNAVAILABLE, "shutting down")
    } else if s.loaded().is_some() {
        (StatusCode::SERVICE_UNAVAILABLE, "the engine has stopped")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "loading")
    }
}

async fn version() -> Json<response::Version> {
    Json(response::Version {
        version: env!("CARGO_PKG_VERSION"),
    })
}

/// The base model, then its adapters with `parent` set to it (vLLM's listing).
async fn models(State(s): State<Arc<AppState>>) -> Json<response::ModelList> {
    let max_model_len = s.loaded().map(|l| l.max_model_len);
    let mut data = vec![response::ModelCard {
        id: s.served_model_name.clone(),
        object: "model",
        created: s.created,
        owned_by: "ferrite",
        root: s.served_model_name.clone(),
        parent: None,
        max_model_len,
    }];
    if let Some(adapters) = s.loaded().and_then(|l| l.adapters.as_ref()) {
        data.extend(adapters.list().into_iter().map(|a| response::ModelCard {
            id: a.name,
            object: "model",
            created: a.created,
            owned_by: "ferrite",
            root: a.source,
            parent: Some(s.served_model_name.clone()),
            max_model_len,
        }));
    }
    Json(response::ModelList {
        object: "list",
        data,
    })
}

/// Prometheus text exposition; reads atomics only, so it never waits on the engine.
async fn metrics(State(s): State<Arc<AppState>>) -> Result<Response, ApiError> {
    let body =
        crate::metrics::encode(&s.registry).map_err(|e| ApiError::internal(e.to_string()))?;
    Ok((
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        body,
    )
        .into_response())
}

/// Bodies read and dropped after a refusal, at most: the largest form a router forwards
/// (`--max-upload-body`, 25 MiB) with room.
const MAX_DISCARDED_BODY: usize = 32 << 20;

/// OpenAI's 404 for any other path (an audio upload a router sent here, say). The body, which
/// nothing reads, is read and dropped while the answer goes out: a connection closed with
/// unread bytes is reset, and the reset can destroy the answer before its client reads it.
async fn not_found(req: Request) -> ApiError {
    let err = ApiError::not_found(format!(
        "no route for {} {}",
        req.method(),
        req.uri().path()
    ));
    discard(req, MAX_DISCARDED_BODY);
    err
}

/// Reads and drops a refused request's body within its read timeout (see [`not_found`]).
fn discard(req: Request, limit: usize) {
    let timeout = extract::BodyTimeout::of(&req);
    ferrite_net::discard_body(req.into_body(), limit, timeout);
}

async fn require_api_key(
    State(s): State<Arc<AppState>>,
    req: Request,
    next: Next,
) -> Result<Response, ApiError> {
    if let Some(key) = &s.api_key {
        let given = ferrite_net::bearer(req.headers()).unwrap_or("");
        if !ferrite_net::constant_time_eq(given.as_bytes(), key.as_bytes()) {
            discard(req, extract::MAX_BODY);
            return Err(ApiError::unauthorized());
        }
    }
    Ok(next.run(req).await)
}

/// Unix seconds now, for `created`.
pub fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// A random hex id for responses (unique enough to tell requests apart in logs).
pub fn random_id() -> String {
    let mut rng = ferrite_runtime::engine::sampler::Rng::from_entropy();
    format!("{:016x}{:016x}", rng.next_u64(), rng.next_u64())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_differ() {
        assert_ne!(random_id(), random_id());
    }
}

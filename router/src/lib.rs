//! ferrite-router: one OpenAI-compatible endpoint for every InferenceService it watches.
//! Requests go to the service whose served model name matches `model`, to a replica picked by
//! the service's policy ([`policy`]) from the load it scrapes ([`load`]); requests for a
//! service with no ready replica are held while it scales from zero ([`proxy`]).

pub mod candidates;
pub mod demand;
pub mod flow;
pub mod limits;
pub mod load;
pub mod members;
pub mod metrics;
pub mod multipart;
pub mod parse;
pub mod peers;
pub mod policy;
pub mod prefix;
pub mod proxy;
pub mod quota;
pub mod recent;
pub mod registry;
pub mod resume;
pub mod ring;
pub mod tenants;
pub mod wake;
pub mod work;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::{get, post};

use kube::runtime::reflector::store::WriterDropped;

use crate::load::Loads;
use crate::metrics::Metrics;
use crate::peers::Peers;
use crate::registry::Registry;

pub use flow::FlowConfig;
pub use limits::LimitConfig;
pub use members::EndpointsFrom;
pub use peers::PeerConfig;
pub use proxy::{App, Config};

/// Why the router could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("the watch caches stopped before their first listing")]
    Watch(#[from] WriterDropped),
    #[error("registering metrics: {0}")]
    Metrics(#[from] prometheus::Error),
}

/// Starts what serves requests: the watch caches (cluster-wide, or in `namespace`; endpoints
/// `from` EndpointSlices or pods), listed
/// once before this returns so the first request finds its service, and the load scraper
/// every `scrape_every`. With `wake`, the client also writes the scale subresource to wake
/// services scaled to zero; without, held requests only wait.
pub async fn start(
    client: kube::Client,
    namespace: Option<&str>,
    from: EndpointsFrom,
    config: Config,
    scrape_every: Duration,
    wake: bool,
) -> Result<Arc<App>, StartError> {
    let registry = Registry::start(client.clone(), namespace, from);
    registry.ready().await?;
    let (tenants, peers) = match &config.tenants {
        Some(ns) => {
            let t = tenants::Tenants::start(client.clone(), ns);
            t.ready().await?;
            let peers = match &config.peers {
                Some(peer_config) => {
                    let p = peers::Peers::start(client.clone(), ns, peer_config.clone());
                    p.ready().await?;
                    Some(p)
                }
                None => None,
            };
            (Some(t), peers)
        }
        None => (None, None),
    };
    let loads = Loads::default();
    tokio::spawn(loads.clone().refresh(registry.clone(), scrape_every));
    let metrics = Metrics::new()?;
    let kube = wake.then_some(client);
    let app = Arc::new(App::new(
        registry, loads, metrics, config, kube, tenants, peers,
    ));
    tokio::spawn(housekeeping(Arc::downgrade(&app)));
    if app.flows.is_some() {
        tokio::spawn(proxy::pump(Arc::downgrade(&app), PUMP_TICK));
    }
    Ok(app)
}

/// How often waiting requests are looked at when nothing else wakes them (a scrape may have
/// found room).
const PUMP_TICK: Duration = Duration::from_millis(50);

/// Every minute: per-pod series of pods that are gone are removed, the rings of services
/// that are gone dropped, and wake records of services not woken for an hour forgotten.
async fn housekeeping(app: std::sync::Weak<App>) {
    let mut tick = tokio::time::interval(Duration::from_secs(60));
    loop {
        tick.tick().await;
        let Some(app) = app.upgrade() else { return };
        let services = app.registry.all();
        let ids = services.iter().map(|s| s.id()).collect();
        let live = services
            .into_iter()
            .flat_map(|s| {
                let model = s.model;
                s.endpoints
                    .into_iter()
                    .map(move |e| (model.clone(), e.name))
            })
            .collect();
        app.metrics.forget_pods(&live);
        app.metrics.forget_services(&ids);
        if let Some(t) = &app.tenants {
            let names = t.directory().names().clone();
            app.metrics.forget_tenants(&names);
            app.quotas.retain(&names);
        }
        app.rings.retain(&ids);
        if let Some(flows) = &app.flows {
            flows.forget_idle(std::time::Instant::now());
        }
        app.wakes
            .forget_older_than(tokio::time::Instant::now(), Duration::from_secs(3600));
    }
}

/// The HTTP routes: the OpenAI API (generation, embeddings, and any other `POST` naming a
/// model), health, and metrics.
pub fn routes(app: Arc<App>) -> Router {
    api_routes(app.clone()).merge(metrics_routes(app))
}

/// `/metrics` alone, for a port of its own (`--metrics-addr`): the series name every tenant,
/// which the tenants' own API port must not show. The tenants' rates for the other replicas
/// ([`peers`]) are served beside it, for the same reason.
pub fn metrics_routes(app: Arc<App>) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route(peers::DEMAND_PATH, get(tenant_demand))
        .with_state(app)
}

/// This replica's tenants' rates now (tokens a second), a JSON object; empty without
/// `--peers` (no replica reads them, so none are kept).
async fn tenant_demand(State(app): State<Arc<App>>) -> impl IntoResponse {
    axum::Json(app.peers.as_ref().map(Peers::rates_now).unwrap_or_default())
}

/// The OpenAI API and health, without `/metrics`.
pub fn api_routes(app: Arc<App>) -> Router {
    Router::new()
        .route("/v1/completions", post(proxy::forward))
        .route("/v1/chat/completions", post(proxy::forward))
        .route("/v1/embeddings", post(proxy::forward_pooling))
        // Forms with a file: the `model` field read from the head, the file streamed on.
        .route("/v1/audio/transcriptions", post(proxy::forward_upload))
        .route("/v1/audio/translations", post(proxy::forward_upload))
        // Adapters are the InferenceService's to declare: a client must not load one (from a
        // URL it chose) onto a replica through the router.
        .route("/v1/load_lora_adapter", post(proxy::not_for_clients))
        .route("/v1/unload_lora_adapter", post(proxy::not_for_clients))
        .route("/v1/{*rest}", post(proxy::forward_other))
        .route("/tokenize", post(proxy::forward_other))
        .route("/detokenize", post(proxy::forward_other))
        .route("/v1/models", get(proxy::models))
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .fallback(proxy::no_route)
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
    if let Some(flows) = &app.flows {
        // Every service shows its queue, waiting or not (0 is a value to scale on too).
        let queued: std::collections::HashMap<String, usize> = flows.queued().into_iter().collect();
        // Reset first: a service that went takes its series with it.
        app.metrics.queued.reset();
        for s in app.registry.all() {
            let n = queued.get(&s.id()).copied().unwrap_or(0);
            app.metrics
                .queued
                .with_label_values(&[&s.namespace, &s.name, &s.model])
                .set(n as i64);
        }
    }
    if let Some(peers) = &app.peers {
        let (ready, heard) = peers.replicas();
        let gauge = |state: &str, n: usize| {
            app.metrics
                .peer_replicas
                .with_label_values(&[state])
                .set(n as i64);
        };
        gauge("ready", ready);
        gauge("heard", heard);
    }
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4",
        )],
        app.metrics.render(),
    )
}

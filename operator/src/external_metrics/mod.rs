//! The External Metrics API (`external.metrics.k8s.io/v1beta1`), served from the autoscaler's
//! [`SignalStore`]. `api` holds the routes and queries, `tls` the HTTPS serving, `selector` the
//! label-selector grammar.
//!
//! Why: in `HPA` mode the stock HorizontalPodAutoscaler scales an InferenceService on its LLM
//! signals (waiting requests, KV-cache usage). HPA reads non-resource metrics only through the
//! aggregated metrics APIs, which usually means Prometheus plus prometheus-adapter or KEDA. The
//! operator already scrapes the pods for the built-in autoscaler, so it serves those same numbers
//! itself: register an `APIService` for `v1beta1.external.metrics.k8s.io` pointing at the
//! operator's Service and HPA works with nothing else installed.
//!
//! Metrics (one item per InferenceService in the namespace whose labels match the selector):
//!
//! | name                        | value                                            |
//! |-----------------------------|--------------------------------------------------|
//! | `ferrite_requests_waiting`  | waiting requests, summed over the reporting pods |
//! | `ferrite_requests_running`  | running requests, summed                         |
//! | `ferrite_queue_per_replica` | waiting requests per reporting pod               |
//! | `ferrite_kv_cache_usage`    | KV-cache usage fraction 0..1, averaged           |
//!
//! The labels a selector sees (and `metricLabels`) are the InferenceService's own labels plus
//! `ferrite.dev/inferenceservice: <name>`, which is what the HPA the operator builds selects on.
//! An InferenceService with no pod reporting yet yields no items rather than zeros: HPA then
//! reports `FailedGetExternalMetric` and holds the replica count, where a zero would scale
//! down on missing data. Likewise `ferrite_kv_cache_usage` is left out when no pod exports it.
//!
//! The aggregator only talks HTTPS, so [`serve_tls`] serves over rustls: from PEM files (e.g. a
//! cert-manager Secret) or a self-signed certificate made at start (its PEM goes in the
//! APIService's `caBundle`). `/apis` needs what an aggregated API server needs (see `authn`):
//! a client certificate signed by the cluster's request-header CA with an allowed common name,
//! both read from `kube-system/extension-apiserver-authentication` and watched; the health
//! endpoints stay open for the kubelet.
//!
//! Errors are Kubernetes `Status` objects, as kube-apiserver would send them.

pub mod api;
pub mod authn;
pub mod keeper;
pub mod selector;
pub mod tls;

use std::future::Future;
use std::sync::Arc;

use tokio::net::TcpListener;

pub use api::{ExternalMetricValue, ExternalMetricValueList, GROUP_VERSION, query, router};
pub use authn::{ClientAuth, RequestHeader, TrustError, Verdict};
pub use tls::{CertSource, ServerTls, TlsError, TlsSettings, service_names};

use crate::autoscale::store::SignalStore;

/// Serves the API for `store` over HTTPS on `listener` until `shutdown` completes.
pub async fn serve_tls(
    listener: TcpListener,
    tls: ServerTls,
    store: Arc<SignalStore>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    tls::serve(listener, tls, router(store), shutdown).await
}

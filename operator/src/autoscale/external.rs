//! The External Metrics API (`external.metrics.k8s.io/v1beta1`), served from the [`SignalStore`].
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
//! APIService's `caBundle`). With a client CA (the cluster's `requestheader-client-ca-file`),
//! `/apis` needs a client certificate signed by it, so only the aggregator can read metrics;
//! the health endpoints stay open for the kubelet.
//!
//! Errors are Kubernetes `Status` objects, as kube-apiserver would send them.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::pin::pin;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::rejection::{PathRejection, QueryRejection};
use axum::extract::{Path as UrlPath, Query, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{
    APIGroup, APIGroupList, APIResource, APIResourceList, GroupVersionForDiscovery, ListMeta,
    Status, StatusDetails, Time,
};
use k8s_openapi::jiff::Timestamp;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use serde::{Deserialize, Serialize};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls::server::WebPkiClientVerifier;
use tokio_rustls::rustls::{self, RootCertStore, ServerConfig};
use tower::ServiceExt;

use super::algorithm::Signals;
use super::selector::{Selector, is_dns1123_label};
use super::store::{SignalStore, Snapshot};
use crate::build::INSTANCE_LABEL;

pub const GROUP: &str = "external.metrics.k8s.io";
pub const VERSION: &str = "v1beta1";
pub const GROUP_VERSION: &str = "external.metrics.k8s.io/v1beta1";
/// What discovery lists each metric as, following prometheus-adapter and KEDA.
pub const LIST_KIND: &str = "ExternalMetricValueList";

/// A slow or silent client cannot hold a connection task forever.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(30);
/// How long open connections get to finish after shutdown starts.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// The metrics served.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Metric {
    RequestsWaiting,
    RequestsRunning,
    QueuePerReplica,
    KvCacheUsage,
}

impl Metric {
    pub const ALL: [Metric; 4] = [
        Metric::RequestsWaiting,
        Metric::RequestsRunning,
        Metric::QueuePerReplica,
        Metric::KvCacheUsage,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Metric::RequestsWaiting => "ferrite_requests_waiting",
            Metric::RequestsRunning => "ferrite_requests_running",
            Metric::QueuePerReplica => "ferrite_queue_per_replica",
            Metric::KvCacheUsage => "ferrite_kv_cache_usage",
        }
    }

    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|m| m.name() == name)
    }

    /// The value for one InferenceService; `None` when there is no data to report.
    pub fn value(self, s: &Signals) -> Option<f64> {
        if s.reporting == 0 {
            return None;
        }
        match self {
            Metric::RequestsWaiting => Some(s.waiting),
            Metric::RequestsRunning => Some(s.running),
            Metric::QueuePerReplica => s.queue_per_replica,
            Metric::KvCacheUsage => s.kv_usage,
        }
    }
}

/// `v` as a Kubernetes quantity in milli-units ("1500m"), or a plain integer when whole ("3").
/// `None` for NaN and infinities, which no quantity can hold.
pub fn quantity(v: f64) -> Option<Quantity> {
    if !v.is_finite() {
        return None;
    }
    let milli = (v * 1000.0).round() as i64;
    Some(Quantity(if milli % 1000 == 0 {
        (milli / 1000).to_string()
    } else {
        format!("{milli}m")
    }))
}

/// One metric value (`external.metrics.k8s.io/v1beta1` ExternalMetricValue).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ExternalMetricValue {
    pub metric_name: String,
    pub metric_labels: BTreeMap<String, String>,
    /// When the pods were scraped.
    pub timestamp: Time,
    pub value: Quantity,
}

/// The response of a metric query.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ExternalMetricValueList {
    pub api_version: String,
    pub kind: String,
    pub metadata: ListMeta,
    pub items: Vec<ExternalMetricValue>,
}

/// The labels a selector matches against: the InferenceService's own plus the instance label.
pub fn metric_labels(name: &str, snapshot: &Snapshot) -> BTreeMap<String, String> {
    let mut labels = snapshot.labels.clone();
    labels.insert(INSTANCE_LABEL.to_string(), name.to_string());
    labels
}

/// The items of `metric` for the InferenceServices of `namespace` that `selector` matches.
pub fn query(
    store: &SignalStore,
    namespace: &str,
    metric: Metric,
    selector: &Selector,
) -> ExternalMetricValueList {
    let items = store
        .in_namespace(namespace)
        .into_iter()
        .filter_map(|(name, snapshot)| {
            let labels = metric_labels(&name, &snapshot);
            if !selector.matches(&labels) {
                return None;
            }
            let value = metric.value(&snapshot.signals).and_then(quantity)?;
            // Before 1970 or past jiff's range cannot come from a real clock; fall back to now.
            let timestamp = Timestamp::try_from(snapshot.at).unwrap_or_else(|_| Timestamp::now());
            Some(ExternalMetricValue {
                metric_name: metric.name().to_string(),
                metric_labels: labels,
                timestamp: Time(timestamp),
                value,
            })
        })
        .collect();
    ExternalMetricValueList {
        api_version: GROUP_VERSION.to_string(),
        kind: LIST_KIND.to_string(),
        metadata: ListMeta::default(),
        items,
    }
}

/// The API as an axum router (no TLS; [`serve_tls`] adds it).
pub fn router(store: Arc<SignalStore>) -> Router {
    Router::new()
        .route("/apis", get(api_group_list))
        .route(&format!("/apis/{GROUP}"), get(api_group))
        .route(&format!("/apis/{GROUP_VERSION}"), get(api_resource_list))
        .route(
            &format!("/apis/{GROUP_VERSION}/namespaces/{{namespace}}/{{metric}}"),
            get(list_metric),
        )
        .route("/healthz", get(ok))
        .route("/readyz", get(ok))
        .route("/livez", get(ok))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(store)
}

async fn ok() -> &'static str {
    "ok"
}

fn group_version() -> GroupVersionForDiscovery {
    GroupVersionForDiscovery {
        group_version: GROUP_VERSION.to_string(),
        version: VERSION.to_string(),
    }
}

fn group() -> APIGroup {
    APIGroup {
        name: GROUP.to_string(),
        versions: vec![group_version()],
        preferred_version: Some(group_version()),
        server_address_by_client_cidrs: None,
    }
}

async fn api_group_list() -> Response {
    axum::Json(APIGroupList {
        groups: vec![group()],
    })
    .into_response()
}

async fn api_group() -> Response {
    axum::Json(group()).into_response()
}

async fn api_resource_list() -> Response {
    let resources = Metric::ALL
        .into_iter()
        .map(|m| APIResource {
            name: m.name().to_string(),
            singular_name: String::new(),
            namespaced: true,
            kind: LIST_KIND.to_string(),
            verbs: vec!["get".to_string()],
            ..APIResource::default()
        })
        .collect();
    axum::Json(APIResourceList {
        group_version: GROUP_VERSION.to_string(),
        resources,
    })
    .into_response()
}

async fn list_metric(
    State(store): State<Arc<SignalStore>>,
    path: Result<UrlPath<(String, String)>, PathRejection>,
    params: Result<Query<Vec<(String, String)>>, QueryRejection>,
) -> Response {
    let (namespace, metric_name) = match path {
        Ok(UrlPath(p)) => p,
        Err(e) => return status(StatusCode::BAD_REQUEST, "BadRequest", e.body_text(), None),
    };
    let params = match params {
        Ok(Query(p)) => p,
        Err(e) => return status(StatusCode::BAD_REQUEST, "BadRequest", e.body_text(), None),
    };
    // kube-apiserver does not check the namespace of a list (a malformed one just lists
    // nothing); a name that can never exist can only be a client bug, so say so.
    if !is_dns1123_label(&namespace) {
        return status(
            StatusCode::BAD_REQUEST,
            "BadRequest",
            format!("invalid namespace {namespace:?}: must be a DNS-1123 label"),
            None,
        );
    }
    let raw = params
        .iter()
        .find(|(k, _)| k == "labelSelector")
        .map_or("", |(_, v)| v.as_str());
    let selector = match Selector::parse(raw) {
        Ok(s) => s,
        Err(e) => {
            return status(
                StatusCode::BAD_REQUEST,
                "BadRequest",
                format!("invalid labelSelector {raw:?}: {e}"),
                None,
            );
        }
    };
    let Some(metric) = Metric::from_name(&metric_name) else {
        return status(
            StatusCode::NOT_FOUND,
            "NotFound",
            format!("the server could not find the metric {metric_name}"),
            Some(StatusDetails {
                group: Some(GROUP.to_string()),
                name: Some(metric_name),
                ..StatusDetails::default()
            }),
        );
    };
    let list = query(&store, &namespace, metric, &selector);
    tracing::debug!(
        %namespace,
        metric = metric.name(),
        selector = %selector,
        items = list.items.len(),
        "external metric query"
    );
    axum::Json(list).into_response()
}

async fn not_found() -> Response {
    status(
        StatusCode::NOT_FOUND,
        "NotFound",
        "the server could not find the requested resource".to_string(),
        None,
    )
}

async fn method_not_allowed() -> Response {
    let mut r = status(
        StatusCode::METHOD_NOT_ALLOWED,
        "MethodNotAllowed",
        "the server does not allow this method on the requested resource".to_string(),
        None,
    );
    r.headers_mut()
        .insert(header::ALLOW, header::HeaderValue::from_static("GET, HEAD"));
    r
}

/// A `Status` failure response, as kube-apiserver sends errors.
fn status(
    code: StatusCode,
    reason: &str,
    message: String,
    details: Option<StatusDetails>,
) -> Response {
    let body = Status {
        code: Some(i32::from(code.as_u16())),
        details,
        message: Some(message),
        metadata: ListMeta::default(),
        reason: Some(reason.to_string()),
        status: Some("Failure".to_string()),
    };
    (code, axum::Json(body)).into_response()
}

/// Where the serving certificate comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CertSource {
    /// PEM files (certificate chain and private key), read once at start.
    Files { cert: PathBuf, key: PathBuf },
    /// A certificate made at start for these DNS names or IP addresses. Trust it through
    /// [`ServerTls::cert_pem`] (the APIService's `caBundle`) or `insecureSkipTLSVerify`.
    SelfSigned { names: Vec<String> },
}

/// How [`serve_tls`] does TLS.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsSettings {
    pub cert: CertSource,
    /// PEM CA bundle; when set, `/apis` requires a client certificate signed by it (the
    /// aggregator presents its proxy-client certificate, signed by the cluster's
    /// requestheader client CA).
    pub client_ca: Option<PathBuf>,
}

impl TlsSettings {
    /// From `--tls-cert-file`/`--tls-key-file`-style flags: both files, or neither for a
    /// self-signed certificate for `names` (see [`service_names`]).
    pub fn from_flags(
        cert_file: Option<PathBuf>,
        key_file: Option<PathBuf>,
        names: Vec<String>,
        client_ca: Option<PathBuf>,
    ) -> Result<Self, TlsError> {
        let cert = match (cert_file, key_file) {
            (Some(cert), Some(key)) => CertSource::Files { cert, key },
            (None, None) => CertSource::SelfSigned { names },
            _ => return Err(TlsError::Incomplete),
        };
        Ok(Self { cert, client_ca })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("set both the certificate and the key file, or neither (self-signed)")]
    Incomplete,
    #[error("reading {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("parsing {path}: {source}")]
    Pem {
        path: PathBuf,
        #[source]
        source: rustls_pki_types::pem::Error,
    },
    #[error("{0} holds no certificate")]
    NoCertificate(PathBuf),
    #[error("a self-signed certificate needs at least one name")]
    NoNames,
    #[error("generating the self-signed certificate: {0}")]
    Generate(#[from] rcgen::Error),
    #[error("client CA {path}: {source}")]
    ClientCa {
        path: PathBuf,
        #[source]
        source: rustls::server::VerifierBuilderError,
    },
    #[error("TLS configuration: {0}")]
    Rustls(#[from] rustls::Error),
    #[error(transparent)]
    Version(#[from] crate::certs::CertError),
}

/// A ready TLS server configuration and the certificate it presents.
#[derive(Debug, Clone)]
pub struct ServerTls {
    config: Arc<ServerConfig>,
    cert_pem: String,
    client_auth: bool,
}

impl ServerTls {
    pub fn new(settings: &TlsSettings) -> Result<Self, TlsError> {
        let (cert_pem, chain, key) = match &settings.cert {
            CertSource::Files { cert, key } => {
                let cert_pem = read_to_string(cert)?;
                let chain = CertificateDer::pem_slice_iter(cert_pem.as_bytes())
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|source| TlsError::Pem {
                        path: cert.clone(),
                        source,
                    })?;
                if chain.is_empty() {
                    return Err(TlsError::NoCertificate(cert.clone()));
                }
                crate::certs::check_file(cert, "the serving certificate")?;
                let key_der = PrivateKeyDer::from_pem_slice(read_to_string(key)?.as_bytes())
                    .map_err(|source| TlsError::Pem {
                        path: key.clone(),
                        source,
                    })?;
                (cert_pem, chain, key_der)
            }
            CertSource::SelfSigned { names } => self_signed(names)?,
        };
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()?;
        let builder = match &settings.client_ca {
            Some(path) => {
                let mut roots = RootCertStore::empty();
                let pem = read_to_string(path)?;
                crate::certs::check_pem(
                    pem.as_bytes(),
                    &format!("the client CA {}", path.display()),
                )?;
                for cert in CertificateDer::pem_slice_iter(pem.as_bytes()) {
                    let cert = cert.map_err(|source| TlsError::Pem {
                        path: path.clone(),
                        source,
                    })?;
                    roots.add(cert)?;
                }
                if roots.is_empty() {
                    return Err(TlsError::NoCertificate(path.clone()));
                }
                // Unauthenticated clients may connect (the kubelet probes /healthz); the
                // request layer then keeps them off /apis.
                let verifier =
                    WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                        .allow_unauthenticated()
                        .build()
                        .map_err(|source| TlsError::ClientCa {
                            path: path.clone(),
                            source,
                        })?;
                builder.with_client_cert_verifier(verifier)
            }
            None => builder.with_no_client_auth(),
        };
        let mut config = builder.with_single_cert(chain, key)?;
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Self {
            config: Arc::new(config),
            cert_pem,
            client_auth: settings.client_ca.is_some(),
        })
    }

    /// The PEM of the certificate (chain) presented; for a self-signed one, what clients must
    /// trust.
    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    pub fn server_config(&self) -> Arc<ServerConfig> {
        self.config.clone()
    }
}

fn read_to_string(path: &Path) -> Result<String, TlsError> {
    std::fs::read_to_string(path).map_err(|source| TlsError::Read {
        path: path.to_path_buf(),
        source,
    })
}

type KeyMaterial = (String, Vec<CertificateDer<'static>>, PrivateKeyDer<'static>);

fn self_signed(names: &[String]) -> Result<KeyMaterial, TlsError> {
    let first = names.first().ok_or(TlsError::NoNames)?;
    let mut params = rcgen::CertificateParams::new(names.to_vec())?;
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, first.as_str());
    let key = rcgen::KeyPair::generate()?;
    let cert = params.self_signed(&key)?;
    let key_der = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
    Ok((cert.pem(), vec![cert.der().clone()], key_der))
}

/// The names a Service is reached by in-cluster; the aggregator dials `<service>.<ns>.svc`.
pub fn service_names(service: &str, namespace: &str) -> Vec<String> {
    vec![
        service.to_string(),
        format!("{service}.{namespace}"),
        format!("{service}.{namespace}.svc"),
        format!("{service}.{namespace}.svc.cluster.local"),
    ]
}

/// Serves [`router`] over HTTPS (HTTP/1.1) on `listener` until `shutdown` completes, then gives
/// open connections a few seconds to finish.
pub async fn serve_tls(
    listener: TcpListener,
    tls: ServerTls,
    store: Arc<SignalStore>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let acceptor = TlsAcceptor::from(tls.config.clone());
    let app = router(store);
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut shutdown = pin!(shutdown);
    let mut connections = JoinSet::new();
    tracing::info!(addr = ?listener.local_addr().ok(), client_auth = tls.client_auth, "serving the External Metrics API");
    loop {
        tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    connections.spawn(connection(
                        acceptor.clone(),
                        stream,
                        peer,
                        app.clone(),
                        tls.client_auth,
                        stop_rx.clone(),
                    ));
                }
                Err(e) => {
                    // Out of file descriptors and the like: back off instead of spinning.
                    tracing::warn!(error = %e, "accepting a connection");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
    let _ = stop_tx.send(true);
    let drained = tokio::time::timeout(SHUTDOWN_GRACE, async {
        while connections.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        connections.abort_all();
    }
    Ok(())
}

async fn connection(
    acceptor: TlsAcceptor,
    stream: TcpStream,
    peer: SocketAddr,
    app: Router,
    client_auth: bool,
    mut stop: watch::Receiver<bool>,
) {
    let tls = match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
        Ok(Ok(tls)) => tls,
        Ok(Err(e)) => {
            match crate::certs::explain_handshake(&format!("{e:?}")) {
                Some(why) => tracing::warn!(%peer, error = %e, "TLS handshake failed: {why}"),
                None => tracing::debug!(%peer, error = %e, "TLS handshake failed"),
            }
            return;
        }
        Err(_) => {
            tracing::debug!(%peer, "TLS handshake timed out");
            return;
        }
    };
    // The verifier already checked any certificate presented against the client CA.
    let authenticated = tls
        .get_ref()
        .1
        .peer_certificates()
        .is_some_and(|c| !c.is_empty());
    let service = hyper::service::service_fn(move |req: hyper::Request<Incoming>| {
        let app = app.clone();
        async move {
            if client_auth && !authenticated && req.uri().path().starts_with("/apis") {
                return Ok::<_, Infallible>(status(
                    StatusCode::UNAUTHORIZED,
                    "Unauthorized",
                    "a client certificate signed by the client CA is required".to_string(),
                    None,
                ));
            }
            app.oneshot(req).await
        }
    });
    let conn = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_READ_TIMEOUT)
        .serve_connection(TokioIo::new(tls), service);
    let mut conn = pin!(conn);
    tokio::select! {
        res = conn.as_mut() => {
            if let Err(e) = res {
                tracing::debug!(%peer, error = %e, "connection ended with an error");
            }
        }
        () = async { let _ = stop.wait_for(|s| *s).await; } => {
            conn.as_mut().graceful_shutdown();
            let _ = conn.await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::autoscale::store::Key;
    use axum::body::Body;
    use http_body_util::BodyExt;
    use std::time::SystemTime;

    fn signals(waiting: f64, running: f64, pods: usize, kv: Option<f64>) -> Signals {
        Signals {
            queue_per_replica: (pods > 0).then(|| waiting / pods as f64),
            kv_usage: kv,
            waiting,
            running,
            reporting: pods,
            ..Signals::default()
        }
    }

    fn snapshot(s: Signals, labels: &[(&str, &str)]) -> Snapshot {
        Snapshot {
            signals: s,
            at: SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000),
            labels: labels
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        }
    }

    #[test]
    fn external_quantity_formats() {
        let q = |v| quantity(v).map(|q| q.0);
        assert_eq!(q(3.0), Some("3".into()));
        assert_eq!(q(0.0), Some("0".into()));
        assert_eq!(q(1.5), Some("1500m".into()));
        assert_eq!(q(0.4567), Some("457m".into()));
        assert_eq!(q(-0.25), Some("-250m".into()));
        assert_eq!(q(f64::NAN), None);
        assert_eq!(q(f64::INFINITY), None);
    }

    #[test]
    fn external_metric_values_need_reporting_pods() {
        let s = signals(6.0, 4.0, 3, Some(0.5));
        assert_eq!(Metric::RequestsWaiting.value(&s), Some(6.0));
        assert_eq!(Metric::RequestsRunning.value(&s), Some(4.0));
        assert_eq!(Metric::QueuePerReplica.value(&s), Some(2.0));
        assert_eq!(Metric::KvCacheUsage.value(&s), Some(0.5));
        let none = signals(0.0, 0.0, 0, None);
        for m in Metric::ALL {
            assert_eq!(m.value(&none), None, "{m:?}");
            assert_eq!(Metric::from_name(m.name()), Some(m));
        }
        assert_eq!(
            Metric::KvCacheUsage.value(&signals(1.0, 1.0, 1, None)),
            None
        );
        assert_eq!(Metric::from_name("ferrite_other"), None);
    }

    #[test]
    fn external_query_filters_and_labels() {
        let store = SignalStore::new();
        store.put(
            Key::new("ml", "chat"),
            snapshot(signals(3.0, 2.0, 2, Some(0.25)), &[("tier", "gold")]),
        );
        store.put(
            Key::new("ml", "idle"),
            snapshot(signals(0.0, 0.0, 0, None), &[]),
        );
        store.put(
            Key::new("other", "chat"),
            snapshot(signals(9.0, 9.0, 1, None), &[]),
        );
        let all = Selector::default();
        let list = query(&store, "ml", Metric::RequestsWaiting, &all);
        assert_eq!(list.items.len(), 1);
        let item = &list.items[0];
        assert_eq!(item.value.0, "3");
        assert_eq!(item.metric_labels["tier"], "gold");
        assert_eq!(item.metric_labels[INSTANCE_LABEL], "chat");
        let json = serde_json::to_value(&list).expect("json");
        assert_eq!(json["items"][0]["timestamp"], "2023-11-14T22:13:20Z");
        assert_eq!(json["kind"], "ExternalMetricValueList");
        assert_eq!(json["metadata"], serde_json::json!({}));
        let gold = Selector::parse("tier=gold").expect("selector");
        assert_eq!(
            query(&store, "ml", Metric::QueuePerReplica, &gold).items[0]
                .value
                .0,
            "1500m"
        );
        let silver = Selector::parse("tier=silver").expect("selector");
        assert!(
            query(&store, "ml", Metric::KvCacheUsage, &silver)
                .items
                .is_empty()
        );
    }

    async fn call(app: Router, method: &str, uri: &str) -> (StatusCode, serde_json::Value) {
        let req = axum::http::Request::builder()
            .method(method)
            .uri(uri)
            .body(Body::empty())
            .expect("request");
        let resp = app.oneshot(req).await.expect("infallible");
        let code = resp.status();
        let bytes = resp.into_body().collect().await.expect("body").to_bytes();
        (code, serde_json::from_slice(&bytes).unwrap_or_default())
    }

    #[tokio::test]
    async fn external_router_errors_are_status_objects() {
        let app = router(Arc::new(SignalStore::new()));
        let base = "/apis/external.metrics.k8s.io/v1beta1/namespaces";
        for (method, uri, code, reason) in [
            ("GET", format!("{base}/ml/nope"), 404, "NotFound"),
            (
                "GET",
                format!("{base}/ml/ferrite_requests_waiting?labelSelector=a%3D%3D%3Db"),
                400,
                "BadRequest",
            ),
            (
                "GET",
                format!("{base}/Bad_NS/ferrite_requests_waiting"),
                400,
                "BadRequest",
            ),
            (
                "POST",
                format!("{base}/ml/ferrite_requests_waiting"),
                405,
                "MethodNotAllowed",
            ),
            ("GET", "/api/v1/pods".to_string(), 404, "NotFound"),
        ] {
            let (got, body) = call(app.clone(), method, &uri).await;
            assert_eq!(got.as_u16(), code, "{method} {uri}: {body}");
            assert_eq!(body["kind"], "Status", "{uri}");
            assert_eq!(body["apiVersion"], "v1");
            assert_eq!(body["status"], "Failure");
            assert_eq!(body["reason"], reason);
            assert_eq!(body["code"], code);
        }
    }

    #[test]
    fn external_tls_settings_from_flags() {
        let names = service_names("op", "sys");
        let s = TlsSettings::from_flags(None, None, names.clone(), None).expect("self-signed");
        assert_eq!(s.cert, CertSource::SelfSigned { names });
        let files = TlsSettings::from_flags(
            Some("tls.crt".into()),
            Some("tls.key".into()),
            Vec::new(),
            Some("ca.crt".into()),
        )
        .expect("files");
        assert_eq!(
            files.cert,
            CertSource::Files {
                cert: "tls.crt".into(),
                key: "tls.key".into()
            }
        );
        assert_eq!(files.client_ca, Some(PathBuf::from("ca.crt")));
        assert!(matches!(
            TlsSettings::from_flags(Some("tls.crt".into()), None, Vec::new(), None),
            Err(TlsError::Incomplete)
        ));
    }

    #[test]
    fn external_service_names() {
        assert_eq!(
            service_names("ferrite-operator", "ferrite-system")[2],
            "ferrite-operator.ferrite-system.svc"
        );
    }
}

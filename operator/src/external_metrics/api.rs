//! The API itself: discovery, metric queries over the signal store, and errors as
//! Kubernetes `Status` objects.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::Router;
use axum::extract::rejection::{PathRejection, QueryRejection};
use axum::extract::{Path as UrlPath, Query, Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{
    APIGroup, APIGroupList, APIResource, APIResourceList, GroupVersionForDiscovery, ListMeta,
    Status, StatusDetails, Time,
};
use k8s_openapi::jiff::Timestamp;
use serde::{Deserialize, Serialize};

use super::authn::Verdict;
use super::selector::{Selector, is_dns1123_label};
use crate::autoscale::store::{SignalStore, Snapshot};
use ferrite_api::labels::INSTANCE_LABEL;
use ferrite_api::signal::{Signal, quantity};

pub const GROUP: &str = "external.metrics.k8s.io";
pub const VERSION: &str = "v1beta1";
pub const GROUP_VERSION: &str = "external.metrics.k8s.io/v1beta1";
/// What discovery lists each metric as, following prometheus-adapter and KEDA.
pub const LIST_KIND: &str = "ExternalMetricValueList";

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
    metric: Signal,
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
                metric_name: metric.external_name().to_string(),
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
        .layer(middleware::from_fn(require_client_cert))
        .with_state(store)
}

/// `/apis` is for the clients the TLS layer's [`Verdict`] allows (the aggregator); the health
/// endpoints stay open for the kubelet. Without a verdict (plain HTTP in tests) nothing is
/// required.
async fn require_client_cert(req: Request, next: Next) -> Response {
    if req.uri().path().starts_with("/apis") {
        match req.extensions().get::<Verdict>() {
            Some(Verdict::Unauthenticated(why)) => {
                return status(StatusCode::UNAUTHORIZED, "Unauthorized", why.clone(), None);
            }
            Some(Verdict::Forbidden(why)) => {
                return status(StatusCode::FORBIDDEN, "Forbidden", why.clone(), None);
            }
            Some(Verdict::Allowed) | None => {}
        }
    }
    next.run(req).await
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
    let resources = Signal::ALL
        .into_iter()
        .map(|m| APIResource {
            name: m.external_name().to_string(),
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
    let Some(metric) = Signal::from_external_name(&metric_name) else {
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
        metric = metric.external_name(),
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::autoscale::store::Key;
    use axum::body::Body;
    use ferrite_api::signal::{PodMetrics, PodSample, Signals};
    use http_body_util::BodyExt;
    use std::time::{Duration, SystemTime};
    use tower::ServiceExt;

    /// The signals of ready pods reporting `(waiting, running, kv usage)` each.
    fn reported(pods: &[(f64, f64, Option<f64>)]) -> Signals {
        let ready = |&(waiting, running, kv_usage): &(f64, f64, Option<f64>)| {
            PodSample::Ready(PodMetrics {
                waiting,
                running,
                kv_usage,
            })
        };
        Signals::of(&pods.iter().map(ready).collect::<Vec<_>>())
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
    fn external_query_filters_and_labels() {
        let store = SignalStore::new();
        store.put(
            Key::new("ml", "chat"),
            snapshot(
                reported(&[(1.0, 1.0, Some(0.25)), (2.0, 1.0, Some(0.25))]),
                &[("tier", "gold")],
            ),
        );
        store.put(Key::new("ml", "idle"), snapshot(reported(&[]), &[]));
        store.put(
            Key::new("other", "chat"),
            snapshot(reported(&[(9.0, 9.0, None)]), &[]),
        );
        let all = Selector::default();
        let list = query(&store, "ml", Signal::RequestsWaiting, &all);
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
            query(&store, "ml", Signal::QueuePerReplica, &gold).items[0]
                .value
                .0,
            "1500m"
        );
        let silver = Selector::parse("tier=silver").expect("selector");
        assert!(
            query(&store, "ml", Signal::KvCacheUsage, &silver)
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
}

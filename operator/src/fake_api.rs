//! An in-memory Kubernetes API server over real HTTP, for running the real operator binary in
//! tests and benchmarks where no API server can be installed. It speaks the parts of the
//! protocol the operator uses: get, list (with equality label selectors), watch (with replay
//! from a `resourceVersion`), create, replace (with `resourceVersion` conflicts), delete,
//! server-side apply (approximated: the applied fields replace the old ones), JSON merge patch,
//! the `status` subresource, and API discovery for the ServiceMonitor group.
//!
//! Optionally it stands in for the Deployment controller: a written Deployment gets a status of
//! a finished rollout, so an InferenceService can reach `Ready`. It does not garbage-collect.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use serde_json::{Value, json};
use tokio::sync::broadcast;

/// Where an object lives: `/api/v1` or `/apis/GROUP/VERSION`, the plural, the namespace.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Collection {
    prefix: String,
    plural: String,
}

/// A parsed request path.
#[derive(Debug)]
struct Target {
    collection: Collection,
    namespace: Option<String>,
    name: Option<String>,
    status: bool,
    /// The `scale` subresource (autoscaling/v1 Scale over spec.replicas).
    scale: bool,
}

impl Target {
    /// `/api/v1[/namespaces/NS]/PLURAL[/NAME[/status]]` or the same under `/apis/G/V`.
    fn parse(path: &str) -> Option<Target> {
        let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
        let (prefix, rest) = match parts.as_slice() {
            ["api", v, rest @ ..] => (format!("/api/{v}"), rest),
            ["apis", g, v, rest @ ..] => (format!("/apis/{g}/{v}"), rest),
            _ => return None,
        };
        let (namespace, rest) = match rest {
            ["namespaces", ns, rest @ ..] if !rest.is_empty() => (Some(ns.to_string()), rest),
            _ => (None, rest),
        };
        let (plural, name, status, scale) = match rest {
            [plural] => (plural, None, false, false),
            [plural, name] => (plural, Some(name.to_string()), false, false),
            [plural, name, "status"] => (plural, Some(name.to_string()), true, false),
            [plural, name, "scale"] => (plural, Some(name.to_string()), false, true),
            _ => return None,
        };
        Some(Target {
            collection: Collection {
                prefix,
                plural: plural.to_string(),
            },
            namespace,
            name,
            status,
            scale,
        })
    }

    /// The store key of object `name` in this target's collection and namespace.
    fn key(&self, name: &str) -> Key {
        (
            self.collection.clone(),
            self.namespace.clone().unwrap_or_default(),
            name.to_string(),
        )
    }

    fn api_version(&self) -> String {
        let p = &self.collection.prefix;
        p.strip_prefix("/apis/")
            .or_else(|| p.strip_prefix("/api/"))
            .unwrap_or(p)
            .to_string()
    }
}

/// One request as Kubernetes RBAC authorizes it: the verb (`get`, `list`, `watch`, `create`,
/// `update`, `patch`, `delete`, `deletecollection`), the API group (`""` for the core group),
/// the resource with its subresource (`inferenceservices/status`), the namespace and the name.
/// Requests outside `/api` and `/apis/G/V/...` resources (discovery) have an empty resource and
/// their path in `name`. Tests check the Helm chart's RBAC against these.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize)]
pub struct Access {
    pub verb: String,
    pub group: String,
    pub resource: String,
    pub namespace: Option<String>,
    pub name: Option<String>,
}

impl Access {
    /// How the API server's request-info resolver names `method` on `path`.
    pub fn of(method: &Method, path: &str, query: &BTreeMap<String, String>) -> Access {
        let Some(t) = Target::parse(path) else {
            return Access {
                verb: method.as_str().to_ascii_lowercase(),
                group: String::new(),
                resource: String::new(),
                namespace: None,
                name: Some(path.to_string()),
            };
        };
        let watch = query.get("watch").is_some_and(|w| w == "true" || w == "1");
        let verb = match (method.as_str(), t.name.is_some()) {
            ("GET", true) => "get".to_string(),
            ("GET", false) if watch => "watch".to_string(),
            ("GET", false) => "list".to_string(),
            ("POST", _) => "create".to_string(),
            ("PUT", _) => "update".to_string(),
            ("PATCH", _) => "patch".to_string(),
            ("DELETE", true) => "delete".to_string(),
            ("DELETE", false) => "deletecollection".to_string(),
            (m, _) => m.to_ascii_lowercase(),
        };
        let api_version = t.api_version();
        let group = api_version
            .rsplit_once('/')
            .map(|(g, _)| g.to_string())
            .unwrap_or_default();
        let sub = if t.status {
            "/status"
        } else if t.scale {
            "/scale"
        } else {
            ""
        };
        Access {
            verb,
            group,
            resource: format!("{}{sub}", t.collection.plural),
            namespace: t.namespace,
            name: t.name,
        }
    }
}

/// One change, as a watch sends it.
#[derive(Debug, Clone)]
struct Change {
    rv: u64,
    collection: Collection,
    namespace: String,
    type_: &'static str,
    object: Value,
}

type Key = (Collection, String, String);

#[derive(Debug, Default)]
struct Store {
    objects: BTreeMap<Key, Value>,
    log: Vec<Change>,
}

/// A running fake API server.
#[derive(Debug, Clone)]
pub struct FakeApi {
    inner: Arc<Inner>,
    /// The base URL clients use, `http://127.0.0.1:PORT`.
    pub url: String,
}

#[derive(Debug)]
struct Inner {
    store: Mutex<Store>,
    rv: AtomicU64,
    changes: broadcast::Sender<Change>,
    service_monitor_crd: AtomicBool,
    simulate_rollouts: AtomicBool,
    requests: AtomicU64,
    writes: AtomicU64,
    accesses: Mutex<Vec<Access>>,
}

fn status_body(code: StatusCode, reason: &str, message: String) -> Response {
    let body = json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                      "reason": reason, "message": message, "code": code.as_u16()});
    (code, axum::Json(body)).into_response()
}

/// Equality-based label selectors (`a=b,c==d,e!=f`); anything else is refused.
fn selector_matches(selector: &str, obj: &Value) -> Result<bool, String> {
    let labels = &obj["metadata"]["labels"];
    for term in selector.split(',').filter(|t| !t.is_empty()) {
        let (key, want, equal) = if let Some((k, v)) = term.split_once("!=") {
            (k, v, false)
        } else if let Some((k, v)) = term.split_once("==").or_else(|| term.split_once('=')) {
            (k, v, true)
        } else {
            return Err(format!("unsupported label selector term {term:?}"));
        };
        let have = labels[key.trim()].as_str();
        if (have == Some(want.trim())) != equal {
            return Ok(false);
        }
    }
    Ok(true)
}

fn query(uri: &Uri) -> BTreeMap<String, String> {
    uri.query()
        .map(|q| {
            url_pairs(q)
                .into_iter()
                .collect::<BTreeMap<String, String>>()
        })
        .unwrap_or_default()
}

/// Decodes `a=b&c=d` with percent escapes.
fn url_pairs(q: &str) -> Vec<(String, String)> {
    fn decode(s: &str) -> String {
        let bytes = s.as_bytes();
        let mut out = Vec::with_capacity(bytes.len());
        let mut i = 0;
        while i < bytes.len() {
            match bytes[i] {
                b'%' if i + 2 < bytes.len() => {
                    let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).unwrap_or("");
                    match u8::from_str_radix(hex, 16) {
                        Ok(b) => {
                            out.push(b);
                            i += 3;
                            continue;
                        }
                        Err(_) => out.push(b'%'),
                    }
                }
                b'+' => out.push(b' '),
                b => out.push(b),
            }
            i += 1;
        }
        String::from_utf8_lossy(&out).into_owned()
    }
    q.split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (decode(k), decode(v))
        })
        .collect()
}

/// RFC 7386 JSON merge patch.
fn merge_patch(target: &mut Value, patch: &Value) {
    match (target, patch) {
        (Value::Object(t), Value::Object(p)) => {
            for (k, v) in p {
                if v.is_null() {
                    t.remove(k);
                } else {
                    merge_patch(t.entry(k.clone()).or_insert(Value::Null), v);
                }
            }
        }
        (t, p) => *t = p.clone(),
    }
}

impl FakeApi {
    /// Starts serving on an ephemeral port of 127.0.0.1.
    pub async fn start() -> std::io::Result<FakeApi> {
        let listener = tokio::net::TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], 0))).await?;
        let addr = listener.local_addr()?;
        let (changes, _) = broadcast::channel(4096);
        let inner = Arc::new(Inner {
            store: Mutex::new(Store::default()),
            rv: AtomicU64::new(1),
            changes,
            service_monitor_crd: AtomicBool::new(false),
            simulate_rollouts: AtomicBool::new(false),
            requests: AtomicU64::new(0),
            writes: AtomicU64::new(0),
            accesses: Mutex::new(Vec::new()),
        });
        let app = Router::new().fallback(handle).with_state(inner.clone());
        tokio::spawn(async move {
            if let Err(e) = axum::serve(listener, app).await {
                tracing::error!(error = %e, "fake API server stopped");
            }
        });
        Ok(FakeApi {
            inner,
            url: format!("http://{addr}"),
        })
    }

    /// Whether discovery reports the `monitoring.coreos.com/v1` ServiceMonitor resource.
    pub fn set_service_monitor_crd(&self, present: bool) {
        self.inner
            .service_monitor_crd
            .store(present, Ordering::Relaxed);
    }

    /// Whether written Deployments get the status of a finished rollout.
    pub fn set_simulate_rollouts(&self, on: bool) {
        self.inner.simulate_rollouts.store(on, Ordering::Relaxed);
    }

    /// A kube client talking to this server.
    pub fn client(&self) -> Result<kube::Client, kube::Error> {
        let uri = self
            .url
            .parse()
            .map_err(|e: axum::http::uri::InvalidUri| kube::Error::Service(e.into()))?;
        kube::Client::try_from(kube::Config::new(uri))
    }

    /// A kubeconfig pointing at this server, without credentials.
    pub fn kubeconfig(&self, namespace: &str) -> String {
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: {}\n\
             users:\n- name: fake\n  user: {{}}\ncontexts:\n- name: fake\n  context:\n    \
             cluster: fake\n    user: fake\n    namespace: {namespace}\ncurrent-context: fake\n",
            self.url
        )
    }

    /// Requests served, and how many of them wrote.
    pub fn request_counts(&self) -> (u64, u64) {
        (
            self.inner.requests.load(Ordering::Relaxed),
            self.inner.writes.load(Ordering::Relaxed),
        )
    }

    /// Every request served so far, as RBAC sees it, in order.
    pub fn accesses(&self) -> Vec<Access> {
        self.inner
            .accesses
            .lock()
            .map(|a| a.clone())
            .unwrap_or_else(|e| e.into_inner().clone())
    }

    /// Creates or replaces the object at `path` (a collection path), as a client's POST would,
    /// without going through HTTP.
    pub fn put(&self, collection_path: &str, object: Value) -> Result<Value, String> {
        let target = Target::parse(collection_path)
            .ok_or_else(|| format!("not a collection path: {collection_path}"))?;
        let ns = target
            .namespace
            .clone()
            .or_else(|| object["metadata"]["namespace"].as_str().map(String::from))
            .unwrap_or_default();
        let name = object["metadata"]["name"]
            .as_str()
            .ok_or("the object has no metadata.name")?
            .to_string();
        let mut store = self.inner.lock();
        let key = (target.collection.clone(), ns.clone(), name);
        let old = store.objects.get(&key).cloned();
        Ok(self
            .inner
            .write(&mut store, &target, key, old, object, false))
    }

    /// The object at `path`, if any.
    pub fn get(&self, path: &str) -> Option<Value> {
        let t = Target::parse(path)?;
        let key = (t.collection, t.namespace.unwrap_or_default(), t.name?);
        self.inner.lock().objects.get(&key).cloned()
    }

    /// Every object in a collection path (all namespaces when it names none).
    pub fn list(&self, collection_path: &str) -> Vec<Value> {
        let Some(t) = Target::parse(collection_path) else {
            return Vec::new();
        };
        self.inner
            .lock()
            .objects
            .iter()
            .filter(|((c, ns, _), _)| in_scope(&t, c, ns))
            .map(|(_, v)| v.clone())
            .collect()
    }

    /// Deletes the object at `path`; returns whether it existed.
    pub fn delete(&self, path: &str) -> bool {
        let Some(t) = Target::parse(path) else {
            return false;
        };
        let Some(name) = t.name.clone() else {
            return false;
        };
        let mut store = self.inner.lock();
        let key = (
            t.collection.clone(),
            t.namespace.clone().unwrap_or_default(),
            name,
        );
        self.inner.remove(&mut store, key).is_some()
    }
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, Store> {
        // A panic while holding the lock leaves the data consistent enough for a fake.
        self.store.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn next_rv(&self) -> u64 {
        self.rv.fetch_add(1, Ordering::Relaxed) + 1
    }

    fn record(&self, store: &mut Store, change: Change) {
        store.log.push(change.clone());
        // No receivers is fine: nobody is watching.
        let _ = self.changes.send(change);
    }

    /// Stores `new` (with server-set metadata filled in) and records the change.
    fn write(
        &self,
        store: &mut Store,
        target: &Target,
        key: Key,
        old: Option<Value>,
        mut new: Value,
        status_only: bool,
    ) -> Value {
        let rv = self.next_rv();
        if status_only {
            let mut base = old.clone().unwrap_or_else(|| json!({}));
            base["status"] = new["status"].clone();
            new = base;
        } else if let Some(o) = &old {
            // Writes to the main resource never change its status.
            if let Some(s) = o.get("status") {
                new["status"] = s.clone();
            }
        }
        if !new.is_object() {
            new = json!({});
        }
        let generation = match &old {
            None => 1,
            Some(o) => {
                let g = o["metadata"]["generation"].as_i64().unwrap_or(1);
                if !status_only && o.get("spec") != new.get("spec") {
                    g + 1
                } else {
                    g
                }
            }
        };
        let uid = old
            .as_ref()
            .and_then(|o| o["metadata"]["uid"].as_str().map(String::from))
            .unwrap_or_else(|| format!("uid-{rv}"));
        let created = old
            .as_ref()
            .and_then(|o| {
                o["metadata"]["creationTimestamp"]
                    .as_str()
                    .map(String::from)
            })
            .unwrap_or_else(|| "2026-01-01T00:00:00Z".to_string());
        let (collection, ns, name) = key.clone();
        if new["apiVersion"].is_null() {
            new["apiVersion"] = json!(target.api_version());
        }
        let meta = &mut new["metadata"];
        if !meta.is_object() {
            *meta = json!({});
        }
        meta["name"] = json!(name);
        if !ns.is_empty() {
            meta["namespace"] = json!(ns);
        }
        meta["uid"] = json!(uid);
        meta["resourceVersion"] = json!(rv.to_string());
        meta["generation"] = json!(generation);
        meta["creationTimestamp"] = json!(created);
        if collection.plural == "deployments" && self.simulate_rollouts.load(Ordering::Relaxed) {
            let replicas = new["spec"]["replicas"].as_i64().unwrap_or(1);
            new["status"] = json!({"observedGeneration": generation, "replicas": replicas,
                "updatedReplicas": replicas, "readyReplicas": replicas,
                "availableReplicas": replicas});
        }
        store.objects.insert(key, new.clone());
        let type_ = if old.is_some() { "MODIFIED" } else { "ADDED" };
        self.record(
            store,
            Change {
                rv,
                collection,
                namespace: ns,
                type_,
                object: new.clone(),
            },
        );
        new
    }

    fn remove(&self, store: &mut Store, key: Key) -> Option<Value> {
        let mut old = store.objects.remove(&key)?;
        let rv = self.next_rv();
        old["metadata"]["resourceVersion"] = json!(rv.to_string());
        let (collection, namespace, _) = key;
        self.record(
            store,
            Change {
                rv,
                collection,
                namespace,
                type_: "DELETED",
                object: old.clone(),
            },
        );
        Some(old)
    }
}

async fn handle(
    State(inner): State<Arc<Inner>>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    inner.requests.fetch_add(1, Ordering::Relaxed);
    if method != Method::GET {
        inner.writes.fetch_add(1, Ordering::Relaxed);
    }
    let q = query(&uri);
    let access = Access::of(&method, uri.path(), &q);
    match inner.accesses.lock() {
        Ok(mut a) => a.push(access),
        Err(e) => e.into_inner().push(access),
    }
    if method == Method::GET && uri.path().trim_end_matches('/') == "/apis/monitoring.coreos.com/v1"
    {
        return if inner.service_monitor_crd.load(Ordering::Relaxed) {
            axum::Json(json!({"kind": "APIResourceList", "apiVersion": "v1",
                "groupVersion": "monitoring.coreos.com/v1",
                "resources": [{"name": "servicemonitors", "singularName": "servicemonitor",
                    "namespaced": true, "kind": "ServiceMonitor",
                    "verbs": ["create", "delete", "get", "list", "patch", "update", "watch"]}]}))
            .into_response()
        } else {
            status_body(
                StatusCode::NOT_FOUND,
                "NotFound",
                "the server could not find the requested resource".into(),
            )
        };
    }
    let Some(target) = Target::parse(uri.path()) else {
        return status_body(
            StatusCode::NOT_FOUND,
            "NotFound",
            format!("no route {}", uri.path()),
        );
    };
    let body: Value = if body.is_empty() {
        Value::Null
    } else {
        match serde_json::from_slice(&body) {
            Ok(v) => v,
            Err(e) => {
                return status_body(StatusCode::BAD_REQUEST, "BadRequest", format!("body: {e}"));
            }
        }
    };
    let content_type = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    if target.scale {
        return scale(&inner, &target, method, &body);
    }
    match (method, target.name.clone()) {
        (Method::GET, None) if q.get("watch").is_some_and(|w| w == "true" || w == "1") => {
            watch(&inner, target, &q)
        }
        (Method::GET, None) => list(&inner, &target, &q),
        (Method::GET, Some(name)) => {
            let key = target.key(&name);
            match inner.lock().objects.get(&key) {
                Some(v) => axum::Json(v.clone()).into_response(),
                None => not_found(&target, &name),
            }
        }
        (Method::POST, None) => {
            let mut obj = body;
            let name = match obj["metadata"]["name"].as_str() {
                Some(n) => n.to_string(),
                None => match obj["metadata"]["generateName"].as_str() {
                    Some(g) => format!("{g}{:x}", inner.next_rv()),
                    None => {
                        return status_body(
                            StatusCode::UNPROCESSABLE_ENTITY,
                            "Invalid",
                            "metadata.name is required".into(),
                        );
                    }
                },
            };
            obj["metadata"]["name"] = json!(name);
            let key = target.key(&name);
            let mut store = inner.lock();
            if store.objects.contains_key(&key) {
                return status_body(
                    StatusCode::CONFLICT,
                    "AlreadyExists",
                    format!("{} {name} already exists", target.collection.plural),
                );
            }
            let v = inner.write(&mut store, &target, key, None, obj, false);
            (StatusCode::CREATED, axum::Json(v)).into_response()
        }
        (Method::PUT, Some(name)) => {
            let key = target.key(&name);
            let mut store = inner.lock();
            let Some(old) = store.objects.get(&key).cloned() else {
                return not_found(&target, &name);
            };
            let sent = body["metadata"]["resourceVersion"].as_str();
            if sent.is_some_and(|rv| Some(rv) != old["metadata"]["resourceVersion"].as_str()) {
                return status_body(
                    StatusCode::CONFLICT,
                    "Conflict",
                    format!(
                        "the object {name} has been modified; please apply your changes to the latest version and try again"
                    ),
                );
            }
            let v = inner.write(&mut store, &target, key, Some(old), body, target.status);
            axum::Json(v).into_response()
        }
        (Method::PATCH, Some(name)) => {
            let key = target.key(&name);
            let mut store = inner.lock();
            let old = store.objects.get(&key).cloned();
            let apply = content_type.starts_with("application/apply-patch");
            let new = if apply {
                // Server-side apply, approximated: the applied object replaces the old one.
                body
            } else {
                let Some(mut base) = old.clone() else {
                    return not_found(&target, &name);
                };
                merge_patch(&mut base, &body);
                base
            };
            let v = inner.write(&mut store, &target, key, old, new, target.status);
            axum::Json(v).into_response()
        }
        (Method::DELETE, Some(name)) => {
            let key = target.key(&name);
            let mut store = inner.lock();
            match inner.remove(&mut store, key) {
                Some(_) => axum::Json(json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success"})).into_response(),
                None => not_found(&target, &name),
            }
        }
        (m, _) => status_body(
            StatusCode::METHOD_NOT_ALLOWED,
            "MethodNotAllowed",
            format!("{m} is not supported on {}", uri.path()),
        ),
    }
}

/// The API's 404 for object `name` of `target`'s collection.
fn not_found(target: &Target, name: &str) -> Response {
    status_body(
        StatusCode::NOT_FOUND,
        "NotFound",
        format!("{} {name} not found", target.collection.plural),
    )
}

/// The scale subresource: GET reads, a merge PATCH of `spec.replicas` writes the object.
fn scale(inner: &Inner, target: &Target, method: Method, body: &Value) -> Response {
    let name = target.name.clone().unwrap_or_default();
    let key = target.key(&name);
    let mut store = inner.lock();
    let Some(old) = store.objects.get(&key).cloned() else {
        return not_found(target, &name);
    };
    let obj = match method {
        Method::GET => old,
        Method::PATCH | Method::PUT => {
            let Some(replicas) = body["spec"]["replicas"].as_i64() else {
                return status_body(
                    StatusCode::UNPROCESSABLE_ENTITY,
                    "Invalid",
                    "spec.replicas is required".into(),
                );
            };
            let mut new = old.clone();
            new["spec"]["replicas"] = json!(replicas);
            inner.write(&mut store, target, key, Some(old), new, false)
        }
        m => {
            return status_body(
                StatusCode::METHOD_NOT_ALLOWED,
                "MethodNotAllowed",
                format!("{m} is not supported on the scale subresource"),
            );
        }
    };
    axum::Json(json!({"kind": "Scale", "apiVersion": "autoscaling/v1",
        "metadata": {"name": name, "namespace": obj["metadata"]["namespace"],
            "resourceVersion": obj["metadata"]["resourceVersion"]},
        "spec": {"replicas": obj["spec"]["replicas"]},
        "status": {"replicas": obj["status"]["replicas"].as_i64().unwrap_or(0),
            "selector": obj["status"]["selector"]}}))
    .into_response()
}

fn in_scope(target: &Target, collection: &Collection, namespace: &str) -> bool {
    *collection == target.collection && target.namespace.as_deref().is_none_or(|n| n == namespace)
}

fn list(inner: &Inner, target: &Target, q: &BTreeMap<String, String>) -> Response {
    let selector = q.get("labelSelector").cloned().unwrap_or_default();
    let store = inner.lock();
    let mut items = Vec::new();
    for ((c, ns, _), v) in &store.objects {
        if !in_scope(target, c, ns) {
            continue;
        }
        match selector_matches(&selector, v) {
            Ok(true) => items.push(v.clone()),
            Ok(false) => {}
            Err(e) => return status_body(StatusCode::BAD_REQUEST, "BadRequest", e),
        }
    }
    let rv = inner.rv.load(Ordering::Relaxed);
    axum::Json(json!({"kind": "List", "apiVersion": target.api_version(),
                      "metadata": {"resourceVersion": rv.to_string()}, "items": items}))
    .into_response()
}

/// A watch: the changes after the given `resourceVersion`, then live ones, as JSON lines. The
/// stream stays open until the client goes.
fn watch(inner: &Arc<Inner>, target: Target, q: &BTreeMap<String, String>) -> Response {
    let since: u64 = q
        .get("resourceVersion")
        .and_then(|r| r.parse().ok())
        .unwrap_or(0);
    let selector = q.get("labelSelector").cloned().unwrap_or_default();
    if let Err(e) = selector_matches(&selector, &json!({})) {
        return status_body(StatusCode::BAD_REQUEST, "BadRequest", e);
    }
    // Replay and subscribe under one lock so no change falls between them.
    let (backlog, rx) = {
        let store = inner.lock();
        let backlog: Vec<Change> = store.log.iter().filter(|c| c.rv > since).cloned().collect();
        (backlog, inner.changes.subscribe())
    };
    let target = Arc::new(target);
    let keep = {
        let target = target.clone();
        move |c: &Change| {
            in_scope(&target, &c.collection, &c.namespace)
                && selector_matches(&selector, &c.object).unwrap_or(false)
        }
    };
    let line = |c: Change| -> Result<Bytes, Infallible> {
        let mut s = json!({"type": c.type_, "object": c.object}).to_string();
        s.push('\n');
        Ok(Bytes::from(s))
    };
    let keep2 = keep.clone();
    let replay = futures::stream::iter(backlog.into_iter().filter(keep).map(line));
    let live = futures::stream::unfold(rx, |mut rx| async move {
        loop {
            match rx.recv().await {
                Ok(c) => return Some((c, rx)),
                Err(broadcast::error::RecvError::Lagged(_)) => continue,
                Err(broadcast::error::RecvError::Closed) => return None,
            }
        }
    })
    .filter(move |c| std::future::ready(keep2(c)))
    .map(line);
    Response::builder()
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from_stream(replay.chain(live)))
        .unwrap_or_else(|e| {
            status_body(
                StatusCode::INTERNAL_SERVER_ERROR,
                "InternalError",
                e.to_string(),
            )
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_parse_into_collection_namespace_name_and_subresource() {
        let t =
            Target::parse("/apis/ferrite.dev/v1alpha1/namespaces/ml/inferenceservices/chat/status")
                .expect("parses");
        assert_eq!(t.collection.prefix, "/apis/ferrite.dev/v1alpha1");
        assert_eq!(t.collection.plural, "inferenceservices");
        assert_eq!(
            (t.namespace.as_deref(), t.name.as_deref(), t.status),
            (Some("ml"), Some("chat"), true)
        );
        let t = Target::parse("/api/v1/pods").expect("parses");
        assert_eq!(t.api_version(), "v1");
        assert_eq!((t.namespace, t.name), (None, None));
        assert!(Target::parse("/healthz").is_none());
    }

    #[test]
    fn requests_map_to_rbac_verbs_groups_and_subresources() {
        let none = BTreeMap::new();
        let watch = BTreeMap::from([("watch".to_string(), "true".to_string())]);
        let a = |m: Method, p: &str, q: &BTreeMap<String, String>| {
            let a = Access::of(&m, p, q);
            (a.verb, a.group, a.resource, a.namespace, a.name)
        };
        let ns = Some("ml".to_string());
        assert_eq!(
            a(
                Method::PATCH,
                "/apis/ferrite.dev/v1alpha1/namespaces/ml/inferenceservices/x/scale",
                &none
            ),
            (
                "patch".into(),
                "ferrite.dev".into(),
                "inferenceservices/scale".into(),
                ns.clone(),
                Some("x".into())
            )
        );
        assert_eq!(
            a(Method::GET, "/api/v1/namespaces/ml/pods", &none),
            ("list".into(), "".into(), "pods".into(), ns.clone(), None)
        );
        assert_eq!(
            a(Method::GET, "/apis/apps/v1/deployments", &watch).0,
            "watch"
        );
        assert_eq!(
            a(
                Method::PUT,
                "/apis/coordination.k8s.io/v1/namespaces/ml/leases/l",
                &none
            )
            .0,
            "update"
        );
        assert_eq!(
            a(
                Method::POST,
                "/apis/events.k8s.io/v1/namespaces/ml/events",
                &none
            )
            .0,
            "create"
        );
        assert_eq!(
            a(Method::DELETE, "/api/v1/namespaces/ml/configmaps/c", &none).0,
            "delete"
        );
        let d = Access::of(&Method::GET, "/apis/monitoring.coreos.com/v1", &none);
        assert_eq!(
            (d.resource.as_str(), d.name.as_deref()),
            ("", Some("/apis/monitoring.coreos.com/v1"))
        );
    }

    #[test]
    fn label_selectors_match_on_equality_and_refuse_the_rest() {
        let obj = json!({"metadata": {"labels": {"a": "1", "b": "2"}}});
        assert_eq!(selector_matches("a=1,b==2", &obj), Ok(true));
        assert_eq!(selector_matches("a=1,b!=2", &obj), Ok(false));
        assert_eq!(selector_matches("c=3", &obj), Ok(false));
        assert!(selector_matches("a in (1)", &obj).is_err());
    }

    #[test]
    fn queries_are_percent_decoded() {
        let p = url_pairs("labelSelector=app.kubernetes.io%2Fcomponent%3Dserver&watch=true");
        assert_eq!(p[0].1, "app.kubernetes.io/component=server");
        assert_eq!(p[1], ("watch".to_string(), "true".to_string()));
    }

    #[test]
    fn merge_patch_follows_rfc_7386() {
        let mut v = json!({"a": {"b": 1, "c": 2}, "d": 3});
        merge_patch(&mut v, &json!({"a": {"b": null, "e": 4}, "d": [1]}));
        assert_eq!(v, json!({"a": {"c": 2, "e": 4}, "d": [1]}));
    }
}

//! The router's e2e harness: a real API server (etcd, kube-apiserver, kube-controller-manager)
//! with the InferenceService CRD from `crds/`, InferenceServices and their pods created as the
//! operator would make them, the pods made Ready at loopback addresses where real
//! ferrite-servers listen, and the router (in-process, with its real watch caches and HTTP
//! client) in front of them.

#![allow(dead_code)]

use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use ferrite_router::load::Loads;
use ferrite_router::metrics::Metrics;
use ferrite_router::registry::Registry;
use ferrite_router::{App, Config};
use ferrite_testkit::kube::Cluster;
use ferrite_testkit::kube::bins::workspace_root;
use ferrite_testkit::process::eventually;
use ferrite_testkit::server::{Server, binary};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, DynamicObject, Patch, PatchParams, PostParams};
use kube::core::GroupVersionKind;
use kube::discovery::ApiResource;
use serde_json::{Value, json};

pub const WAIT: Duration = Duration::from_secs(60);

async fn install_crd(client: &kube::Client) {
    let path = workspace_root().join("crds/inferenceservice.yaml");
    let text = std::fs::read_to_string(&path).expect("crds/inferenceservice.yaml");
    let crd: CustomResourceDefinition = serde_yaml_ng::from_str(&text).expect("a CRD");
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    api.create(&PostParams::default(), &crd)
        .await
        .expect("creating the CRD");
    eventually(WAIT, "the CRD to be established", async || {
        let c = api.get("inferenceservices.ferrite.dev").await.ok()?;
        c.status?
            .conditions?
            .iter()
            .any(|c| c.type_ == "Established" && c.status == "True")
            .then_some(())
    })
    .await;
}

/// A cluster of this test's own with the CRD installed, a client, and a fresh namespace; `None`
/// where the control-plane binaries are missing outside CI (the testkit says so loudly).
pub async fn cluster_with_crd(prefix: &str) -> Option<(Cluster, kube::Client, String)> {
    let cluster = Cluster::start().await?;
    let client = cluster.client().await;
    install_crd(&client).await;
    let ns = cluster.namespace(prefix).await;
    Some((cluster, client, ns))
}

pub fn isvc_api(client: &kube::Client, ns: &str) -> Api<DynamicObject> {
    let gvk = GroupVersionKind::gvk("ferrite.dev", "v1alpha1", "InferenceService");
    Api::namespaced_with(client.clone(), ns, &ApiResource::from_gvk(&gvk))
}

pub async fn create_isvc(client: &kube::Client, ns: &str, name: &str, spec: Value) {
    let obj: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "ferrite.dev/v1alpha1", "kind": "InferenceService",
        "metadata": {"name": name, "namespace": ns}, "spec": spec}))
    .expect("object");
    isvc_api(client, ns)
        .create(&PostParams::default(), &obj)
        .await
        .unwrap_or_else(|e| panic!("creating InferenceService {name}: {e}"));
}

/// A pod as the operator's Deployment makes it, made Ready at `ip` (where a real server
/// listens on the InferenceService's port).
pub async fn ready_pod(client: &kube::Client, ns: &str, isvc: &str, pod: &str, ip: &str) {
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let p: Pod = serde_json::from_value(json!({
        "metadata": {"name": pod, "labels": {
            "app.kubernetes.io/managed-by": "ferrite-operator",
            "app.kubernetes.io/component": "server",
            "ferrite.dev/inferenceservice": isvc}},
        "spec": {"containers": [{"name": "server", "image": "stand-in"}]}}))
    .expect("pod");
    pods.create(&PostParams::default(), &p)
        .await
        .unwrap_or_else(|e| panic!("creating pod {pod}: {e}"));
    let now = k8s_openapi::jiff::Timestamp::now().to_string();
    let cond = |t: &str| json!({"type": t, "status": "True", "lastTransitionTime": now});
    let status = json!({"status": {
        "phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}], "hostIP": ip, "startTime": now,
        "conditions": [cond("PodScheduled"), cond("Initialized"), cond("ContainersReady"), cond("Ready")]}});
    pods.patch_status(pod, &PatchParams::default(), &Patch::Merge(&status))
        .await
        .unwrap_or_else(|e| panic!("patching pod {pod}'s status: {e}"));
}

/// A ferrite-server on the default model at `host:port`, serving it as `model`, with a KV
/// cache small enough for several on one machine.
pub fn server(host: &str, port: u16, model: &str) -> Server {
    server_with(host, port, model, &[])
}

/// [`server`] with `extra` flags.
pub fn server_with(host: &str, port: u16, model: &str, extra: &[&str]) -> Server {
    let mut flags = vec!["--max-model-len", "512", "--kv-cache-memory", "64MiB"];
    flags.extend_from_slice(extra);
    let mut s = Server::spawn_as(&binary(), model, host, port, &flags, Stdio::null());
    s.wait_ready();
    s
}

/// The router's settings in these tests.
pub fn config() -> Config {
    Config {
        prefix_chars: 256,
        epsilon: 0.25,
        max_body: 1 << 20,
        connect_timeout: Duration::from_secs(2),
    }
}

/// The router in this process, watching `ns` and scraping every 200 ms; returns its base URL.
pub async fn router(client: &kube::Client, ns: &str) -> String {
    router_with(client, ns, config(), true).await
}

/// [`router`] with `config`; `wake: false` is `--no-wake`.
pub async fn router_with(client: &kube::Client, ns: &str, config: Config, wake: bool) -> String {
    let registry = Registry::start(client.clone(), Some(ns));
    registry.ready().await.expect("watch caches listed");
    let loads = Loads::default();
    tokio::spawn(
        loads
            .clone()
            .refresh(registry.clone(), Duration::from_millis(200)),
    );
    let metrics = Metrics::new().expect("metrics");
    let kube = wake.then(|| client.clone());
    let app = Arc::new(App::new(registry, loads, metrics, config, kube));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        axum::serve(listener, ferrite_router::routes(app))
            .await
            .expect("serve");
    });
    format!("http://{addr}")
}

/// POSTs `body` from a blocking thread (ureq), returning status, JSON and Retry-After.
pub async fn post(url: String, body: Value) -> (u16, Value, Option<String>) {
    tokio::task::spawn_blocking(move || {
        let r = match ureq::post(&url)
            .timeout(Duration::from_secs(120))
            .send_json(body)
        {
            Ok(r) => r,
            Err(ureq::Error::Status(_, r)) => r,
            Err(e) => panic!("{url}: {e}"),
        };
        let status = r.status();
        let retry = r.header("retry-after").map(str::to_string);
        (status, r.into_json().unwrap_or(Value::Null), retry)
    })
    .await
    .expect("request thread")
}

pub async fn get(url: String) -> Value {
    serde_json::from_str(&get_text(url).await).expect("JSON")
}

pub async fn get_text(url: String) -> String {
    tokio::task::spawn_blocking(move || {
        ureq::get(&url)
            .call()
            .expect("GET")
            .into_string()
            .expect("text")
    })
    .await
    .expect("request thread")
}

/// The sum of every series of `name` in an exposition whose labels contain all of `labels`
/// (`key="value"` strings).
pub fn metric_sum(exposition: &str, name: &str, labels: &[&str]) -> f64 {
    exposition
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| l.split(['{', ' ']).next().is_some_and(|n| n == name))
        .filter(|l| labels.iter().all(|want| l.contains(want)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Requests a ferrite-server finished, from its `/metrics`.
pub async fn finished(base: &str) -> f64 {
    let text = get_text(format!("{base}/metrics")).await;
    metric_sum(&text, "vllm:request_success_total", &[])
}

/// Waits until `/v1/models` lists `model` with `n` ready replicas.
pub async fn wait_ready_replicas(base: &str, model: &str, n: usize) {
    let url = format!("{base}/v1/models");
    eventually(WAIT, "the replicas listed by the router", async || {
        let v = get(url.clone()).await;
        v["data"]
            .as_array()?
            .iter()
            .any(|m| m["id"] == model && m["ready_replicas"] == n)
            .then_some(())
    })
    .await;
}

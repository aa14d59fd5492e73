//! The router's e2e harness: a real API server (etcd, kube-apiserver, kube-controller-manager)
//! with the InferenceService CRD from `crds/`, InferenceServices and their pods created as the
//! operator would make them, the pods made Ready at loopback addresses where real
//! ferrite-servers listen, and the router (in-process, with its real watch caches and HTTP
//! client) in front of them.

use std::process::Stdio;
use std::time::Duration;

use ferrite_router::{Config, EndpointsFrom, FlowConfig, LimitConfig};
use ferrite_testkit::kube::Cluster;
pub use ferrite_testkit::kube::standin::{create_isvc, install_crd, isvc_api, ready_pod};
use ferrite_testkit::process::{eventually, free_port};
use ferrite_testkit::server::{Metrics, Server, binary};
use serde_json::Value;

pub const WAIT: Duration = Duration::from_secs(60);

/// A cluster of this test's own with the CRD installed, a client, and a fresh namespace; `None`
/// where the control-plane binaries are missing outside CI (the testkit says so loudly).
pub async fn cluster_with_crd(prefix: &str) -> Option<(Cluster, kube::Client, String)> {
    let cluster = Cluster::start().await?;
    let client = cluster.client().await;
    install_crd(&client).await;
    let ns = cluster.namespace(prefix).await;
    Some((cluster, client, ns))
}

/// [`cluster_with_crd`], plus InferenceService `chat` on the default model at a free port
/// with `spec`'s fields (replicas, routing) added; returns the port too.
pub async fn chat_service(
    prefix: &str,
    spec: Value,
) -> Option<(Cluster, kube::Client, String, u16)> {
    let (cluster, client, ns) = cluster_with_crd(prefix).await?;
    let port = free_port();
    let mut full = serde_json::json!({"model": {"source": "/models/smol.gguf"},
                                      "runtime": {"port": port}});
    if let (Some(full), Value::Object(extra)) = (full.as_object_mut(), spec) {
        full.extend(extra);
    }
    create_isvc(&client, &ns, "chat", full).await;
    Some((cluster, client, ns, port))
}

/// [`chat_service`] with the InferenceTenant CRD installed too.
pub async fn tenant_chat_service(prefix: &str) -> Option<(Cluster, kube::Client, String, u16)> {
    let found = chat_service(prefix, serde_json::json!({})).await?;
    ferrite_testkit::kube::standin::install_tenant_crd(&found.1).await;
    Some(found)
}

/// InferenceServices `names` on the default model, each at its own free port (returned in
/// the same order).
pub async fn services(client: &kube::Client, ns: &str, names: &[&str]) -> Vec<u16> {
    let mut ports = Vec::new();
    for name in names {
        let port = free_port();
        let spec = serde_json::json!({"model": {"source": "/models/smol.gguf"},
                                      "runtime": {"port": port}});
        create_isvc(client, ns, name, spec).await;
        ports.push(port);
    }
    ports
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
        limits: LimitConfig {
            max_body: 1 << 20,
            ..LimitConfig::default()
        },
        connect_timeout: Duration::from_secs(2),
        body_read_timeout: Duration::from_secs(30),
        set_aside: Duration::from_secs(10),
        tenants: None,
        peers: None,
        flow: Some(FlowConfig::default()),
    }
}

/// The router in this process, watching `ns` and scraping every 200 ms; returns its base URL.
pub async fn router(client: &kube::Client, ns: &str) -> String {
    router_with(client, ns, config(), true).await
}

/// [`router`] with `config`; `wake: false` is `--no-wake`.
pub async fn router_with(client: &kube::Client, ns: &str, config: Config, wake: bool) -> String {
    router_in(client, Some(ns), config, wake).await
}

/// [`router_with`], watching `ns` or (`None`) the whole cluster.
pub async fn router_in(
    client: &kube::Client,
    ns: Option<&str>,
    config: Config,
    wake: bool,
) -> String {
    router_bound(client, ns, config, wake, "127.0.0.1:0").await
}

/// [`router_in`], listening on `bind` (a router replica's pod address, where the others read
/// its tenants' rates).
pub async fn router_bound(
    client: &kube::Client,
    ns: Option<&str>,
    config: Config,
    wake: bool,
    bind: &str,
) -> String {
    let app = ferrite_router::start(
        client.clone(),
        ns,
        // The test pods sit at loopback addresses, which EndpointSlices refuse.
        EndpointsFrom::Pods,
        config,
        Duration::from_millis(200),
        wake,
    )
    .await
    .expect("the router starts");
    let listener = tokio::net::TcpListener::bind(bind).await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        axum::serve(listener, ferrite_router::routes(app))
            .await
            .expect("serve");
    });
    format!("http://{addr}")
}

/// POSTs `body` from a blocking thread (ureq), returning status, JSON and Retry-After.
pub use ferrite_testkit::server::post_json as post;

/// POSTs `body` with `headers` from a blocking thread: status, JSON body (null when it is
/// not JSON) and the response's headers.
pub async fn post_with(
    url: &str,
    headers: &[(&str, String)],
    body: Value,
) -> (u16, Value, std::collections::HashMap<String, String>) {
    let url = url.to_string();
    let headers: Vec<(String, String)> = headers
        .iter()
        .map(|(k, v)| (k.to_string(), v.clone()))
        .collect();
    tokio::task::spawn_blocking(move || {
        let mut req = ureq::post(&url).timeout(Duration::from_secs(120));
        for (k, v) in &headers {
            req = req.set(k, v);
        }
        let r = match req.send_json(body) {
            Ok(r) | Err(ureq::Error::Status(_, r)) => r,
            Err(e) => panic!("{url}: {e}"),
        };
        let names = r.headers_names();
        let headers = names
            .into_iter()
            .filter_map(|n| Some((n.clone(), r.header(&n)?.to_string())))
            .collect();
        (r.status(), r.into_json().unwrap_or(Value::Null), headers)
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

/// The sum of every series of `name` in an exposition whose labels include `labels`.
pub fn metric_sum(exposition: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    Metrics::parse(exposition.to_string()).sum_where(name, labels)
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

//! ferrite-router on a real API server (etcd, kube-apiserver, kube-controller-manager): the
//! InferenceService CRD installed from `crds/`, InferenceServices and their pods created as
//! the operator would make them, the pods made Ready at loopback addresses where real
//! ferrite-servers listen, and the router (in-process, with its real watch caches and HTTP
//! client) in front of them.

use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferrite_router::load::Loads;
use ferrite_router::metrics::Metrics;
use ferrite_router::registry::Registry;
use ferrite_router::{App, Config};
use ferrite_testkit::kube::Cluster;
use ferrite_testkit::kube::bins::workspace_root;
use ferrite_testkit::process::{eventually, free_port};
use ferrite_testkit::server::{Server, binary};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, DynamicObject, Patch, PatchParams, PostParams};
use kube::core::GroupVersionKind;
use kube::discovery::ApiResource;
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(60);

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
async fn cluster_with_crd(prefix: &str) -> Option<(Cluster, kube::Client, String)> {
    let cluster = Cluster::start().await?;
    let client = cluster.client().await;
    install_crd(&client).await;
    let ns = cluster.namespace(prefix).await;
    Some((cluster, client, ns))
}

fn isvc_api(client: &kube::Client, ns: &str) -> Api<DynamicObject> {
    let gvk = GroupVersionKind::gvk("ferrite.dev", "v1alpha1", "InferenceService");
    Api::namespaced_with(client.clone(), ns, &ApiResource::from_gvk(&gvk))
}

async fn create_isvc(client: &kube::Client, ns: &str, name: &str, spec: Value) {
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
async fn ready_pod(client: &kube::Client, ns: &str, isvc: &str, pod: &str, ip: &str) {
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

/// A ferrite-server on the default model at `host:port`, serving it as `model`.
fn server(host: &str, port: u16, model: &str) -> Server {
    let mut s = Server::spawn_as(
        &binary(),
        model,
        host,
        port,
        &["--max-model-len", "512"],
        Stdio::null(),
    );
    s.wait_ready();
    s
}

/// The router in this process, watching `ns`; returns its base URL.
async fn router(client: &kube::Client, ns: &str) -> String {
    let registry = Registry::start(client.clone(), Some(ns));
    registry.ready().await.expect("watch caches listed");
    let loads = Loads::default();
    tokio::spawn(
        loads
            .clone()
            .refresh(registry.clone(), Duration::from_millis(200)),
    );
    let config = Config {
        prefix_chars: 256,
        epsilon: 0.25,
        max_body: 1 << 20,
        connect_timeout: Duration::from_secs(2),
    };
    let metrics = Metrics::new().expect("metrics");
    let app = Arc::new(App::new(
        registry,
        loads,
        metrics,
        config,
        Some(client.clone()),
    ));
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

/// POSTs `body` to the router from a blocking thread (ureq), returning status and JSON.
async fn post(url: String, body: Value) -> (u16, Value, Option<String>) {
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

async fn get(url: String) -> Value {
    serde_json::from_str(&get_text(url).await).expect("JSON")
}

fn completion(model: &str) -> Value {
    json!({"model": model, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0})
}

/// Two InferenceServices behind one endpoint: each model reaches its own server, unknown
/// models get OpenAI's 404, and `/v1/models` lists both with their ready replicas.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routes_by_model_across_two_inference_services() {
    let Some((_cluster, client, ns)) = cluster_with_crd("router").await else {
        return;
    };
    let (chat_port, code_port) = (free_port(), free_port());
    create_isvc(
        &client,
        &ns,
        "chat",
        json!({"model": {"source": "/models/smol.gguf", "servedName": "chat-model"},
        "runtime": {"port": chat_port}}),
    )
    .await;
    create_isvc(
        &client,
        &ns,
        "code",
        json!({"model": {"source": "/models/smol.gguf"},
        "runtime": {"port": code_port}, "routing": {"policy": "least-load"}}),
    )
    .await;
    let _chat = server("127.0.0.1", chat_port, "chat-model");
    let _code = server("127.0.0.1", code_port, "code");
    ready_pod(&client, &ns, "chat", "chat-0", "127.0.0.1").await;
    ready_pod(&client, &ns, "code", "code-0", "127.0.0.1").await;
    let base = router(&client, &ns).await;

    let listed = eventually(WAIT, "both models ready in /v1/models", async || {
        let v = get(format!("{base}/v1/models")).await;
        let ready = v["data"]
            .as_array()?
            .iter()
            .filter(|m| m["ready_replicas"] == 1)
            .count();
        (ready == 2).then_some(v)
    })
    .await;
    let ids: Vec<&str> = listed["data"]
        .as_array()
        .expect("data")
        .iter()
        .filter_map(|m| m["id"].as_str())
        .collect();
    assert_eq!(ids, ["chat-model", "code"], "{listed}");
    assert_eq!(listed["data"][0]["state"], "ready");

    for model in ["chat-model", "code"] {
        let (status, body, _) = post(format!("{base}/v1/completions"), completion(model)).await;
        assert_eq!(status, 200, "{model}: {body}");
        // Each server names the model it serves: the answer came from the right one.
        assert_eq!(body["model"], model, "{body}");
        assert!(body["choices"][0]["text"].is_string(), "{body}");
    }
    let chat = json!({"model": "chat-model", "max_tokens": 4, "temperature": 0,
        "messages": [{"role": "user", "content": "Say hi"}]});
    let (status, body, _) = post(format!("{base}/v1/chat/completions"), chat).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["object"], "chat.completion");

    let (status, body, _) = post(format!("{base}/v1/completions"), completion("nope")).await;
    assert_eq!(status, 404);
    assert_eq!(body["error"]["type"], "invalid_request_error", "{body}");
    assert_eq!(body["error"]["param"], "model");
    let (status, body, _) = post(format!("{base}/v1/completions"), json!({"prompt": "x"})).await;
    assert_eq!(status, 400, "{body}");
}

/// A request for a service scaled to zero is held, the router scales it up through the scale
/// subresource, and once a pod turns Ready the request succeeds; with a short cold-start
/// timeout and nothing starting, the client gets 503 with Retry-After.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn holds_requests_while_scaling_from_zero() {
    let Some((_cluster, client, ns)) = cluster_with_crd("cold").await else {
        return;
    };
    let port = free_port();
    create_isvc(
        &client,
        &ns,
        "chat",
        json!({"model": {"source": "/models/smol.gguf"},
        "replicas": 0, "runtime": {"port": port}}),
    )
    .await;
    create_isvc(
        &client,
        &ns,
        "idle",
        json!({"model": {"source": "/models/smol.gguf"},
        "replicas": 0, "routing": {"coldStartTimeoutSeconds": 2}}),
    )
    .await;
    let base = router(&client, &ns).await;

    let held = tokio::spawn(post(format!("{base}/v1/completions"), completion("chat")));
    // The router wakes the service: spec.replicas goes 0 -> 1 through /scale.
    eventually(WAIT, "the router to scale chat from zero", async || {
        let o = isvc_api(&client, &ns).get("chat").await.ok()?;
        (o.data["spec"]["replicas"] == 1).then_some(())
    })
    .await;
    let metrics = get_text(format!("{base}/metrics")).await;
    assert!(
        metrics.contains("ferrite_router_held_requests{inferenceservice=\"chat\""),
        "{metrics}"
    );
    assert!(!held.is_finished(), "the request is held, not refused");
    // The pod starts (here: the server, then the pod's Ready condition).
    let _server = server("127.0.0.1", port, "chat");
    ready_pod(&client, &ns, "chat", "chat-0", "127.0.0.1").await;
    let (status, body, _) = held.await.expect("held request");
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["model"], "chat");

    let started = Instant::now();
    let (status, body, retry) = post(format!("{base}/v1/completions"), completion("idle")).await;
    assert_eq!(status, 503, "{body}");
    assert!(
        started.elapsed() >= Duration::from_secs(2),
        "held for the timeout first"
    );
    assert!(retry.is_some(), "Retry-After is set");
    assert_eq!(body["error"]["type"], "service_unavailable", "{body}");
}

async fn get_text(url: String) -> String {
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

/// A replica that refuses connections (its pod still listed Ready, as in the seconds before
/// the kubelet notices a crash) costs a retry on the other replica, not a failed request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_replica_is_retried_on_another() {
    let Some((_cluster, client, ns)) = cluster_with_crd("retry").await else {
        return;
    };
    let port = free_port();
    create_isvc(
        &client,
        &ns,
        "chat",
        json!({"model": {"source": "/models/smol.gguf"}, "replicas": 2,
            "runtime": {"port": port}, "routing": {"policy": "round-robin"}}),
    )
    .await;
    let _server = server("127.0.0.1", port, "chat");
    ready_pod(&client, &ns, "chat", "chat-0", "127.0.0.1").await;
    // Nothing listens on 127.0.0.2 at this port.
    ready_pod(&client, &ns, "chat", "chat-1", "127.0.0.2").await;
    let base = router(&client, &ns).await;
    eventually(WAIT, "both replicas listed", async || {
        let v = get(format!("{base}/v1/models")).await;
        (v["data"][0]["ready_replicas"] == 2).then_some(())
    })
    .await;
    for _ in 0..4 {
        let (status, body, _) = post(format!("{base}/v1/completions"), completion("chat")).await;
        assert_eq!(status, 200, "{body}");
    }
    // Round robin sends every other first attempt to the dead replica.
    let metrics = get_text(format!("{base}/metrics")).await;
    let retries: f64 = metrics
        .lines()
        .filter(|l| {
            l.starts_with("ferrite_router_retries_total{") && l.contains("reason=\"connect\"")
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert!(retries >= 2.0, "retries {retries}: {metrics}");
}

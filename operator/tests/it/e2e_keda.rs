//! KEDA mode on a real API server with KEDA's ScaledObject CRD installed (kept as test data
//! from kedacore/keda, `testkit/data/keda/`) and the operator run by the chart with
//! `keda.enabled`: an InferenceService with `autoscaling.mode: KEDA` gets a ScaledObject the
//! API server accepts under KEDA's schema, aimed at its scale subresource, its triggers
//! reading the Prometheus the chart names (or the spec's own) or the operator's external
//! scaler; a spec that leaves KEDA mode has its ScaledObject pruned; `autoscaling.keda` outside
//! KEDA mode is refused by CEL. The external scaler is called as KEDA calls it (gRPC from
//! KEDA's proto, with grpcio) and answers with what the built-in autoscaler reads from a real
//! server under load. (The Prometheus triggers' PromQL runs against a real Prometheus in
//! `tests/it/dashboards.rs`.)

use std::time::Duration;

use ferrite_testkit::e2e::{
    Applier, Operator, condition, degraded, install, isvc, isvc_api, pods_ready, wait_crd,
};
use ferrite_testkit::kube::{Cluster, workspace_root};
use ferrite_testkit::process::eventually;
use ferrite_testkit::server::{Load, ready_server};
use kube::api::{Api, DynamicObject, Patch, PatchParams, PostParams};
use kube::discovery::ApiResource;
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(60);
const PROMETHEUS: &str = "http://prometheus-operated.monitoring.svc:9090";

fn scaled_objects(client: &kube::Client, ns: &str) -> Api<DynamicObject> {
    let ar = ApiResource {
        group: "keda.sh".into(),
        version: "v1alpha1".into(),
        api_version: "keda.sh/v1alpha1".into(),
        kind: "ScaledObject".into(),
        plural: "scaledobjects".into(),
    };
    Api::namespaced_with(client.clone(), ns, &ar)
}

/// The ScaledObject `name` as JSON, once it exists.
async fn scaled_object(client: &kube::Client, ns: &str, name: &str) -> Value {
    let api = scaled_objects(client, ns);
    eventually(WAIT, "the ScaledObject", async || {
        let so = api.get_opt(name).await.ok().flatten()?;
        serde_json::to_value(so).ok()
    })
    .await
}

/// A private cluster with KEDA's ScaledObject CRD served, a client and an applier.
async fn keda_cluster() -> Option<(Cluster, kube::Client, Applier)> {
    let cluster = Cluster::start().await?;
    let client = cluster.client().await;
    let mut applier = Applier::new(client.clone()).await;
    applier
        .apply_file(&workspace_root().join("testkit/data/keda/keda.sh_scaledobjects.yaml"))
        .await;
    wait_crd(&client, "scaledobjects.keda.sh").await;
    Some((cluster, client, applier))
}

fn trigger<'a>(so: &'a Value, name: &str) -> &'a Value {
    so["spec"]["triggers"]
        .as_array()
        .and_then(|t| t.iter().find(|t| t["name"] == name))
        .unwrap_or_else(|| panic!("no trigger {name}: {so}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keda_mode_renders_a_scaled_object_keda_accepts_and_prunes_it_after() {
    let Some((cluster, client, mut applier)) = keda_cluster().await else {
        return;
    };
    let values = json!({"keda": {"enabled": true, "prometheusAddress": PROMETHEUS}});
    let release = install(&cluster, &values, "keda").await;
    let _op = Operator::launch(&cluster, &release, "op-0", &[]).await;
    let ns = cluster.namespace("keda").await;

    let autoscaling = json!({"mode": "KEDA", "minReplicas": 0, "maxReplicas": 4,
        "keda": {"scaler": "Prometheus"},
        "idleTimeoutSeconds": 120, "scrapeIntervalSeconds": 5,
        "targets": {"queuePerReplica": 2.0, "kvCacheUsage": 0.8},
        "behavior": {"scaleDownStabilizationSeconds": 90}});
    applier
        .apply(&isvc(
            &ns,
            "chat",
            json!({"model": {"source": "/models/smol.gguf"}, "autoscaling": autoscaling}),
        ))
        .await;
    let so = scaled_object(&client, &ns, "chat").await;
    let spec = &so["spec"];
    assert_eq!(
        spec["scaleTargetRef"],
        json!({"apiVersion": "ferrite.dev/v1alpha1", "kind": "InferenceService", "name": "chat"})
    );
    assert_eq!(
        (&spec["minReplicaCount"], &spec["maxReplicaCount"]),
        (&json!(0), &json!(4))
    );
    assert_eq!(spec["cooldownPeriod"], 120, "idleTimeoutSeconds");
    assert_eq!(spec["pollingInterval"], 5, "scrapeIntervalSeconds");
    assert_eq!(
        spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"],
        90
    );
    assert_eq!(
        so["metadata"]["ownerReferences"][0]["kind"],
        "InferenceService"
    );
    let queue = trigger(&so, "queue");
    assert_eq!(queue["type"], "prometheus");
    assert_eq!(queue["metricType"], "AverageValue");
    assert_eq!(queue["metadata"]["serverAddress"], PROMETHEUS);
    assert_eq!(queue["metadata"]["threshold"], "2");
    let q = queue["metadata"]["query"].as_str().expect("query");
    assert!(
        q.contains(&format!(r#"namespace="{ns}", service="chat""#))
            && q.contains("ferrite_router_queued_requests"),
        "{q}"
    );
    let kv = trigger(&so, "kv-cache");
    assert_eq!(kv["metricType"], "Value");
    assert_eq!(kv["metadata"]["threshold"], "0.8");
    // Scale to zero: activity decides; it counts what the routers hold.
    let activity = trigger(&so, "activity");
    assert_eq!(activity["metadata"]["activationThreshold"], "0");
    assert!(
        activity["metadata"]["query"]
            .as_str()
            .is_some_and(|q| q.contains("ferrite_router_held_requests")),
        "{activity}"
    );
    let chat_degraded = condition(&client, &ns, "chat", "Degraded").await;
    assert!(
        chat_degraded.as_ref().is_none_or(|d| d.0 != "True"),
        "{chat_degraded:?}"
    );

    // A spec's own Prometheus, and no activity trigger without scale to zero.
    applier
        .apply(&isvc(
            &ns,
            "own",
            json!({"model": {"source": "/models/smol.gguf"},
                   "autoscaling": {"mode": "KEDA", "minReplicas": 1, "maxReplicas": 2,
                       "keda": {"serverAddress": "https://thanos.example:9090"},
                       "targets": {"queuePerReplica": 1.0}}}),
        ))
        .await;
    let own = scaled_object(&client, &ns, "own").await;
    assert_eq!(
        trigger(&own, "queue")["metadata"]["serverAddress"],
        "https://thanos.example:9090"
    );
    assert_eq!(
        own["spec"]["triggers"].as_array().map(Vec::len),
        Some(1),
        "{own}"
    );

    // Out of KEDA mode: the ScaledObject goes.
    isvc_api(&client, &ns)
        .patch(
            "chat",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"autoscaling": {"mode": "Builtin", "keda": null}}})),
        )
        .await
        .expect("patching chat");
    let api = scaled_objects(&client, &ns);
    eventually(WAIT, "chat's ScaledObject pruned", async || {
        matches!(api.get_opt("chat").await, Ok(None)).then_some(())
    })
    .await;

    // HPA mode beside KEDA: its HPA would ask KEDA's metrics server for the operator's series.
    applier
        .apply(&isvc(
            &ns,
            "hpa",
            json!({"model": {"source": "/models/smol.gguf"},
                   "autoscaling": {"mode": "HPA", "minReplicas": 1, "maxReplicas": 2,
                       "targets": {"queuePerReplica": 1.0}}}),
        ))
        .await;
    let d = degraded(&client, &ns, "hpa", WAIT).await;
    assert_eq!(d.1, "HpaModeWithKeda", "{d:?}");

    // A Prometheus address with the external scaler: refused.
    let mixed: DynamicObject = serde_json::from_value(isvc(
        &ns,
        "mixed",
        json!({"model": {"source": "/models/smol.gguf"},
               "autoscaling": {"mode": "KEDA", "minReplicas": 1, "maxReplicas": 2,
                   "keda": {"scaler": "External", "serverAddress": PROMETHEUS},
                   "targets": {"queuePerReplica": 1.0}}}),
    ))
    .expect("object");
    let refused = isvc_api(&client, &ns)
        .create(&PostParams::default(), &mixed)
        .await
        .expect_err("refused");
    assert!(
        refused.to_string().contains("it needs scaler Prometheus"),
        "{refused}"
    );
    // `keda` outside KEDA mode: refused with the CEL rule's message.
    let bad: DynamicObject = serde_json::from_value(isvc(
        &ns,
        "bad",
        json!({"model": {"source": "/models/smol.gguf"},
               "autoscaling": {"mode": "HPA", "minReplicas": 1, "maxReplicas": 2,
                   "keda": {"serverAddress": PROMETHEUS},
                   "targets": {"queuePerReplica": 1.0}}}),
    ))
    .expect("object");
    let refused = isvc_api(&client, &ns)
        .create(&PostParams::default(), &bad)
        .await
        .expect_err("refused");
    assert!(
        refused
            .to_string()
            .contains("autoscaling.keda applies only to mode KEDA"),
        "{refused}"
    );
}

/// KEDA's calls for `namespace/name`'s trigger with `signal`, through `scaler_client.py`.
fn keda_calls(out: &std::path::Path, port: u16, ns: &str, name: &str, signal: &str) -> Value {
    let python = ferrite_testkit::tools::python();
    let script = workspace_root().join("testkit/data/keda/scaler_client.py");
    let output = std::process::Command::new(python)
        .arg(script)
        .arg(out)
        .arg(format!("127.0.0.1:{port}"))
        .args([ns, name, signal])
        .output()
        .expect("the scaler client runs");
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).expect("JSON")
}

/// `name`'s signal `signal` as the operator's autoscaler exports it.
fn exported(op: &Operator, ns: &str, name: &str, signal: &str) -> Option<f64> {
    let (_, body) = op.get("/metrics")?;
    let labels = [
        format!("namespace=\"{ns}\""),
        format!("inferenceservice=\"{name}\""),
        format!("signal=\"{signal}\""),
    ];
    body.lines()
        .filter(|l| l.starts_with("ferrite_operator_autoscaler_signal{"))
        .find(|l| labels.iter().all(|p| l.contains(p.as_str())))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
}

/// The operator's external scaler, called as KEDA calls it: the ScaledObject's triggers point
/// at it (the chart's Service address, a `signal` each), `GetMetricSpec` gives the spec's
/// targets, `GetMetrics` the very numbers the built-in autoscaler reads from a real server
/// under load (compared within one scrape), `IsActive` is true under load and false once
/// idle; a service not in KEDA mode, or a trigger without a known signal, is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_external_scaler_answers_keda_with_the_autoscalers_signals() {
    let Some((cluster, client, mut applier)) = keda_cluster().await else {
        return;
    };
    let release = install(&cluster, &json!({"keda": {"enabled": true}}), "keda-ext").await;
    let op = Operator::launch(&cluster, &release, "op-0", &[]).await;
    let ns = cluster.namespace("keda-ext").await;
    let (server, port) = ready_server().await;
    let autoscaling = json!({"mode": "KEDA", "minReplicas": 1, "maxReplicas": 4,
        "scrapeIntervalSeconds": 1, "targets": {"queuePerReplica": 2.0, "kvCacheUsage": 0.8}});
    for (name, autoscaling) in [
        ("chat", autoscaling),
        (
            "plain",
            json!({"minReplicas": 1, "maxReplicas": 2, "targets": {"queuePerReplica": 1.0}}),
        ),
    ] {
        applier
            .apply(&isvc(
                &ns,
                name,
                json!({"model": {"source": "/models/smol.gguf"}, "runtime": {"port": port},
                       "autoscaling": autoscaling}),
            ))
            .await;
    }
    eventually(WAIT, "chat's pod", async || {
        (pods_ready(&client, &ns, "chat", "127.0.0.1").await > 0).then_some(())
    })
    .await;
    let so = scaled_object(&client, &ns, "chat").await;
    let queue = trigger(&so, "queue");
    assert_eq!(queue["type"], "external");
    assert_eq!(queue["metadata"]["signal"], "queue");
    let service = release
        .docs
        .iter()
        .find(|d| {
            d["kind"] == "Service"
                && d["metadata"]["labels"]["app.kubernetes.io/component"] == "operator"
        })
        .expect("the operator's Service");
    assert_eq!(
        queue["metadata"]["scalerAddress"],
        format!(
            "{}.ferrite-system.svc:9443",
            service["metadata"]["name"].as_str().expect("name")
        )
    );
    assert_eq!(trigger(&so, "kv-cache")["metricType"], "Value");

    let dir = ferrite_testkit::process::TempDir::new("keda-client");
    let out = dir.path().to_path_buf();
    let scaler = op.keda_scaler_port;
    let call = |name: &'static str, signal: &'static str| {
        let (out, ns) = (out.clone(), ns.clone());
        async move {
            tokio::task::spawn_blocking(move || keda_calls(&out, scaler, &ns, name, signal))
                .await
                .expect("client thread")
        }
    };
    let spec = call("chat", "queue").await;
    assert_eq!(
        spec["spec"],
        json!([{"metricName": "queue", "targetSize": 2, "targetSizeFloat": 2.0}]),
        "{spec}"
    );
    let kv = call("chat", "kv-cache").await;
    assert_eq!(kv["spec"][0]["targetSizeFloat"], 0.8, "{kv}");
    let kv_now = kv["metrics"][0]["metricValueFloat"]
        .as_f64()
        .expect("a value");
    assert!((0.0..=1.0).contains(&kv_now), "{kv}");

    // Under load (a server that runs 2 at once, 8 clients): the queue KEDA reads is the
    // autoscaler's, read between two exports that agree (one scrape).
    let load = Load::start(&server.base, 8, 48);
    let (seen, active) = eventually(WAIT, "a queue, as the autoscaler reads it", async || {
        let before = exported(&op, &ns, "chat", "requests_waiting")?;
        let answer = call("chat", "queue").await;
        let after = exported(&op, &ns, "chat", "requests_waiting")?;
        let value = answer["metrics"][0]["metricValueFloat"].as_f64()?;
        (before == after && before >= 2.0 && value == before)
            .then(|| (value, answer["active"].clone()))
    })
    .await;
    assert_eq!(active, true, "active under load");
    let statuses = load.finish();
    assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");
    eprintln!("KEDA read a queue of {seen}, as the autoscaler did");
    // Idle: nothing runs, waits or is held.
    eventually(WAIT, "IsActive false once idle", async || {
        (call("chat", "queue").await["active"] == false).then_some(())
    })
    .await;

    // Refusals: a service in Builtin mode, one that does not exist, a signal KEDA's trigger
    // does not name.
    for (name, signal, code) in [
        ("plain", "queue", "NOT_FOUND"),
        ("nobody", "queue", "NOT_FOUND"),
        ("chat", "tokens", "INVALID_ARGUMENT"),
    ] {
        let answer = call(name, signal).await;
        for part in ["spec", "metrics", "active"] {
            assert_eq!(answer[part]["error"], code, "{name} {signal}: {answer}");
        }
    }
}

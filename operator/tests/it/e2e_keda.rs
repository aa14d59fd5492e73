//! KEDA mode on a real API server with KEDA's ScaledObject CRD installed (kept as test data
//! from kedacore/keda, `testkit/data/keda/`) and the operator run by the chart with
//! `keda.enabled`: an InferenceService with `autoscaling.mode: KEDA` gets a ScaledObject the
//! API server accepts under KEDA's schema, aimed at its scale subresource, its triggers
//! reading the Prometheus the chart names (or the spec's own); a spec that leaves KEDA mode
//! has its ScaledObject pruned; `autoscaling.keda` outside KEDA mode is refused by CEL.
//! (The triggers' PromQL runs against a real Prometheus in `tests/it/dashboards.rs`.)

use std::time::Duration;

use ferrite_testkit::e2e::{Applier, Operator, condition, install, isvc, isvc_api, wait_crd};
use ferrite_testkit::kube::{Cluster, workspace_root};
use ferrite_testkit::process::eventually;
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

fn trigger<'a>(so: &'a Value, name: &str) -> &'a Value {
    so["spec"]["triggers"]
        .as_array()
        .and_then(|t| t.iter().find(|t| t["name"] == name))
        .unwrap_or_else(|| panic!("no trigger {name}: {so}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keda_mode_renders_a_scaled_object_keda_accepts_and_prunes_it_after() {
    let Some(cluster) = Cluster::start().await else {
        return;
    };
    let client = cluster.client().await;
    let mut applier = Applier::new(client.clone()).await;
    applier
        .apply_file(&workspace_root().join("testkit/data/keda/keda.sh_scaledobjects.yaml"))
        .await;
    wait_crd(&client, "scaledobjects.keda.sh").await;
    let values = json!({"keda": {"enabled": true, "prometheusAddress": PROMETHEUS}});
    let release = install(&cluster, &values, "keda").await;
    let _op = Operator::launch(&cluster, &release, "op-0", &[]).await;
    let ns = cluster.namespace("keda").await;

    let autoscaling = json!({"mode": "KEDA", "minReplicas": 0, "maxReplicas": 4,
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
    let degraded = condition(&client, &ns, "chat", "Degraded").await;
    assert!(
        degraded.as_ref().is_none_or(|d| d.0 != "True"),
        "{degraded:?}"
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
            &Patch::Merge(json!({"spec": {"autoscaling": {"mode": "Builtin"}}})),
        )
        .await
        .expect("patching chat");
    let api = scaled_objects(&client, &ns);
    eventually(WAIT, "chat's ScaledObject pruned", async || {
        matches!(api.get_opt("chat").await, Ok(None)).then_some(())
    })
    .await;

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

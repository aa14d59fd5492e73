//! Scaling on a real API server: the scale subresource without spec.replicas (as
//! `kubectl scale`, KEDA and HPA use it), the built-in autoscaler scaling on a real
//! ferrite-server's queue behind a stand-in Ready pod, and a real HorizontalPodAutoscaler
//! (kube-controller-manager's) reading the operator's External Metrics API through the
//! aggregation layer.

use std::time::Duration;

use ferrite_testkit::e2e::{
    Applier, Operator, audited, condition, get_isvc, install, isvc, pods_ready,
};
use ferrite_testkit::kube::Cluster;
use ferrite_testkit::process::eventually;
use ferrite_testkit::server::{Load, ready_server};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::autoscaling::v2::HorizontalPodAutoscaler;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::rbac::v1::ClusterRole;
use kube::api::{Api, DynamicObject};
use kube::core::GroupVersionKind;
use kube::discovery::ApiResource;
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(60);

/// GET or PATCH on an InferenceService's scale subresource, as `kubectl scale` does.
async fn scale(client: &kube::Client, ns: &str, name: &str, to: Option<i32>) -> Value {
    let path = format!("/apis/ferrite.dev/v1alpha1/namespaces/{ns}/inferenceservices/{name}/scale");
    let req = match to {
        None => http::Request::get(&path).body(Vec::new()),
        Some(n) => http::Request::patch(&path)
            .header("Content-Type", "application/merge-patch+json")
            .body(json!({"spec": {"replicas": n}}).to_string().into_bytes()),
    }
    .expect("request");
    let text = client
        .request_text(req)
        .await
        .unwrap_or_else(|e| panic!("{path}: {e}"));
    serde_json::from_str(&text).expect("a Scale")
}

/// Waits for the InferenceService's pods and makes them Ready at 127.0.0.1 (where the real
/// server listens, on the InferenceService's port).
async fn stand_in_pods(client: &kube::Client, ns: &str, name: &str, at_least: usize) {
    eventually(WAIT, "the ReplicaSet's pods", async || {
        (pods_ready(client, ns, name, "127.0.0.1").await >= at_least).then_some(())
    })
    .await;
}

/// Without spec.replicas, the scale subresource answers (the schema defaults it to 1);
/// a user with the chart's aggregated `edit` role can scale, and the Deployment follows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_scale_subresource_works_without_spec_replicas() {
    let Some(cluster) = Cluster::start().await else {
        return;
    };
    let client = cluster.client().await;
    let release = install(&cluster, &json!({}), "scale").await;
    let _op = Operator::launch(&cluster, &release, "op-0", &[]).await;
    let ns = cluster.namespace("scale").await;

    // An editor of the namespace, as a person would be: the built-in `edit` role, which the
    // chart's role joins through aggregation.
    let alice = cluster.ca().client("alice", &[]);
    let dir = ferrite_testkit::process::TempDir::new("alice");
    std::fs::write(dir.path().join("alice.crt"), &alice.cert).expect("cert");
    std::fs::write(dir.path().join("alice.key"), &alice.key).expect("key");
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        ferrite_testkit::kube::kubeconfig(
            &cluster.url(),
            &cluster.ca_file(),
            &ferrite_testkit::kube::KubeUser::Certificate {
                cert: dir.path().join("alice.crt"),
                key: dir.path().join("alice.key"),
            },
        ),
    )
    .expect("kubeconfig");
    let mut applier = Applier::new(client.clone()).await;
    applier
        .apply(&json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
            "metadata": {"name": "alice-edit", "namespace": ns},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "edit"},
            "subjects": [{"kind": "User", "name": "alice", "apiGroup": "rbac.authorization.k8s.io"}]}))
        .await;
    let as_alice = ferrite_testkit::kube::client_from(&kubeconfig).await;
    let created = eventually(
        WAIT,
        "alice to create an InferenceService (edit aggregates ours)",
        async || {
            let api = ferrite_testkit::e2e::isvc_api(&as_alice, &ns);
            let obj: DynamicObject = serde_json::from_value(isvc(
                &ns,
                "chat",
                json!({"model": {"source": "/models/smol.gguf"}}),
            ))
            .expect("object");
            api.create(&Default::default(), &obj).await.ok()
        },
    )
    .await;
    assert!(
        created.data["spec"].get("replicas").is_some(),
        "defaulted: {:?}",
        created.data
    );
    // `view` joins `edit` only through a second round of aggregation; the chart's edit role
    // carries the read verbs itself, so whatever lets alice create also lets her read the scale.
    let edit = Api::<ClusterRole>::all(client.clone())
        .get("edit")
        .await
        .expect("the edit ClusterRole");
    let allows = |resource: &str, verb: &str| {
        edit.rules.iter().flatten().any(|r| {
            r.api_groups.iter().flatten().any(|g| g == "ferrite.dev")
                && r.resources.iter().flatten().any(|x| x == resource)
                && r.verbs.iter().any(|v| v == verb)
        })
    };
    assert!(allows("inferenceservices", "create"), "{:?}", edit.rules);
    assert!(allows("inferenceservices/scale", "get"), "{:?}", edit.rules);

    let s = scale(&as_alice, &ns, "chat", None).await;
    assert_eq!(s["kind"], "Scale");
    assert_eq!(s["spec"]["replicas"], 1, "{s}");
    let s = eventually(WAIT, "the selector in the Scale's status", async || {
        let s = scale(&as_alice, &ns, "chat", None).await;
        s["status"]["selector"].is_string().then_some(s)
    })
    .await;
    assert_eq!(
        s["status"]["selector"],
        "app.kubernetes.io/component=server,ferrite.dev/inferenceservice=chat"
    );

    let s = scale(&as_alice, &ns, "chat", Some(3)).await;
    assert_eq!(s["spec"]["replicas"], 3);
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), &ns);
    eventually(WAIT, "the Deployment at 3 replicas and a PDB", async || {
        let d = deployments.get_opt("chat").await.ok()??;
        let pdb = Api::<PodDisruptionBudget>::namespaced(client.clone(), &ns)
            .get_opt("chat")
            .await
            .ok()??;
        (d.spec?.replicas == Some(3)).then_some(pdb)
    })
    .await;
    let i = get_isvc(&client, &ns, "chat").await.expect("chat");
    assert_eq!(i["spec"]["replicas"], 3);
}

/// Builtin autoscaling end to end: the operator finds the InferenceService's pod in its
/// cache, scrapes a real ferrite-server behind it, and when the queue backs up writes
/// spec.replicas through the scale subresource; the Deployment follows, status shows the
/// decision and the signals, an event records it, the operator's metrics count it, and the
/// status settles (no write loop).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_builtin_autoscaler_scales_on_a_real_servers_queue() {
    let Some(cluster) = Cluster::start_with(audited()).await else {
        return;
    };
    let client = cluster.client().await;
    let release = install(&cluster, &json!({}), "builtin").await;
    let op = Operator::launch(&cluster, &release, "op-0", &[]).await;
    let ns = cluster.namespace("builtin").await;
    let (server, port) = ready_server().await;
    let mut applier = Applier::new(client.clone()).await;
    applier
        .apply(&isvc(
            &ns,
            "chat",
            json!({"model": {"source": "/models/smol.gguf"}, "runtime": {"port": port},
                   "autoscaling": {"minReplicas": 1, "maxReplicas": 4,
                                   "targets": {"queuePerReplica": 1.0},
                                   "scrapeIntervalSeconds": 1}}),
        ))
        .await;
    stand_in_pods(&client, &ns, "chat", 1).await;

    // Idle: the signals are read and nothing changes.
    let idle = eventually(WAIT, "ScalingActive with metrics", async || {
        let i = get_isvc(&client, &ns, "chat").await?;
        (condition(&client, &ns, "chat", "ScalingActive").await?.0 == "True"
            && i["status"]["currentMetrics"]["reportingReplicas"] == 1)
            .then_some(i)
    })
    .await;
    assert_eq!(idle["status"]["desiredReplicas"], 1);
    assert_eq!(idle["status"]["currentMetrics"]["requestsWaiting"], 0.0);
    let limited = condition(&client, &ns, "chat", "ScalingLimited")
        .await
        .expect("ScalingLimited");
    assert_eq!(
        (limited.0.as_str(), limited.1.as_str()),
        ("True", "TooFewReplicas")
    );

    // 8 requests on a server that runs 2 at once: 6 wait, 6 × the target of 1 is past the
    // default panic threshold (3×), so it goes straight to maxReplicas.
    let clients = Load::start(&server.base, 8, 48);
    let scaled = eventually(WAIT, "spec.replicas 4", async || {
        let i = get_isvc(&client, &ns, "chat").await?;
        (i["spec"]["replicas"] == 4).then_some(i)
    })
    .await;
    // The queue has done its part; every request it sent must have succeeded.
    let statuses = tokio::task::spawn_blocking(move || clients.finish())
        .await
        .expect("clients");
    assert!(
        !statuses.is_empty() && statuses.iter().all(|s| *s == 200),
        "{statuses:?}"
    );
    assert_eq!(
        scaled["metadata"]["generation"], 2,
        "one write of spec.replicas"
    );
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), &ns);
    eventually(
        WAIT,
        "the Deployment at 4 and status showing the scale",
        async || {
            let d = deployments.get_opt("chat").await.ok()??;
            let i = get_isvc(&client, &ns, "chat").await?;
            (d.spec?.replicas == Some(4)
                && i["status"]["desiredReplicas"] == 4
                && i["status"]["lastScaleTime"].is_string())
            .then_some(())
        },
    )
    .await;

    // The stored status equals what the operator computes, so it settles: a status that never
    // compares equal would patch on every reconcile and reconcile on every patch.
    let user = release.operator_user();
    let writes = |cluster: &Cluster| {
        cluster
            .audit_events()
            .iter()
            .filter(|e| {
                e["user"]["username"] == user.as_str()
                    && matches!(
                        e["verb"].as_str(),
                        Some("create" | "update" | "patch" | "delete")
                    )
                    && e["objectRef"]["resource"] != "leases"
            })
            .count()
    };
    let settle = std::time::Instant::now();
    loop {
        let before = writes(&cluster);
        tokio::time::sleep(Duration::from_secs(3)).await;
        let after = writes(&cluster);
        if after - before <= 2 {
            break;
        }
        assert!(
            settle.elapsed() < Duration::from_secs(30),
            "{} writes in 3 s, 30 s after the scale: a write loop\n{}",
            after - before,
            op.log()
        );
    }

    use k8s_openapi::api::events::v1::Event;
    let events = Api::<Event>::namespaced(client.clone(), &ns)
        .list(&Default::default())
        .await
        .expect("events");
    let scale_event = events
        .items
        .iter()
        .find(|e| e.reason.as_deref() == Some("ScaledUp"))
        .unwrap_or_else(|| panic!("no ScaledUp event"));
    let note = scale_event.note.as_deref().unwrap_or_default();
    assert!(note.starts_with("1 → 4 replicas (panic mode"), "{note}");

    let body = op.get("/metrics").map(|(_, b)| b).unwrap_or_default();
    let line = |prefix: String| {
        body.lines()
            .find(|l| l.starts_with(&prefix))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse::<f64>().ok())
    };
    let labels = format!(r#"inferenceservice="chat",namespace="{ns}""#);
    assert_eq!(
        line(format!(
            r#"ferrite_operator_autoscaler_scale_actions_total{{direction="up",{labels}}}"#
        )),
        Some(1.0),
        "{body}"
    );
    assert_eq!(
        line(format!(
            r#"ferrite_operator_autoscaler_desired_replicas{{{labels}}}"#
        )),
        Some(4.0)
    );
    assert_eq!(
        line(format!(
            r#"ferrite_operator_autoscaler_scale_actions_total{{direction="down",{labels}}}"#
        )),
        Some(0.0),
        "born at 0, so increase() sees the first scale"
    );
    assert_eq!(
        line(format!(
            r#"ferrite_operator_autoscaler_target{{{labels},signal="queue_per_replica"}}"#
        )),
        Some(1.0)
    );
    drop(server);
}

/// Whether the APIService is Available.
async fn api_service_available(client: &kube::Client) -> Option<()> {
    let ar = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("apiregistration.k8s.io", "v1", "APIService"),
        "apiservices",
    );
    let api: Api<DynamicObject> = Api::all_with(client.clone(), &ar);
    let s = api.get("v1beta1.external.metrics.k8s.io").await.ok()?;
    s.data["status"]["conditions"]
        .as_array()?
        .iter()
        .any(|c| c["type"] == "Available" && c["status"] == "True")
        .then_some(())
}

/// HPA mode end to end: the chart registers the APIService (Available through the
/// aggregator, whose front-proxy client certificate the operator checks against the CA and
/// allowed names kube-apiserver publishes), the operator makes
/// the HPA, and kube-controller-manager's HPA controller reads the queue through
/// external.metrics.k8s.io and scales the InferenceService through its scale subresource.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_hpa_scales_on_the_external_metrics_api() {
    let Some(cluster) = Cluster::start().await else {
        return;
    };
    let client = cluster.client().await;
    // The chart's defaults: the operator takes the front-proxy CA and allowed names from
    // kube-system/extension-apiserver-authentication, as kube-apiserver wrote them.
    let release = install(
        &cluster,
        &json!({"externalMetrics": {"enabled": true}}),
        "hpa",
    )
    .await;
    let op = Operator::launch(&cluster, &release, "op-0", &[]).await;
    eventually(WAIT, "the APIService to be Available", async || {
        api_service_available(&client).await
    })
    .await;
    let ns = cluster.namespace("hpa").await;
    let (server, port) = ready_server().await;
    let mut applier = Applier::new(client.clone()).await;
    applier
        .apply(&isvc(
            &ns,
            "chat",
            json!({"model": {"source": "/models/smol.gguf"}, "runtime": {"port": port},
                   "autoscaling": {"mode": "HPA", "minReplicas": 1, "maxReplicas": 4,
                                   "targets": {"queuePerReplica": 1.0},
                                   "scrapeIntervalSeconds": 1}}),
        ))
        .await;
    stand_in_pods(&client, &ns, "chat", 1).await;
    let hpas: Api<HorizontalPodAutoscaler> = Api::namespaced(client.clone(), &ns);
    let hpa = eventually(WAIT, "the HPA", async || hpas.get_opt("chat").await.ok()?).await;
    let spec = hpa.spec.expect("spec");
    assert_eq!(spec.scale_target_ref.kind, "InferenceService");

    // What the HPA controller reads, through the aggregator.
    let path = format!(
        "/apis/external.metrics.k8s.io/v1beta1/namespaces/{ns}/ferrite_requests_waiting?labelSelector=ferrite.dev%2Finferenceservice%3Dchat"
    );
    let items = eventually(WAIT, "the queue through the aggregator", async || {
        let req = http::Request::get(&path).body(Vec::new()).ok()?;
        let v: Value = serde_json::from_str(&client.request_text(req).await.ok()?).ok()?;
        let items = v["items"].as_array()?.clone();
        (!items.is_empty()).then_some(items)
    })
    .await;
    assert_eq!(items[0]["metricName"], "ferrite_requests_waiting");

    let clients = Load::start(&server.base, 8, 64);
    eventually(WAIT, "the HPA to scale the InferenceService", async || {
        let i = get_isvc(&client, &ns, "chat").await?;
        (i["spec"]["replicas"].as_i64()? > 1).then_some(())
    })
    .await;
    // The HPA controller made that write (through /scale): its status records the rescale
    // and wants what the InferenceService now has (the status is written after the scale, in
    // the same sync, so it may trail the replicas by a moment).
    let status = eventually(WAIT, "the HPA's status to record the rescale", async || {
        let status = hpas.get("chat").await.ok()?.status?;
        let replicas = get_isvc(&client, &ns, "chat").await?["spec"]["replicas"].as_i64()?;
        (status.last_scale_time.is_some() && i64::from(status.desired_replicas) == replicas)
            .then_some(status)
    })
    .await;
    assert!(status.desired_replicas > 1, "{status:?}");
    let able = status
        .conditions
        .unwrap_or_default()
        .into_iter()
        .find(|c| c.type_ == "AbleToScale")
        .expect("AbleToScale");
    // SucceededRescale right after the write; a later sync may already say it is holding
    // still (stabilized, or ready for the next scale).
    assert_eq!(able.status, "True", "{able:?}\n{}", op.log());
    assert!(
        matches!(
            able.reason.as_deref(),
            Some("SucceededRescale" | "ScaleDownStabilized" | "ReadyForNewScale")
        ),
        "{able:?}\n{}",
        op.log()
    );
    // The load has done its part: stop the server (the clients' requests end with it).
    drop(server);
    drop(clients);
}

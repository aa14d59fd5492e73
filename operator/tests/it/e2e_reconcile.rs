//! The operator on a real API server (kube-apiserver v1.32 with RBAC, etcd and
//! kube-controller-manager), installed by its chart and running as the chart's ServiceAccount:
//! the examples reconcile with and without the ServiceMonitor CRD, children carry owner
//! references and are garbage-collected, come back when deleted, and lose hand edits; pods
//! and children that cannot be created show as Degraded; a missing claim blocks until it
//! appears.

use std::time::Duration;

use ferrite_testkit::e2e::{
    Applier, Operator, condition, condition_with_reason, degraded, get_isvc, install,
    install_service_monitor_crd, yaml_docs,
};
use ferrite_testkit::kube::{Cluster, Options, workspace_root};
use ferrite_testkit::process::eventually;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Service};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::api::{Api, DynamicObject, ListParams, Patch, PatchParams};
use kube::core::GroupVersionKind;
use kube::discovery::ApiResource;
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(60);

/// Waits for the first pod the ReplicaSet controller made for InferenceService `name`.
async fn first_pod(client: &kube::Client, ns: &str, name: &str) -> Pod {
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let selector = format!("ferrite.dev/inferenceservice={name}");
    eventually(WAIT, &format!("a pod of {name}"), async || {
        pods.list(&ListParams::default().labels(&selector))
            .await
            .ok()?
            .items
            .into_iter()
            .next()
    })
    .await
}

/// What the examples need to exist in their namespace: claims, a ServiceAccount, a priority
/// and runtime class.
async fn prerequisites(applier: &mut Applier, ns: &str) {
    applier
        .apply(&json!({"apiVersion": "v1", "kind": "ServiceAccount",
            "metadata": {"name": "llama-8b", "namespace": ns}}))
        .await;
    for claim in ["models", "hf-cache", "lora-adapters"] {
        applier
            .apply(&json!({"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                "metadata": {"name": claim, "namespace": ns},
                "spec": {"accessModes": ["ReadWriteOnce"],
                         "resources": {"requests": {"storage": "1Gi"}}}}))
            .await;
    }
    applier
        .apply(
            &json!({"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
            "metadata": {"name": "inference-high"}, "value": 1000}),
        )
        .await;
    applier
        .apply(
            &json!({"apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass",
            "metadata": {"name": "nvidia"}, "handler": "nvidia"}),
        )
        .await;
}

/// The examples, moved into namespace `ns`.
fn examples(ns: &str) -> Vec<Value> {
    ["minimal.yaml", "full.yaml"]
        .iter()
        .flat_map(|f| {
            let text = std::fs::read_to_string(workspace_root().join("examples").join(f))
                .expect("example");
            yaml_docs(&text)
        })
        .map(|mut d| {
            d["metadata"]["namespace"] = json!(ns);
            d
        })
        .collect()
}

fn monitors_api(client: &kube::Client, ns: &str) -> Api<DynamicObject> {
    let ar = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("monitoring.coreos.com", "v1", "ServiceMonitor"),
        "servicemonitors",
    );
    Api::namespaced_with(client.clone(), ns, &ar)
}

/// Waits until the InferenceService's status describes its current generation.
async fn observed(client: &kube::Client, ns: &str, name: &str) -> Value {
    eventually(
        WAIT,
        &format!("{name} to reach observedGeneration"),
        async || {
            let obj = get_isvc(client, ns, name).await?;
            (obj["status"]["observedGeneration"] == obj["metadata"]["generation"]).then_some(obj)
        },
    )
    .await
}

/// Every child of `name`: Deployment, Service, dashboards; a PDB with replicas > 1. Each is
/// controlled by the InferenceService.
async fn children(client: &kube::Client, ns: &str, name: &str, uid: &str, pdb: bool) {
    let owned = |meta: &kube::api::ObjectMeta| {
        meta.owner_references
            .iter()
            .flatten()
            .any(|r| r.controller == Some(true) && r.uid == uid && r.kind == "InferenceService")
    };
    let d = Api::<Deployment>::namespaced(client.clone(), ns)
        .get(name)
        .await
        .expect("Deployment");
    assert!(owned(&d.metadata), "Deployment {name} owned");
    let s = Api::<Service>::namespaced(client.clone(), ns)
        .get(name)
        .await
        .expect("Service");
    assert!(owned(&s.metadata), "Service {name} owned");
    let p = Api::<PodDisruptionBudget>::namespaced(client.clone(), ns)
        .get_opt(name)
        .await
        .expect("reading PDB");
    assert_eq!(p.is_some(), pdb, "PDB of {name}");
    if let Some(p) = p {
        assert!(owned(&p.metadata), "PDB {name} owned");
    }
    let dashboards = Api::<ConfigMap>::namespaced(client.clone(), ns)
        .list(&ListParams::default().labels(&format!(
            "app.kubernetes.io/component=dashboard,ferrite.dev/inferenceservice={name}"
        )))
        .await
        .expect("dashboards");
    assert_eq!(
        dashboards.items.len(),
        2,
        "overview and real-time for {name}"
    );
    assert!(dashboards.items.iter().all(|c| owned(&c.metadata)));
}

/// Without the Prometheus Operator: both examples reconcile fully (discovery's plain-text 404
/// for monitoring.coreos.com must not stop them), and MonitoringReady says why there is no
/// ServiceMonitor.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_examples_reconcile_without_the_service_monitor_crd() {
    let Some(cluster) = Cluster::start().await else {
        return;
    };
    let client = cluster.client().await;
    let release = install(&cluster, &json!({}), "plain").await;
    let op = Operator::launch(&cluster, &release, "op-0", &[]).await;
    let ns = cluster.namespace("examples").await;
    let mut applier = Applier::new(client.clone()).await;
    prerequisites(&mut applier, &ns).await;
    for ex in examples(&ns) {
        applier.apply(&ex).await;
    }
    for (name, pdb) in [("smollm2", false), ("llama-8b", true)] {
        let obj = observed(&client, &ns, name).await;
        let uid = obj["metadata"]["uid"].as_str().expect("uid");
        children(&client, &ns, name, uid, pdb).await;
        let m = condition(&client, &ns, name, "MonitoringReady")
            .await
            .expect("MonitoringReady");
        assert_eq!(
            (m.0.as_str(), m.1.as_str()),
            ("False", "ServiceMonitorCRDNotInstalled"),
            "{name}: {m:?}\n{}",
            op.log()
        );
        let d = condition(&client, &ns, name, "Degraded")
            .await
            .expect("Degraded");
        assert_eq!(d.0, "False", "{name}: {d:?}");
    }
    full_example_pods(&client, &ns).await;
    assert!(
        !op.log().contains("reconcile failed"),
        "no reconcile failed:\n{}",
        op.log()
    );
}

/// The pods the ReplicaSet controller makes for the full example (admitted by the real API
/// server, its ServiceAccount admission included) carry every pod setting, resource and the
/// rollout of the spec.
async fn full_example_pods(client: &kube::Client, ns: &str) {
    let pod = first_pod(client, ns, "llama-8b").await;
    let labels = pod.metadata.labels.clone().unwrap_or_default();
    assert_eq!(
        labels.get("kueue.x-k8s.io/queue-name").map(String::as_str),
        Some("gpu-queue")
    );
    let annotations = pod.metadata.annotations.clone().unwrap_or_default();
    assert_eq!(
        annotations
            .get("cluster-autoscaler.kubernetes.io/safe-to-evict")
            .map(String::as_str),
        Some("false")
    );
    let spec = pod.spec.expect("pod spec");
    assert_eq!(spec.service_account_name.as_deref(), Some("llama-8b"));
    assert_eq!(spec.automount_service_account_token, Some(false));
    assert_eq!(spec.scheduler_name.as_deref(), Some("default-scheduler"));
    assert_eq!(spec.termination_grace_period_seconds, Some(90));
    assert_eq!(
        spec.image_pull_secrets.unwrap_or_default()[0].name,
        "registry-credentials"
    );
    assert_eq!(spec.topology_spread_constraints.map(|t| t.len()), Some(1));
    assert!(spec.volumes.unwrap_or_default().iter().any(|v| {
        v.name == "adapters"
            && v.persistent_volume_claim
                .as_ref()
                .map(|c| c.claim_name.as_str())
                == Some("lora-adapters")
    }));
    let c = &spec.containers[0];
    assert!(
        c.volume_mounts
            .iter()
            .flatten()
            .any(|m| m.name == "adapters" && m.mount_path == "/adapters")
    );
    // The model's Secret, then the pod's own envFrom.
    let from: Vec<&str> = c
        .env_from
        .iter()
        .flatten()
        .filter_map(|f| Some(f.secret_ref.as_ref()?.name.as_str()))
        .collect();
    assert_eq!(from, ["hf-token", "proxy-env"]);
    let r = c.resources.clone().expect("resources");
    let (requests, limits) = (r.requests.expect("requests"), r.limits.expect("limits"));
    let q = |m: &std::collections::BTreeMap<String, Quantity>, k: &str| {
        m.get(k).map(|q| q.0.clone()).unwrap_or_default()
    };
    assert_eq!(q(&requests, "cpu"), "6");
    assert_eq!(q(&limits, "cpu"), "12");
    assert_eq!(q(&limits, "nvidia.com/gpu"), "2");
    // The API server defaults an extended resource's request to its limit.
    assert_eq!(q(&requests, "nvidia.com/gpu"), "2");
    assert_eq!(q(&limits, "ephemeral-storage"), "20Gi");
    let startup = c.startup_probe.clone().expect("startup probe");
    assert_eq!(startup.failure_threshold, Some(360));
    let liveness = c.liveness_probe.clone().expect("liveness probe");
    assert_eq!(liveness.timeout_seconds, Some(10));
    let d = Api::<Deployment>::namespaced(client.clone(), ns)
        .get("llama-8b")
        .await
        .expect("Deployment");
    let ru = d
        .spec
        .and_then(|s| s.strategy)
        .and_then(|s| s.rolling_update)
        .expect("rolling update");
    assert_eq!(
        (ru.max_surge, ru.max_unavailable),
        (Some(IntOrString::Int(0)), Some(IntOrString::Int(1)))
    );
}

/// With the ServiceMonitor CRD installed, both examples get one; turning monitoring off
/// prunes it, and the condition says it is disabled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_service_monitor_crd_monitors_are_made_and_pruned() {
    let Some(cluster) = Cluster::start().await else {
        return;
    };
    let client = cluster.client().await;
    install_service_monitor_crd(&client).await;
    let release = install(&cluster, &json!({}), "monitors").await;
    let op = Operator::launch(&cluster, &release, "op-0", &[]).await;
    let ns = cluster.namespace("examples").await;
    let mut applier = Applier::new(client.clone()).await;
    prerequisites(&mut applier, &ns).await;
    for ex in examples(&ns) {
        applier.apply(&ex).await;
    }
    let monitors = monitors_api(&client, &ns);
    for (name, pdb) in [("smollm2", false), ("llama-8b", true)] {
        let obj = observed(&client, &ns, name).await;
        let uid = obj["metadata"]["uid"].as_str().expect("uid").to_string();
        children(&client, &ns, name, &uid, pdb).await;
        let sm = monitors.get(name).await.expect("ServiceMonitor");
        assert!(
            sm.metadata
                .owner_references
                .iter()
                .flatten()
                .any(|r| r.uid == uid && r.controller == Some(true))
        );
        let m = condition(&client, &ns, name, "MonitoringReady")
            .await
            .expect("MonitoringReady");
        assert_eq!(
            (m.0.as_str(), m.1.as_str()),
            ("True", "ServiceMonitorApplied")
        );
    }
    let full = monitors.get("llama-8b").await.expect("ServiceMonitor");
    let full = serde_json::to_value(full).expect("json");
    assert_eq!(
        full["metadata"]["labels"]["release"],
        "kube-prometheus-stack"
    );
    assert_eq!(full["spec"]["endpoints"][0]["interval"], "10s");

    // Monitoring off: the ServiceMonitor goes, the condition follows.
    ferrite_testkit::e2e::isvc_api(&client, &ns)
        .patch(
            "smollm2",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"monitoring": {"serviceMonitor": {"enabled": false}}}})),
        )
        .await
        .expect("monitoring off");
    eventually(WAIT, "the ServiceMonitor to be pruned", async || {
        monitors
            .get_opt("smollm2")
            .await
            .ok()
            .and_then(|o| o.is_none().then_some(()))
    })
    .await;
    let c = condition_with_reason(
        &client,
        &ns,
        "smollm2",
        ("MonitoringReady", "ServiceMonitorDisabled"),
        WAIT,
    )
    .await;
    assert_eq!(c.0, "True");
    // The other one keeps its monitor.
    assert!(monitors.get_opt("llama-8b").await.expect("read").is_some());
    drop(op);
}

/// The image of the Deployment's server container.
async fn image(deployments: &Api<Deployment>, name: &str) -> Option<String> {
    deployments
        .get_opt(name)
        .await
        .ok()
        .flatten()?
        .spec?
        .template
        .spec?
        .containers
        .first()?
        .image
        .clone()
}

/// Notes of the events recorded about `name` in `ns`.
async fn event_notes(client: &kube::Client, ns: &str) -> Vec<String> {
    use k8s_openapi::api::events::v1::Event;
    Api::<Event>::namespaced(client.clone(), ns)
        .list(&ListParams::default())
        .await
        .map(|l| l.items.into_iter().filter_map(|e| e.note).collect())
        .unwrap_or_default()
}

/// Children come back when deleted, lose hand edits to fields the operator owns at once, and
/// are garbage-collected with their InferenceService.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn children_are_healed_restored_and_garbage_collected() {
    let Some(cluster) = Cluster::start().await else {
        return;
    };
    let client = cluster.client().await;
    let release = install(&cluster, &json!({}), "heal").await;
    let op = Operator::launch(&cluster, &release, "op-0", &[]).await;
    let ns = cluster.namespace("heal").await;
    let mut applier = Applier::new(client.clone()).await;
    applier
        .apply(&ferrite_testkit::e2e::isvc(
            &ns,
            "chat",
            json!({"model": {"source": "/models/smol.gguf"}}),
        ))
        .await;
    let obj = observed(&client, &ns, "chat").await;
    let uid = obj["metadata"]["uid"].as_str().expect("uid").to_string();
    children(&client, &ns, "chat", &uid, false).await;

    // A deleted Service comes back (its watch fires).
    let services = Api::<Service>::namespaced(client.clone(), &ns);
    let before = services.get("chat").await.expect("Service").metadata.uid;
    services
        .delete("chat", &Default::default())
        .await
        .expect("delete Service");
    eventually(WAIT, "the Service to come back", async || {
        let s = services.get_opt("chat").await.ok()??;
        (s.metadata.uid != before).then_some(())
    })
    .await;

    // A hand edit of the image (as `kubectl edit` would make it) is reverted.
    let deployments = Api::<Deployment>::namespaced(client.clone(), &ns);
    let original = image(&deployments, "chat").await.expect("image");
    let edit = json!({"spec": {"template": {"spec": {"containers": [
        {"name": "server", "image": "registry.example/mine:1"}]}}}});
    deployments
        .patch("chat", &PatchParams::default(), &Patch::Strategic(edit))
        .await
        .expect("hand edit");
    eventually(
        Duration::from_secs(20),
        "the hand-edited image to be restored",
        async || (image(&deployments, "chat").await? == original).then_some(()),
    )
    .await;
    let notes = event_notes(&client, &ns).await;
    assert!(
        notes
            .iter()
            .any(|n| n == "restored Deployment chat, which was changed outside the operator"),
        "{notes:?}"
    );

    // Deleting the InferenceService garbage-collects every child.
    ferrite_testkit::e2e::isvc_api(&client, &ns)
        .delete("chat", &Default::default())
        .await
        .expect("delete InferenceService");
    eventually(
        WAIT,
        "the garbage collector to remove the children",
        async || {
            let d = deployments.get_opt("chat").await.ok()?;
            let s = services.get_opt("chat").await.ok()?;
            let cms = Api::<ConfigMap>::namespaced(client.clone(), &ns)
                .list(&ListParams::default().labels("ferrite.dev/inferenceservice=chat"))
                .await
                .ok()?;
            (d.is_none() && s.is_none() && cms.items.is_empty()).then_some(())
        },
    )
    .await;
    assert!(!op.log().contains("reconcile failed"), "{}", op.log());

    // Its own probes and metrics, then a clean exit on SIGTERM.
    assert_eq!(op.get("/healthz").map(|r| r.0), Some(200));
    assert_eq!(op.get("/readyz").map(|r| r.0), Some(200));
    // One scrape, so both counts describe the same moment.
    let (_, body) = op.get("/metrics").expect("/metrics");
    let sample = |name: &str| {
        body.lines()
            .find(|l| l.split_whitespace().next() == Some(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<f64>().ok())
    };
    let reconciles = sample("ferrite_operator_reconciliations_total").expect("counter");
    assert!(reconciles >= 4.0, "reconciles: {reconciles}");
    assert_eq!(
        sample("ferrite_operator_reconcile_duration_seconds_count"),
        Some(reconciles),
        "every reconcile is timed"
    );
    assert_eq!(op.metric("ferrite_operator_leader"), Some(1.0));
    let mut op = op;
    let status = tokio::task::spawn_blocking(move || op.terminate())
        .await
        .expect("terminate");
    assert!(status.success(), "exit status after SIGTERM: {status}");
}

/// Pods the ReplicaSet cannot create (a missing PriorityClass, an exceeded ResourceQuota)
/// make the InferenceService Degraded with the API server's reason; so does a child the API
/// server fails to create (a Service when the cluster's Service IP range is used up), until
/// it can be created.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pods_and_children_that_cannot_be_created_show_as_degraded() {
    // A small Service range (14 addresses), so that it can be used up.
    let Some(cluster) = Cluster::start_with(Options {
        service_cidr: "10.0.0.0/28",
        ..Options::default()
    })
    .await
    else {
        return;
    };
    let client = cluster.client().await;
    let release = install(&cluster, &json!({}), "degraded").await;
    let op = Operator::launch(&cluster, &release, "op-0", &[]).await;
    let ns = cluster.namespace("degraded").await;
    let mut applier = Applier::new(client.clone()).await;
    applier
        .apply(&ferrite_testkit::e2e::isvc(
            &ns,
            "no-class",
            json!({"model": {"source": "/models/smol.gguf"},
                   "scheduling": {"priorityClassName": "missing"}}),
        ))
        .await;
    let quota_ns = cluster.namespace("quota").await;
    ferrite_testkit::e2e::quota(&client, &quota_ns, json!({"pods": "0"})).await;
    applier
        .apply(&ferrite_testkit::e2e::isvc(
            &quota_ns,
            "over-quota",
            json!({"model": {"source": "/models/smol.gguf"}}),
        ))
        .await;
    for (ns, name, cause) in [
        (
            &ns,
            "no-class",
            "no PriorityClass with name missing was found",
        ),
        (&quota_ns, "over-quota", "exceeded quota"),
    ] {
        let d = degraded(&client, ns, name, WAIT).await;
        assert_eq!(d.1, "ReplicaFailure", "{name}: {d:?}\n{}", op.log());
        assert!(d.2.contains(cause), "{name}: {d:?}");
        let ready = condition(&client, ns, name, "Ready").await.expect("Ready");
        assert_eq!(ready.0, "False");
    }

    // Use up the Service range, then ask for one more Service.
    let services: Api<Service> = Api::namespaced(client.clone(), &ns);
    let filler = |i: usize| -> Service {
        serde_json::from_value(json!({"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": format!("filler-{i}")},
            "spec": {"ports": [{"port": 80}]}}))
        .expect("Service")
    };
    let mut fillers = 0;
    loop {
        match services.create(&Default::default(), &filler(fillers)).await {
            Ok(_) => fillers += 1,
            Err(kube::Error::Api(e)) if e.message.contains("range is full") => break,
            Err(e) => panic!("creating filler Service {fillers}: {e}"),
        }
        assert!(fillers < 14, "the Service range never filled up");
    }
    applier
        .apply(&ferrite_testkit::e2e::isvc(
            &ns,
            "no-ip",
            json!({"model": {"source": "/models/smol.gguf"}}),
        ))
        .await;
    let d = degraded(&client, &ns, "no-ip", WAIT).await;
    assert_eq!(d.1, "ChildApplyFailed", "{d:?}\n{}", op.log());
    assert!(
        d.2.contains("Service no-ip") && d.2.contains("range is full"),
        "{d:?}"
    );
    let observed = get_isvc(&client, &ns, "no-ip").await.expect("no-ip");
    assert_eq!(
        observed["status"]["observedGeneration"], observed["metadata"]["generation"],
        "the status describes the current spec"
    );
    // Once an address is free, a retry creates the Service and the condition clears.
    services
        .delete("filler-0", &Default::default())
        .await
        .expect("delete a filler");
    eventually(WAIT, "no-ip's Service and Degraded=False", async || {
        let ok = services.get_opt("no-ip").await.ok().flatten().is_some()
            && condition(&client, &ns, "no-ip", "Degraded")
                .await
                .is_some_and(|c| c.0 == "False");
        ok.then_some(())
    })
    .await;
}

/// A claim that does not exist blocks the spec (Degraded, nothing applied); creating it lets
/// the reconcile go on at once, through the claim's watch, not the minute-long retry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_claim_blocks_until_it_is_created() {
    let Some(cluster) = Cluster::start().await else {
        return;
    };
    let client = cluster.client().await;
    let release = install(&cluster, &json!({}), "claim").await;
    let _op = Operator::launch(&cluster, &release, "op-0", &[]).await;
    let ns = cluster.namespace("claim").await;
    let mut applier = Applier::new(client.clone()).await;
    applier
        .apply(&ferrite_testkit::e2e::isvc(
            &ns,
            "chat",
            json!({"model": {"source": "pvc://weights/smol.gguf"}}),
        ))
        .await;
    let d = degraded(&client, &ns, "chat", WAIT).await;
    assert_eq!(d.1, "PersistentVolumeClaimNotFound");
    assert!(d.2.contains(&format!("{ns}/weights")), "{d:?}");
    let deployments = Api::<Deployment>::namespaced(client.clone(), &ns);
    assert!(deployments.get_opt("chat").await.expect("read").is_none());

    applier
        .apply(&json!({"apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": {"name": "weights", "namespace": ns},
            "spec": {"accessModes": ["ReadOnlyMany"],
                     "resources": {"requests": {"storage": "1Gi"}}}}))
        .await;
    eventually(
        Duration::from_secs(20),
        "the Deployment once the claim exists",
        async || deployments.get_opt("chat").await.ok()?,
    )
    .await;
    let d = eventually(WAIT, "Degraded to clear", async || {
        condition(&client, &ns, "chat", "Degraded")
            .await
            .filter(|c| c.0 == "False")
    })
    .await;
    assert_eq!(d.1, "AsExpected");
}

/// Resource profiles from the chart's values (its ConfigMap, mounted as the chart mounts it):
/// an InferenceService naming `nvidia-h100:2` gets the profile's placement and two GPUs under
/// its own settings, in pods the API server admits; one naming a profile that does not exist
/// is Degraded with the reason and the profiles there are.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resource_profiles_from_the_chart_apply_under_the_spec() {
    let Some(cluster) = Cluster::start().await else {
        return;
    };
    let client = cluster.client().await;
    let values: Value = serde_yaml_ng::from_str(
        &std::fs::read_to_string(
            workspace_root().join("charts/ferrite-operator/ci/resource-profiles-values.yaml"),
        )
        .expect("values"),
    )
    .expect("YAML");
    let release = install(&cluster, &values, "profiles").await;
    let op = Operator::launch(&cluster, &release, "op-0", &[]).await;
    let ns = cluster.namespace("profiles").await;
    let mut applier = Applier::new(client.clone()).await;
    applier
        .apply(
            &json!({"apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass",
            "metadata": {"name": "nvidia"}, "handler": "nvidia"}),
        )
        .await;
    for (name, profile) in [("h100", "nvidia-h100:2"), ("tpu", "tpu-v5")] {
        applier
            .apply(
                &json!({"apiVersion": "ferrite.dev/v1alpha1", "kind": "InferenceService",
                "metadata": {"name": name, "namespace": ns},
                "spec": {"model": {"source": "/models/m.gguf"}, "resourceProfile": profile,
                         "scheduling": {"nodeSelector": {"pool": "inference"}}}}),
            )
            .await;
    }
    observed(&client, &ns, "h100").await;
    let pod = first_pod(&client, &ns, "h100").await;
    let spec = pod.spec.expect("pod spec");
    let selector = spec.node_selector.unwrap_or_default();
    assert_eq!(selector["pool"], "inference", "the spec's own");
    assert_eq!(selector["nvidia.com/gpu.product"], "NVIDIA-H100-80GB-HBM3");
    assert_eq!(spec.runtime_class_name.as_deref(), Some("nvidia"));
    assert!(
        spec.tolerations
            .unwrap_or_default()
            .iter()
            .any(|t| t.key.as_deref() == Some("nvidia.com/gpu"))
    );
    assert_eq!(
        spec.image_pull_secrets.unwrap_or_default()[0].name,
        "ngc-registry"
    );
    let limits = spec.containers[0]
        .resources
        .clone()
        .and_then(|r| r.limits)
        .unwrap_or_default();
    assert_eq!(
        limits.get("nvidia.com/gpu").map(|q| q.0.as_str()),
        Some("2")
    );
    let d = degraded(&client, &ns, "tpu", WAIT).await;
    assert_eq!(d.1, "ResourceProfileNotFound", "{d:?}\n{}", op.log());
    assert!(
        d.2.contains("\"tpu-v5\"") && d.2.contains("nvidia-h100"),
        "{d:?}"
    );
}

/// A model that cannot be downloaded says so: the pod the ReplicaSet made is run as a kubelet
/// would run it (its container's arguments, its environment, the model's Secret as `envFrom`)
/// by the real ferrite-server against a stand-in Hub that refuses the token. The server's
/// termination message, reported in the pod's status as the kubelet reports it, becomes
/// `Degraded`, reason `ModelDownloadFailed`, with the pod and the Hub's answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_download_refused_by_the_hub_shows_as_degraded() {
    let Some(cluster) = Cluster::start().await else {
        return;
    };
    let client = cluster.client().await;
    let release = install(&cluster, &json!({}), "download").await;
    let op = Operator::launch(&cluster, &release, "op-0", &[]).await;
    let ns = cluster.namespace("download").await;
    let hub = ferrite_testkit::hub::FileHost::start();
    hub.add_repo(
        "acme/smol",
        "0123456789abcdef0123456789abcdef01234567",
        &["main"],
        &[("smol.gguf", b"GGUF".to_vec())],
    );
    hub.require_token("hf_right");
    let mut applier = Applier::new(client.clone()).await;
    applier
        .apply(&json!({"apiVersion": "v1", "kind": "Secret",
            "metadata": {"name": "hf-token", "namespace": ns},
            "stringData": {"HF_TOKEN": "hf_expired", "HF_ENDPOINT": hub.url()}}))
        .await;
    applier
        .apply(&ferrite_testkit::e2e::isvc(
            &ns,
            "gated",
            json!({"model": {"source": "hf://acme/smol/smol.gguf",
                             "secretRef": {"name": "hf-token"}}}),
        ))
        .await;
    let pod = first_pod(&client, &ns, "gated").await;
    let name = pod.metadata.name.clone().expect("pod name");
    let c = &pod.spec.as_ref().expect("pod spec").containers[0];
    assert!(
        pod.spec
            .as_ref()
            .and_then(|s| s.init_containers.as_ref())
            .is_none()
    );
    let secret = c
        .env_from
        .iter()
        .flatten()
        .find_map(|f| f.secret_ref.as_ref())
        .expect("the model's Secret as envFrom");
    assert_eq!(secret.name, "hf-token");

    // The kubelet's part: the container's arguments and environment, the Secret's keys, the
    // termination message file (local paths for /dev/termination-log and the model volume).
    let dir = ferrite_testkit::process::TempDir::new("kubelet");
    let termination = dir.path().join("termination-log");
    let mut args = c.args.clone().expect("args");
    for (flag, value) in [
        ("--host", "127.0.0.1".to_string()),
        ("--port", ferrite_testkit::process::free_port().to_string()),
        (
            "--termination-message-path",
            termination.display().to_string(),
        ),
    ] {
        let i = args.iter().position(|a| a == flag).expect(flag);
        args[i + 1] = value;
    }
    let secrets: Api<k8s_openapi::api::core::v1::Secret> = Api::namespaced(client.clone(), &ns);
    let data = secrets
        .get("hf-token")
        .await
        .expect("Secret")
        .data
        .expect("data");
    let mut cmd = std::process::Command::new(ferrite_testkit::server::binary());
    cmd.args(&args).env_clear();
    for e in c.env.iter().flatten() {
        let value = e.value.clone().unwrap_or_default();
        cmd.env(
            &e.name,
            value.replace("/mnt/models", &dir.path().display().to_string()),
        );
    }
    for (k, v) in &data {
        cmd.env(k, String::from_utf8_lossy(&v.0).into_owned());
    }
    let out = cmd.output().expect("run ferrite-server");
    assert!(!out.status.success());
    let message = std::fs::read_to_string(&termination).expect("termination message");
    assert!(message.starts_with("ModelDownloadFailed: "), "{message}");
    assert!(
        hub.requests()
            .iter()
            .any(|r| r.status == 401 && r.authorization.as_deref() == Some("Bearer hf_expired")),
        "the Hub saw the Secret's token"
    );

    // The kubelet reports the container restarting after that exit.
    let now = k8s_openapi::jiff::Timestamp::now().to_string();
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    pods.patch_status(
        &name,
        &PatchParams::default(),
        &Patch::Merge(
            &json!({"status": {"phase": "Running", "containerStatuses": [{
            "name": "server", "image": c.image, "imageID": "", "ready": false,
            "restartCount": 3, "started": false,
            "state": {"waiting": {"reason": "CrashLoopBackOff",
                                  "message": "back-off 40s restarting failed container"}},
            "lastState": {"terminated": {"exitCode": 1, "reason": "Error", "message": message,
                                         "startedAt": now, "finishedAt": now}}}]}}),
        ),
    )
    .await
    .expect("pod status");
    let d = degraded(&client, &ns, "gated", WAIT).await;
    assert_eq!(d.1, "ModelDownloadFailed", "{d:?}\n{}", op.log());
    assert!(
        d.2.contains(&format!("pod {name}"))
            && d.2.contains("HTTP 401")
            && d.2.contains("spec.model.secretRef"),
        "{d:?}"
    );
}

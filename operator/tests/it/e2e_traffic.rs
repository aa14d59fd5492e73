//! What the operator sends to a real API server, read from the API server's own audit log:
//! run as the chart's ServiceAccount through everything it does, it is never refused and uses
//! every verb of every rule the chart grants (so the RBAC is exactly enough); and once 20
//! InferenceServices have settled, it sends nothing but its watches and Lease renewals.

use std::time::Duration;

use ferrite_testkit::e2e::{
    Applier, Operator, assert_exact_rbac, audited, condition_with_reason, get_isvc, install,
    install_service_monitor_crd, isvc, pods_ready, requests,
};
use ferrite_testkit::kube::Cluster;
use ferrite_testkit::process::eventually;
use ferrite_testkit::server::{Load, ready_server};
use k8s_openapi::api::autoscaling::v2::HorizontalPodAutoscaler;
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::api::{Api, Patch, PatchParams};
use serde_json::json;

const WAIT: Duration = Duration::from_secs(60);

/// Everything the operator does, under the chart's RBAC: children of every kind created,
/// changed and pruned, status, events and an event series, the built-in autoscaler's scale,
/// and the Lease taken, renewed and handed back. No request is refused, and every verb the
/// chart grants is used.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_operator_uses_exactly_the_rbac_the_chart_grants() {
    let Some(cluster) = Cluster::start_with(audited()).await else {
        return;
    };
    let client = cluster.client().await;
    install_service_monitor_crd(&client).await;
    let release = install(&cluster, &json!({}), "traffic").await;
    let mut op = Operator::launch(&cluster, &release, "op-0", &["--adapter-sync-seconds=1"]).await;
    let ns = cluster.namespace("traffic").await;
    let mut applier = Applier::new(client.clone()).await;
    applier
        .apply(&json!({"apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": {"name": "models", "namespace": ns},
            "spec": {"accessModes": ["ReadOnlyMany"], "resources": {"requests": {"storage": "1Gi"}}}}))
        .await;

    // The built-in autoscaler scales a real server's queue (the scale subresource, an event).
    let (server, port) = ready_server().await;
    applier
        .apply(&isvc(
            &ns,
            "scaled",
            json!({"model": {"source": "/models/smol.gguf"},
            "runtime": {"port": port},
            "autoscaling": {"minReplicas": 1, "maxReplicas": 2,
                            "targets": {"queuePerReplica": 1.0}, "scrapeIntervalSeconds": 1}}),
        ))
        .await;
    eventually(WAIT, "the stand-in pod", async || {
        (pods_ready(&client, &ns, "scaled", "127.0.0.1").await > 0).then_some(())
    })
    .await;
    let clients = Load::start(&server.base, 6, 32);
    eventually(WAIT, "the autoscaler to scale", async || {
        let i = get_isvc(&client, &ns, "scaled").await?;
        (i["spec"]["replicas"] == 2).then_some(())
    })
    .await;
    drop(server);
    drop(clients);

    // Every child kind, from a claim-backed model; an adapter on a service with an API key
    // (the adapter sync reads the key's Secret, absent here: a get all the same).
    let everything = isvc(
        &ns,
        "everything",
        json!({
        "model": {"source": "pvc://models/smol.gguf",
                  "adapters": [{"name": "tuned", "source": "/adapters/tuned"}]},
        "auth": {"apiKeySecretRef": {"name": "keys"}},
        "replicas": 2,
        "autoscaling": {"mode": "HPA", "minReplicas": 2, "maxReplicas": 4,
                        "targets": {"queuePerReplica": 4.0}},
        "monitoring": {"serviceMonitor": {"enabled": true}}}),
    );
    applier.apply(&everything).await;
    let hpas: Api<HorizontalPodAutoscaler> = Api::namespaced(client.clone(), &ns);
    let pdbs: Api<PodDisruptionBudget> = Api::namespaced(client.clone(), &ns);
    eventually(WAIT, "the HPA and the PDB", async || {
        hpas.get_opt("everything").await.ok()??;
        pdbs.get_opt("everything").await.ok()?
    })
    .await;
    eventually(
        WAIT,
        "the adapter sync to look for the API key",
        async || {
            let i = get_isvc(&client, &ns, "everything").await?;
            (i["status"]["adapters"][0]["reason"] == "ApiKeySecretNotFound").then_some(())
        },
    )
    .await;
    // The chart's default serves no External Metrics API: the HPA is made, and status says it
    // cannot read the signals.
    let scaling = condition_with_reason(
        &client,
        &ns,
        "everything",
        ("ScalingActive", "ExternalMetricsOff"),
        WAIT,
    )
    .await;
    assert_eq!(scaling.0, "False", "{scaling:?}");
    assert!(scaling.2.contains("externalMetrics.enabled"), "{scaling:?}");

    // A deleted Service, twice: two "created" events with the same reason and object make a
    // series, which the recorder patches.
    let services: Api<Service> = Api::namespaced(client.clone(), &ns);
    for _ in 0..2 {
        let uid = services
            .get("everything")
            .await
            .expect("Service")
            .metadata
            .uid;
        services
            .delete("everything", &Default::default())
            .await
            .expect("delete");
        eventually(WAIT, "the Service back", async || {
            let s = services.get_opt("everything").await.ok()??;
            (s.metadata.uid != uid).then_some(())
        })
        .await;
    }

    // Everything optional turned off: pruned.
    let isvcs = ferrite_testkit::e2e::isvc_api(&client, &ns);
    isvcs
        .patch("everything", &PatchParams::apply("ferrite-e2e").force(), &Patch::Apply(isvc(&ns, "everything", json!({
            "model": {"source": "pvc://models/smol.gguf"}, "replicas": 1,
            "monitoring": {"serviceMonitor": {"enabled": false}, "dashboards": {"enabled": false}}}))))
        .await
        .expect("spec change");
    eventually(WAIT, "the HPA and the PDB pruned", async || {
        let gone = hpas.get_opt("everything").await.ok()?.is_none()
            && pdbs.get_opt("everything").await.ok()?.is_none();
        gone.then_some(())
    })
    .await;

    // SIGTERM: the Lease goes back.
    let status = tokio::task::spawn_blocking(move || (op.terminate(), op))
        .await
        .expect("terminate");
    assert!(status.0.success(), "{}", status.1.log());
    op = status.1;

    let used = assert_exact_rbac(
        &cluster,
        &release.docs,
        &release.service_account(),
        &op.log(),
    );
    eprintln!("{used} distinct (verb, group, resource) uses, all granted, every grant used");
}

/// 20 InferenceServices of four kinds, settled: over 40 s the operator writes nothing, and
/// reads nothing but its watches (no polling), beyond its Lease renewals and at most one
/// discovery of the ServiceMonitor API.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_settled_operator_sends_nothing_but_watches_and_lease_renewals() {
    let Some(cluster) = Cluster::start_with(audited()).await else {
        return;
    };
    let client = cluster.client().await;
    let release = install(&cluster, &json!({}), "quiet").await;
    let op = Operator::launch(&cluster, &release, "op-0", &[]).await;
    let ns = cluster.namespace("quiet").await;
    let mut applier = Applier::new(client.clone()).await;
    applier
        .apply(&json!({"apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": {"name": "models", "namespace": ns},
            "spec": {"accessModes": ["ReadOnlyMany"], "resources": {"requests": {"storage": "1Gi"}}}}))
        .await;
    for i in 0..20 {
        let spec = match i % 4 {
            0 => json!({"model": {"source": "pvc://models/m.gguf"}}),
            1 => json!({"model": {"source": "/models/m.gguf"}, "replicas": 2}),
            2 => json!({"model": {"source": "hf://org/m"}, "runtime": {"kind": "vllm"},
                        "resources": {"gpus": 1}}),
            _ => json!({"model": {"source": "/models/m.gguf"},
                        "autoscaling": {"mode": "HPA", "minReplicas": 1, "maxReplicas": 3,
                                        "targets": {"queuePerReplica": 2.0}}}),
        };
        applier
            .apply(&isvc(&ns, &format!("svc-{i:02}"), spec))
            .await;
    }
    // Settled: every status written, no pod will ever run (no kubelet).
    eventually(WAIT, "every InferenceService observed", async || {
        for i in 0..20 {
            let obj = get_isvc(&client, &ns, &format!("svc-{i:02}")).await?;
            if obj["status"]["observedGeneration"] != obj["metadata"]["generation"] {
                return None;
            }
        }
        Some(())
    })
    .await;
    // Statuses keep following the Deployments until kube-controller-manager has made their
    // ReplicaSets and pods (seconds on a loaded machine): settled means nothing but watches
    // and the Lease for 8 s in a row.
    let user = release.operator_user();
    let busy = || {
        requests(&cluster, &user)
            .0
            .iter()
            .filter(|(verb, _, resource)| resource != "leases" && verb != "watch")
            .count()
    };
    let (mut last, mut since) = (busy(), std::time::Instant::now());
    eventually(WAIT, "the operator to go quiet", async || {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let now = busy();
        if now != last {
            (last, since) = (now, std::time::Instant::now());
        }
        (since.elapsed() >= Duration::from_secs(8)).then_some(())
    })
    .await;
    let before = requests(&cluster, &user).0.len();
    tokio::time::sleep(Duration::from_secs(40)).await;
    let (all, refused) = requests(&cluster, &user);
    assert!(refused.is_empty());
    let window: Vec<_> = all[before..]
        .iter()
        .filter(|(verb, _, resource)| resource != "leases" && verb != "watch")
        .collect();
    let discovery = window
        .iter()
        .filter(|(verb, _, resource)| verb == "get" && resource.is_empty())
        .count();
    assert!(
        window.len() == discovery && discovery <= 1,
        "requests in 40 s of steady state: {window:?}\n{}",
        op.log()
    );
    eprintln!(
        "steady state, 20 InferenceServices, 40 s: {} requests beyond watches and the Lease",
        window.len()
    );
}

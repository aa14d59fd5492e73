//! Replicas that span pods, on a real API server: the chart installed with
//! `leaderWorkerSet.enabled`, the real `ferrite-operator` and `ferrite-router` binaries run as it
//! renders them, and LeaderWorkerSet's CRD (test data from kubernetes-sigs/lws,
//! `testkit/data/lws/`) installed during the test. There is no LWS controller: the test makes a
//! group's pods as LWS would, from the templates the operator rendered, with a real ferrite-server
//! behind the leader and another behind the worker.
//!
//! Checked: without the CRD the spec is `Degraded` saying to install LWS, while a single-pod spec
//! beside it runs, and a parallelism that cannot run is `Degraded` saying why; with it, a
//! LeaderWorkerSet the API server accepts under LWS's schema (group size, vLLM's multi-node start,
//! GPUs per pod, probes on the leader only); the router sends every request to the leader and none
//! to the worker; status reads LWS's groups; `/scale` changes the groups, to zero and back; a spec that moves to one
//! pod gets a Deployment and loses the LeaderWorkerSet, and back. KEDA's CRD is installed too, with
//! the chart's KEDA mode off: a KEDA-mode spec is `Degraded`, and nothing else is held up by a kind
//! the operator may not watch (it is never refused, so it never tried). The operator uses nothing
//! beyond the chart's rules.

use std::time::Duration;

use ferrite_testkit::e2e::{
    Applier, Operator, Router, assert_rbac_covers, audited, condition, condition_with_reason,
    degraded, get_isvc, install, isvc, isvc_api, wait_crd,
};
use ferrite_testkit::kube::standin::ready_pod_labelled;
use ferrite_testkit::kube::{Cluster, workspace_root};
use ferrite_testkit::process::{eventually, free_port};
use ferrite_testkit::server::{Metrics, post_json, start_server_at};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Service;
use kube::api::{Api, DynamicObject, Patch, PatchParams};
use kube::discovery::ApiResource;
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(90);
const LWS_CRD: &str = "leaderworkersets.leaderworkerset.x-k8s.io";
const LEADER_IP: &str = "127.0.0.5";
const WORKER_IP: &str = "127.0.0.6";

fn groups(client: &kube::Client, ns: &str) -> Api<DynamicObject> {
    let ar = ApiResource {
        group: "leaderworkerset.x-k8s.io".into(),
        version: "v1".into(),
        api_version: "leaderworkerset.x-k8s.io/v1".into(),
        kind: "LeaderWorkerSet".into(),
        plural: "leaderworkersets".into(),
    };
    Api::namespaced_with(client.clone(), ns, &ar)
}

/// The LeaderWorkerSet `name` as JSON, once `check` holds for it; the InferenceService is
/// touched meanwhile, so that a reconcile follows at once.
async fn group_set(
    client: &kube::Client,
    ns: &str,
    name: &str,
    what: &str,
    check: impl Fn(&Value) -> bool,
) -> Value {
    let api = groups(client, ns);
    eventually(WAIT, what, async || {
        touch(client, ns, name).await;
        let g = serde_json::to_value(api.get_opt(name).await.ok()??).ok()?;
        check(&g).then_some(g)
    })
    .await
}

/// An annotation change: the operator reconciles the InferenceService again.
async fn touch(client: &kube::Client, ns: &str, name: &str) {
    let now = format!("{:?}", std::time::SystemTime::now());
    let _ = isvc_api(client, ns)
        .patch(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"annotations": {"test/touched": now}}})),
        )
        .await;
}

async fn patch_spec(client: &kube::Client, ns: &str, name: &str, spec: Value) {
    isvc_api(client, ns)
        .patch(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({ "spec": spec })),
        )
        .await
        .unwrap_or_else(|e| panic!("patching {name}: {e}"));
}

/// Requests the server behind `base` finished.
async fn finished(base: &str) -> f64 {
    let url = format!("{base}/metrics");
    let text = tokio::task::spawn_blocking(move || {
        ureq::get(&url)
            .call()
            .ok()
            .and_then(|r| r.into_string().ok())
            .unwrap_or_default()
    })
    .await
    .expect("metrics");
    Metrics::parse(text).sum_where("vllm:e2e_request_latency_seconds_count", &[])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_across_pods_is_a_leader_worker_set_whose_leaders_alone_serve() {
    let Some(cluster) = Cluster::start_with(audited()).await else {
        return;
    };
    let client = cluster.client().await;
    let ns = cluster.namespace("lws").await;
    let mut applier = Applier::new(client.clone()).await;
    applier
        .apply_file(&workspace_root().join("testkit/data/keda/keda.sh_scaledobjects.yaml"))
        .await;
    wait_crd(&client, "scaledobjects.keda.sh").await;
    let values = json!({"leaderWorkerSet": {"enabled": true}, "router": {"endpointsFrom": "pods"}});
    let release = install(&cluster, &values, "lws").await;
    let operator =
        Operator::launch(&cluster, &release, "op-0", &["--discovery-ttl-seconds=1"]).await;
    let mut router = Router::launch(&cluster, &release).await;

    // 2 × 2 GPUs a replica over pods of 2: groups of 2 pods.
    let port = free_port();
    let spec = json!({"model": {"source": "/models/smol.gguf", "servedName": "big"},
        "runtime": {"kind": "vllm", "port": port},
        "parallelism": {"tensor": 2, "pipeline": 2}, "resources": {"gpus": 2}});
    applier.apply(&isvc(&ns, "big", spec.clone())).await;
    let d = degraded(&client, &ns, "big", WAIT).await;
    assert_eq!(d.1, "LeaderWorkerSetNotInstalled", "{d:?}");
    assert!(d.2.contains("install LeaderWorkerSet"), "{d:?}");
    // Beside it, a spec that fits one pod runs as ever, and a KEDA-mode spec says why not.
    applier
        .apply(&isvc(
            &ns,
            "small",
            json!({"model": {"source": "/models/smol.gguf"}}),
        ))
        .await;
    applier
        .apply(&isvc(
            &ns,
            "keda",
            json!({"model": {"source": "/models/smol.gguf"},
                   "autoscaling": {"mode": "KEDA", "minReplicas": 1, "maxReplicas": 2,
                                   "targets": {"queuePerReplica": 1.0}}}),
        ))
        .await;
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), &ns);
    eventually(WAIT, "small's Deployment", async || {
        deployments.get_opt("small").await.ok()?
    })
    .await;
    let d = degraded(&client, &ns, "keda", WAIT).await;
    assert_eq!(d.1, "KedaNotEnabled", "{d:?}");
    // Parallelism that cannot run is refused with why, not rendered.
    applier
        .apply(&isvc(
            &ns,
            "odd",
            json!({"model": {"source": "/models/smol.gguf"}, "runtime": {"kind": "vllm"},
                   "parallelism": {"tensor": 2, "data": 2}, "resources": {"gpus": 2}}),
        ))
        .await;
    let d = degraded(&client, &ns, "odd", WAIT).await;
    assert_eq!(d.1, "InvalidParallelism", "{d:?}");
    assert!(d.2.contains("data 2 across 2 pods"), "{d:?}");

    // LWS installed: the group set, as the API server accepted it under LWS's schema.
    applier
        .apply_file(
            &workspace_root()
                .join("testkit/data/lws/leaderworkerset.x-k8s.io_leaderworkersets.yaml"),
        )
        .await;
    wait_crd(&client, LWS_CRD).await;
    let g = group_set(&client, &ns, "big", "big's LeaderWorkerSet", |_| true).await;
    let s = &g["spec"];
    assert_eq!(s["replicas"], 1, "{s}");
    assert_eq!(s["startupPolicy"], "LeaderCreated");
    let t = &s["leaderWorkerTemplate"];
    assert_eq!(t["size"], 2, "{t}");
    assert_eq!(t["restartPolicy"], "RecreateGroupOnPodRestart");
    // GPU pods roll one group at a time, without a spare group.
    assert_eq!(
        s["rolloutStrategy"]["rollingUpdateConfiguration"],
        json!({"maxSurge": 0, "maxUnavailable": 1, "partition": 0})
    );
    assert_eq!(
        g["metadata"]["ownerReferences"][0]["kind"],
        "InferenceService"
    );
    let leader = &t["leaderTemplate"];
    let worker = &t["workerTemplate"];
    let component = |p: &Value| p["metadata"]["labels"]["app.kubernetes.io/component"].clone();
    assert_eq!(component(leader), "server");
    assert_eq!(component(worker), "worker");
    let lc = &leader["spec"]["containers"][0];
    let wc = &worker["spec"]["containers"][0];
    let command = |c: &Value| c["command"].to_string();
    assert!(command(lc).contains("multi-node-serving.sh leader"), "{lc}");
    assert!(command(lc).contains("exec vllm serve"), "{lc}");
    assert!(command(wc).contains("multi-node-serving.sh worker"), "{wc}");
    assert!(command(wc).contains("LWS_LEADER_ADDRESS"), "{wc}");
    ferrite_testkit::chart::assert_flag_values(
        lc,
        &[
            ["--tensor-parallel-size", "2"],
            ["--pipeline-parallel-size", "2"],
            ["--distributed-executor-backend", "ray"],
        ],
    );
    for c in [lc, wc] {
        assert_eq!(c["resources"]["limits"]["nvidia.com/gpu"], "2", "{c}");
        assert_eq!(c["securityContext"]["allowPrivilegeEscalation"], false);
    }
    assert!(lc["readinessProbe"].is_object() && lc["startupProbe"].is_object());
    assert!(
        wc["readinessProbe"].is_null() && wc["ports"].is_null(),
        "{wc}"
    );
    assert!(deployments.get_opt("big").await.expect("get").is_none());
    // The Service and the status follow the group set in the same reconcile, which a loaded
    // machine may not have finished when the set shows.
    let services: Api<Service> = Api::namespaced(client.clone(), &ns);
    let service = eventually(WAIT, "big's Service", async || {
        services.get_opt("big").await.ok()?
    })
    .await;
    let selector = service.spec.and_then(|s| s.selector).unwrap_or_default();
    assert_eq!(
        selector
            .get("app.kubernetes.io/component")
            .map(String::as_str),
        Some("server"),
        "the Service reaches leaders only: {selector:?}"
    );
    eventually(WAIT, "big no longer Degraded", async || {
        condition(&client, &ns, "big", "Degraded")
            .await
            .filter(|d| d.0 == "False")
    })
    .await;

    // The group's pods, as LWS makes them from the templates, each with a real server.
    let group_labels = |template: &Value, index: &str| {
        let mut labels = template["metadata"]["labels"].clone();
        labels["leaderworkerset.sigs.k8s.io/name"] = json!("big");
        labels["leaderworkerset.sigs.k8s.io/group-index"] = json!("0");
        labels["leaderworkerset.sigs.k8s.io/worker-index"] = json!(index);
        labels
    };
    let (leader_server, worker_server) = tokio::task::spawn_blocking(move || {
        let flags = ["--served-model-name", "big"];
        let mut l = start_server_at(LEADER_IP, port, &flags);
        let mut w = start_server_at(WORKER_IP, port, &flags);
        l.wait_ready();
        w.wait_ready();
        (l, w)
    })
    .await
    .expect("servers");
    ready_pod_labelled(&client, &ns, "big-0", LEADER_IP, group_labels(leader, "0")).await;
    ready_pod_labelled(
        &client,
        &ns,
        "big-0-1",
        WORKER_IP,
        group_labels(worker, "1"),
    )
    .await;
    // LWS's status: the group is ready.
    let generation = g["metadata"]["generation"].clone();
    groups(&client, &ns)
        .patch_status(
            "big",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"replicas": 1, "readyReplicas": 1,
                "updatedReplicas": 1, "observedGeneration": generation}})),
        )
        .await
        .expect("LWS status");
    let ready = eventually(WAIT, "big Ready from its group", async || {
        touch(&client, &ns, "big").await;
        let i = get_isvc(&client, &ns, "big").await?;
        let ready = i["status"]["conditions"]
            .as_array()?
            .iter()
            .any(|c| c["type"] == "Ready" && c["status"] == "True");
        ready.then_some(i)
    })
    .await;
    assert_eq!(ready["status"]["readyReplicas"], 1, "{}", ready["status"]);
    assert_eq!(
        ready["status"]["selector"],
        "app.kubernetes.io/component=server,ferrite.dev/inferenceservice=big"
    );

    // Through the router: every request to the leader, none to the worker.
    let base = router.base.clone();
    eventually(WAIT, "the router to route big", async || {
        let (status, _, _) = post_json(
            format!("{base}/v1/completions"),
            json!({"model": "big", "prompt": "hi", "max_tokens": 1}),
        )
        .await;
        (status == 200).then_some(())
    })
    .await;
    for i in 0..8 {
        let (status, body, _) = post_json(
            format!("{base}/v1/completions"),
            json!({"model": "big", "prompt": format!("request {i}"), "max_tokens": 2}),
        )
        .await;
        assert_eq!(status, 200, "{body}");
    }
    let (to_leader, to_worker) = (
        finished(&leader_server.base).await,
        finished(&worker_server.base).await,
    );
    assert!(to_leader >= 9.0, "the leader served {to_leader}");
    assert_eq!(to_worker, 0.0, "the worker served {to_worker}");

    // `/scale` scales groups.
    isvc_api(&client, &ns)
        .patch_scale(
            "big",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"replicas": 2}})),
        )
        .await
        .expect("scale");
    group_set(&client, &ns, "big", "two groups", |g| {
        g["spec"]["replicas"] == 2
    })
    .await;
    // To zero and back, as the router's wake and the autoscaler do it.
    for replicas in [0, 2] {
        isvc_api(&client, &ns)
            .patch_scale(
                "big",
                &PatchParams::default(),
                &Patch::Merge(json!({"spec": {"replicas": replicas}})),
            )
            .await
            .expect("scale");
        group_set(&client, &ns, "big", "the groups follow /scale", |g| {
            g["spec"]["replicas"] == replicas
        })
        .await;
        if replicas == 0 {
            let ready =
                condition_with_reason(&client, &ns, "big", ("Ready", "ScaledToZero"), WAIT).await;
            assert_eq!(ready.0, "False", "{ready:?}");
        }
    }

    // Fitting one pod again: a Deployment, and the LeaderWorkerSet goes (GPU pods do not
    // surge, so at once); and back.
    patch_spec(
        &client,
        &ns,
        "big",
        json!({"parallelism": {"tensor": 2, "pipeline": 1}}),
    )
    .await;
    eventually(WAIT, "a Deployment for big, its LWS gone", async || {
        touch(&client, &ns, "big").await;
        let d = deployments.get_opt("big").await.ok()??;
        let gone = groups(&client, &ns).get_opt("big").await.ok()?.is_none();
        (gone && d.spec?.replicas == Some(2)).then_some(())
    })
    .await;
    patch_spec(
        &client,
        &ns,
        "big",
        json!({"parallelism": {"tensor": 2, "pipeline": 2}}),
    )
    .await;
    group_set(&client, &ns, "big", "big's LeaderWorkerSet again", |_| true).await;
    eventually(WAIT, "big's Deployment gone", async || {
        deployments
            .get_opt("big")
            .await
            .ok()?
            .is_none()
            .then_some(())
    })
    .await;

    let log = operator.log();
    assert_rbac_covers(
        &cluster,
        &release.docs,
        &release.service_account(),
        &log,
        &[
            ("list", "leaderworkerset.x-k8s.io", "leaderworkersets"),
            ("watch", "leaderworkerset.x-k8s.io", "leaderworkersets"),
            ("create", "leaderworkerset.x-k8s.io", "leaderworkersets"),
            ("patch", "leaderworkerset.x-k8s.io", "leaderworkersets"),
            ("delete", "leaderworkerset.x-k8s.io", "leaderworkersets"),
            ("delete", "apps", "deployments"),
        ],
    );
    router.terminate();
}

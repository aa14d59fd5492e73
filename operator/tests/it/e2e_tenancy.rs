//! Tenants that collide, on a real API server with the operator installed by its chart: an
//! InferenceService named like an object someone else made is refused (`ChildConflict`) and
//! the object is left as it was, and survives the InferenceService's deletion; a served name
//! copied from another namespace leaves the copy `Ready=False` (`ServedNameConflict`, with a
//! Warning event) while the older claimant keeps it, until the older one goes.

use std::time::Duration;

use ferrite_testkit::e2e::{
    Applier, Operator, condition, condition_with_reason, degraded, install, isvc_api,
};
use ferrite_testkit::kube::Cluster;
use ferrite_testkit::process::eventually;
use k8s_openapi::api::core::v1::Service;
use kube::api::{Api, DeleteParams, ListParams};
use serde_json::json;

const WAIT: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn colliding_tenants_are_refused_not_taken_over() {
    let Some(cluster) = Cluster::start().await else {
        return;
    };
    let client = cluster.client().await;
    let release = install(&cluster, &json!({}), "tenancy").await;
    let _op = Operator::launch(&cluster, &release, "op-0", &[]).await;
    let ns = cluster.namespace("tenancy").await;
    let mut applier = Applier::new(client.clone()).await;

    // Someone's own Service, named like the InferenceService about to be made.
    applier
        .apply(&json!({"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": "web", "namespace": ns, "labels": {"team": "web"}},
            "spec": {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": 8080}]}}))
        .await;
    applier
        .apply(&ferrite_testkit::e2e::isvc(
            &ns,
            "web",
            json!({"model": {"source": "/models/smol.gguf"}}),
        ))
        .await;
    let d = degraded(&client, &ns, "web", WAIT).await;
    assert_eq!(d.1, "ChildConflict", "{d:?}");
    assert!(d.2.contains("Service web"), "{d:?}");
    let services: Api<Service> = Api::namespaced(client.clone(), &ns);
    let svc = services.get("web").await.expect("the Service");
    assert!(
        svc.metadata.owner_references.is_none(),
        "{:?}",
        svc.metadata
    );
    let spec = svc.spec.expect("spec");
    assert_eq!(spec.selector.expect("selector")["app"], "web");
    assert_eq!(spec.ports.expect("ports")[0].port, 80);

    // Deleting the InferenceService deletes nothing of theirs.
    isvc_api(&client, &ns)
        .delete("web", &DeleteParams::default())
        .await
        .expect("delete");
    eventually(WAIT, "web to be gone", async || {
        isvc_api(&client, &ns)
            .get_opt("web")
            .await
            .ok()?
            .is_none()
            .then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(services.get_opt("web").await.expect("read").is_some());

    // A served name copied from another namespace.
    let owner_ns = cluster.namespace("zzz-owner").await;
    applier
        .apply(&ferrite_testkit::e2e::isvc(
            &owner_ns,
            "llm",
            json!({"model": {"source": "/models/smol.gguf", "servedName": "shared"}}),
        ))
        .await;
    // Creation times are whole seconds: the copy is clearly younger.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let copy_ns = cluster.namespace("aaa-tenant").await;
    applier
        .apply(&ferrite_testkit::e2e::isvc(
            &copy_ns,
            "copy",
            json!({"model": {"source": "/models/smol.gguf", "servedName": "shared"}}),
        ))
        .await;
    let r = condition_with_reason(
        &client,
        &copy_ns,
        "copy",
        ("Ready", "ServedNameConflict"),
        WAIT,
    )
    .await;
    assert_eq!(r.0, "False");
    assert!(r.2.contains(&format!("{owner_ns}/llm")), "{r:?}");
    assert!(r.2.contains(&format!("{copy_ns}/copy")), "{r:?}");
    let owner = condition(&client, &owner_ns, "llm", "Ready").await;
    assert!(
        owner.as_ref().is_some_and(|c| c.1 != "ServedNameConflict"),
        "{owner:?}"
    );
    let events = eventually(WAIT, "a ServedNameConflict event", async || {
        use k8s_openapi::api::events::v1::Event;
        let list = Api::<Event>::namespaced(client.clone(), &copy_ns)
            .list(&ListParams::default())
            .await
            .ok()?;
        list.items
            .into_iter()
            .find(|e| e.reason.as_deref() == Some("ServedNameConflict"))
    })
    .await;
    assert_eq!(events.type_.as_deref(), Some("Warning"));

    // The holder goes: the copy holds the name now.
    isvc_api(&client, &owner_ns)
        .delete("llm", &DeleteParams::default())
        .await
        .expect("delete");
    eventually(WAIT, "the copy to hold the name", async || {
        condition(&client, &copy_ns, "copy", "Ready")
            .await
            .filter(|c| c.1 != "ServedNameConflict")
    })
    .await;
}

/// With the chart's `networkPolicy.enabled`, every InferenceService gets a NetworkPolicy that
/// the real API server accepts: its pods, ingress on the model's port from the operator, the
/// router and Prometheus only, owned by the InferenceService and put back when deleted. (No
/// CNI runs here, so enforcement itself is the CNI's.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn model_pods_admit_only_the_router_the_operator_and_prometheus() {
    use k8s_openapi::api::networking::v1::NetworkPolicy;
    let Some(cluster) = Cluster::start().await else {
        return;
    };
    let client = cluster.client().await;
    let release = install(
        &cluster,
        &json!({"networkPolicy": {"enabled": true}}),
        "netpol",
    )
    .await;
    let op = Operator::launch(&cluster, &release, "op-0", &[]).await;
    let ns = cluster.namespace("netpol").await;
    Applier::new(client.clone())
        .await
        .apply(&ferrite_testkit::e2e::isvc(
            &ns,
            "chat",
            json!({"model": {"source": "/models/smol.gguf"}, "runtime": {"port": 8123}}),
        ))
        .await;
    let policies: Api<NetworkPolicy> = Api::namespaced(client.clone(), &ns);
    let deadline = std::time::Instant::now() + WAIT;
    let policy = loop {
        if let Some(p) = policies.get_opt("chat").await.expect("read") {
            break p;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no NetworkPolicy within {WAIT:?}: {:?}\n{}",
            condition(&client, &ns, "chat", "Degraded").await,
            op.log()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let owner = &policy.metadata.owner_references.clone().expect("owned")[0];
    assert_eq!(
        (owner.kind.as_str(), owner.name.as_str()),
        ("InferenceService", "chat")
    );
    let spec = policy.spec.clone().expect("spec");
    let selected = spec
        .pod_selector
        .and_then(|s| s.match_labels)
        .expect("pods");
    assert_eq!(
        selected["ferrite.dev/inferenceservice"], "chat",
        "{selected:?}"
    );
    assert_eq!(spec.policy_types, Some(vec!["Ingress".to_string()]));
    let rules = spec.ingress.expect("ingress");
    assert_eq!(rules.len(), 1, "{rules:?}");
    let port = &rules[0].ports.as_ref().expect("ports")[0];
    assert_eq!(
        port.port,
        Some(k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(8123))
    );
    let from = serde_json::to_value(rules[0].from.as_ref().expect("peers")).expect("json");
    let pods = |i: usize| from[i]["podSelector"]["matchLabels"]["app.kubernetes.io/name"].clone();
    assert_eq!(from.as_array().map(Vec::len), Some(3), "{from}");
    assert_eq!(pods(0), "ferrite-operator", "{from}");
    assert_eq!(pods(1), "ferrite-router", "{from}");
    assert_eq!(pods(2), "prometheus", "{from}");
    for i in 0..2 {
        assert_eq!(
            from[i]["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"],
            ferrite_testkit::chart::NAMESPACE,
            "{from}"
        );
    }

    // Deleted by hand: put back.
    let uid = policy.metadata.uid.clone();
    policies
        .delete("chat", &DeleteParams::default())
        .await
        .expect("delete");
    eventually(WAIT, "the NetworkPolicy back", async || {
        let p = policies.get_opt("chat").await.ok()??;
        (p.metadata.uid != uid).then_some(())
    })
    .await;
    assert!(!op.log().contains("ERROR"), "{}", op.log());
}

/// A peer that selects nothing would admit every client: refused at start, as is a list that
/// is not one.
#[test]
fn a_peer_that_selects_nothing_is_refused_at_start() {
    for (peers, why) in [
        (r#"[{"podSelector": {}}, {}]"#, "peer 1 selects nothing"),
        ("router", "not a JSON list of NetworkPolicyPeers"),
    ] {
        let out = std::process::Command::new(ferrite_testkit::e2e::operator_binary())
            .arg(format!("--network-policy-peers={peers}"))
            .output()
            .expect("the operator runs");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{stderr}");
        assert!(stderr.contains(why), "{stderr}");
    }
}

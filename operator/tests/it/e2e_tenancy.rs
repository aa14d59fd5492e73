//! Tenants that collide, on a real API server with the operator installed by its chart: an
//! InferenceService named like an object someone else made is refused (`ChildConflict`) and
//! the object is left as it was, and survives the InferenceService's deletion; a served name
//! copied from another namespace leaves the copy `Ready=False` (`ServedNameConflict`, with a
//! Warning event) while the older claimant keeps it, until the older one goes.

use crate::common;

use std::time::Duration;

use common::e2e::{Applier, Operator, condition, install, isvc_api};
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
        .apply(&common::e2e::isvc(
            &ns,
            "web",
            json!({"model": {"source": "/models/smol.gguf"}}),
        ))
        .await;
    let d = eventually(WAIT, "web to be Degraded", async || {
        condition(&client, &ns, "web", "Degraded")
            .await
            .filter(|c| c.0 == "True")
    })
    .await;
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
        .apply(&common::e2e::isvc(
            &owner_ns,
            "llm",
            json!({"model": {"source": "/models/smol.gguf", "servedName": "shared"}}),
        ))
        .await;
    // Creation times are whole seconds: the copy is clearly younger.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let copy_ns = cluster.namespace("aaa-tenant").await;
    applier
        .apply(&common::e2e::isvc(
            &copy_ns,
            "copy",
            json!({"model": {"source": "/models/smol.gguf", "servedName": "shared"}}),
        ))
        .await;
    let r = eventually(WAIT, "the copy to be marked", async || {
        condition(&client, &copy_ns, "copy", "Ready")
            .await
            .filter(|c| c.1 == "ServedNameConflict")
    })
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

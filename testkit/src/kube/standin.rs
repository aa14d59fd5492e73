//! InferenceServices and their pods as the operator would make them, for tests and benchmarks
//! that run no operator: the CRD from `crds/`, InferenceServices created directly, and pods
//! made Ready at a loopback address where a real ferrite-server listens (pod status accepts
//! loopback IPs; there is no kubelet to run them).

use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, DynamicObject, Patch, PatchParams, PostParams};
use kube::core::GroupVersionKind;
use kube::discovery::ApiResource;
use serde_json::{Value, json};

use super::workspace_root;
use crate::process::eventually;

/// Installs `crds/inferenceservice.yaml` and waits until it is established.
pub async fn install_crd(client: &kube::Client) {
    install_crd_file(client, "inferenceservice").await;
}

/// Installs `crds/inferencetenant.yaml` and waits until it is established.
pub async fn install_tenant_crd(client: &kube::Client) {
    install_crd_file(client, "inferencetenant").await;
}

/// Installs `crds/{kind}.yaml` (its plural is `{kind}s`) and waits until it is established.
async fn install_crd_file(client: &kube::Client, kind: &str) {
    let path = workspace_root().join(format!("crds/{kind}.yaml"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path:?}: {e}"));
    let crd: CustomResourceDefinition = serde_yaml_ng::from_str(&text).expect("a CRD");
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    api.create(&PostParams::default(), &crd)
        .await
        .expect("creating the CRD");
    let name = format!("{kind}s.ferrite.dev");
    eventually(
        Duration::from_secs(60),
        "the CRD to be established",
        async || {
            let c = api.get(&name).await.ok()?;
            c.status?
                .conditions?
                .iter()
                .any(|c| c.type_ == "Established" && c.status == "True")
                .then_some(())
        },
    )
    .await;
}

/// InferenceServices in `ns`, untyped (the testkit does not depend on the operator).
pub fn isvc_api(client: &kube::Client, ns: &str) -> Api<DynamicObject> {
    let gvk = GroupVersionKind::gvk("ferrite.dev", "v1alpha1", "InferenceService");
    Api::namespaced_with(client.clone(), ns, &ApiResource::from_gvk(&gvk))
}

/// Creates InferenceService `name` in `ns` with `spec`.
pub async fn create_isvc(client: &kube::Client, ns: &str, name: &str, spec: Value) {
    let obj: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "ferrite.dev/v1alpha1", "kind": "InferenceService",
        "metadata": {"name": name, "namespace": ns}, "spec": spec}))
    .expect("object");
    isvc_api(client, ns)
        .create(&PostParams::default(), &obj)
        .await
        .unwrap_or_else(|e| panic!("creating InferenceService {name}: {e}"));
}

/// A pod of InferenceService `isvc` labelled as the operator's Deployment labels it, made
/// Ready at `ip` (where a real server listens on the InferenceService's port).
pub async fn ready_pod(client: &kube::Client, ns: &str, isvc: &str, pod: &str, ip: &str) {
    let labels = json!({
        "app.kubernetes.io/managed-by": "ferrite-operator",
        "app.kubernetes.io/component": "server",
        "ferrite.dev/inferenceservice": isvc});
    ready_pod_labelled(client, ns, pod, ip, labels).await;
}

/// A pod labelled `labels`, made Ready at `ip`.
pub async fn ready_pod_labelled(
    client: &kube::Client,
    ns: &str,
    pod: &str,
    ip: &str,
    labels: Value,
) {
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let p: Pod = serde_json::from_value(json!({
        "metadata": {"name": pod, "labels": labels},
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

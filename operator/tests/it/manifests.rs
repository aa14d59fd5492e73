//! Every object the build step makes passes Kubernetes' own schemas (PyPI `kubernetes-validate`,
//! strict: unknown fields rejected) for 1.29 and 1.32, and the examples pass the generated CRD
//! schema (jsonschema), and ServiceMonitors pass the Prometheus Operator's (npm
//! `@kubernetes-models/prometheus-operator`).

use ferrite_api::crd::InferenceService;
use ferrite_operator::build::{ClusterCapabilities, Desired, build};
use ferrite_operator::config::{Dashboard, OperatorConfig};
use ferrite_testkit::kube::workspace_root;
use ferrite_testkit::validate::{custom_resources, temp_dir, validate, write_yaml};
use serde_json::{Value, json};

fn objects(d: &Desired) -> Vec<Value> {
    let mut v = vec![
        serde_json::to_value(d.deployment().expect("a Deployment")).expect("json"),
        serde_json::to_value(&d.service).expect("json"),
    ];
    v.extend(d.pdb.iter().map(|p| serde_json::to_value(p).expect("json")));
    v.extend(
        d.dashboards
            .iter()
            .map(|c| serde_json::to_value(c).expect("json")),
    );
    v
}

#[test]
fn built_objects_pass_kubernetes_schemas_strictly() {
    let config = OperatorConfig {
        dashboards: vec![Dashboard {
            name: "overview".into(),
            json: json!({"title": "Overview", "panels": []}),
        }],
        ..OperatorConfig::default()
    };
    let caps = ClusterCapabilities {
        service_monitor_crd: true,
        scaled_object_crd: false,
        leader_worker_set_crd: false,
    };
    let specs = [
        ("minimal", json!({"model": {"source": "/models/m.gguf"}})),
        (
            "ferrite-gpu-pvc",
            json!({"model": {"source": "pvc://weights/m.gguf"}, "replicas": 3,
                   "resources": {"gpus": 1, "cpu": "4", "memory": "16Gi"},
                   "runtime": {"engine": {"kvCacheMemory": "4Gi", "maxModelLen": 4096}}}),
        ),
        (
            "ferrite-hf",
            json!({"model": {"source": "hf://HuggingFaceTB/SmolLM2-135M-Instruct/model.gguf"},
                   "modelCache": {"claimName": "cache"}}),
        ),
        (
            "full",
            serde_yaml_ng::from_str::<Value>(
                &std::fs::read_to_string(workspace_root().join("examples/full.yaml"))
                    .expect("full.yaml"),
            )
            .expect("yaml")["spec"]
                .clone(),
        ),
    ];
    let dir = temp_dir("k8s");
    let mut files = Vec::new();
    for (name, spec) in specs {
        let isvc: InferenceService = serde_json::from_value(json!({
            "apiVersion": "ferrite.dev/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": name, "namespace": "ml", "uid": "u-1"}, "spec": spec,
        }))
        .expect("isvc");
        let d = build(&isvc, &config, caps).expect("build");
        files.push(write_yaml(&dir, &format!("{name}.yaml"), &objects(&d)));
    }
    for version in ["1.29.0", "1.32.0"] {
        let (ok, out) = validate("k8s", version, &files);
        assert!(ok, "{out}");
        // Deployment, Service and ConfigMap for each, PDB for the two with several replicas.
        assert_eq!(
            out.lines().filter(|l| l.starts_with("ok")).count(),
            14,
            "{out}"
        );
    }
    // The validator rejects a broken object, so the check above can fail.
    let mut broken = serde_json::to_value(
        build(
            &serde_json::from_value::<InferenceService>(json!({
                "apiVersion": "ferrite.dev/v1alpha1", "kind": "InferenceService",
                "metadata": {"name": "x", "namespace": "ml", "uid": "u"},
                "spec": {"model": {"source": "/m.gguf"}}}))
            .expect("isvc"),
            &config,
            caps,
        )
        .expect("build")
        .deployment()
        .expect("a Deployment"),
    )
    .expect("json");
    broken["spec"]["template"]["spec"]["containers"][0]["terminationGracePeriod"] = json!(3);
    let bad = write_yaml(&dir, "broken.yaml", &[broken]);
    let (ok, out) = validate("k8s", "1.32.0", &[bad]);
    assert!(!ok, "an unknown field passed strict validation: {out}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn examples_pass_the_generated_crd_schema() {
    let crd = workspace_root().join("crds/inferenceservice.yaml");
    let examples = [
        workspace_root().join("examples/minimal.yaml"),
        workspace_root().join("examples/full.yaml"),
    ];
    let (ok, out) = validate("crd", crd.to_str().expect("utf-8"), &examples);
    assert!(ok, "{out}");
    assert_eq!(
        out.lines().filter(|l| l.starts_with("ok")).count(),
        2,
        "{out}"
    );
    // A wrong type and an out-of-range value are rejected.
    let dir = temp_dir("crd");
    let bad = write_yaml(
        &dir,
        "bad.yaml",
        &[
            json!({"apiVersion": "ferrite.dev/v1alpha1", "kind": "InferenceService",
                 "metadata": {"name": "bad"},
                 "spec": {"model": {"source": "ftp://bucket/m"}, "replicas": "two",
                          "resources": {"gpus": 99}}}),
        ],
    );
    let (ok, out) = validate("crd", crd.to_str().expect("utf-8"), &[bad]);
    assert!(!ok, "{out}");
    for field in ["spec.model.source", "spec.replicas", "spec.resources.gpus"] {
        assert!(out.contains(field), "{field} not reported: {out}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Built ServiceMonitors pass `@kubernetes-models/prometheus-operator`'s validation (npm), and
/// a monitor with a malformed interval does not, so the check can fail.
#[test]
fn service_monitors_pass_the_prometheus_operator_schema() {
    let caps = ClusterCapabilities {
        service_monitor_crd: true,
        scaled_object_crd: false,
        leader_worker_set_crd: false,
    };
    let specs = [
        ("default", json!({"model": {"source": "/models/m.gguf"}})),
        (
            "tuned",
            json!({"model": {"source": "/models/m.gguf"}, "runtime": {"port": 9000},
                   "monitoring": {"serviceMonitor": {"enabled": true, "interval": "1m30s",
                                                     "labels": {"release": "kps"}}}}),
        ),
        (
            "vllm",
            json!({"model": {"source": "hf://org/m"}, "runtime": {"kind": "vllm"}}),
        ),
    ];
    let dir = temp_dir("sm");
    let mut files = Vec::new();
    let mut last = Value::Null;
    for (name, spec) in specs {
        let isvc: InferenceService = serde_json::from_value(json!({
            "apiVersion": "ferrite.dev/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": name, "namespace": "ml", "uid": "u-1"}, "spec": spec,
        }))
        .expect("isvc");
        let sm = build(&isvc, &OperatorConfig::default(), caps)
            .expect("build")
            .service_monitor
            .expect("a ServiceMonitor is wanted");
        last = serde_json::to_value(&sm).expect("json");
        let p = dir.join(format!("{name}.json"));
        std::fs::write(&p, last.to_string()).expect("write");
        files.push(p);
    }
    let (ok, out) = custom_resources(&files);
    assert!(ok, "{out}");
    assert_eq!(
        out.lines().filter(|l| l.starts_with("ok ")).count(),
        3,
        "{out}"
    );

    last["spec"]["endpoints"][0]["interval"] = json!("every minute");
    let bad = dir.join("bad.json");
    std::fs::write(&bad, last.to_string()).expect("write");
    let (ok, out) = custom_resources(&[bad]);
    assert!(!ok, "a malformed interval passed: {out}");
    assert!(out.contains("interval"), "{out}");
    let _ = std::fs::remove_dir_all(&dir);
}

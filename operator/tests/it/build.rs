//! The build step, object by object and option by option: fields, not snapshots.

use std::collections::BTreeMap;

use ferrite_api::crd::InferenceService;
use ferrite_operator::build::dashboards::dashboard_uid;
use ferrite_operator::build::{BuildError, ClusterCapabilities, Desired, build};
use ferrite_operator::config::{Dashboard, OperatorConfig};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Container, PodSpec};
use serde_json::{Value, json};

const NO_MONITOR_CRD: ClusterCapabilities = ClusterCapabilities {
    service_monitor_crd: false,
    scaled_object_crd: false,
    leader_worker_set_crd: false,
};
const MONITOR_CRD: ClusterCapabilities = ClusterCapabilities {
    service_monitor_crd: true,
    scaled_object_crd: false,
    leader_worker_set_crd: false,
};

fn isvc(spec: Value) -> InferenceService {
    serde_json::from_value(json!({
        "apiVersion": "ferrite.dev/v1alpha1", "kind": "InferenceService",
        "metadata": {"name": "chat", "namespace": "ml", "uid": "1234-abcd", "generation": 3},
        "spec": spec,
    }))
    .expect("valid InferenceService")
}

fn config() -> OperatorConfig {
    OperatorConfig {
        dashboards: vec![Dashboard {
            name: "overview".into(),
            json: json!({"uid": "ferrite-overview", "title": "Ferrite overview", "id": 7,
                         "templating": {"list": [
                             {"name": "datasource", "type": "datasource"},
                             {"name": "model_name", "type": "query"}]}}),
        }],
        ..OperatorConfig::default()
    }
}

fn built(spec: Value, caps: ClusterCapabilities) -> Desired {
    build(&isvc(spec), &config(), caps).expect("builds")
}

fn dep(d: &Desired) -> &Deployment {
    d.deployment().expect("a Deployment")
}

fn pod(d: &Desired) -> &PodSpec {
    dep(d)
        .spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .expect("pod spec")
}

fn server(d: &Desired) -> &Container {
    &pod(d).containers[0]
}

fn args(d: &Desired) -> Vec<String> {
    server(d).args.clone().expect("args")
}

/// The value after `flag` in the arguments.
fn arg(d: &Desired, flag: &str) -> Option<String> {
    let a = args(d);
    a.iter()
        .position(|x| x == flag)
        .and_then(|i| a.get(i + 1).cloned())
}

#[test]
fn minimal_ferrite_cpu_deployment() {
    let d = built(
        json!({"model": {"source": "/models/smol.gguf"}}),
        NO_MONITOR_CRD,
    );
    let dep = dep(&d);
    assert_eq!(dep.metadata.name.as_deref(), Some("chat"));
    assert_eq!(dep.metadata.namespace.as_deref(), Some("ml"));
    let owner = &dep.metadata.owner_references.as_ref().expect("owner")[0];
    assert_eq!(
        (owner.kind.as_str(), owner.name.as_str(), owner.uid.as_str()),
        ("InferenceService", "chat", "1234-abcd")
    );
    assert_eq!(owner.controller, Some(true));
    let spec = dep.spec.as_ref().expect("spec");
    assert_eq!(spec.replicas, Some(1));
    let c = server(&d);
    assert_eq!(
        c.image.as_deref(),
        Some(OperatorConfig::default().ferrite_image.as_str())
    );
    assert_eq!(arg(&d, "--model").as_deref(), Some("/models/smol.gguf"));
    assert_eq!(arg(&d, "--served-model-name").as_deref(), Some("chat"));
    assert_eq!(arg(&d, "--port").as_deref(), Some("8000"));
    assert_eq!(arg(&d, "--host").as_deref(), Some("0.0.0.0"));
    assert_eq!(arg(&d, "--shutdown-timeout").as_deref(), Some("30"));
    assert_eq!(arg(&d, "--device"), None, "CPU pods run on the CPU");
    assert_eq!(c.ports.as_ref().expect("ports")[0].container_port, 8000);

    // Probes: /health gates traffic; startup allows a long model load.
    let startup = c.startup_probe.as_ref().expect("startup probe");
    assert_eq!(
        startup.http_get.as_ref().and_then(|h| h.path.as_deref()),
        Some("/health")
    );
    let budget = startup.period_seconds.unwrap_or(10) * startup.failure_threshold.unwrap_or(3);
    assert!(budget >= 1800, "startup budget {budget}s");
    let ready = c.readiness_probe.as_ref().expect("readiness probe");
    assert_eq!(
        ready.http_get.as_ref().and_then(|h| h.path.as_deref()),
        Some("/health")
    );

    // Security: non-root, no escalation, no capabilities, read-only root (ferrite writes only
    // /tmp, an emptyDir).
    let sc = c.security_context.as_ref().expect("security context");
    assert_eq!(sc.allow_privilege_escalation, Some(false));
    assert_eq!(sc.run_as_non_root, Some(true));
    assert_eq!(sc.read_only_root_filesystem, Some(true));
    assert_eq!(
        sc.capabilities.as_ref().and_then(|c| c.drop.clone()),
        Some(vec!["ALL".to_string()])
    );
    let psc = pod(&d).security_context.as_ref().expect("pod security");
    assert_eq!(psc.run_as_non_root, Some(true));
    assert!(
        c.volume_mounts
            .as_ref()
            .expect("mounts")
            .iter()
            .any(|m| m.mount_path == "/tmp")
    );

    // Drain: the kubelet waits longer than the server's --shutdown-timeout.
    assert_eq!(pod(&d).termination_grace_period_seconds, Some(45));

    let ann = spec
        .template
        .metadata
        .as_ref()
        .and_then(|m| m.annotations.clone())
        .expect("annotations");
    assert_eq!(ann["prometheus.io/scrape"], "true");
    assert_eq!(ann["prometheus.io/port"], "8000");
    assert_eq!(ann["prometheus.io/path"], "/metrics");

    // The Service selects exactly the Deployment's pods, on the named port.
    let svc = d.service.spec.as_ref().expect("service spec");
    assert_eq!(svc.selector.as_ref(), spec.selector.match_labels.as_ref());
    let pod_labels = spec
        .template
        .metadata
        .as_ref()
        .and_then(|m| m.labels.clone())
        .expect("pod labels");
    for (k, v) in svc.selector.as_ref().expect("selector") {
        assert_eq!(pod_labels.get(k), Some(v));
    }
    assert_eq!(svc.ports.as_ref().expect("ports")[0].port, 8000);
    assert_eq!(
        d.selector,
        "app.kubernetes.io/component=server,ferrite.dev/inferenceservice=chat"
    );
    assert_eq!(d.url, "http://chat.ml.svc.cluster.local:8000");
    assert!(d.pdb.is_none(), "one replica needs no PDB");
    assert!(d.service_monitor.is_none(), "no ServiceMonitor CRD");
}

#[test]
fn engine_settings_become_flags() {
    let d = built(
        json!({"model": {"source": "/m.gguf", "servedName": "assistant"},
               "runtime": {"port": 9000, "args": ["--weights", "quantized"],
                           "engine": {"maxModelLen": 4096, "maxNumSeqs": 64, "blockSize": 32,
                                      "kvCacheMemory": "2Gi", "shutdownTimeoutSeconds": 120}}}),
        NO_MONITOR_CRD,
    );
    assert_eq!(arg(&d, "--served-model-name").as_deref(), Some("assistant"));
    assert_eq!(arg(&d, "--port").as_deref(), Some("9000"));
    assert_eq!(arg(&d, "--max-model-len").as_deref(), Some("4096"));
    assert_eq!(arg(&d, "--max-num-seqs").as_deref(), Some("64"));
    assert_eq!(arg(&d, "--block-size").as_deref(), Some("32"));
    assert_eq!(arg(&d, "--kv-cache-memory").as_deref(), Some("2147483648"));
    assert_eq!(arg(&d, "--shutdown-timeout").as_deref(), Some("120"));
    assert_eq!(pod(&d).termination_grace_period_seconds, Some(135));
    // The user's own arguments come last, so they win where the runtime takes the last value.
    assert_eq!(&args(&d)[args(&d).len() - 2..], ["--weights", "quantized"]);
    assert_eq!(d.url, "http://chat.ml.svc.cluster.local:9000");
}

#[test]
fn ferrite_on_gpus_uses_the_cuda_image_and_device() {
    let d = built(
        json!({"model": {"source": "/m.gguf"}, "resources": {"gpus": 1, "cpu": "4", "memory": "16Gi"}}),
        NO_MONITOR_CRD,
    );
    let c = server(&d);
    assert_eq!(
        c.image.as_deref(),
        Some(OperatorConfig::default().ferrite_cuda_image.as_str())
    );
    assert_eq!(arg(&d, "--device").as_deref(), Some("cuda"));
    let r = c.resources.as_ref().expect("resources");
    let limits = r.limits.as_ref().expect("limits");
    assert_eq!(limits["nvidia.com/gpu"].0, "1");
    assert_eq!(limits["cpu"].0, "4");
    assert_eq!(r.requests.as_ref().expect("requests")["memory"].0, "16Gi");
    assert!(
        !r.requests
            .as_ref()
            .expect("requests")
            .contains_key("nvidia.com/gpu"),
        "extended resources are set as limits"
    );
}

#[test]
fn vllm_gets_its_image_flags_shared_memory_and_a_writable_root() {
    let d = built(
        json!({"model": {"source": "hf://meta-llama/Llama-3.1-8B-Instruct"},
               "runtime": {"kind": "vllm", "engine": {"kvCacheMemory": "10Gi"}},
               "resources": {"gpus": 2}, "modelCache": {"claimName": "hf-cache"}}),
        NO_MONITOR_CRD,
    );
    let c = server(&d);
    assert_eq!(
        c.image.as_deref(),
        Some(OperatorConfig::default().vllm_image.as_str())
    );
    assert_eq!(
        arg(&d, "--model").as_deref(),
        Some("meta-llama/Llama-3.1-8B-Instruct")
    );
    assert_eq!(arg(&d, "--tensor-parallel-size").as_deref(), Some("2"));
    assert_eq!(
        arg(&d, "--kv-cache-memory-bytes").as_deref(),
        Some("10737418240")
    );
    assert_eq!(arg(&d, "--kv-cache-memory"), None);
    assert_eq!(arg(&d, "--shutdown-timeout"), None, "not a vLLM flag");
    let sc = c.security_context.as_ref().expect("security");
    assert_eq!(sc.read_only_root_filesystem, Some(false));
    assert_eq!(sc.run_as_non_root, Some(true));
    let mounts = c.volume_mounts.as_ref().expect("mounts");
    assert!(mounts.iter().any(|m| m.mount_path == "/dev/shm"));
    let env = c.env.as_ref().expect("env");
    assert!(
        env.iter()
            .any(|e| e.name == "HF_HOME" && e.value.as_deref() == Some("/mnt/models/hf"))
    );
    // vLLM downloads by itself, into the cache claim.
    assert!(pod(&d).init_containers.is_none());
    let vols = pod(&d).volumes.as_ref().expect("volumes");
    assert!(vols.iter().any(|v| {
        v.persistent_volume_claim
            .as_ref()
            .is_some_and(|p| p.claim_name == "hf-cache" && p.read_only == Some(false))
    }));
}

#[test]
fn pvc_models_mount_read_only() {
    let d = built(
        json!({"model": {"source": "pvc://weights/smol/model.gguf"}}),
        NO_MONITOR_CRD,
    );
    assert_eq!(
        arg(&d, "--model").as_deref(),
        Some("/mnt/models/smol/model.gguf")
    );
    let vol = pod(&d)
        .volumes
        .as_ref()
        .expect("volumes")
        .iter()
        .find(|v| v.name == "model")
        .expect("model volume");
    let pvc = vol.persistent_volume_claim.as_ref().expect("pvc");
    assert_eq!(pvc.claim_name, "weights");
    assert_eq!(pvc.read_only, Some(true));
    let m = server(&d)
        .volume_mounts
        .as_ref()
        .expect("mounts")
        .iter()
        .find(|m| m.name == "model")
        .expect("model mount");
    assert_eq!(
        (m.mount_path.as_str(), m.read_only),
        ("/mnt/models", Some(true))
    );
}

#[test]
fn remote_models_are_downloaded_by_the_runtime_into_the_cache_with_the_models_secret() {
    let d = built(
        json!({"model": {"source": "hf://meta-llama/Llama-3.2-1B@v1.0/q4.gguf",
                         "secretRef": {"name": "hf-token"}}}),
        NO_MONITOR_CRD,
    );
    // ferrite-server fetches the source as written: no init container, no image to pull.
    assert!(pod(&d).init_containers.is_none());
    assert_eq!(
        arg(&d, "--model").as_deref(),
        Some("hf://meta-llama/Llama-3.2-1B@v1.0/q4.gguf")
    );
    assert_eq!(
        arg(&d, "--termination-message-path").as_deref(),
        Some("/dev/termination-log")
    );
    let c = server(&d);
    assert_eq!(
        c.termination_message_policy.as_deref(),
        Some("FallbackToLogsOnError")
    );
    let env: BTreeMap<String, String> = c
        .env
        .iter()
        .flatten()
        .map(|e| (e.name.clone(), e.value.clone().unwrap_or_default()))
        .collect();
    assert_eq!(env["HF_HOME"], "/mnt/models/hf");
    let from = c.env_from.as_ref().expect("envFrom");
    assert_eq!(
        from[0]
            .secret_ref
            .as_ref()
            .map(|s| (s.name.as_str(), s.optional)),
        Some(("hf-token", Some(false)))
    );
    // The server writes into the cache: an emptyDir without a claim, mounted writable.
    let vol = pod(&d)
        .volumes
        .as_ref()
        .expect("volumes")
        .iter()
        .find(|v| v.name == "model")
        .expect("model volume");
    assert!(vol.empty_dir.is_some());
    let m = c
        .volume_mounts
        .iter()
        .flatten()
        .find(|m| m.name == "model")
        .expect("model mount");
    assert_eq!(m.read_only, Some(false));

    // Object stores take the same path, with the user's own envFrom after the model's Secret.
    let d = built(
        json!({"model": {"source": "s3://weights/llama/8b/", "secretRef": {"name": "s3"}},
               "modelCache": {"claimName": "cache"},
               "pod": {"envFrom": [{"configMapRef": {"name": "proxy"}}]}}),
        NO_MONITOR_CRD,
    );
    assert_eq!(
        arg(&d, "--model").as_deref(),
        Some("s3://weights/llama/8b/")
    );
    let from = server(&d).env_from.clone().expect("envFrom");
    assert_eq!(from.len(), 2);
    assert!(from[0].secret_ref.is_some() && from[1].config_map_ref.is_some());
}

#[test]
fn vllm_gets_the_revision_apart_streams_buckets_and_refuses_what_it_cannot_read() {
    let d = built(
        json!({"model": {"source": "hf://meta-llama/Llama-3.1-8B-Instruct@0e9e39f",
                         "secretRef": {"name": "hf-token"}},
               "runtime": {"kind": "vllm"}}),
        NO_MONITOR_CRD,
    );
    assert_eq!(
        arg(&d, "--model").as_deref(),
        Some("meta-llama/Llama-3.1-8B-Instruct")
    );
    assert_eq!(arg(&d, "--revision").as_deref(), Some("0e9e39f"));
    assert_eq!(
        arg(&d, "--termination-message-path"),
        None,
        "not a vLLM flag"
    );
    // The token reaches vLLM's own downloader.
    let from = server(&d).env_from.clone().expect("envFrom");
    assert_eq!(
        from[0].secret_ref.as_ref().map(|s| s.name.as_str()),
        Some("hf-token")
    );
    let d = built(
        json!({"model": {"source": "gs://weights/llama/"}, "runtime": {"kind": "vllm"}}),
        NO_MONITOR_CRD,
    );
    assert_eq!(arg(&d, "--model").as_deref(), Some("gs://weights/llama/"));
    assert_eq!(arg(&d, "--load-format").as_deref(), Some("runai_streamer"));
    for source in ["hf://org/m/model.gguf", "https://host/m.gguf"] {
        let e = build(
            &isvc(json!({"model": {"source": source}, "runtime": {"kind": "vllm"}})),
            &config(),
            NO_MONITOR_CRD,
        )
        .expect_err(source);
        assert_eq!(e.reason(), "InvalidModelSource", "{e}");
        assert!(e.to_string().contains("ferrite runtime"), "{e}");
    }
}

#[test]
fn several_replicas_get_a_disruption_budget() {
    let d = built(
        json!({"model": {"source": "/m.gguf"}, "replicas": 3}),
        NO_MONITOR_CRD,
    );
    assert_eq!(dep(&d).spec.as_ref().and_then(|s| s.replicas), Some(3));
    let pdb = d.pdb.clone().expect("PDB with 3 replicas");
    let spec = pdb.spec.expect("spec");
    assert_eq!(
        spec.max_unavailable,
        Some(k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(1))
    );
    assert_eq!(
        spec.selector.and_then(|s| s.match_labels),
        dep(&d).spec.clone().and_then(|s| s.selector.match_labels)
    );
    // Autoscaled without explicit replicas: starts at minReplicas.
    let d = built(
        json!({"model": {"source": "/m.gguf"},
               "autoscaling": {"minReplicas": 2, "maxReplicas": 5, "targets": {"queuePerReplica": 3}}}),
        NO_MONITOR_CRD,
    );
    assert_eq!(dep(&d).spec.as_ref().and_then(|s| s.replicas), Some(2));
    assert!(d.pdb.is_some());
}

#[test]
fn service_monitor_only_when_enabled_and_the_crd_exists() {
    let spec = json!({"model": {"source": "/m.gguf"},
                      "monitoring": {"serviceMonitor": {"interval": "5s", "labels": {"release": "prom"}}}});
    let sm = built(spec.clone(), MONITOR_CRD)
        .service_monitor
        .expect("monitor when the CRD exists");
    assert_eq!(
        sm.metadata.labels.as_ref().expect("labels")["release"],
        "prom"
    );
    let ep = &sm.spec.endpoints[0];
    assert_eq!(
        (ep.port.as_str(), ep.path.as_str(), ep.interval.as_str()),
        ("http", "/metrics", "5s")
    );
    let d = built(spec.clone(), MONITOR_CRD);
    let svc_labels = d.service.metadata.labels.clone().expect("service labels");
    for (k, v) in &sm.spec.selector.match_labels {
        assert_eq!(svc_labels.get(k), Some(v), "monitor selects the Service");
    }
    assert!(
        built(json!({"model": {"source": "/m.gguf"}}), NO_MONITOR_CRD)
            .service_monitor
            .is_none()
    );
    let off = json!({"model": {"source": "/m.gguf"}, "monitoring": {"serviceMonitor": {"enabled": false}}});
    assert!(built(off, MONITOR_CRD).service_monitor.is_none());
    // The operator's --monitor-label sits under the spec's labels.
    let mut cfg = config();
    cfg.monitor_labels = BTreeMap::from([
        ("release".to_string(), "kube-prometheus-stack".to_string()),
        ("tier".to_string(), "llm".to_string()),
    ]);
    let sm = build(&isvc(spec), &cfg, MONITOR_CRD)
        .expect("builds")
        .service_monitor
        .expect("monitor");
    let labels = sm.metadata.labels.expect("labels");
    assert_eq!(labels["release"], "prom", "the spec's own wins");
    assert_eq!(labels["tier"], "llm");
    let plain = build(
        &isvc(json!({"model": {"source": "/m.gguf"}})),
        &cfg,
        MONITOR_CRD,
    )
    .expect("builds")
    .service_monitor
    .expect("monitor");
    assert_eq!(
        plain.metadata.labels.expect("labels")["release"],
        "kube-prometheus-stack"
    );
}

#[test]
fn dashboards_are_personalised_config_maps_for_the_sidecar() {
    let d = built(
        json!({"model": {"source": "/m.gguf", "servedName": "assistant"},
               "monitoring": {"dashboards": {"folder": "LLM"}}}),
        NO_MONITOR_CRD,
    );
    assert_eq!(d.dashboards.len(), 1);
    let cm = &d.dashboards[0];
    assert_eq!(cm.metadata.name.as_deref(), Some("chat-dashboard-overview"));
    assert_eq!(
        cm.metadata.labels.as_ref().expect("labels")["grafana_dashboard"],
        "1"
    );
    assert_eq!(
        cm.metadata.annotations.as_ref().expect("annotations")["grafana_folder"],
        "LLM"
    );
    let json: Value =
        serde_json::from_str(&cm.data.as_ref().expect("data")["chat-overview.json"]).expect("json");
    assert_eq!(json["uid"], dashboard_uid("ml", "chat", "overview"));
    assert!(json["uid"].as_str().expect("uid").len() <= 40);
    assert_eq!(json["title"], "Ferrite overview (ml/chat)");
    assert!(json.get("id").is_none());
    assert_eq!(
        json["templating"]["list"][1]["current"]["value"],
        "assistant"
    );
    // Another resource's copy never collides.
    assert_ne!(
        dashboard_uid("ml", "chat", "overview"),
        dashboard_uid("ml", "chat2", "overview")
    );
    let off =
        json!({"model": {"source": "/m.gguf"}, "monitoring": {"dashboards": {"enabled": false}}});
    assert!(built(off, NO_MONITOR_CRD).dashboards.is_empty());
}

#[test]
fn scheduling_passes_through() {
    let d = built(
        json!({"model": {"source": "/m.gguf"},
               "scheduling": {"nodeSelector": {"gpu": "h100"},
                              "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                              "priorityClassName": "high", "runtimeClassName": "nvidia"}}),
        NO_MONITOR_CRD,
    );
    let p = pod(&d);
    assert_eq!(p.node_selector.as_ref().expect("selector")["gpu"], "h100");
    assert_eq!(
        p.tolerations.as_ref().expect("tolerations")[0]
            .key
            .as_deref(),
        Some("nvidia.com/gpu")
    );
    assert_eq!(p.priority_class_name.as_deref(), Some("high"));
    assert_eq!(p.runtime_class_name.as_deref(), Some("nvidia"));
}

#[test]
fn specs_the_schema_accepts_but_cannot_be_built_are_errors_not_panics() {
    let bad_kv = isvc(
        json!({"model": {"source": "/m.gguf"}, "runtime": {"engine": {"kvCacheMemory": "0"}}}),
    );
    assert!(matches!(
        build(&bad_kv, &config(), NO_MONITOR_CRD),
        Err(BuildError::KvCacheMemory(_))
    ));
    let bad_source = isvc(json!({"model": {"source": "pvc://claim-only"}}));
    let e = build(&bad_source, &config(), NO_MONITOR_CRD).expect_err("bad source");
    assert_eq!(e.reason(), "InvalidModelSource");
    assert!(e.to_string().contains("pvc://claim-only"), "{e}");
    let mut no_ns = isvc(json!({"model": {"source": "/m.gguf"}}));
    no_ns.metadata.namespace = None;
    assert_eq!(
        build(&no_ns, &config(), NO_MONITOR_CRD),
        Err(BuildError::MissingMetadata("namespace"))
    );
}

#[test]
fn pod_settings_reach_the_pod_and_the_selector_labels_stay_the_operators() {
    let d = built(
        json!({"model": {"source": "/adapters/m.gguf"},
               "pod": {
                   "imagePullSecrets": [{"name": "regcred"}],
                   "serviceAccountName": "chat-sa",
                   "automountServiceAccountToken": true,
                   "labels": {"kueue.x-k8s.io/queue-name": "gpu", "app.kubernetes.io/name": "mine"},
                   "annotations": {"prometheus.io/scrape": "false", "team": "ml"},
                   "volumes": [{"name": "adapters", "persistentVolumeClaim": {"claimName": "lora"}}],
                   "volumeMounts": [{"name": "adapters", "mountPath": "/adapters"}],
                   "envFrom": [{"secretRef": {"name": "hf"}}],
                   "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "zone",
                                                  "whenUnsatisfiable": "DoNotSchedule"}],
                   "schedulerName": "volcano",
                   "terminationGracePeriodSeconds": 120,
                   "probes": {"startup": {"failureThreshold": 720},
                              "readiness": {"periodSeconds": 2, "successThreshold": 2},
                              "liveness": {"timeoutSeconds": 30, "initialDelaySeconds": 5}}}}),
        NO_MONITOR_CRD,
    );
    let p = pod(&d);
    assert_eq!(
        p.image_pull_secrets.as_ref().expect("secrets")[0].name,
        "regcred"
    );
    assert_eq!(p.service_account_name.as_deref(), Some("chat-sa"));
    assert_eq!(p.automount_service_account_token, Some(true));
    assert_eq!(p.scheduler_name.as_deref(), Some("volcano"));
    assert_eq!(p.termination_grace_period_seconds, Some(120));
    assert_eq!(
        p.topology_spread_constraints.as_ref().map(Vec::len),
        Some(1)
    );
    let volumes = p.volumes.as_ref().expect("volumes");
    assert!(
        volumes.iter().any(|v| v.name == "tmp"),
        "the operator's stay"
    );
    assert!(volumes.iter().any(|v| v.name == "adapters"));
    let c = server(&d);
    let mounts = c.volume_mounts.as_ref().expect("mounts");
    assert!(
        mounts
            .iter()
            .any(|m| m.name == "adapters" && m.mount_path == "/adapters")
    );
    assert_eq!(
        c.env_from.as_ref().expect("envFrom")[0]
            .secret_ref
            .as_ref()
            .map(|s| s.name.as_str()),
        Some("hf")
    );
    let startup = c.startup_probe.as_ref().expect("startup");
    assert_eq!(
        (startup.period_seconds, startup.failure_threshold),
        (Some(10), Some(720))
    );
    let readiness = c.readiness_probe.as_ref().expect("readiness");
    assert_eq!(
        (
            readiness.period_seconds,
            readiness.failure_threshold,
            readiness.success_threshold
        ),
        (Some(2), Some(3), Some(2))
    );
    let liveness = c.liveness_probe.as_ref().expect("liveness");
    assert_eq!(
        (
            liveness.timeout_seconds,
            liveness.initial_delay_seconds,
            liveness.period_seconds
        ),
        (Some(30), Some(5), Some(10))
    );
    let meta = dep(&d)
        .spec
        .as_ref()
        .and_then(|s| s.template.metadata.as_ref())
        .expect("template metadata");
    let labels = meta.labels.as_ref().expect("labels");
    assert_eq!(labels["kueue.x-k8s.io/queue-name"], "gpu");
    assert_eq!(
        labels["app.kubernetes.io/name"], "mine",
        "the user's label wins"
    );
    assert_eq!(labels["ferrite.dev/inferenceservice"], "chat");
    assert_eq!(labels["app.kubernetes.io/component"], "server");
    let annotations = meta.annotations.as_ref().expect("annotations");
    assert_eq!(
        annotations["prometheus.io/scrape"], "false",
        "the user's annotation wins"
    );
    assert_eq!(annotations["team"], "ml");
    // Without pod settings: no token, the derived grace period, the default probes.
    let plain = built(json!({"model": {"source": "/m.gguf"}}), NO_MONITOR_CRD);
    assert_eq!(pod(&plain).automount_service_account_token, Some(false));
    assert_eq!(pod(&plain).termination_grace_period_seconds, Some(45));
    assert_eq!(pod(&plain).service_account_name, None);
    let r = server(&plain).readiness_probe.as_ref().expect("readiness");
    assert_eq!(
        (r.period_seconds, r.failure_threshold, r.timeout_seconds),
        (Some(5), Some(3), Some(5))
    );
}

#[test]
fn requests_and_limits_apart_ephemeral_storage_and_other_gpu_resources() {
    let d = built(
        json!({"model": {"source": "/m.gguf"},
               "resources": {"gpus": 2, "gpuResourceName": "amd.com/gpu",
                             "cpu": "4", "memory": "16Gi", "ephemeralStorage": "20Gi",
                             "requests": {"cpu": "2"}, "limits": {"memory": "24Gi"}}}),
        NO_MONITOR_CRD,
    );
    let r = server(&d).resources.clone().expect("resources");
    let (requests, limits) = (r.requests.expect("requests"), r.limits.expect("limits"));
    assert_eq!(requests["cpu"].0, "2", "requests.cpu wins over cpu");
    assert_eq!(limits["cpu"].0, "4");
    assert_eq!(requests["memory"].0, "16Gi");
    assert_eq!(limits["memory"].0, "24Gi", "limits.memory wins over memory");
    assert_eq!(requests["ephemeral-storage"].0, "20Gi");
    assert_eq!(limits["ephemeral-storage"].0, "20Gi");
    assert_eq!(limits["amd.com/gpu"].0, "2");
    assert!(!limits.contains_key("nvidia.com/gpu"));
    // MIG: one slice.
    let mig = built(
        json!({"model": {"source": "/m.gguf"},
               "resources": {"gpus": 1, "gpuResourceName": "nvidia.com/mig-1g.10gb"}}),
        NO_MONITOR_CRD,
    );
    let limits = server(&mig)
        .resources
        .clone()
        .and_then(|r| r.limits)
        .expect("limits");
    assert_eq!(limits["nvidia.com/mig-1g.10gb"].0, "1");
}

#[test]
fn requests_above_limits_and_split_gpu_requests_are_refused_with_the_reason() {
    for (resources, says) in [
        (
            json!({"requests": {"cpu": "8"}, "limits": {"cpu": "4"}}),
            "the cpu limit 4 is below its request 8",
        ),
        (
            json!({"memory": "16Gi", "limits": {"memory": "8Gi"}}),
            "the memory limit 8Gi is below its request 16Gi",
        ),
        (
            json!({"gpus": 2, "requests": {"nvidia.com/gpu": "1"}}),
            "an extended resource's request must equal its limit",
        ),
        (
            json!({"requests": {"cpu": "lots"}}),
            "request cpu: \"lots\" is not a quantity",
        ),
    ] {
        let e = build(
            &isvc(json!({"model": {"source": "/m.gguf"}, "resources": resources})),
            &config(),
            NO_MONITOR_CRD,
        )
        .expect_err("refused");
        assert_eq!(e.reason(), "InvalidResources", "{e}");
        assert!(e.to_string().contains(says), "{e}");
    }
    // Equal request and limit, and 500m under 1, are fine.
    built(
        json!({"model": {"source": "/m.gguf"},
               "resources": {"requests": {"cpu": "500m"}, "limits": {"cpu": "1"}}}),
        NO_MONITOR_CRD,
    );
}

#[test]
fn mounts_over_the_operators_paths_are_refused() {
    for path in ["/tmp", "/mnt/models", "/mnt/models/sub", "/dev/shm/"] {
        let e = build(
            &isvc(json!({"model": {"source": "/m.gguf"},
                         "pod": {"volumes": [{"name": "v", "emptyDir": {}}],
                                 "volumeMounts": [{"name": "v", "mountPath": path}]}})),
            &config(),
            NO_MONITOR_CRD,
        )
        .expect_err(path);
        assert_eq!(e.reason(), "InvalidPodSettings", "{e}");
        assert!(e.to_string().contains("the operator's mount point"), "{e}");
    }
    // A mount must name one of the spec's volumes.
    let e = build(
        &isvc(json!({"model": {"source": "/m.gguf"},
                     "pod": {"volumes": [{"name": "weights", "emptyDir": {}}],
                             "volumeMounts": [{"name": "wieghts", "mountPath": "/weights"}]}})),
        &config(),
        NO_MONITOR_CRD,
    )
    .expect_err("unknown volume");
    assert!(e.to_string().contains("\"wieghts\" names no volume"), "{e}");
    // A sibling path is fine.
    built(
        json!({"model": {"source": "/m.gguf"},
               "pod": {"volumes": [{"name": "v", "emptyDir": {}}],
                       "volumeMounts": [{"name": "v", "mountPath": "/mnt/modelsextra"}]}}),
        NO_MONITOR_CRD,
    );
}

#[test]
fn rollouts_default_to_no_spare_gpu_and_follow_the_spec() {
    let strategy = |spec: Value| {
        let d = built(spec, NO_MONITOR_CRD);
        let s = dep(&d)
            .spec
            .clone()
            .and_then(|s| s.strategy)
            .expect("strategy");
        let ru = s.rolling_update.map(|r| {
            (
                serde_json::to_value(r.max_surge).expect("json"),
                serde_json::to_value(r.max_unavailable).expect("json"),
            )
        });
        (s.type_.expect("type"), ru)
    };
    let rolling = |surge: Value, unavailable: Value| {
        ("RollingUpdate".to_string(), Some((surge, unavailable)))
    };
    // CPU: a surge pod first, no capacity lost.
    assert_eq!(
        strategy(json!({"model": {"source": "/m.gguf"}})),
        rolling(json!(1), json!(0))
    );
    // GPU: stop one, then start its successor; no spare GPU needed.
    assert_eq!(
        strategy(json!({"model": {"source": "/m.gguf"}, "resources": {"gpus": 1}})),
        rolling(json!(0), json!(1))
    );
    assert_eq!(
        strategy(
            json!({"model": {"source": "/m.gguf"}, "resources": {"gpus": 1},
                        "rollout": {"strategy": "Recreate"}})
        ),
        ("Recreate".to_string(), None)
    );
    // One bound given: the other is 0, or 1 when the given one is 0.
    assert_eq!(
        strategy(
            json!({"model": {"source": "/m.gguf"}, "resources": {"gpus": 1},
                        "rollout": {"maxSurge": "25%"}})
        ),
        rolling(json!("25%"), json!(0))
    );
    assert_eq!(
        strategy(json!({"model": {"source": "/m.gguf"}, "rollout": {"maxSurge": 0}})),
        rolling(json!(0), json!(1))
    );
    assert_eq!(
        strategy(json!({"model": {"source": "/m.gguf"},
                        "rollout": {"maxSurge": 2, "maxUnavailable": "50%"}})),
        rolling(json!(2), json!("50%"))
    );
    let e = build(
        &isvc(json!({"model": {"source": "/m.gguf"},
                     "rollout": {"maxSurge": 0, "maxUnavailable": "0%"}})),
        &config(),
        NO_MONITOR_CRD,
    )
    .expect_err("stuck rollout");
    assert_eq!(e.reason(), "InvalidRollout");
    let e = build(
        &isvc(json!({"model": {"source": "/m.gguf"}, "rollout": {"maxSurge": "2"}})),
        &config(),
        NO_MONITOR_CRD,
    )
    .expect_err("a quoted number");
    assert!(e.to_string().contains("not a number in quotes"), "{e}");
}

/// `spec.auth`: the server gets its API key from the Secret as the variable its runtime reads
/// for `--api-key`, never in its arguments (which `kubectl get pod` shows); the pod also
/// answers to its `namespace/name`, the router's unambiguous id for it.
#[test]
fn an_api_key_comes_from_its_secret_never_the_arguments() {
    for (kind, var, key) in [
        ("ferrite", "FERRITE_API_KEY", None),
        ("vllm", "VLLM_API_KEY", Some("token")),
    ] {
        let mut secret = json!({"name": "chat-keys"});
        if let Some(k) = key {
            secret["key"] = json!(k);
        }
        let d = built(
            json!({"model": {"source": "/models/smol.gguf"}, "runtime": {"kind": kind},
                   "auth": {"apiKeySecretRef": secret}}),
            NO_MONITOR_CRD,
        );
        let c = server(&d);
        let env = c.env.as_ref().expect("env");
        let from = env
            .iter()
            .find(|e| e.name == var)
            .and_then(|e| e.value_from.as_ref()?.secret_key_ref.as_ref())
            .unwrap_or_else(|| panic!("{kind}: no {var} from a Secret: {env:?}"));
        assert_eq!(from.name, "chat-keys");
        assert_eq!(from.key, key.unwrap_or("api-key"));
        let a = args(&d);
        assert!(!a.iter().any(|x| x.contains("api-key")), "{kind}: {a:?}");
        let names = a
            .iter()
            .position(|x| x == "--served-model-name")
            .expect("names");
        assert_eq!(a[names + 1], "chat");
        assert_eq!(a[names + 2], "ml/chat");
    }
    let none = built(
        json!({"model": {"source": "/models/smol.gguf"}}),
        NO_MONITOR_CRD,
    );
    let env = server(&none).env.clone().unwrap_or_default();
    assert!(!env.iter().any(|e| e.name.ends_with("API_KEY")), "{env:?}");
}

#[test]
fn a_network_policy_admits_only_the_configured_peers_to_the_pods_port() {
    let spec = json!({"model": {"source": "/m.gguf"}, "runtime": {"port": 9000}});
    assert!(
        built(spec.clone(), NO_MONITOR_CRD).network_policy.is_none(),
        "only when the operator is configured to make them"
    );
    let router: k8s_openapi::api::networking::v1::NetworkPolicyPeer =
        serde_json::from_value(json!({
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ferrite-system"}},
            "podSelector": {"matchLabels": {"app.kubernetes.io/name": "ferrite-router"}}}))
        .expect("peer");
    let with = |peers| OperatorConfig {
        network_policy_peers: Some(peers),
        ..config()
    };
    let d = build(
        &isvc(spec.clone()),
        &with(vec![router.clone()]),
        NO_MONITOR_CRD,
    )
    .expect("builds");
    let policy = d.network_policy.clone().expect("a NetworkPolicy");
    assert_eq!(policy.metadata.name.as_deref(), Some("chat"));
    assert_eq!(policy.metadata.namespace.as_deref(), Some("ml"));
    assert_eq!(
        policy.metadata.owner_references.expect("owned")[0].uid,
        "1234-abcd"
    );
    let spec_ = policy.spec.expect("spec");
    assert_eq!(
        spec_.pod_selector.and_then(|s| s.match_labels),
        dep(&d).spec.clone().and_then(|s| s.selector.match_labels),
        "the InferenceService's pods"
    );
    let rule = &spec_.ingress.expect("ingress")[0];
    assert_eq!(rule.from.as_deref(), Some(&[router][..]));
    assert_eq!(
        rule.ports.as_ref().expect("ports")[0].port,
        Some(k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(9000))
    );
    // No peers: no rule at all (an empty `from` would admit everyone), so nothing connects.
    let closed = build(&isvc(spec), &with(Vec::new()), NO_MONITOR_CRD)
        .expect("builds")
        .network_policy
        .expect("a NetworkPolicy");
    let closed = closed.spec.expect("spec");
    assert_eq!(closed.ingress, Some(Vec::new()));
    assert_eq!(closed.policy_types, Some(vec!["Ingress".to_string()]));
}

/// With `--router-service-account`, a service with `spec.auth` grants the router `get` on its
/// key's Secret and nothing else; a service without one grants nothing.
#[test]
fn a_router_is_granted_only_the_secret_spec_auth_names() {
    let router = OperatorConfig {
        router_service_account: Some("ferrite-system/ferrite-router".parse().expect("a ref")),
        ..config()
    };
    let plain = json!({"model": {"source": "/m.gguf"}});
    assert!(
        build(&isvc(plain), &router, NO_MONITOR_CRD)
            .expect("builds")
            .router_key
            .is_none()
    );
    let guarded = json!({"model": {"source": "/m.gguf"},
                         "auth": {"apiKeySecretRef": {"name": "chat-key", "key": "k"}}});
    assert!(
        built(guarded.clone(), NO_MONITOR_CRD).router_key.is_none(),
        "only when the operator is told the router's account"
    );
    let (role, binding) = build(&isvc(guarded), &router, NO_MONITOR_CRD)
        .expect("builds")
        .router_key
        .expect("a grant");
    for meta in [&role.metadata, &binding.metadata] {
        assert_eq!(meta.name.as_deref(), Some("chat-router-key"));
        assert_eq!(meta.namespace.as_deref(), Some("ml"));
        assert_eq!(
            meta.owner_references.as_ref().expect("owned")[0].uid,
            "1234-abcd"
        );
    }
    let rules = role.rules.expect("rules");
    assert_eq!(rules.len(), 1);
    assert_eq!(rules[0].api_groups, Some(vec![String::new()]));
    assert_eq!(rules[0].resources, Some(vec!["secrets".to_string()]));
    assert_eq!(rules[0].resource_names, Some(vec!["chat-key".to_string()]));
    assert_eq!(rules[0].verbs, ["get"]);
    assert_eq!(binding.role_ref.kind, "Role");
    assert_eq!(binding.role_ref.name, "chat-router-key");
    let subject = &binding.subjects.expect("subjects")[0];
    assert_eq!(
        (
            subject.kind.as_str(),
            subject.name.as_str(),
            subject.namespace.as_deref()
        ),
        ("ServiceAccount", "ferrite-router", Some("ferrite-system"))
    );
    for bad in ["ferrite-router", "/x", "ns/", "a/b/c"] {
        assert!(
            bad.parse::<ferrite_operator::config::ServiceAccountRef>()
                .is_err(),
            "{bad}"
        );
    }
}

#[test]
fn model_sha256_reaches_ferrite_server_and_vllm_is_refused() {
    let sha = "0123456789abcdef".repeat(4);
    let d = built(
        json!({"model": {"source": "https://models.example/smol.gguf", "sha256": sha}}),
        NO_MONITOR_CRD,
    );
    assert_eq!(arg(&d, "--model-sha256").as_deref(), Some(sha.as_str()));
    assert_eq!(
        arg(
            &built(json!({"model": {"source": "/m.gguf"}}), NO_MONITOR_CRD),
            "--model-sha256"
        ),
        None
    );
    let vllm = isvc(json!({"model": {"source": "hf://org/model", "sha256": sha},
                           "runtime": {"kind": "vllm"}}));
    let e = build(&vllm, &config(), NO_MONITOR_CRD).expect_err("vLLM cannot check it");
    assert_eq!(e.reason(), "InvalidModelSource");
    assert!(e.to_string().contains("model.sha256"), "{e}");
}

/// LoRA: the limits become flags and runtime updates are allowed; the adapters themselves stay
/// out of the pod template (the operator loads them through the API), except the claims and
/// Secrets their sources need.
#[test]
fn lora_limits_reach_the_pods_and_the_adapter_list_stays_out_of_the_template() {
    let two = json!({"model": {"source": "/m.gguf", "adapters": [
        {"name": "sql", "source": "pvc://adapters/sql"},
        {"name": "tone", "source": "hf://org/tone-lora", "secretRef": {"name": "hf"}}],
        "lora": {"maxAdapters": 2, "maxRank": 64}}});
    let d = built(two.clone(), NO_MONITOR_CRD);
    assert_eq!(arg(&d, "--max-loras").as_deref(), Some("2"));
    assert_eq!(arg(&d, "--max-lora-rank").as_deref(), Some("64"));
    assert_eq!(arg(&d, "--max-cpu-loras").as_deref(), Some("16"));
    assert!(args(&d).contains(&"--enable-lora".to_string()));
    assert!(
        !args(&d)
            .iter()
            .any(|a| a.contains("sql") || a.contains("tone"))
    );
    let c = server(&d);
    let env = c.env.clone().unwrap_or_default();
    assert!(env.iter().any(
        |e| e.name == "VLLM_ALLOW_RUNTIME_LORA_UPDATING" && e.value.as_deref() == Some("True")
    ));
    let mounts = c.volume_mounts.clone().unwrap_or_default();
    let m = mounts
        .iter()
        .find(|m| m.mount_path == "/mnt/adapters/adapters")
        .expect("the adapter claim is mounted");
    assert_eq!(m.read_only, Some(true));
    let from = c.env_from.clone().unwrap_or_default();
    assert_eq!(
        from.iter()
            .filter_map(|f| f.secret_ref.as_ref().map(|s| s.name.as_str()))
            .collect::<Vec<_>>(),
        ["hf"]
    );
    // Another adapter from the same claim, one removed: the same pod template.
    let edited = json!({"model": {"source": "/m.gguf", "adapters": [
        {"name": "sql-v2", "source": "pvc://adapters/sql-v2"},
        {"name": "tone", "source": "hf://org/tone-lora", "secretRef": {"name": "hf"}}],
        "lora": {"maxAdapters": 2, "maxRank": 64}}});
    let template = |d: &Desired| dep(d).spec.as_ref().map(|s| s.template.clone());
    assert_eq!(template(&built(edited, NO_MONITOR_CRD)), template(&d));
    // `lora: {}` keeps LoRA on with no adapter, with the same flags as one adapter.
    let empty = built(
        json!({"model": {"source": "/m.gguf", "lora": {}}}),
        NO_MONITOR_CRD,
    );
    let one = built(
        json!({"model": {"source": "/m.gguf", "lora": {},
            "adapters": [{"name": "a", "source": "/adapters/a"}]}}),
        NO_MONITOR_CRD,
    );
    assert_eq!(template(&empty), template(&one));
    assert!(args(&empty).contains(&"--enable-lora".to_string()));
    // No LoRA at all: no flag, no variable.
    let plain = built(json!({"model": {"source": "/m.gguf"}}), NO_MONITOR_CRD);
    assert!(!args(&plain).iter().any(|a| a.contains("lora")));
}

#[test]
fn adapters_a_runtime_cannot_load_are_refused_with_the_reason() {
    let refused = |spec: Value| {
        let e = build(&isvc(spec), &config(), NO_MONITOR_CRD).expect_err("refused");
        assert_eq!(e.reason(), "InvalidAdapter", "{e}");
        e.to_string()
    };
    let vllm_s3 = refused(json!({"model": {"source": "hf://org/base",
        "adapters": [{"name": "a", "source": "s3://bucket/a/"}]}, "runtime": {"kind": "vllm"}}));
    assert!(vllm_s3.contains("s3://"), "{vllm_s3}");
    let vllm_rev = refused(json!({"model": {"source": "hf://org/base",
        "adapters": [{"name": "a", "source": "hf://org/a@v2"}]}, "runtime": {"kind": "vllm"}}));
    assert!(vllm_rev.contains("revision"), "{vllm_rev}");
    let vllm_rank = refused(
        json!({"model": {"source": "hf://org/base", "lora": {"maxRank": 20}},
        "runtime": {"kind": "vllm"}}),
    );
    assert!(vllm_rank.contains("maxRank 20"), "{vllm_rank}");
    // More adapters than a replica keeps in memory: the runtime pages them.
    let paged = json!({"model": {"source": "/m.gguf", "lora": {"maxCpuAdapters": 1},
        "adapters": [{"name": "a", "source": "/a"}, {"name": "b", "source": "/b"}]}});
    build(&isvc(paged), &config(), NO_MONITOR_CRD).expect("paged adapters");
    let same_name = refused(json!({"model": {"source": "/m.gguf",
        "adapters": [{"name": "chat", "source": "/a"}]}}));
    assert!(same_name.contains("served name"), "{same_name}");
    let twice = refused(json!({"model": {"source": "/m.gguf",
        "adapters": [{"name": "a", "source": "/a"}, {"name": "a", "source": "/b"}]}}));
    assert!(twice.contains("twice"), "{twice}");
    let bad = refused(json!({"model": {"source": "/m.gguf",
        "adapters": [{"name": "a", "source": "pvc://claim-only"}]}}));
    assert!(bad.contains("pvc://claim-only"), "{bad}");
    // vLLM loads a path, a claim and a whole repository; ferrite every form.
    let ok = json!({"model": {"source": "hf://org/base", "adapters": [
        {"name": "a", "source": "/a"}, {"name": "b", "source": "pvc://c/b"},
        {"name": "c", "source": "hf://org/c"}]}, "runtime": {"kind": "vllm"}});
    build(&isvc(ok), &config(), NO_MONITOR_CRD).expect("vLLM adapters");
    let ok = json!({"model": {"source": "/m.gguf", "adapters": [
        {"name": "a", "source": "s3://b/a/"}, {"name": "b", "source": "hf://org/b@v2/x.gguf"},
        {"name": "c", "source": "https://h/a.gguf"}]}});
    build(&isvc(ok), &config(), NO_MONITOR_CRD).expect("ferrite adapters");
}

/// `spec.parallelism` for vLLM: the pod's GPUs follow it (all of a replica's unless
/// `resources.gpus` says), vLLM gets each size above 1 and expert parallelism as flags; what
/// cannot run is refused with a message that says why: ferrite-server, GPUs left idle, pods
/// that do not divide the replica, data parallelism across pods, a replica of more than one
/// pod's GPUs without `resources.gpus`, or of more than 64 pods.
#[test]
fn parallelism_sets_vllms_flags_and_the_pods_gpus_or_is_refused() {
    let vllm = |parallelism: Value, gpus: Option<i32>| {
        let mut spec = json!({"model": {"source": "hf://org/big"}, "runtime": {"kind": "vllm"},
                              "parallelism": parallelism});
        if let Some(g) = gpus {
            spec["resources"] = json!({"gpus": g});
        }
        spec
    };
    let d = built(
        vllm(json!({"tensor": 4, "pipeline": 2, "expert": true}), None),
        NO_MONITOR_CRD,
    );
    assert_eq!(arg(&d, "--tensor-parallel-size").as_deref(), Some("4"));
    assert_eq!(arg(&d, "--pipeline-parallel-size").as_deref(), Some("2"));
    assert_eq!(arg(&d, "--data-parallel-size"), None, "1 is vLLM's default");
    assert!(args(&d).iter().any(|a| a == "--enable-expert-parallel"));
    let limits = server(&d)
        .resources
        .as_ref()
        .and_then(|r| r.limits.clone())
        .expect("limits");
    assert_eq!(limits["nvidia.com/gpu"].0, "8", "tensor × pipeline");
    // Data parallelism on GPUs the spec counts itself.
    let d = built(
        vllm(json!({"tensor": 2, "data": 2}), Some(4)),
        NO_MONITOR_CRD,
    );
    assert_eq!(arg(&d, "--data-parallel-size").as_deref(), Some("2"));
    assert_eq!(arg(&d, "--tensor-parallel-size").as_deref(), Some("2"));

    let refused = |spec: Value| {
        let e = build(&isvc(spec), &config(), NO_MONITOR_CRD).expect_err("refused");
        assert_eq!(e.reason(), "InvalidParallelism", "{e}");
        e.to_string()
    };
    let ferrite = refused(
        json!({"model": {"source": "/m.gguf"}, "parallelism": {"tensor": 2},
                                 "resources": {"gpus": 2}}),
    );
    assert!(
        ferrite.contains("ferrite-server runs a model on one device"),
        "{ferrite}"
    );
    let idle = refused(vllm(json!({"tensor": 2}), Some(4)));
    assert!(idle.contains("would leave 2 idle"), "{idle}");
    let uneven = refused(vllm(json!({"tensor": 3, "pipeline": 2}), Some(4)));
    assert!(uneven.contains("does not split into pods"), "{uneven}");
    let data = refused(vllm(json!({"tensor": 8, "data": 2}), Some(8)));
    assert!(data.contains("data 2 across 2 pods"), "{data}");
    let huge = refused(vllm(json!({"tensor": 8, "pipeline": 4}), None));
    assert!(
        huge.contains("needs 32 GPUs") && huge.contains("set resources.gpus"),
        "{huge}"
    );
    let wide = refused(vllm(json!({"tensor": 64, "pipeline": 2}), Some(1)));
    assert!(wide.contains("at most 64 pods"), "{wide}");
    // All sizes 1 is no parallelism, for either runtime.
    let d = built(
        json!({"model": {"source": "/m.gguf"}, "parallelism": {"tensor": 1}}),
        NO_MONITOR_CRD,
    );
    assert!(
        server(&d)
            .resources
            .as_ref()
            .and_then(|r| r.limits.as_ref())
            .is_none_or(|l| !l.contains_key("nvidia.com/gpu"))
    );
}

/// A replica over several pods is a LeaderWorkerSet of groups, where the operator may write
/// them and LWS is installed: groups of `GPUs a replica / resources.gpus` pods, the leader
/// the server pod with vLLM's multi-node start before `vllm serve` on the Ray backend, workers
/// joining its Ray cluster with the same pod and no probes, ports or API key; the Service,
/// status selector and the autoscaler see leaders only, the budget and NetworkPolicy every
/// pod, which may reach each other. Elsewhere the spec is refused with what to install.
#[test]
fn a_replica_across_pods_is_a_leader_worker_set_of_groups() {
    let spec = |extra: Value| {
        let mut s = json!({"model": {"source": "hf://org/big"}, "runtime": {"kind": "vllm"},
                           "parallelism": {"tensor": 8, "pipeline": 2},
                           "resources": {"gpus": 8}, "replicas": 3,
                           "auth": {"apiKeySecretRef": {"name": "keys"}}});
        if let (Some(s), Some(extra)) = (s.as_object_mut(), extra.as_object()) {
            s.extend(extra.clone());
        }
        isvc(s)
    };
    let caps = |installed| ClusterCapabilities {
        leader_worker_set_crd: installed,
        ..NO_MONITOR_CRD
    };
    let allowed = OperatorConfig {
        leader_worker_sets: true,
        network_policy_peers: Some(Vec::new()),
        ..config()
    };
    let e = build(&spec(json!({})), &config(), caps(true)).expect_err("not enabled");
    assert_eq!(e.reason(), "LeaderWorkerSetNotEnabled", "{e}");
    assert!(
        e.to_string().contains("leaderWorkerSet.enabled") && e.to_string().contains("2 pods"),
        "{e}"
    );
    let e = build(&spec(json!({})), &allowed, caps(false)).expect_err("not installed");
    assert_eq!(e.reason(), "LeaderWorkerSetNotInstalled", "{e}");
    assert!(e.to_string().contains("install LeaderWorkerSet"), "{e}");

    let d = build(&spec(json!({})), &allowed, caps(true)).expect("builds");
    assert!(d.deployment().is_none());
    let g = serde_json::to_value(d.groups().expect("a LeaderWorkerSet")).expect("json");
    assert_eq!(g["apiVersion"], "leaderworkerset.x-k8s.io/v1");
    assert_eq!(g["metadata"]["name"], "chat");
    assert_eq!(
        g["metadata"]["ownerReferences"][0]["kind"],
        "InferenceService"
    );
    assert_eq!(g["spec"]["replicas"], 3);
    assert_eq!(g["spec"]["startupPolicy"], "LeaderCreated");
    let t = &g["spec"]["leaderWorkerTemplate"];
    assert_eq!(t["size"], 2);
    assert_eq!(t["restartPolicy"], "RecreateGroupOnPodRestart");
    assert_eq!(
        g["spec"]["rolloutStrategy"],
        json!({"type": "RollingUpdate",
               "rollingUpdateConfiguration": {"maxSurge": 0, "maxUnavailable": 1}}),
        "GPU pods: no spare group"
    );
    let (leader, worker) = (&t["leaderTemplate"], &t["workerTemplate"]);
    let label = |p: &Value, k: &str| p["metadata"]["labels"][k].clone();
    assert_eq!(label(leader, "app.kubernetes.io/component"), "server");
    assert_eq!(label(worker, "app.kubernetes.io/component"), "worker");
    for p in [leader, worker] {
        assert_eq!(label(p, "ferrite.dev/inferenceservice"), "chat");
        assert_eq!(label(p, "app.kubernetes.io/managed-by"), "ferrite-operator");
    }
    assert_eq!(
        leader["metadata"]["annotations"]["prometheus.io/scrape"],
        "true"
    );
    assert!(worker["metadata"]["annotations"]["prometheus.io/scrape"].is_null());
    let (lc, wc) = (
        &leader["spec"]["containers"][0],
        &worker["spec"]["containers"][0],
    );
    let command = lc["command"].as_array().expect("leader command");
    assert_eq!(command[..2], [json!("/bin/sh"), json!("-c")]);
    let script = command[2].as_str().expect("script");
    assert!(
        script.starts_with(
            "bash /vllm-workspace/examples/online_serving/multi-node-serving.sh leader \
             --ray_cluster_size=\"$LWS_GROUP_SIZE\" && exec vllm serve \"$@\""
        ),
        "{script}"
    );
    ferrite_testkit::chart::assert_flag_values(
        lc,
        &[
            ["--tensor-parallel-size", "8"],
            ["--pipeline-parallel-size", "2"],
            ["--distributed-executor-backend", "ray"],
        ],
    );
    assert!(
        wc["command"][2]
            .as_str()
            .is_some_and(|c| c.contains("worker --ray_address=\"$LWS_LEADER_ADDRESS\"")),
        "{wc}"
    );
    assert!(wc["args"].is_null());
    for c in [lc, wc] {
        assert_eq!(c["resources"]["limits"]["nvidia.com/gpu"], "8");
        assert_eq!(c["image"], lc["image"]);
        assert_eq!(c["securityContext"]["runAsNonRoot"], true);
        assert_eq!(c["securityContext"]["capabilities"]["drop"], json!(["ALL"]));
    }
    assert_eq!(leader["spec"]["volumes"], worker["spec"]["volumes"]);
    assert!(lc["readinessProbe"].is_object() && lc["livenessProbe"].is_object());
    for probe in ["startupProbe", "readinessProbe", "livenessProbe", "ports"] {
        assert!(wc[probe].is_null(), "a worker has no {probe}: {wc}");
    }
    let env_names = |c: &Value| -> Vec<String> {
        c["env"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|e| e["name"].as_str().map(String::from))
            .collect()
    };
    assert!(env_names(lc).contains(&"VLLM_API_KEY".to_string()));
    assert!(
        !env_names(wc).contains(&"VLLM_API_KEY".to_string()),
        "the key stays on the leader"
    );

    // Leaders alone serve: the Service and status.selector; a group is down when any pod is.
    let svc = d
        .service
        .spec
        .as_ref()
        .and_then(|s| s.selector.clone())
        .expect("selector");
    assert_eq!(svc["app.kubernetes.io/component"], "server");
    assert_eq!(
        d.selector,
        "app.kubernetes.io/component=server,ferrite.dev/inferenceservice=chat"
    );
    let pdb = serde_json::to_value(d.pdb.as_ref().expect("a budget")).expect("json");
    assert_eq!(
        pdb["spec"]["selector"]["matchLabels"],
        json!({"ferrite.dev/inferenceservice": "chat"})
    );
    let np = serde_json::to_value(d.network_policy.as_ref().expect("a policy")).expect("json");
    assert_eq!(
        np["spec"]["podSelector"]["matchLabels"],
        json!({"ferrite.dev/inferenceservice": "chat"})
    );
    assert_eq!(
        np["spec"]["ingress"],
        json!([{"from": [{"podSelector": {"matchLabels": {"ferrite.dev/inferenceservice": "chat"}}}]}]),
        "no peers: only the group's own pods reach it"
    );

    // Rollouts in groups: the spec's surge, and Recreate as every group at once.
    let rollout = |r: Value| {
        let d = build(&spec(json!({"rollout": r})), &allowed, caps(true)).expect("builds");
        serde_json::to_value(d.groups().expect("groups")).expect("json")["spec"]["rolloutStrategy"]
            ["rollingUpdateConfiguration"]
            .clone()
    };
    assert_eq!(
        rollout(json!({"maxSurge": 1})),
        json!({"maxSurge": 1, "maxUnavailable": 0})
    );
    assert_eq!(
        rollout(json!({"strategy": "Recreate"})),
        json!({"maxSurge": 0, "maxUnavailable": "100%"})
    );
    // One pod a replica stays a Deployment, LWS or not.
    let d = build(
        &spec(json!({"parallelism": {"tensor": 8}})),
        &allowed,
        caps(true),
    )
    .expect("builds");
    assert!(d.groups().is_none() && d.deployment().is_some());
    assert!(
        !args(&d)
            .iter()
            .any(|a| a == "--distributed-executor-backend"),
        "one pod: vLLM's own processes"
    );
}

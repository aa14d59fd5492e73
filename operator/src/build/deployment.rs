//! The Deployment: the runtime's arguments, resources, probes, security context and drain time.

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::{
    Deployment, DeploymentSpec, DeploymentStrategy, RollingUpdateDeployment,
};
use k8s_openapi::api::core::v1::{
    Capabilities, Container, ContainerPort, EmptyDirVolumeSource, EnvVar, HTTPGetAction,
    PodSecurityContext, PodSpec, PodTemplateSpec, Probe, ResourceRequirements, SeccompProfile,
    SecurityContext, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use super::model::model_mount;
use super::{DEFAULT_SHUTDOWN_SECONDS, Validated, served_name};
use crate::config::OperatorConfig;
use crate::crd::{InferenceService, RuntimeKind};

/// The startup probe allows 180 × 10 s = 30 minutes for downloading and loading the model:
/// large weights from network storage load slowly, and liveness must not kill a loading pod.
const STARTUP_PERIOD: i32 = 10;
const STARTUP_FAILURES: i32 = 180;
/// Margin between the server's drain timeout and the kubelet's SIGKILL.
const GRACE_MARGIN: i32 = 15;
/// UID the ferrite images run as (distroless `nonroot`).
const FERRITE_UID: i64 = 65532;
/// vLLM's image defaults to root; run it as an ordinary user instead.
const VLLM_UID: i64 = 1000;

/// Parses a Kubernetes byte quantity (`2Gi`, `512Mi`, `1G`, `1024`) into bytes.
pub fn quantity_bytes(q: &str) -> Option<u64> {
    let split = q
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(q.len());
    let (num, unit) = q.split_at(split);
    let num: f64 = num.parse().ok()?;
    let mult: f64 = match unit {
        "" => 1.0,
        "Ki" => 1024.0,
        "Mi" => 1024f64.powi(2),
        "Gi" => 1024f64.powi(3),
        "Ti" => 1024f64.powi(4),
        "k" => 1e3,
        "M" => 1e6,
        "G" => 1e9,
        "T" => 1e12,
        _ => return None,
    };
    let bytes = num * mult;
    (bytes.is_finite() && bytes >= 1.0).then_some(bytes as u64)
}

fn gpus(isvc: &InferenceService) -> i32 {
    isvc.spec.resources.gpus.unwrap_or(0)
}

fn shutdown_seconds(isvc: &InferenceService) -> i32 {
    isvc.spec
        .runtime
        .engine
        .shutdown_timeout_seconds
        .unwrap_or(DEFAULT_SHUTDOWN_SECONDS)
}

/// The runtime's command-line arguments, derived from the spec, then the user's own.
fn args(isvc: &InferenceService, model_arg: &str, kv_cache_bytes: Option<u64>) -> Vec<String> {
    let e = &isvc.spec.runtime.engine;
    let kind = isvc.spec.runtime.kind;
    let mut a: Vec<String> = vec![
        "--model".into(),
        model_arg.into(),
        "--served-model-name".into(),
        served_name(isvc),
        "--host".into(),
        "0.0.0.0".into(),
        "--port".into(),
        isvc.port().to_string(),
    ];
    let mut flag = |name: &str, v: Option<String>| {
        if let Some(v) = v {
            a.push(name.into());
            a.push(v);
        }
    };
    flag("--max-model-len", e.max_model_len.map(|v| v.to_string()));
    flag("--max-num-seqs", e.max_num_seqs.map(|v| v.to_string()));
    flag("--block-size", e.block_size.map(|v| v.to_string()));
    let kv = kv_cache_bytes.map(|b| b.to_string());
    match kind {
        RuntimeKind::Ferrite => {
            flag("--kv-cache-memory", kv);
            flag(
                "--shutdown-timeout",
                Some(shutdown_seconds(isvc).to_string()),
            );
            if gpus(isvc) > 0 {
                flag("--device", Some("cuda".into()));
            }
        }
        RuntimeKind::Vllm => {
            flag("--kv-cache-memory-bytes", kv);
            if gpus(isvc) > 1 {
                flag("--tensor-parallel-size", Some(gpus(isvc).to_string()));
            }
        }
    }
    a.extend(isvc.spec.runtime.args.iter().cloned());
    a
}

fn image(isvc: &InferenceService, config: &OperatorConfig) -> String {
    if let Some(i) = &isvc.spec.runtime.image {
        return i.clone();
    }
    match (isvc.spec.runtime.kind, gpus(isvc) > 0) {
        (RuntimeKind::Ferrite, false) => config.ferrite_image.clone(),
        (RuntimeKind::Ferrite, true) => config.ferrite_cuda_image.clone(),
        (RuntimeKind::Vllm, _) => config.vllm_image.clone(),
    }
}

fn resources(isvc: &InferenceService) -> ResourceRequirements {
    let r = &isvc.spec.resources;
    let mut both = BTreeMap::new();
    if let Some(c) = &r.cpu {
        both.insert("cpu".to_string(), Quantity(c.clone()));
    }
    if let Some(m) = &r.memory {
        both.insert("memory".to_string(), Quantity(m.clone()));
    }
    let mut limits = both.clone();
    if gpus(isvc) > 0 {
        limits.insert("nvidia.com/gpu".into(), Quantity(gpus(isvc).to_string()));
    }
    ResourceRequirements {
        requests: (!both.is_empty()).then_some(both),
        limits: (!limits.is_empty()).then_some(limits),
        ..ResourceRequirements::default()
    }
}

fn http_probe(path: &str, period: i32, failures: i32) -> Probe {
    Probe {
        http_get: Some(HTTPGetAction {
            path: Some(path.into()),
            port: IntOrString::String("http".into()),
            ..HTTPGetAction::default()
        }),
        period_seconds: Some(period),
        failure_threshold: Some(failures),
        timeout_seconds: Some(5),
        ..Probe::default()
    }
}

/// Non-root, no privilege escalation, no capabilities; read-only root where the runtime allows
/// (vLLM compiles kernels and writes caches under its home).
pub fn container_security(kind: RuntimeKind) -> SecurityContext {
    SecurityContext {
        allow_privilege_escalation: Some(false),
        read_only_root_filesystem: Some(kind == RuntimeKind::Ferrite),
        run_as_non_root: Some(true),
        capabilities: Some(Capabilities {
            drop: Some(vec!["ALL".into()]),
            ..Capabilities::default()
        }),
        ..SecurityContext::default()
    }
}

fn empty_dir(name: &str, memory: bool) -> Volume {
    Volume {
        name: name.into(),
        empty_dir: Some(EmptyDirVolumeSource {
            medium: memory.then(|| "Memory".to_string()),
            ..EmptyDirVolumeSource::default()
        }),
        ..Volume::default()
    }
}

fn volume_mount(name: &str, path: &str) -> VolumeMount {
    VolumeMount {
        name: name.into(),
        mount_path: path.into(),
        ..VolumeMount::default()
    }
}

pub(crate) fn deployment(v: &Validated<'_>, config: &OperatorConfig) -> Deployment {
    let (isvc, owner) = (v.isvc, &v.owner);
    let kind = isvc.spec.runtime.kind;
    let security = container_security(kind);
    let model = model_mount(isvc, &v.model, &config.downloader_image, &security);
    let port = isvc.port();

    let mut volumes = vec![empty_dir("tmp", false)];
    let mut mounts = vec![volume_mount("tmp", "/tmp")];
    let mut env = vec![EnvVar {
        name: "HOME".into(),
        value: Some("/tmp".into()),
        ..EnvVar::default()
    }];
    if kind == RuntimeKind::Vllm {
        // Shared memory for vLLM's worker processes and NCCL.
        volumes.push(empty_dir("dshm", true));
        mounts.push(volume_mount("dshm", "/dev/shm"));
    }
    volumes.extend(model.volumes);
    mounts.extend(model.mounts);
    env.extend(model.env);
    env.extend(isvc.spec.runtime.env.iter().cloned());

    let container = Container {
        name: "server".into(),
        image: Some(image(isvc, config)),
        args: Some(args(isvc, &model.model_arg, v.kv_cache_bytes)),
        ports: Some(vec![ContainerPort {
            name: Some("http".into()),
            container_port: port,
            protocol: Some("TCP".into()),
            ..ContainerPort::default()
        }]),
        env: Some(env),
        resources: Some(resources(isvc)),
        // /health answers 503 until the model is loaded and warm, and while draining.
        startup_probe: Some(http_probe("/health", STARTUP_PERIOD, STARTUP_FAILURES)),
        readiness_probe: Some(http_probe("/health", 5, 3)),
        liveness_probe: Some(http_probe("/health", 10, 6)),
        security_context: Some(security),
        volume_mounts: Some(mounts),
        ..Container::default()
    };

    let uid = match kind {
        RuntimeKind::Ferrite => FERRITE_UID,
        RuntimeKind::Vllm => VLLM_UID,
    };
    let s = &isvc.spec.scheduling;
    let pod = PodSpec {
        containers: vec![container],
        init_containers: (!model.init_containers.is_empty()).then_some(model.init_containers),
        volumes: Some(volumes),
        termination_grace_period_seconds: Some(i64::from(shutdown_seconds(isvc) + GRACE_MARGIN)),
        security_context: Some(PodSecurityContext {
            run_as_non_root: Some(true),
            run_as_user: Some(uid),
            run_as_group: Some(uid),
            fs_group: Some(uid),
            seccomp_profile: Some(SeccompProfile {
                type_: "RuntimeDefault".into(),
                ..SeccompProfile::default()
            }),
            ..PodSecurityContext::default()
        }),
        automount_service_account_token: Some(false),
        node_selector: (!s.node_selector.is_empty()).then(|| s.node_selector.clone()),
        tolerations: (!s.tolerations.is_empty()).then(|| s.tolerations.clone()),
        affinity: s.affinity.clone(),
        priority_class_name: s.priority_class_name.clone(),
        runtime_class_name: s.runtime_class_name.clone(),
        ..PodSpec::default()
    };

    let mut pod_labels = owner.labels();
    pod_labels.extend(owner.selector_labels());
    let annotations = BTreeMap::from([
        ("prometheus.io/scrape".to_string(), "true".to_string()),
        ("prometheus.io/port".to_string(), port.to_string()),
        ("prometheus.io/path".to_string(), "/metrics".to_string()),
    ]);
    Deployment {
        metadata: owner.meta(owner.name.clone(), &BTreeMap::new()),
        spec: Some(DeploymentSpec {
            replicas: Some(isvc.desired_replicas()),
            selector: LabelSelector {
                match_labels: Some(owner.selector_labels()),
                ..LabelSelector::default()
            },
            // Keep serving capacity during rollouts: a new pod must be ready before an old
            // one drains.
            strategy: Some(DeploymentStrategy {
                type_: Some("RollingUpdate".into()),
                rolling_update: Some(RollingUpdateDeployment {
                    max_surge: Some(IntOrString::Int(1)),
                    max_unavailable: Some(IntOrString::Int(0)),
                }),
            }),
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(pod_labels),
                    annotations: Some(annotations),
                    ..ObjectMeta::default()
                }),
                spec: Some(pod),
            },
            ..DeploymentSpec::default()
        }),
        ..Deployment::default()
    }
}

//! The Deployment: the runtime's arguments, resources, probes, security context and drain time.

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::{
    Deployment, DeploymentSpec, DeploymentStrategy, RollingUpdateDeployment,
};
use k8s_openapi::api::core::v1::{
    Capabilities, Container, ContainerPort, EmptyDirVolumeSource, EnvVar, EnvVarSource,
    HTTPGetAction, PodSecurityContext, PodSpec, PodTemplateSpec, Probe, ResourceRequirements,
    SeccompProfile, SecretKeySelector, SecurityContext, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::ResourceExt;

use super::model::{ModelMount, model_mount};

/// Where Kubernetes reads a container's termination message (its default, written out so the
/// server's flag and the pod agree).
const TERMINATION_MESSAGE_PATH: &str = "/dev/termination-log";
use ferrite_api::served::served_name;

use super::{DEFAULT_SHUTDOWN_SECONDS, Validated};
use crate::config::OperatorConfig;
use ferrite_api::crd::{
    DEFAULT_GPU_RESOURCE, InferenceService, ProbeTiming, RolloutStrategy, RuntimeKind,
};

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

fn gpus(isvc: &InferenceService) -> i32 {
    super::parallelism::gpus_per_pod(isvc)
}

/// The extended resource GPUs are counted in.
fn gpu_resource(isvc: &InferenceService) -> &str {
    isvc.spec
        .resources
        .gpu_resource_name
        .as_deref()
        .unwrap_or(DEFAULT_GPU_RESOURCE)
}

fn shutdown_seconds(isvc: &InferenceService) -> i32 {
    isvc.spec
        .runtime
        .engine
        .shutdown_timeout_seconds
        .unwrap_or(DEFAULT_SHUTDOWN_SECONDS)
}

/// The runtime's command-line arguments, derived from the spec, then the user's own.
fn args(isvc: &InferenceService, model: &ModelMount, kv_cache_bytes: Option<u64>) -> Vec<String> {
    let e = &isvc.spec.runtime.engine;
    let kind = isvc.spec.runtime.kind;
    let mut a: Vec<String> = vec![
        "--model".into(),
        model.model_arg.clone(),
        "--served-model-name".into(),
        served_name(isvc),
        // The router's namespace-qualified id for this service, which no other can claim.
        format!(
            "{}/{}",
            isvc.namespace().unwrap_or_default(),
            isvc.name_any()
        ),
        "--host".into(),
        "0.0.0.0".into(),
        "--port".into(),
        isvc.port().to_string(),
    ];
    a.extend(model.args.iter().cloned());
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
            flag(
                "--termination-message-path",
                Some(TERMINATION_MESSAGE_PATH.into()),
            );
            if gpus(isvc) > 0 {
                flag("--device", Some("cuda".into()));
            }
            flag("--model-sha256", isvc.spec.model.sha256.clone());
        }
        RuntimeKind::Vllm => {
            flag("--kv-cache-memory-bytes", kv);
            match &isvc.spec.parallelism {
                Some(p) => {
                    a.extend(super::parallelism::vllm_args(p));
                    // Across pods, vLLM's workers are the group's Ray cluster (`super::lws`).
                    if super::parallelism::pods_per_replica(isvc) > 1 {
                        a.extend(["--distributed-executor-backend".into(), "ray".into()]);
                    }
                }
                // Without a layout, every GPU of the pod splits each layer.
                None if gpus(isvc) > 1 => {
                    flag("--tensor-parallel-size", Some(gpus(isvc).to_string()));
                }
                None => {}
            }
        }
    }
    a.extend(super::lora::args(isvc));
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

/// The server container's requests and limits: `cpu`, `memory` and `ephemeralStorage` as
/// both, then `requests` and `limits` over them, then the GPUs as a limit (the kubelet sets an
/// extended resource's request to its limit).
pub fn resources(isvc: &InferenceService) -> ResourceRequirements {
    let r = &isvc.spec.resources;
    let mut both = BTreeMap::new();
    for (name, q) in [
        ("cpu", &r.cpu),
        ("memory", &r.memory),
        ("ephemeral-storage", &r.ephemeral_storage),
    ] {
        if let Some(q) = q {
            both.insert(name.to_string(), Quantity(q.clone()));
        }
    }
    let mut requests = both.clone();
    requests.extend(r.requests.clone());
    let mut limits = both;
    limits.extend(r.limits.clone());
    if gpus(isvc) > 0 {
        limits.insert(
            gpu_resource(isvc).to_string(),
            Quantity(gpus(isvc).to_string()),
        );
    }
    ResourceRequirements {
        requests: (!requests.is_empty()).then_some(requests),
        limits: (!limits.is_empty()).then_some(limits),
        ..ResourceRequirements::default()
    }
}

/// A probe of `path` with the default timing, then the spec's over it.
fn http_probe(path: &str, period: i32, failures: i32, timing: Option<&ProbeTiming>) -> Probe {
    let t = timing.cloned().unwrap_or_default();
    Probe {
        http_get: Some(HTTPGetAction {
            path: Some(path.into()),
            port: IntOrString::String("http".into()),
            ..HTTPGetAction::default()
        }),
        initial_delay_seconds: t.initial_delay_seconds,
        period_seconds: Some(t.period_seconds.unwrap_or(period)),
        failure_threshold: Some(t.failure_threshold.unwrap_or(failures)),
        success_threshold: t.success_threshold,
        timeout_seconds: Some(t.timeout_seconds.unwrap_or(5)),
        ..Probe::default()
    }
}

/// Whether a count or percentage is zero.
pub(crate) fn is_zero(v: &IntOrString) -> bool {
    match v {
        IntOrString::Int(n) => *n == 0,
        IntOrString::String(s) => s.trim_end_matches('%').parse::<i64>() == Ok(0),
    }
}

/// How the Deployment replaces pods: the spec's rollout, else one at a time without a spare
/// GPU (stop, then start) for GPU specs and with a surge pod (start, then stop) for CPU ones.
/// With only one of maxSurge and maxUnavailable set, the other is 0, or 1 when the given one
/// is 0.
pub fn strategy(isvc: &InferenceService) -> DeploymentStrategy {
    let rollout = isvc.spec.rollout.clone().unwrap_or_default();
    if rollout.strategy == RolloutStrategy::Recreate {
        return DeploymentStrategy {
            type_: Some("Recreate".into()),
            rolling_update: None,
        };
    }
    let other = |given: &IntOrString| IntOrString::Int(if is_zero(given) { 1 } else { 0 });
    let (surge, unavailable) = match (rollout.max_surge, rollout.max_unavailable) {
        (Some(s), Some(u)) => (s, u),
        (Some(s), None) => {
            let u = other(&s);
            (s, u)
        }
        (None, Some(u)) => (other(&u), u),
        (None, None) if gpus(isvc) > 0 => (IntOrString::Int(0), IntOrString::Int(1)),
        (None, None) => (IntOrString::Int(1), IntOrString::Int(0)),
    };
    DeploymentStrategy {
        type_: Some("RollingUpdate".into()),
        rolling_update: Some(RollingUpdateDeployment {
            max_surge: Some(surge),
            max_unavailable: Some(unavailable),
        }),
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

/// The variables each runtime reads `--api-key` from: ferrite-server's, vLLM's.
pub(crate) const API_KEY_VARIABLES: [&str; 2] = ["FERRITE_API_KEY", "VLLM_API_KEY"];

/// The API key from `spec.auth`, as the variable each runtime reads for `--api-key`.
fn api_key_env(isvc: &InferenceService) -> Option<EnvVar> {
    let secret = &isvc.spec.auth.as_ref()?.api_key_secret_ref;
    let name = match isvc.spec.runtime.kind {
        RuntimeKind::Ferrite => API_KEY_VARIABLES[0],
        RuntimeKind::Vllm => API_KEY_VARIABLES[1],
    };
    Some(EnvVar {
        name: name.into(),
        value_from: Some(EnvVarSource {
            secret_key_ref: Some(SecretKeySelector {
                name: secret.name.clone(),
                key: secret.key_or_default().into(),
                optional: Some(false),
            }),
            ..EnvVarSource::default()
        }),
        ..EnvVar::default()
    })
}

fn volume_mount(name: &str, path: &str) -> VolumeMount {
    VolumeMount {
        name: name.into(),
        mount_path: path.into(),
        ..VolumeMount::default()
    }
}

/// The server's pod: a Deployment's pods, a LeaderWorkerSet's leaders (`super::lws`).
pub(crate) fn pod_template(v: &Validated<'_>, config: &OperatorConfig) -> PodTemplateSpec {
    let isvc = &*v.isvc;
    let model = model_mount(isvc, &v.model);
    let server_args = args(isvc, &model, v.kv_cache_bytes);
    let (container, volumes) = server_container(isvc, config, model, server_args);
    PodTemplateSpec {
        metadata: Some(pod_meta(v)),
        spec: Some(pod_spec(isvc, container, volumes)),
    }
}

pub(crate) fn deployment(v: &Validated<'_>, config: &OperatorConfig) -> Deployment {
    let (isvc, owner) = (&*v.isvc, &v.owner);
    Deployment {
        metadata: owner.meta(owner.name.clone(), &BTreeMap::new()),
        spec: Some(DeploymentSpec {
            replicas: Some(isvc.desired_replicas()),
            selector: LabelSelector {
                match_labels: Some(owner.selector_labels()),
                ..LabelSelector::default()
            },
            strategy: Some(strategy(isvc)),
            template: pod_template(v, config),
            ..DeploymentSpec::default()
        }),
        ..Deployment::default()
    }
}

/// The server container and the pod's volumes: a writable `/tmp`, vLLM's shared memory, the
/// model's and the user's.
fn server_container(
    isvc: &InferenceService,
    config: &OperatorConfig,
    model: ModelMount,
    server_args: Vec<String>,
) -> (Container, Vec<Volume>) {
    let kind = isvc.spec.runtime.kind;
    let p = &isvc.spec.pod;
    let mut volumes = vec![empty_dir("tmp", false)];
    let mut mounts = vec![volume_mount("tmp", "/tmp")];
    let mut env = vec![EnvVar {
        name: "HOME".into(),
        value: Some("/tmp".into()),
        ..EnvVar::default()
    }];
    env.extend(api_key_env(isvc));
    if kind == RuntimeKind::Vllm {
        // Shared memory for vLLM's worker processes and NCCL.
        volumes.push(empty_dir("dshm", true));
        mounts.push(volume_mount("dshm", "/dev/shm"));
    }
    volumes.extend(model.volumes);
    mounts.extend(model.mounts);
    let (adapter_volumes, adapter_mounts) = super::lora::volumes(isvc);
    volumes.extend(adapter_volumes);
    mounts.extend(adapter_mounts);
    env.extend(model.env);
    env.extend(super::lora::env(isvc));
    env.extend(isvc.spec.runtime.env.iter().cloned());
    volumes.extend(p.volumes.iter().cloned());
    mounts.extend(p.volume_mounts.iter().cloned());
    // The model's Secret first, then the adapters': a key the user also sets through
    // pod.envFrom wins.
    let env_from: Vec<_> = model
        .env_from
        .into_iter()
        .chain(super::lora::env_from(isvc))
        .chain(p.env_from.clone())
        .collect();
    let container = Container {
        name: "server".into(),
        image: Some(image(isvc, config)),
        args: Some(server_args),
        ports: Some(vec![ContainerPort {
            name: Some("http".into()),
            container_port: isvc.port(),
            protocol: Some("TCP".into()),
            ..ContainerPort::default()
        }]),
        env: Some(env),
        env_from: (!env_from.is_empty()).then_some(env_from),
        // A container that fails to start says why: ferrite-server writes the reason
        // (ModelDownloadFailed, ...) to the message file, and anything else shows its last log
        // lines.
        termination_message_path: Some(TERMINATION_MESSAGE_PATH.into()),
        termination_message_policy: Some("FallbackToLogsOnError".into()),
        resources: Some(resources(isvc)),
        // /health answers 503 until the model is loaded and warm, and while draining.
        startup_probe: Some(http_probe(
            "/health",
            STARTUP_PERIOD,
            STARTUP_FAILURES,
            p.probes.startup.as_ref(),
        )),
        readiness_probe: Some(http_probe("/health", 5, 3, p.probes.readiness.as_ref())),
        liveness_probe: Some(http_probe("/health", 10, 6, p.probes.liveness.as_ref())),
        security_context: Some(container_security(kind)),
        volume_mounts: Some(mounts),
        ..Container::default()
    };
    (container, volumes)
}

/// The pod around the container: who it runs as, its drain time, and the user's pod and
/// scheduling settings.
fn pod_spec(isvc: &InferenceService, container: Container, volumes: Vec<Volume>) -> PodSpec {
    let p = &isvc.spec.pod;
    let s = &isvc.spec.scheduling;
    let uid = match isvc.spec.runtime.kind {
        RuntimeKind::Ferrite => FERRITE_UID,
        RuntimeKind::Vllm => VLLM_UID,
    };
    PodSpec {
        containers: vec![container],
        volumes: Some(volumes),
        termination_grace_period_seconds: Some(
            p.termination_grace_period_seconds
                .unwrap_or_else(|| i64::from(shutdown_seconds(isvc) + GRACE_MARGIN)),
        ),
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
        // The server never calls the Kubernetes API.
        automount_service_account_token: Some(p.automount_service_account_token.unwrap_or(false)),
        service_account_name: p.service_account_name.clone(),
        image_pull_secrets: (!p.image_pull_secrets.is_empty())
            .then(|| p.image_pull_secrets.clone()),
        topology_spread_constraints: (!p.topology_spread_constraints.is_empty())
            .then(|| p.topology_spread_constraints.clone()),
        scheduler_name: p.scheduler_name.clone(),
        node_selector: (!s.node_selector.is_empty()).then(|| s.node_selector.clone()),
        tolerations: (!s.tolerations.is_empty()).then(|| s.tolerations.clone()),
        affinity: s.affinity.clone(),
        priority_class_name: s.priority_class_name.clone(),
        runtime_class_name: s.runtime_class_name.clone(),
        ..PodSpec::default()
    }
}

/// The pod template's labels (the user's over the operator's, except the selector's, which
/// the schema refuses) and annotations (Prometheus' scrape hints, then the user's).
fn pod_meta(v: &Validated<'_>) -> ObjectMeta {
    let (p, owner) = (&v.isvc.spec.pod, &v.owner);
    let mut labels = owner.labels();
    labels.extend(p.labels.clone());
    labels.extend(owner.selector_labels());
    let mut annotations = BTreeMap::from([
        ("prometheus.io/scrape".to_string(), "true".to_string()),
        ("prometheus.io/port".to_string(), v.isvc.port().to_string()),
        ("prometheus.io/path".to_string(), "/metrics".to_string()),
    ]);
    annotations.extend(p.annotations.clone());
    ObjectMeta {
        labels: Some(labels),
        annotations: Some(annotations),
        ..ObjectMeta::default()
    }
}

//! The validate and build steps, both pure. [`validate`] checks what the CRD schema cannot and
//! parses the spec once into a [`Validated`]; [`desired`] turns that (and the operator's config)
//! into the objects that should exist. No API calls here, so every field is unit-tested
//! without a cluster.

pub mod adapters;
pub mod dashboards;
pub mod deployment;
pub mod hpa;
pub mod keda;
pub mod lora;
pub mod lws;
pub mod model;
pub mod monitor;
pub mod network_policy;
pub mod parallelism;
pub mod profile;
pub mod quantity;
pub mod router_key;
pub mod service;

use std::borrow::Cow;
use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::autoscaling::v2::HorizontalPodAutoscaler;
use k8s_openapi::api::core::v1::{ConfigMap, Service};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::{Resource, ResourceExt};

use crate::config::OperatorConfig;
use ferrite_api::crd::InferenceService;
use ferrite_api::labels::{COMPONENT_LABEL, INSTANCE_LABEL, SERVER_COMPONENT};
use model::ModelSource;
use monitor::ServiceMonitor;

/// Default drain time, matching ferrite-server's `--shutdown-timeout`.
pub const DEFAULT_SHUTDOWN_SECONDS: i32 = 30;

/// What the cluster offers, discovered at run time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClusterCapabilities {
    /// Whether `servicemonitors.monitoring.coreos.com` is installed.
    pub service_monitor_crd: bool,
    /// Whether KEDA's `scaledobjects.keda.sh` is installed.
    pub scaled_object_crd: bool,
    /// Whether `leaderworkersets.leaderworkerset.x-k8s.io` is installed (looked for only by
    /// an operator allowed to write them).
    pub leader_worker_set_crd: bool,
}

/// What runs the replicas: a Deployment of one pod each, or a LeaderWorkerSet of groups.
#[derive(Debug, Clone, PartialEq)]
pub enum Workload {
    Deployment(Box<Deployment>),
    Groups(Box<lws::LeaderWorkerSet>),
}

/// Everything one InferenceService should own.
#[derive(Debug, Clone, PartialEq)]
pub struct Desired {
    pub workload: Workload,
    pub service: Service,
    /// Only with more than one replica.
    pub pdb: Option<PodDisruptionBudget>,
    /// Only when enabled and the CRD exists.
    pub service_monitor: Option<ServiceMonitor>,
    pub dashboards: Vec<ConfigMap>,
    /// Only with `autoscaling.mode: HPA`.
    pub hpa: Option<HorizontalPodAutoscaler>,
    /// Only with `autoscaling.mode: KEDA`.
    pub scaled_object: Option<keda::ScaledObject>,
    /// Only when the operator runs with `--network-policy-peers`.
    pub network_policy: Option<k8s_openapi::api::networking::v1::NetworkPolicy>,
    /// ferrite-router's `get` on the Secret `spec.auth` names: only with `spec.auth` and the
    /// operator run with `--router-service-account`.
    pub router_key: Option<(
        k8s_openapi::api::rbac::v1::Role,
        k8s_openapi::api::rbac::v1::RoleBinding,
    )>,
    /// The label selector of the pods, for status.selector (the scale subresource).
    pub selector: String,
    /// In-cluster base URL of the API.
    pub url: String,
}

impl Desired {
    /// The Deployment, where each replica is one pod.
    pub fn deployment(&self) -> Option<&Deployment> {
        match &self.workload {
            Workload::Deployment(d) => Some(d),
            Workload::Groups(_) => None,
        }
    }

    /// The LeaderWorkerSet, where each replica is a group of pods.
    pub fn groups(&self) -> Option<&lws::LeaderWorkerSet> {
        match &self.workload {
            Workload::Groups(g) => Some(g),
            Workload::Deployment(_) => None,
        }
    }
}

/// A spec the CRD schema accepts but the operator cannot build; shown as `Degraded`.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum BuildError {
    #[error("the resource has no {0}")]
    MissingMetadata(&'static str),
    #[error("model.source {0:?}: {1}")]
    ModelSource(String, &'static str),
    #[error(
        "runtime.engine.kvCacheMemory {0:?} is not a usable size: give at least one byte, as a quantity like 2Gi"
    )]
    KvCacheMemory(String),
    #[error("dashboard {0}: {1}")]
    Dashboard(String, &'static str),
    #[error("resources: {0}")]
    Resources(String),
    #[error("pod: {0}")]
    PodSettings(String),
    #[error("rollout: {0}")]
    Rollout(&'static str),
    #[error("resourceProfile {0}")]
    ResourceProfile(String),
    #[error("{0}")]
    Adapter(String),
    #[error(
        "autoscaling.mode KEDA needs KEDA: its CRD scaledobjects.keda.sh is not installed \
         (install KEDA, or use mode Builtin or HPA)"
    )]
    KedaNotInstalled,
    #[error(
        "autoscaling.mode KEDA needs the Prometheus that scrapes the pods: set \
         autoscaling.keda.serverAddress, or run the operator with --keda-prometheus-address \
         (the chart's keda.prometheusAddress)"
    )]
    KedaPrometheusAddress,
    #[error(
        "autoscaling.keda.scaler External needs the operator's external scaler, which it does \
         not serve (the chart's keda.externalScaler.enabled); or use scaler Prometheus"
    )]
    KedaScalerOff,
    #[error("parallelism {0}")]
    Parallelism(String),
    #[error(
        "autoscaling.mode HPA reads the operator's External Metrics API, but this cluster runs \
         KEDA (scaledobjects.keda.sh), whose metrics server serves that API: use mode KEDA"
    )]
    HpaWithKeda,
    #[error(
        "autoscaling.mode KEDA needs an operator allowed to write ScaledObjects: install the \
         chart with keda.enabled (the operator's --keda)"
    )]
    KedaNotEnabled,
    #[error(
        "a replica spans {0} pods, which takes a LeaderWorkerSet: install the chart with \
         leaderWorkerSet.enabled (the operator's --leader-worker-sets), or fit a replica in one \
         pod"
    )]
    LeaderWorkerSetNotEnabled(i32),
    #[error(
        "a replica spans {0} pods, which takes a LeaderWorkerSet, and its CRD \
         leaderworkersets.leaderworkerset.x-k8s.io is not installed: install LeaderWorkerSet \
         (https://github.com/kubernetes-sigs/lws), or fit a replica in one pod"
    )]
    LeaderWorkerSetNotInstalled(i32),
}

impl BuildError {
    /// CamelCase reason for the `Degraded` condition.
    pub fn reason(&self) -> &'static str {
        match self {
            BuildError::MissingMetadata(_) => "InvalidMetadata",
            BuildError::ModelSource(..) => "InvalidModelSource",
            BuildError::KvCacheMemory(_) => "InvalidEngineSettings",
            BuildError::Dashboard(..) => "InvalidDashboard",
            BuildError::Resources(_) => "InvalidResources",
            BuildError::PodSettings(_) => "InvalidPodSettings",
            BuildError::Rollout(_) => "InvalidRollout",
            BuildError::ResourceProfile(_) => "ResourceProfileNotFound",
            BuildError::Adapter(_) => "InvalidAdapter",
            BuildError::KedaNotInstalled => "KedaNotInstalled",
            BuildError::KedaPrometheusAddress => "KedaPrometheusAddressMissing",
            BuildError::KedaScalerOff => "KedaScalerOff",
            BuildError::Parallelism(_) => "InvalidParallelism",
            BuildError::HpaWithKeda => "HpaModeWithKeda",
            BuildError::KedaNotEnabled => "KedaNotEnabled",
            BuildError::LeaderWorkerSetNotEnabled(_) => "LeaderWorkerSetNotEnabled",
            BuildError::LeaderWorkerSetNotInstalled(_) => "LeaderWorkerSetNotInstalled",
        }
    }
}

/// The resource's name, namespace and the owner reference children carry.
#[derive(Debug, Clone)]
pub(crate) struct Owner {
    pub name: String,
    pub namespace: String,
    pub reference: OwnerReference,
}

impl Owner {
    fn of(isvc: &InferenceService) -> Result<Self, BuildError> {
        let namespace = isvc
            .namespace()
            .ok_or(BuildError::MissingMetadata("namespace"))?;
        let reference = isvc
            .controller_owner_ref(&())
            .ok_or(BuildError::MissingMetadata("uid"))?;
        Ok(Self {
            name: isvc.name_any(),
            namespace,
            reference,
        })
    }

    /// Metadata for a child named `name`, labelled and owned.
    pub fn meta(&self, name: String, extra_labels: &BTreeMap<String, String>) -> ObjectMeta {
        let mut labels = self.labels();
        labels.extend(extra_labels.clone());
        ObjectMeta {
            name: Some(name),
            namespace: Some(self.namespace.clone()),
            labels: Some(labels),
            owner_references: Some(vec![self.reference.clone()]),
            ..ObjectMeta::default()
        }
    }

    /// Labels on every child (and the pods).
    pub fn labels(&self) -> BTreeMap<String, String> {
        BTreeMap::from([
            (
                "app.kubernetes.io/name".into(),
                "inferenceservice".to_string(),
            ),
            ("app.kubernetes.io/instance".into(), self.name.clone()),
            (
                "app.kubernetes.io/managed-by".into(),
                "ferrite-operator".into(),
            ),
            (INSTANCE_LABEL.into(), self.name.clone()),
        ])
    }

    /// The serving pods' selector: stable across spec changes (a Deployment's selector is
    /// immutable); a LeaderWorkerSet's leaders, not its workers.
    pub fn selector_labels(&self) -> BTreeMap<String, String> {
        BTreeMap::from([
            (INSTANCE_LABEL.into(), self.name.clone()),
            (COMPONENT_LABEL.into(), SERVER_COMPONENT.into()),
        ])
    }

    /// Every pod a replica consists of: the serving pods, or with `groups` (a
    /// LeaderWorkerSet) leaders and workers alike.
    pub fn replica_pods_labels(&self, groups: bool) -> BTreeMap<String, String> {
        match groups {
            false => self.selector_labels(),
            true => BTreeMap::from([(INSTANCE_LABEL.into(), self.name.clone())]),
        }
    }
}

/// The serving pods' label selector as a string (status.selector, and for listing the pods).
pub fn selector(name: &str) -> String {
    format!("{COMPONENT_LABEL}={SERVER_COMPONENT},{INSTANCE_LABEL}={name}")
}

/// In-cluster base URL of the API.
pub fn url(isvc: &InferenceService) -> String {
    format!(
        "http://{}.{}.svc.cluster.local:{}",
        isvc.name_any(),
        isvc.namespace().unwrap_or_default(),
        isvc.port()
    )
}

/// A spec that passed [`validate`], with what build needs parsed once.
#[derive(Debug, Clone)]
pub struct Validated<'a> {
    /// The resource, with its resource profile merged under its spec when it names one.
    pub isvc: Cow<'a, InferenceService>,
    pub(crate) owner: Owner,
    /// `spec.model.source`, parsed.
    pub model: ModelSource,
    /// `spec.runtime.engine.kvCacheMemory` in bytes.
    pub kv_cache_bytes: Option<u64>,
}

impl Validated<'_> {
    /// The PersistentVolumeClaims the spec mounts, each with the field that names it.
    pub fn claims(&self) -> Vec<(&'static str, String)> {
        model::claims(Some(&self.model), &self.isvc)
    }
}

/// Merges the resource profile the spec names (from `config`), then checks what the schema
/// cannot (metadata, the model source's form, the KV-cache size, requests against limits,
/// mount paths, the rollout's bounds) and parses it, once.
pub fn validate<'a>(
    isvc: &'a InferenceService,
    config: &OperatorConfig,
) -> Result<Validated<'a>, BuildError> {
    let owner = Owner::of(isvc)?;
    let isvc = match profile::resolve(isvc, &config.resource_profiles)? {
        Some(merged) => Cow::Owned(merged),
        None => Cow::Borrowed(isvc),
    };
    let model = model::parse(&isvc)?;
    let kv_cache_bytes = match &isvc.spec.runtime.engine.kv_cache_memory {
        Some(q) => Some(quantity::bytes(q).ok_or_else(|| BuildError::KvCacheMemory(q.clone()))?),
        None => None,
    };
    parallelism::check(&isvc)?;
    check_resources(&isvc)?;
    check_mounts(&isvc)?;
    check_rollout(&isvc)?;
    check_adapters(&isvc)?;
    Ok(Validated {
        isvc,
        owner,
        model,
        kv_cache_bytes,
    })
}

/// Every request and limit a quantity, no limit below its request, and an extended resource
/// (a GPU) requested as much as its limit: the apiserver would refuse the pods, not the
/// Deployment, and only the ReplicaSet's events would say so.
fn check_resources(isvc: &InferenceService) -> Result<(), BuildError> {
    let r = deployment::resources(isvc);
    let (requests, limits) = (r.requests.unwrap_or_default(), r.limits.unwrap_or_default());
    let parse = |kind: &str, name: &str, q: &str| {
        quantity::value(q)
            .ok_or_else(|| BuildError::Resources(format!("{kind} {name}: {q:?} is not a quantity")))
    };
    for (name, q) in &requests {
        parse("request", name, &q.0)?;
    }
    for (name, limit) in &limits {
        let l = parse("limit", name, &limit.0)?;
        let Some(request) = requests.get(name) else {
            continue;
        };
        let req = parse("request", name, &request.0)?;
        let extended = name.contains('/') && !name.starts_with("kubernetes.io/");
        if extended && req != l {
            return Err(BuildError::Resources(format!(
                "{name} is requested {} but limited to {}: an extended resource's request must equal its limit",
                request.0, limit.0
            )));
        }
        if req > l {
            return Err(BuildError::Resources(format!(
                "the {name} limit {} is below its request {}",
                limit.0, request.0
            )));
        }
    }
    Ok(())
}

/// Every mount names one of the spec's volumes (a CEL rule would cost more than the
/// apiserver's budget over lists this long), and the operator's mount points (the scratch
/// dir, shared memory, the model) stay its own.
fn check_mounts(isvc: &InferenceService) -> Result<(), BuildError> {
    const RESERVED: [&str; 4] = [
        "/tmp",
        "/dev/shm",
        model::MODEL_ROOT,
        crate::build::adapters::ADAPTER_ROOT,
    ];
    let pod = &isvc.spec.pod;
    for m in &pod.volume_mounts {
        if !pod.volumes.iter().any(|v| v.name == m.name) {
            return Err(BuildError::PodSettings(format!(
                "volumeMounts {:?} names no volume in pod.volumes",
                m.name
            )));
        }
        let path = m.mount_path.trim_end_matches('/');
        if let Some(r) = RESERVED
            .iter()
            .find(|r| path == **r || path.starts_with(&format!("{r}/")))
        {
            return Err(BuildError::PodSettings(format!(
                "volumeMounts {:?} at {:?}: {r} is the operator's mount point; mount elsewhere",
                m.name, m.mount_path
            )));
        }
    }
    Ok(())
}

/// Every adapter in a form its runtime loads, the LoRA limits the runtime accepts, and none
/// named as the model is served (the CRD's rules say the same; this holds for objects
/// stored before them).
fn check_adapters(isvc: &InferenceService) -> Result<(), BuildError> {
    let wanted =
        crate::build::adapters::wanted(isvc).map_err(|e| BuildError::Adapter(e.to_string()))?;
    lora::check(isvc)?;
    let (volumes, _) = lora::volumes(isvc);
    if let Some(v) = volumes
        .iter()
        .find(|v| isvc.spec.pod.volumes.iter().any(|p| p.name == v.name))
    {
        return Err(BuildError::Adapter(format!(
            "pod.volumes {:?} has the name of the volume the operator mounts an adapter claim \
             with; rename it",
            v.name
        )));
    }
    let served = ferrite_api::served::served_name(isvc);
    let mut names = std::collections::BTreeSet::new();
    for w in &wanted {
        if w.name == served {
            return Err(BuildError::Adapter(format!(
                "model.adapters {:?} has the model's served name",
                w.name
            )));
        }
        if !names.insert(&w.name) {
            return Err(BuildError::Adapter(format!(
                "model.adapters names {:?} twice",
                w.name
            )));
        }
    }
    Ok(())
}

/// A rolling update that may neither add nor remove a pod never progresses; the apiserver
/// refuses the Deployment.
fn check_rollout(isvc: &InferenceService) -> Result<(), BuildError> {
    if let Some(r) = deployment::strategy(isvc).rolling_update {
        let bounds: Vec<&IntOrString> = [&r.max_surge, &r.max_unavailable]
            .into_iter()
            .flatten()
            .collect();
        if bounds
            .iter()
            .any(|v| matches!(v, IntOrString::String(s) if !s.ends_with('%')))
        {
            return Err(BuildError::Rollout(
                "maxSurge and maxUnavailable take a number (1) or a percentage (\"25%\"), not a number in quotes",
            ));
        }
        if bounds.iter().all(|v| deployment::is_zero(v)) {
            return Err(BuildError::Rollout(
                "maxSurge and maxUnavailable are both 0, so no pod could ever be replaced",
            ));
        }
    }
    Ok(())
}

/// Validates, then builds every desired object.
pub fn build(
    isvc: &InferenceService,
    config: &OperatorConfig,
    caps: ClusterCapabilities,
) -> Result<Desired, BuildError> {
    desired(&validate(isvc, config)?, config, caps)
}

/// Builds every desired object of a validated spec.
pub fn desired(
    v: &Validated<'_>,
    config: &OperatorConfig,
    caps: ClusterCapabilities,
) -> Result<Desired, BuildError> {
    let (isvc, owner) = (&*v.isvc, &v.owner);
    let pods = parallelism::pods_per_replica(isvc);
    let workload = match pods {
        1 => Workload::Deployment(Box::new(deployment::deployment(v, config))),
        _ if !config.leader_worker_sets => return Err(BuildError::LeaderWorkerSetNotEnabled(pods)),
        _ if !caps.leader_worker_set_crd => {
            return Err(BuildError::LeaderWorkerSetNotInstalled(pods));
        }
        _ => Workload::Groups(Box::new(lws::leader_worker_set(v, config, pods))),
    };
    let service = service::service(isvc, owner);
    // A group is down when any of its pods is: the budget counts every pod.
    let pdb = (isvc.desired_replicas() > 1)
        .then(|| service::pdb(owner, owner.replica_pods_labels(pods > 1)));
    let sm = &isvc.spec.monitoring.service_monitor;
    let service_monitor = (sm.enabled && caps.service_monitor_crd)
        .then(|| monitor::service_monitor(sm, &config.monitor_labels, owner));
    let dashboards = if isvc.spec.monitoring.dashboards.enabled {
        dashboards::config_maps(isvc, config, owner)?
    } else {
        Vec::new()
    };
    let hpa = hpa::hpa(isvc, owner);
    // KEDA's metrics server is the cluster's External Metrics API wherever KEDA runs: an HPA on
    // the operator's metrics would ask it for series it never has.
    if hpa.is_some() && caps.scaled_object_crd {
        return Err(BuildError::HpaWithKeda);
    }
    let scaled_object = keda::scaled_object(
        isvc,
        owner,
        keda::Sources {
            allowed: config.keda,
            prometheus: config.keda_prometheus_address.as_deref(),
            external: config.keda_scaler_address.as_deref(),
        },
        caps.scaled_object_crd,
    )?;
    let network_policy = config
        .network_policy_peers
        .as_deref()
        .map(|peers| network_policy::network_policy(owner, isvc.port(), peers, pods > 1));
    let router_key = config
        .router_service_account
        .as_ref()
        .zip(isvc.spec.auth.as_ref())
        .map(|(router, auth)| router_key::router_key(owner, auth, router));
    let selector = selector(&owner.name);
    let url = url(isvc);
    Ok(Desired {
        hpa,
        scaled_object,
        network_policy,
        router_key,
        workload,
        service,
        pdb,
        service_monitor,
        dashboards,
        selector,
        url,
    })
}

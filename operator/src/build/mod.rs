//! The validate and build steps, both pure. [`validate`] checks what the CRD schema cannot and
//! parses the spec once into a [`Validated`]; [`desired`] turns that (and the operator's config)
//! into the objects that should exist. No API calls here, so every field is unit-tested
//! without a cluster.

pub mod dashboards;
pub mod deployment;
pub mod hpa;
pub mod model;
pub mod monitor;
pub mod service;

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::autoscaling::v2::HorizontalPodAutoscaler;
use k8s_openapi::api::core::v1::{ConfigMap, Service};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::{Resource, ResourceExt};

use crate::config::OperatorConfig;
use crate::crd::InferenceService;
use crate::labels::{COMPONENT_LABEL, INSTANCE_LABEL};
use model::ModelSource;
use monitor::ServiceMonitor;

/// Default drain time, matching ferrite-server's `--shutdown-timeout`.
pub const DEFAULT_SHUTDOWN_SECONDS: i32 = 30;

/// What the cluster offers, discovered at run time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClusterCapabilities {
    /// Whether `servicemonitors.monitoring.coreos.com` is installed.
    pub service_monitor_crd: bool,
}

/// Everything one InferenceService should own.
#[derive(Debug, Clone, PartialEq)]
pub struct Desired {
    pub deployment: Deployment,
    pub service: Service,
    /// Only with more than one replica.
    pub pdb: Option<PodDisruptionBudget>,
    /// Only when enabled and the CRD exists.
    pub service_monitor: Option<ServiceMonitor>,
    pub dashboards: Vec<ConfigMap>,
    /// Only with `autoscaling.mode: HPA`.
    pub hpa: Option<HorizontalPodAutoscaler>,
    /// The label selector of the pods, for status.selector (the scale subresource).
    pub selector: String,
    /// In-cluster base URL of the API.
    pub url: String,
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
}

impl BuildError {
    /// CamelCase reason for the `Degraded` condition.
    pub fn reason(&self) -> &'static str {
        match self {
            BuildError::MissingMetadata(_) => "InvalidMetadata",
            BuildError::ModelSource(..) => "InvalidModelSource",
            BuildError::KvCacheMemory(_) => "InvalidEngineSettings",
            BuildError::Dashboard(..) => "InvalidDashboard",
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

    /// The pods' selector: stable across spec changes (a Deployment's selector is immutable).
    pub fn selector_labels(&self) -> BTreeMap<String, String> {
        BTreeMap::from([
            (INSTANCE_LABEL.into(), self.name.clone()),
            (COMPONENT_LABEL.into(), "server".into()),
        ])
    }
}

/// The served model name: spec.model.servedName or the resource name.
pub fn served_name(isvc: &InferenceService) -> String {
    isvc.spec
        .model
        .served_name
        .clone()
        .unwrap_or_else(|| isvc.name_any())
}

/// The pods' label selector as a string (status.selector, and for listing the pods).
pub fn selector(name: &str) -> String {
    format!("{COMPONENT_LABEL}=server,{INSTANCE_LABEL}={name}")
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
    pub isvc: &'a InferenceService,
    pub(crate) owner: Owner,
    /// `spec.model.source`, parsed.
    pub model: ModelSource,
    /// `spec.runtime.engine.kvCacheMemory` in bytes.
    pub kv_cache_bytes: Option<u64>,
}

impl Validated<'_> {
    /// The PersistentVolumeClaims the spec mounts, each with the field that names it.
    pub fn claims(&self) -> Vec<(&'static str, String)> {
        model::claims(Some(&self.model), self.isvc)
    }
}

/// Checks what the schema cannot (metadata, the model source's form, the KV-cache size) and
/// parses it, once.
pub fn validate(isvc: &InferenceService) -> Result<Validated<'_>, BuildError> {
    let owner = Owner::of(isvc)?;
    let model = ModelSource::parse(&isvc.spec.model.source)?;
    let kv_cache_bytes = match &isvc.spec.runtime.engine.kv_cache_memory {
        Some(q) => Some(
            deployment::quantity_bytes(q).ok_or_else(|| BuildError::KvCacheMemory(q.clone()))?,
        ),
        None => None,
    };
    Ok(Validated {
        isvc,
        owner,
        model,
        kv_cache_bytes,
    })
}

/// Validates, then builds every desired object.
pub fn build(
    isvc: &InferenceService,
    config: &OperatorConfig,
    caps: ClusterCapabilities,
) -> Result<Desired, BuildError> {
    desired(&validate(isvc)?, config, caps)
}

/// Builds every desired object of a validated spec.
pub fn desired(
    v: &Validated<'_>,
    config: &OperatorConfig,
    caps: ClusterCapabilities,
) -> Result<Desired, BuildError> {
    let (isvc, owner) = (v.isvc, &v.owner);
    let deployment = deployment::deployment(v, config);
    let service = service::service(isvc, owner);
    let pdb = (isvc.desired_replicas() > 1).then(|| service::pdb(owner));
    let sm = &isvc.spec.monitoring.service_monitor;
    let service_monitor =
        (sm.enabled && caps.service_monitor_crd).then(|| monitor::service_monitor(sm, owner));
    let dashboards = if isvc.spec.monitoring.dashboards.enabled {
        dashboards::config_maps(isvc, config, owner)?
    } else {
        Vec::new()
    };
    let hpa = hpa::hpa(isvc, owner);
    let selector = selector(&owner.name);
    let url = url(isvc);
    Ok(Desired {
        hpa,
        deployment,
        service,
        pdb,
        service_monitor,
        dashboards,
        selector,
        url,
    })
}

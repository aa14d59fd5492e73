//! The build step: a pure function from an `InferenceService` (and the operator's config) to the
//! objects that should exist. No API calls here, so every field is unit-tested without a cluster.

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
use monitor::ServiceMonitor;

/// Label carrying the owning InferenceService's name on everything the operator makes.
pub const INSTANCE_LABEL: &str = "ferrite.dev/inferenceservice";
/// The standard component label; pods carry `server`, dashboard ConfigMaps `dashboard`.
pub const COMPONENT_LABEL: &str = "app.kubernetes.io/component";
/// Default HTTP port of both runtimes.
pub const DEFAULT_PORT: i32 = 8000;
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

/// Replicas to run: spec.replicas (the schema defaults it to 1), brought within
/// autoscaling.minReplicas..maxReplicas when autoscaling is on, as an HPA does.
pub fn desired_replicas(isvc: &InferenceService) -> i32 {
    let replicas = isvc.spec.replicas.unwrap_or(1);
    match &isvc.spec.autoscaling {
        Some(a) => replicas.clamp(a.min_replicas, a.max_replicas.max(a.min_replicas)),
        None => replicas,
    }
}

pub fn port(isvc: &InferenceService) -> i32 {
    isvc.spec.runtime.port.unwrap_or(DEFAULT_PORT)
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
        port(isvc)
    )
}

/// Builds every desired object.
pub fn build(
    isvc: &InferenceService,
    config: &OperatorConfig,
    caps: ClusterCapabilities,
) -> Result<Desired, BuildError> {
    let owner = Owner::of(isvc)?;
    let deployment = deployment::deployment(isvc, config, &owner)?;
    let service = service::service(isvc, &owner);
    let pdb = (desired_replicas(isvc) > 1).then(|| service::pdb(&owner));
    let sm = &isvc.spec.monitoring.service_monitor;
    let service_monitor =
        (sm.enabled && caps.service_monitor_crd).then(|| monitor::service_monitor(sm, &owner));
    let dashboards = if isvc.spec.monitoring.dashboards.enabled {
        dashboards::config_maps(isvc, config, &owner)?
    } else {
        Vec::new()
    };
    let hpa = hpa::hpa(isvc, &owner);
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

//! Operator-wide settings: default images, the field manager, and the dashboards to ship.

use std::collections::BTreeMap;
use std::path::Path;

use k8s_openapi::api::core::v1::{Affinity, LocalObjectReference, Toleration};
use serde::{Deserialize, Serialize};

/// One Grafana dashboard (from `dashboards/`).
#[derive(Debug, Clone, PartialEq)]
pub struct Dashboard {
    /// File stem, e.g. `overview`.
    pub name: String,
    pub json: serde_json::Value,
}

#[derive(Debug, Clone, PartialEq)]
pub struct OperatorConfig {
    /// ferrite-server image for CPU pods.
    pub ferrite_image: String,
    /// ferrite-server image built with `--features cuda`, for pods with GPUs.
    pub ferrite_cuda_image: String,
    /// vLLM's OpenAI server image.
    pub vllm_image: String,
    /// Dashboards shipped as ConfigMaps for each InferenceService.
    pub dashboards: Vec<Dashboard>,
    /// Resource profiles by name, for `spec.resourceProfile`.
    pub resource_profiles: BTreeMap<String, ResourceProfile>,
    /// Labels on every ServiceMonitor the operator makes, under each spec's own (e.g.
    /// kube-prometheus-stack's `release`).
    pub monitor_labels: BTreeMap<String, String>,
    /// With `Some`, each InferenceService gets a NetworkPolicy admitting only these peers to
    /// its pods (see `build::network_policy`).
    pub network_policy_peers: Option<Vec<k8s_openapi::api::networking::v1::NetworkPolicyPeer>>,
    /// With `Some`, ferrite-router's ServiceAccount: each InferenceService with `spec.auth`
    /// gets a Role letting it read that one Secret, so that a router with tenants (which
    /// keeps the tenant's key) sends the service's own (see `build::router_key`).
    pub router_service_account: Option<ServiceAccountRef>,
    /// The Prometheus KEDA mode's triggers read, unless a spec names its own
    /// (`autoscaling.keda.serverAddress`).
    pub keda_prometheus_address: Option<String>,
    /// `host:port` where KEDA reaches the operator's external scaler, when it serves one.
    pub keda_scaler_address: Option<String>,
    /// The operator may write KEDA ScaledObjects (its RBAC allows them: the chart's
    /// `keda.enabled`). Without it, KEDA's CRD in the cluster is never watched.
    pub keda: bool,
    /// The operator may write LeaderWorkerSets, for replicas that span pods (its RBAC allows
    /// them: the chart's `leaderWorkerSet.enabled`).
    pub leader_worker_sets: bool,
}

/// A ServiceAccount by namespace and name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServiceAccountRef {
    pub namespace: String,
    pub name: String,
}

impl std::str::FromStr for ServiceAccountRef {
    type Err = String;

    /// `NAMESPACE/NAME`.
    fn from_str(s: &str) -> Result<Self, String> {
        match s.split_once('/') {
            Some((ns, name)) if !ns.is_empty() && !name.is_empty() && !name.contains('/') => {
                Ok(ServiceAccountRef {
                    namespace: ns.into(),
                    name: name.into(),
                })
            }
            _ => Err(format!("{s:?} is not NAMESPACE/NAME")),
        }
    }
}

/// One resource profile (see `build::profile`), as the chart's `resourceProfiles.<name>` values give it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ResourceProfile {
    /// Node labels the pods require.
    #[serde(default)]
    pub node_selector: BTreeMap<String, String>,
    /// Taints the pods tolerate.
    #[serde(default)]
    pub tolerations: Vec<Toleration>,
    /// Node and pod (anti-)affinity, used when the spec has none.
    #[serde(default)]
    pub affinity: Option<Affinity>,
    /// RuntimeClass of the pods.
    #[serde(default)]
    pub runtime_class_name: Option<String>,
    /// PriorityClass of the pods.
    #[serde(default)]
    pub priority_class_name: Option<String>,
    /// Scheduler of the pods.
    #[serde(default)]
    pub scheduler_name: Option<String>,
    /// The extended resource GPUs are counted in.
    #[serde(default)]
    pub gpu_resource_name: Option<String>,
    /// Registry credentials.
    #[serde(default)]
    pub image_pull_secrets: Vec<LocalObjectReference>,
}

/// The one field manager for every server-side apply.
pub const FIELD_MANAGER: &str = "ferrite-operator";

impl Default for OperatorConfig {
    fn default() -> Self {
        let v = env!("CARGO_PKG_VERSION");
        Self {
            ferrite_image: format!("ghcr.io/ferrite-dev/ferrite-server:{v}"),
            ferrite_cuda_image: format!("ghcr.io/ferrite-dev/ferrite-server:{v}-cuda"),
            vllm_image: "vllm/vllm-openai:v0.11.0".into(),
            dashboards: Vec::new(),
            resource_profiles: BTreeMap::new(),
            monitor_labels: BTreeMap::new(),
            network_policy_peers: None,
            router_service_account: None,
            keda_prometheus_address: None,
            keda_scaler_address: None,
            keda: false,
            leader_worker_sets: false,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("reading dashboards from {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("dashboard {path} is not valid JSON: {source}")]
    Json {
        path: String,
        source: serde_json::Error,
    },
    #[error("resource profiles in {path}: {source}")]
    Profiles {
        path: String,
        source: serde_yaml_ng::Error,
    },
}

/// Reads resource profiles from a YAML (or JSON) map of name to profile, as the chart writes
/// its `resourceProfiles` values. An empty file is no profiles.
pub fn load_resource_profiles(
    path: &Path,
) -> Result<BTreeMap<String, ResourceProfile>, ConfigError> {
    let p = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Io {
        path: p.clone(),
        source,
    })?;
    if text.trim().is_empty() {
        return Ok(BTreeMap::new());
    }
    let profiles: Option<BTreeMap<String, ResourceProfile>> = serde_yaml_ng::from_str(&text)
        .map_err(|source| ConfigError::Profiles { path: p, source })?;
    Ok(profiles.unwrap_or_default())
}

/// Loads every `*.json` in `dir`, sorted by name.
pub fn load_dashboards(dir: &Path) -> Result<Vec<Dashboard>, ConfigError> {
    let io = |source| ConfigError::Io {
        path: dir.display().to_string(),
        source,
    };
    let mut paths: Vec<_> = std::fs::read_dir(dir)
        .map_err(io)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    paths.sort();
    paths
        .into_iter()
        .map(|p| {
            let path = p.display().to_string();
            let text = std::fs::read_to_string(&p).map_err(|source| ConfigError::Io {
                path: path.clone(),
                source,
            })?;
            let json =
                serde_json::from_str(&text).map_err(|source| ConfigError::Json { path, source })?;
            let name = p
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default();
            Ok(Dashboard { name, json })
        })
        .collect()
}

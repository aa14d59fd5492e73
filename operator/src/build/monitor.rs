//! The Prometheus Operator ServiceMonitor (`monitoring.coreos.com/v1`), typed with just the
//! fields the operator sets.

use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::Owner;
use ferrite_api::crd::ServiceMonitorSpec as MonitorSettings;

/// The subset of the Prometheus Operator's ServiceMonitor spec the operator writes.
#[derive(CustomResource, JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "monitoring.coreos.com",
    version = "v1",
    kind = "ServiceMonitor",
    plural = "servicemonitors",
    namespaced,
    derive = "PartialEq"
)]
#[serde(rename_all = "camelCase")]
pub struct ServiceMonitorSpec {
    pub selector: LabelSelector,
    pub endpoints: Vec<Endpoint>,
}

#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct LabelSelector {
    pub match_labels: std::collections::BTreeMap<String, String>,
}

#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Endpoint {
    pub port: String,
    pub path: String,
    pub interval: String,
    pub scheme: String,
}

/// The CRD whose presence decides whether monitors can be created.
pub const SERVICE_MONITOR_CRD: &str = "servicemonitors.monitoring.coreos.com";

/// The monitor of one InferenceService; `defaults` (the operator's `--monitor-label`s) sit
/// under the spec's own labels.
pub(crate) fn service_monitor(
    settings: &MonitorSettings,
    defaults: &std::collections::BTreeMap<String, String>,
    owner: &Owner,
) -> ServiceMonitor {
    let spec = ServiceMonitorSpec {
        // The Service carries the owner's labels; select it by the instance label only.
        selector: LabelSelector {
            match_labels: std::collections::BTreeMap::from([(
                ferrite_api::labels::INSTANCE_LABEL.to_string(),
                owner.name.clone(),
            )]),
        },
        endpoints: vec![Endpoint {
            port: "http".into(),
            path: "/metrics".into(),
            interval: settings.interval.clone(),
            scheme: "http".into(),
        }],
    };
    let mut sm = ServiceMonitor::new(&owner.name, spec);
    let mut labels = defaults.clone();
    labels.extend(settings.labels.clone());
    sm.metadata = owner.meta(owner.name.clone(), &labels);
    sm
}

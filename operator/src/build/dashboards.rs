//! Grafana dashboard ConfigMaps for the Grafana sidecar. Each InferenceService gets its own
//! copy, with a unique uid (the sidecar loads every ConfigMap it finds; equal uids would
//! overwrite each other) and its `model_name` variable preset to its served name.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::ConfigMap;
use serde_json::Value;

use ferrite_api::served::served_name;

use super::{BuildError, Owner};
use crate::config::OperatorConfig;
use ferrite_api::crd::InferenceService;
use ferrite_api::hash::fnv1a;
use ferrite_api::labels::COMPONENT_LABEL;

/// `app.kubernetes.io/component` of the dashboard ConfigMaps, so the operator can list (and
/// prune) exactly its own.
pub const DASHBOARD_COMPONENT: &str = "dashboard";

/// Annotation the Grafana sidecar reads to place a dashboard in a folder.
pub const FOLDER_ANNOTATION: &str = "grafana_folder";

/// A Grafana uid (at most 40 characters) unique to this resource and dashboard.
pub fn dashboard_uid(namespace: &str, name: &str, dashboard: &str) -> String {
    format!(
        "ferrite-{dashboard:.14}-{:016x}",
        fnv1a(format!("{namespace}/{name}/{dashboard}").as_bytes())
    )
}

/// This resource's copy of one dashboard.
pub fn personalise(
    json: &Value,
    dashboard: &str,
    owner_namespace: &str,
    owner_name: &str,
    served: &str,
) -> Result<Value, BuildError> {
    let mut d = json.clone();
    let obj = d
        .as_object_mut()
        .ok_or_else(|| BuildError::Dashboard(dashboard.into(), "not a JSON object"))?;
    let title = obj
        .get("title")
        .and_then(Value::as_str)
        .unwrap_or(dashboard)
        .to_string();
    obj.insert(
        "uid".into(),
        Value::String(dashboard_uid(owner_namespace, owner_name, dashboard)),
    );
    obj.insert(
        "title".into(),
        Value::String(format!("{title} ({owner_namespace}/{owner_name})")),
    );
    obj.remove("id");
    if let Some(vars) = obj
        .get_mut("templating")
        .and_then(|t| t.get_mut("list"))
        .and_then(Value::as_array_mut)
    {
        for v in vars
            .iter_mut()
            .filter(|v| v.get("name").and_then(Value::as_str) == Some("model_name"))
        {
            v["current"] = serde_json::json!({"text": served, "value": served, "selected": true});
        }
    }
    Ok(d)
}

pub(crate) fn config_maps(
    isvc: &InferenceService,
    config: &OperatorConfig,
    owner: &Owner,
) -> Result<Vec<ConfigMap>, BuildError> {
    let spec = &isvc.spec.monitoring.dashboards;
    let served = served_name(isvc);
    config
        .dashboards
        .iter()
        .map(|d| {
            let json = personalise(&d.json, &d.name, &owner.namespace, &owner.name, &served)?;
            let mut labels = spec.labels.clone();
            labels.insert(COMPONENT_LABEL.into(), DASHBOARD_COMPONENT.into());
            let mut meta = owner.meta(format!("{}-dashboard-{}", owner.name, d.name), &labels);
            if let Some(folder) = &spec.folder {
                meta.annotations = Some(BTreeMap::from([(
                    FOLDER_ANNOTATION.to_string(),
                    folder.clone(),
                )]));
            }
            Ok(ConfigMap {
                metadata: meta,
                data: Some(BTreeMap::from([(
                    format!("{}-{}.json", owner.name, d.name),
                    json.to_string(),
                )])),
                ..ConfigMap::default()
            })
        })
        .collect()
}

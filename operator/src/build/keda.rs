//! The KEDA ScaledObject for `autoscaling.mode: KEDA`, for clusters that run KEDA (which owns
//! the External Metrics API there, so HPA mode's cannot be installed beside it). KEDA scales
//! the InferenceService through its scale subresource, on one of two kinds of trigger.
//!
//! `scaler: External` (the default where the operator serves it): KEDA's `external` scaler,
//! the operator's own (`crate::keda_scaler`), one trigger per target with its `signal` in the
//! metadata (`queue`, an `AverageValue`; `kv-cache`, a `Value`). No Prometheus: the answers
//! are the built-in autoscaler's signals, and `IsActive` (any request running, waiting or held)
//! decides scale to and from zero.
//!
//! `scaler: Prometheus`: `prometheus` triggers that read the
//! signals the built-in autoscaler uses from the Prometheus that scrapes the pods (the
//! ServiceMonitor's target labels `namespace` and `service`) and the routers (their own
//! `namespace` and `inferenceservice` labels, kept by the router ServiceMonitor's
//! `honorLabels`):
//!
//! - `queue` (with `queuePerReplica`): the pods' waiting requests plus those the routers queue
//!   for the service, as an `AverageValue` (KEDA's HPA divides by the replicas, as Builtin
//!   mode does);
//! - `kv-cache` (with `kvCacheUsage`): the pods' mean KV-cache usage, a `Value`;
//! - `activity` (only with `minReplicas: 0`): requests running, waiting, queued or held in a
//!   router. It only decides whether the service is active: its target is out of reach, so it
//!   never asks for more than one replica. Idle for `idleTimeoutSeconds` (KEDA's
//!   `cooldownPeriod`), KEDA scales to zero; a request the router holds wakes it (as does the
//!   router's own wake).
//!
//! The spec's behaviour becomes the HPA behaviour KEDA's HPA gets, as in HPA mode.

use std::collections::BTreeMap;

use k8s_openapi::api::autoscaling::v2::HorizontalPodAutoscalerBehavior;
use kube::{CustomResource, Resource};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{BuildError, Owner};
use ferrite_api::crd::{AutoscalingMode, AutoscalingSpec, InferenceService, KedaScaler};

/// The subset of KEDA's ScaledObject spec the operator writes.
#[derive(CustomResource, JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "keda.sh",
    version = "v1alpha1",
    kind = "ScaledObject",
    plural = "scaledobjects",
    namespaced,
    derive = "PartialEq"
)]
#[serde(rename_all = "camelCase")]
pub struct ScaledObjectSpec {
    pub scale_target_ref: ScaleTargetRef,
    pub polling_interval: i32,
    pub cooldown_period: i32,
    pub min_replica_count: i32,
    pub max_replica_count: i32,
    pub advanced: Advanced,
    pub triggers: Vec<Trigger>,
}

#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ScaleTargetRef {
    pub api_version: String,
    pub kind: String,
    pub name: String,
}

#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Advanced {
    pub horizontal_pod_autoscaler_config: HpaConfig,
}

#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct HpaConfig {
    pub behavior: HorizontalPodAutoscalerBehavior,
}

#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Trigger {
    #[serde(rename = "type")]
    pub type_: String,
    pub name: String,
    pub metric_type: String,
    pub metadata: BTreeMap<String, String>,
}

/// The CRD whose presence decides whether KEDA mode can work.
pub const SCALED_OBJECT_CRD: &str = "scaledobjects.keda.sh";

/// Scale-to-zero's activity trigger target: beyond any real count, so that it never asks for
/// a second replica.
const ACTIVITY_TARGET: &str = "1000000";

/// KEDA's defaults where the spec has none: its polling interval is 30 s, ours a scrape's 15.
const DEFAULT_POLLING_SECONDS: i32 = 15;
const DEFAULT_COOLDOWN_SECONDS: i32 = 300;

/// What an external trigger asks about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Signal {
    Queue,
    KvCache,
}

impl Signal {
    /// The trigger's name and its `signal` metadata.
    pub fn name(self) -> &'static str {
        match self {
            Signal::Queue => "queue",
            Signal::KvCache => "kv-cache",
        }
    }

    pub fn parse(s: &str) -> Option<Signal> {
        [Signal::Queue, Signal::KvCache]
            .into_iter()
            .find(|x| x.name() == s)
    }
}

/// The scaler a KEDA-mode spec uses: its own choice; else `Prometheus` when it names a
/// Prometheus, `External` when the operator serves it, else `Prometheus`.
pub fn effective_scaler(spec: &AutoscalingSpec, operator_serves: bool) -> KedaScaler {
    let keda = spec.keda.as_ref();
    match keda.and_then(|k| k.scaler) {
        Some(s) => s,
        None if keda.is_some_and(|k| k.server_address.is_some()) => KedaScaler::Prometheus,
        None if operator_serves => KedaScaler::External,
        None => KedaScaler::Prometheus,
    }
}

/// The PromQL each trigger runs for the InferenceService `namespace/name`.
#[derive(Debug, Clone, PartialEq)]
pub struct Queries {
    pub queue: String,
    pub kv_cache: String,
    pub activity: String,
}

/// The queries, each an instant vector that is never empty (a missing series counts 0).
pub fn queries(namespace: &str, name: &str) -> Queries {
    let pods = format!(r#"{{namespace="{namespace}", service="{name}"}}"#);
    let routers = format!(r#"{{namespace="{namespace}", inferenceservice="{name}"}}"#);
    let sum = |metric: &str, labels: &str| format!("(sum({metric}{labels}) or vector(0))");
    let waiting = sum("vllm:num_requests_waiting", &pods);
    let queued = sum("ferrite_router_queued_requests", &routers);
    Queries {
        queue: format!("{waiting} + {queued}"),
        kv_cache: format!("avg(vllm:kv_cache_usage_perc{pods}) or vector(0)"),
        activity: [
            sum("vllm:num_requests_running", &pods),
            waiting.clone(),
            queued.clone(),
            sum("ferrite_router_held_requests", &routers),
        ]
        .join(" + "),
    }
}

/// Where the operator's settings point KEDA.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Sources<'a> {
    /// The operator may write ScaledObjects (`--keda`).
    pub allowed: bool,
    /// The Prometheus of `--keda-prometheus-address`.
    pub prometheus: Option<&'a str>,
    /// `host:port` of the operator's external scaler, where it serves one.
    pub external: Option<&'a str>,
}

/// The ScaledObject, or `None` unless the mode is `KEDA`; an error where the operator may not
/// write one, without KEDA's CRD, or without the scaler the spec uses.
pub(crate) fn scaled_object(
    isvc: &InferenceService,
    owner: &Owner,
    sources: Sources<'_>,
    keda_installed: bool,
) -> Result<Option<ScaledObject>, BuildError> {
    let Some(spec) = isvc
        .spec
        .autoscaling
        .as_ref()
        .filter(|a| a.mode == AutoscalingMode::Keda)
    else {
        return Ok(None);
    };
    if !sources.allowed {
        return Err(BuildError::KedaNotEnabled);
    }
    if !keda_installed {
        return Err(BuildError::KedaNotInstalled);
    }
    let triggers = match effective_scaler(spec, sources.external.is_some()) {
        KedaScaler::External => {
            external_triggers(spec, sources.external.ok_or(BuildError::KedaScalerOff)?)
        }
        KedaScaler::Prometheus => {
            let address = spec
                .keda
                .as_ref()
                .and_then(|k| k.server_address.as_deref())
                .or(sources.prometheus)
                .ok_or(BuildError::KedaPrometheusAddress)?;
            triggers(spec, &queries(&owner.namespace, &owner.name), address)
        }
    };
    let mut so = ScaledObject::new(
        &owner.name,
        ScaledObjectSpec {
            scale_target_ref: ScaleTargetRef {
                api_version: InferenceService::api_version(&()).into_owned(),
                kind: InferenceService::kind(&()).into_owned(),
                name: owner.name.clone(),
            },
            polling_interval: spec
                .scrape_interval_seconds
                .unwrap_or(DEFAULT_POLLING_SECONDS),
            cooldown_period: spec
                .idle_timeout_seconds
                .unwrap_or(DEFAULT_COOLDOWN_SECONDS),
            min_replica_count: spec.min_replicas,
            max_replica_count: spec.max_replicas.max(spec.min_replicas).max(1),
            advanced: Advanced {
                horizontal_pod_autoscaler_config: HpaConfig {
                    behavior: super::hpa::behavior(&spec.behavior),
                },
            },
            triggers,
        },
    );
    so.metadata = owner.meta(owner.name.clone(), &BTreeMap::new());
    Ok(Some(so))
}

/// One `external` trigger per target, each naming its signal; the operator answers with the
/// spec's target and the current value.
fn external_triggers(spec: &AutoscalingSpec, address: &str) -> Vec<Trigger> {
    let targets = [
        (
            Signal::Queue,
            "AverageValue",
            spec.targets.queue_per_replica,
        ),
        (Signal::KvCache, "Value", spec.targets.kv_cache_usage),
    ];
    targets
        .into_iter()
        .filter(|t| t.2.is_some())
        .map(|(signal, metric_type, _)| Trigger {
            type_: "external".into(),
            name: signal.name().into(),
            metric_type: metric_type.into(),
            metadata: BTreeMap::from([
                ("scalerAddress".into(), address.to_string()),
                ("signal".into(), signal.name().into()),
            ]),
        })
        .collect()
}

fn triggers(spec: &AutoscalingSpec, q: &Queries, address: &str) -> Vec<Trigger> {
    let prometheus =
        |name: &str, metric_type: &str, query: &str, target: String, active: &str| Trigger {
            type_: "prometheus".into(),
            name: name.into(),
            metric_type: metric_type.into(),
            metadata: BTreeMap::from([
                ("serverAddress".into(), address.to_string()),
                ("query".into(), query.to_string()),
                ("threshold".into(), target),
                ("activationThreshold".into(), active.to_string()),
            ]),
        };
    let mut out = Vec::new();
    if let Some(target) = spec.targets.queue_per_replica {
        out.push(prometheus(
            "queue",
            "AverageValue",
            &q.queue,
            target.to_string(),
            "0",
        ));
    }
    if let Some(target) = spec.targets.kv_cache_usage {
        // Never active by itself (usage is at most 1): activity is the `activity` trigger's.
        out.push(prometheus(
            "kv-cache",
            "Value",
            &q.kv_cache,
            target.to_string(),
            "1",
        ));
    }
    if spec.min_replicas == 0 {
        out.push(prometheus(
            "activity",
            "AverageValue",
            &q.activity,
            ACTIVITY_TARGET.into(),
            "0",
        ));
    }
    out
}

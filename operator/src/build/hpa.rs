//! The HorizontalPodAutoscaler for `autoscaling.mode: HPA`: the stock HPA scales the
//! InferenceService (through its scale subresource) on the metrics the operator serves on the
//! External Metrics API (`crate::external_metrics`), with the spec's behaviour translated to
//! HPA policies.
//!
//! - `queuePerReplica` → External `ferrite_requests_waiting` (the sum over pods) with an
//!   `AverageValue` target: HPA divides the sum by the current replicas, the same ratio the
//!   built-in autoscaler uses.
//! - `kvCacheUsage` → External `ferrite_kv_cache_usage` (already an average) with a `Value`
//!   target: desired = current × usage / target.
//!
//! Differences from Builtin mode: no panic mode and no scale to zero. minReplicas is at least 1
//! because HPA's minReplicas 0 needs the alpha `HPAScaleToZero` feature gate.

use std::collections::BTreeMap;

use k8s_openapi::api::autoscaling::v2::{
    CrossVersionObjectReference, ExternalMetricSource, HPAScalingPolicy, HPAScalingRules,
    HorizontalPodAutoscaler, HorizontalPodAutoscalerBehavior, HorizontalPodAutoscalerSpec,
    MetricIdentifier, MetricSpec, MetricTarget,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use kube::Resource;

use super::Owner;
use ferrite_api::crd::{AutoscalingMode, InferenceService, ScalingBehavior};
use ferrite_api::labels::INSTANCE_LABEL;
use ferrite_api::signal::{Signal, quantity};

/// Defaults, matching the built-in autoscaler's (`autoscale::algorithm::Policy`).
pub const DEFAULT_SCALE_UP_STABILIZATION_SECONDS: i32 = 0;
pub const DEFAULT_SCALE_DOWN_STABILIZATION_SECONDS: i32 = 300;
pub const DEFAULT_MAX_SCALE_UP_PERCENT: i32 = 100;
pub const DEFAULT_MAX_SCALE_DOWN_PERCENT: i32 = 50;
/// The rate policies' period: the spec's limits are per minute.
const POLICY_PERIOD_SECONDS: i32 = 60;

/// The HPA, named and labelled like the InferenceService's other children. `None` unless the
/// mode is `HPA`, and also without any target: an HPA with no metrics gets the API server's
/// default of 80% CPU, which is never what an LLM server should scale on (the CRD requires a
/// target, so this only guards against schema drift).
pub(crate) fn hpa(isvc: &InferenceService, owner: &Owner) -> Option<HorizontalPodAutoscaler> {
    let spec = isvc
        .spec
        .autoscaling
        .as_ref()
        .filter(|a| a.mode == AutoscalingMode::Hpa)?;
    let mut metrics = Vec::new();
    if let Some(target) = spec.targets.queue_per_replica.and_then(quantity) {
        metrics.push(external(
            Signal::RequestsWaiting,
            &owner.name,
            MetricTarget {
                type_: "AverageValue".into(),
                average_value: Some(target),
                ..MetricTarget::default()
            },
        ));
    }
    if let Some(target) = spec.targets.kv_cache_usage.and_then(quantity) {
        metrics.push(external(
            Signal::KvCacheUsage,
            &owner.name,
            MetricTarget {
                type_: "Value".into(),
                value: Some(target),
                ..MetricTarget::default()
            },
        ));
    }
    if metrics.is_empty() {
        return None;
    }
    let min_replicas = spec.min_replicas.max(1);
    Some(HorizontalPodAutoscaler {
        metadata: owner.meta(owner.name.clone(), &BTreeMap::new()),
        spec: Some(HorizontalPodAutoscalerSpec {
            scale_target_ref: CrossVersionObjectReference {
                api_version: Some(InferenceService::api_version(&()).into_owned()),
                kind: InferenceService::kind(&()).into_owned(),
                name: owner.name.clone(),
            },
            min_replicas: Some(min_replicas),
            max_replicas: spec.max_replicas.max(min_replicas),
            metrics: Some(metrics),
            behavior: Some(behavior(&spec.behavior)),
        }),
        ..HorizontalPodAutoscaler::default()
    })
}

/// An External metric selecting this InferenceService's series.
fn external(metric: Signal, name: &str, target: MetricTarget) -> MetricSpec {
    MetricSpec {
        type_: "External".into(),
        external: Some(ExternalMetricSource {
            metric: MetricIdentifier {
                name: metric.external_name().into(),
                selector: Some(LabelSelector {
                    match_labels: Some(BTreeMap::from([(
                        INSTANCE_LABEL.to_string(),
                        name.to_string(),
                    )])),
                    ..LabelSelector::default()
                }),
            },
            target,
        }),
        ..MetricSpec::default()
    }
}

/// The spec's windows and per-minute percentages as HPA scaling rules. `tolerance` is set only
/// when the spec sets it: the field is alpha in Kubernetes 1.33 (feature gate
/// `HPAConfigurableTolerance`); API servers without the gate drop it and HPA uses its
/// cluster-wide tolerance (default 10%).
pub(crate) fn behavior(b: &ScalingBehavior) -> HorizontalPodAutoscalerBehavior {
    let tolerance = b.tolerance.and_then(quantity);
    let rules = |window: i32, percent: i32| HPAScalingRules {
        stabilization_window_seconds: Some(window),
        policies: Some(vec![HPAScalingPolicy {
            type_: "Percent".into(),
            value: percent,
            period_seconds: POLICY_PERIOD_SECONDS,
        }]),
        select_policy: None,
        tolerance: tolerance.clone(),
    };
    HorizontalPodAutoscalerBehavior {
        scale_up: Some(rules(
            b.scale_up_stabilization_seconds
                .unwrap_or(DEFAULT_SCALE_UP_STABILIZATION_SECONDS),
            b.max_scale_up_percent_per_minute
                .unwrap_or(DEFAULT_MAX_SCALE_UP_PERCENT),
        )),
        scale_down: Some(rules(
            b.scale_down_stabilization_seconds
                .unwrap_or(DEFAULT_SCALE_DOWN_STABILIZATION_SECONDS),
            b.max_scale_down_percent_per_minute
                .unwrap_or(DEFAULT_MAX_SCALE_DOWN_PERCENT),
        )),
    }
}

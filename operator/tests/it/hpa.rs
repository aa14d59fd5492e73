//! The HorizontalPodAutoscaler built for `autoscaling.mode: HPA`: its fields for each target
//! combination and behaviour, and Kubernetes' own schema (strict) accepting it.

use std::collections::BTreeMap;

use ferrite_api::crd::InferenceService;
use ferrite_operator::build::{BuildError, ClusterCapabilities, build};
use ferrite_operator::config::OperatorConfig;
use k8s_openapi::api::autoscaling::v2::{HPAScalingRules, HorizontalPodAutoscaler, MetricSpec};
use serde_json::{Value, json};

fn isvc(autoscaling: Value) -> InferenceService {
    serde_json::from_value(json!({
        "apiVersion": "ferrite.dev/v1alpha1", "kind": "InferenceService",
        "metadata": {"name": "chat", "namespace": "ml", "uid": "1234-abcd"},
        "spec": {"model": {"source": "/models/m.gguf"}, "autoscaling": autoscaling},
    }))
    .expect("valid InferenceService")
}

/// The HPA the build step makes for `isvc`, if any.
fn hpa_for(isvc: &InferenceService) -> Result<Option<HorizontalPodAutoscaler>, BuildError> {
    let caps = ClusterCapabilities {
        service_monitor_crd: false,
        scaled_object_crd: false,
        leader_worker_set_crd: false,
    };
    build(isvc, &OperatorConfig::default(), caps).map(|d| d.hpa)
}

fn built(autoscaling: Value) -> HorizontalPodAutoscaler {
    hpa_for(&isvc(autoscaling))
        .expect("build")
        .expect("an HPA in HPA mode")
}

fn metric<'a>(h: &'a HorizontalPodAutoscaler, name: &str) -> Option<&'a MetricSpec> {
    h.spec
        .as_ref()
        .and_then(|s| s.metrics.as_ref())
        .and_then(|m| {
            m.iter()
                .find(|m| m.external.as_ref().is_some_and(|e| e.metric.name == name))
        })
}

/// (stabilization window, policy type, value, period) of one direction.
fn rule(r: Option<&HPAScalingRules>) -> (i32, String, i32, i32) {
    let r = r.expect("rules");
    let policies = r.policies.as_ref().expect("policies");
    assert_eq!(policies.len(), 1, "{policies:?}");
    let p = &policies[0];
    (
        r.stabilization_window_seconds.expect("window"),
        p.type_.clone(),
        p.value,
        p.period_seconds,
    )
}

#[test]
fn hpa_default_behaviour_and_both_targets() {
    let h = built(json!({"mode": "HPA", "minReplicas": 2, "maxReplicas": 8,
                         "targets": {"queuePerReplica": 1.5, "kvCacheUsage": 0.8}}));
    let meta = &h.metadata;
    assert_eq!(meta.name.as_deref(), Some("chat"));
    assert_eq!(meta.namespace.as_deref(), Some("ml"));
    let labels = meta.labels.as_ref().expect("labels");
    assert_eq!(labels["ferrite.dev/inferenceservice"], "chat");
    assert_eq!(labels["app.kubernetes.io/managed-by"], "ferrite-operator");
    let owner = &meta.owner_references.as_ref().expect("owner")[0];
    assert_eq!(
        (owner.kind.as_str(), owner.name.as_str(), owner.uid.as_str()),
        ("InferenceService", "chat", "1234-abcd")
    );
    assert_eq!(owner.controller, Some(true));

    let spec = h.spec.as_ref().expect("spec");
    assert_eq!(
        spec.scale_target_ref.api_version.as_deref(),
        Some("ferrite.dev/v1alpha1")
    );
    assert_eq!(spec.scale_target_ref.kind, "InferenceService");
    assert_eq!(spec.scale_target_ref.name, "chat");
    assert_eq!(spec.min_replicas, Some(2));
    assert_eq!(spec.max_replicas, 8);
    assert_eq!(spec.metrics.as_ref().expect("metrics").len(), 2);

    let queue = metric(&h, "ferrite_requests_waiting").expect("queue metric");
    assert_eq!(queue.type_, "External");
    let ext = queue.external.as_ref().expect("external");
    let selector = ext.metric.selector.as_ref().expect("selector");
    assert_eq!(
        selector.match_labels,
        Some(BTreeMap::from([(
            "ferrite.dev/inferenceservice".to_string(),
            "chat".to_string()
        )]))
    );
    assert_eq!(ext.target.type_, "AverageValue");
    assert_eq!(
        ext.target.average_value.as_ref().map(|q| q.0.as_str()),
        Some("1500m")
    );
    assert_eq!(ext.target.value, None);

    let kv = metric(&h, "ferrite_kv_cache_usage").expect("kv metric");
    let ext = kv.external.as_ref().expect("external");
    assert_eq!(ext.target.type_, "Value");
    assert_eq!(
        ext.target.value.as_ref().map(|q| q.0.as_str()),
        Some("800m")
    );
    assert_eq!(ext.target.average_value, None);
    assert_eq!(
        ext.metric
            .selector
            .as_ref()
            .and_then(|s| s.match_labels.as_ref()),
        selector.match_labels.as_ref()
    );

    let behavior = spec.behavior.as_ref().expect("behavior");
    assert_eq!(
        rule(behavior.scale_up.as_ref()),
        (0, "Percent".into(), 100, 60)
    );
    assert_eq!(
        rule(behavior.scale_down.as_ref()),
        (300, "Percent".into(), 50, 60)
    );
    for r in [&behavior.scale_up, &behavior.scale_down] {
        let r = r.as_ref().expect("rules");
        assert_eq!(r.tolerance, None, "tolerance only when the spec sets it");
        assert_eq!(r.select_policy, None);
    }

    // The wire form: apiVersion/kind and camelCase fields as kubectl would show them.
    let v = serde_json::to_value(&h).expect("json");
    assert_eq!(v["apiVersion"], "autoscaling/v2");
    assert_eq!(v["kind"], "HorizontalPodAutoscaler");
    assert_eq!(
        v["spec"]["metrics"][0],
        json!({"type": "External", "external": {
            "metric": {"name": "ferrite_requests_waiting",
                       "selector": {"matchLabels": {"ferrite.dev/inferenceservice": "chat"}}},
            "target": {"type": "AverageValue", "averageValue": "1500m"}}})
    );
}

#[test]
fn hpa_one_target_each() {
    let q = built(json!({"mode": "HPA", "minReplicas": 1, "maxReplicas": 4,
                         "targets": {"queuePerReplica": 4}}));
    let metrics = q
        .spec
        .as_ref()
        .and_then(|s| s.metrics.as_ref())
        .expect("metrics");
    assert_eq!(metrics.len(), 1);
    let ext = metric(&q, "ferrite_requests_waiting")
        .and_then(|m| m.external.as_ref())
        .expect("queue metric");
    assert_eq!(
        ext.target.average_value.as_ref().map(|q| q.0.as_str()),
        Some("4")
    );

    let kv = built(json!({"mode": "HPA", "minReplicas": 1, "maxReplicas": 4,
                          "targets": {"kvCacheUsage": 0.75}}));
    let metrics = kv
        .spec
        .as_ref()
        .and_then(|s| s.metrics.as_ref())
        .expect("metrics");
    assert_eq!(metrics.len(), 1);
    assert!(metric(&kv, "ferrite_requests_waiting").is_none());
    let ext = metric(&kv, "ferrite_kv_cache_usage")
        .and_then(|m| m.external.as_ref())
        .expect("kv metric");
    assert_eq!(
        ext.target.value.as_ref().map(|q| q.0.as_str()),
        Some("750m")
    );
}

#[test]
fn hpa_custom_behaviour_and_tolerance() {
    let h = built(json!({"mode": "HPA", "minReplicas": 1, "maxReplicas": 10,
        "targets": {"queuePerReplica": 2},
        "behavior": {"scaleUpStabilizationSeconds": 30, "scaleDownStabilizationSeconds": 600,
                     "maxScaleUpPercentPerMinute": 200, "maxScaleDownPercentPerMinute": 10,
                     "tolerance": 0.05}}));
    let behavior = h
        .spec
        .as_ref()
        .and_then(|s| s.behavior.as_ref())
        .expect("behavior");
    assert_eq!(
        rule(behavior.scale_up.as_ref()),
        (30, "Percent".into(), 200, 60)
    );
    assert_eq!(
        rule(behavior.scale_down.as_ref()),
        (600, "Percent".into(), 10, 60)
    );
    for r in [&behavior.scale_up, &behavior.scale_down] {
        let t = r.as_ref().and_then(|r| r.tolerance.as_ref());
        assert_eq!(t.map(|q| q.0.as_str()), Some("50m"));
    }
}

#[test]
fn hpa_min_zero_becomes_one() {
    let h = built(json!({"mode": "HPA", "minReplicas": 0, "maxReplicas": 3,
                         "idleTimeoutSeconds": 300, "targets": {"queuePerReplica": 1}}));
    let spec = h.spec.as_ref().expect("spec");
    assert_eq!(spec.min_replicas, Some(1));
    assert_eq!(spec.max_replicas, 3);
}

#[test]
fn hpa_only_in_hpa_mode() {
    let targets = json!({"queuePerReplica": 1});
    for autoscaling in [
        json!({"minReplicas": 1, "maxReplicas": 3, "targets": targets}),
        json!({"mode": "Builtin", "minReplicas": 1, "maxReplicas": 3, "targets": targets}),
    ] {
        assert_eq!(hpa_for(&isvc(autoscaling)).expect("build"), None);
    }
    let plain: InferenceService = serde_json::from_value(json!({
        "apiVersion": "ferrite.dev/v1alpha1", "kind": "InferenceService",
        "metadata": {"name": "chat", "namespace": "ml", "uid": "u"},
        "spec": {"model": {"source": "/m.gguf"}}}))
    .expect("isvc");
    assert_eq!(hpa_for(&plain).expect("build"), None);
    // No targets (the CRD forbids it): no HPA rather than one defaulting to CPU.
    assert_eq!(
        hpa_for(&isvc(
            json!({"mode": "HPA", "minReplicas": 1, "maxReplicas": 3, "targets": {}})
        ))
        .expect("build"),
        None
    );
}

#[test]
fn hpa_needs_namespace_and_uid() {
    let no_uid: InferenceService = serde_json::from_value(json!({
        "apiVersion": "ferrite.dev/v1alpha1", "kind": "InferenceService",
        "metadata": {"name": "chat", "namespace": "ml"},
        "spec": {"model": {"source": "/m.gguf"}, "autoscaling":
                 {"mode": "HPA", "minReplicas": 1, "maxReplicas": 3,
                  "targets": {"queuePerReplica": 1}}}}))
    .expect("isvc");
    assert_eq!(hpa_for(&no_uid), Err(BuildError::MissingMetadata("uid")));
}

/// Kubernetes' schema for autoscaling/v2 accepts the HPAs strictly (no unknown fields); the
/// alpha `tolerance` only from 1.33, where the field exists.
#[test]
fn hpa_passes_kubernetes_schemas_strictly() {
    let dir = ferrite_testkit::validate::temp_dir("hpa");
    let plain: Vec<Value> = [
        json!({"mode": "HPA", "minReplicas": 1, "maxReplicas": 8,
               "targets": {"queuePerReplica": 1.5, "kvCacheUsage": 0.8}}),
        json!({"mode": "HPA", "minReplicas": 0, "maxReplicas": 3, "idleTimeoutSeconds": 60,
               "targets": {"queuePerReplica": 2}}),
        json!({"mode": "HPA", "minReplicas": 2, "maxReplicas": 2,
               "targets": {"kvCacheUsage": 0.7},
               "behavior": {"scaleUpStabilizationSeconds": 3600,
                            "maxScaleUpPercentPerMinute": 1000,
                            "maxScaleDownPercentPerMinute": 100}}),
    ]
    .into_iter()
    .map(|a| serde_json::to_value(built(a)).expect("json"))
    .collect();
    let plain_file = ferrite_testkit::validate::write_yaml(&dir, "hpa.yaml", &plain);
    for version in ["1.29.0", "1.32.0", "1.33.0"] {
        let (ok, out) =
            ferrite_testkit::validate::kubernetes(version, std::slice::from_ref(&plain_file));
        assert!(ok, "{version}: {out}");
        assert_eq!(
            out.lines()
                .filter(|l| l.starts_with("ok") && l.contains("HorizontalPodAutoscaler/chat"))
                .count(),
            3,
            "{out}"
        );
    }

    let tolerant = serde_json::to_value(built(json!({"mode": "HPA", "minReplicas": 1,
        "maxReplicas": 4, "targets": {"queuePerReplica": 1}, "behavior": {"tolerance": 0.05}})))
    .expect("json");
    let tolerant_file = ferrite_testkit::validate::write_yaml(&dir, "tolerant.yaml", &[tolerant]);
    let (ok, out) =
        ferrite_testkit::validate::kubernetes("1.33.0", std::slice::from_ref(&tolerant_file));
    assert!(ok, "{out}");
    // Before 1.33 the field does not exist, so strict validation rejects it: the check can fail.
    let (ok, out) = ferrite_testkit::validate::kubernetes("1.32.0", &[tolerant_file]);
    assert!(!ok, "tolerance passed the 1.32 schema: {out}");
    assert!(out.contains("tolerance"), "{out}");

    // A broken object is rejected too (maxReplicas must be an integer).
    let mut broken = plain[0].clone();
    broken["spec"]["maxReplicas"] = json!("many");
    let bad = ferrite_testkit::validate::write_yaml(&dir, "bad.yaml", &[broken]);
    let (ok, out) = ferrite_testkit::validate::kubernetes("1.32.0", &[bad]);
    assert!(!ok, "{out}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// KEDA mode: no HPA of the operator's, and a ScaledObject only where KEDA is installed and a
/// Prometheus is named (the operator's, or the spec's own); else `Degraded` with a reason
/// that says what to do.
#[test]
fn keda_mode_needs_keda_and_a_prometheus() {
    let keda = |extra: Value| {
        let mut a = json!({"mode": "KEDA", "minReplicas": 1, "maxReplicas": 3,
                           "targets": {"queuePerReplica": 2.0}});
        if let (Some(a), Some(extra)) = (a.as_object_mut(), extra.as_object()) {
            a.extend(extra.clone());
        }
        isvc(a)
    };
    let caps = |installed| ClusterCapabilities {
        service_monitor_crd: false,
        scaled_object_crd: installed,
        leader_worker_set_crd: false,
    };
    let allowed = OperatorConfig {
        keda: true,
        ..OperatorConfig::default()
    };
    let with_address = OperatorConfig {
        keda_prometheus_address: Some("http://prometheus:9090".into()),
        ..allowed.clone()
    };
    // An operator whose RBAC has no ScaledObjects (the chart without keda.enabled) says so.
    let off = OperatorConfig {
        keda: false,
        ..with_address.clone()
    };
    let not_enabled = build(&keda(json!({})), &off, caps(true)).expect_err("not enabled");
    assert_eq!(not_enabled.reason(), "KedaNotEnabled");
    assert!(
        not_enabled.to_string().contains("keda.enabled"),
        "{not_enabled}"
    );
    let missing = build(&keda(json!({})), &with_address, caps(false)).expect_err("no KEDA");
    assert_eq!(missing.reason(), "KedaNotInstalled");
    assert!(
        missing.to_string().contains("scaledobjects.keda.sh"),
        "{missing}"
    );
    let no_address = build(&keda(json!({})), &allowed, caps(true)).expect_err("no address");
    assert_eq!(no_address.reason(), "KedaPrometheusAddressMissing");
    assert!(
        no_address.to_string().contains("serverAddress"),
        "{no_address}"
    );

    let d = build(&keda(json!({})), &with_address, caps(true)).expect("builds");
    assert!(d.hpa.is_none(), "KEDA makes its own HPA");
    let so = serde_json::to_value(d.scaled_object.expect("a ScaledObject")).expect("json");
    let triggers = so["spec"]["triggers"].as_array().expect("triggers");
    assert_eq!(
        triggers.len(),
        1,
        "queue only: no kv target, no scale to zero"
    );
    assert_eq!(
        triggers[0]["metadata"]["serverAddress"],
        "http://prometheus:9090"
    );
    assert_eq!(so["spec"]["minReplicaCount"], 1);
    let own = build(
        &keda(json!({"keda": {"serverAddress": "https://thanos:10902"}})),
        &allowed,
        caps(true),
    )
    .expect("a spec's own Prometheus");
    let own = serde_json::to_value(own.scaled_object.expect("a ScaledObject")).expect("json");
    assert_eq!(
        own["spec"]["triggers"][0]["metadata"]["serverAddress"],
        "https://thanos:10902"
    );
    // Where the operator serves the external scaler, specs default to it: one `external`
    // trigger per target, naming its signal; asking for it where it is not served is refused.
    let serving = OperatorConfig {
        keda_scaler_address: Some("ferrite-operator.ferrite-system.svc:9443".into()),
        ..with_address.clone()
    };
    let d = build(&keda(json!({})), &serving, caps(true)).expect("builds");
    let so = serde_json::to_value(d.scaled_object.expect("a ScaledObject")).expect("json");
    assert_eq!(
        so["spec"]["triggers"],
        json!([{"type": "external", "name": "queue", "metricType": "AverageValue",
                "metadata": {"scalerAddress": "ferrite-operator.ferrite-system.svc:9443",
                             "signal": "queue"}}])
    );
    let prometheus = build(
        &keda(json!({"keda": {"scaler": "Prometheus"}})),
        &serving,
        caps(true),
    )
    .expect("builds");
    let so = serde_json::to_value(prometheus.scaled_object.expect("a ScaledObject")).expect("json");
    assert_eq!(so["spec"]["triggers"][0]["type"], "prometheus");
    let off = build(
        &keda(json!({"keda": {"scaler": "External"}})),
        &with_address,
        caps(true),
    )
    .expect_err("not served");
    assert_eq!(off.reason(), "KedaScalerOff");
    // HPA mode where KEDA runs: KEDA's metrics server answers the External Metrics API.
    let hpa = isvc(json!({"mode": "HPA", "minReplicas": 1, "maxReplicas": 3,
                          "targets": {"queuePerReplica": 2.0}}));
    let e = build(&hpa, &with_address, caps(true)).expect_err("refused beside KEDA");
    assert_eq!(e.reason(), "HpaModeWithKeda");
    assert!(e.to_string().contains("use mode KEDA"), "{e}");
    assert!(build(&hpa, &with_address, caps(false)).is_ok_and(|d| d.hpa.is_some()));
    // Other modes: none, KEDA or not.
    let builtin = isvc(json!({"minReplicas": 1, "maxReplicas": 3,
                              "targets": {"queuePerReplica": 2.0}}));
    let d = build(&builtin, &with_address, caps(true)).expect("builds");
    assert!(d.scaled_object.is_none());
}

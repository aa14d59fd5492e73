//! The NetworkPolicy of one InferenceService's pods, when the operator is run with
//! `--network-policy-peers`: only the peers named there (the router, the operator, the
//! cluster's Prometheus, as the chart fills them in) may open connections to the model's
//! port. A model pod holds a tenant's weights and serves whoever reaches it; without this any
//! pod in any namespace can bypass the router, its limits and its API keys.

use k8s_openapi::api::networking::v1::{
    NetworkPolicy, NetworkPolicyIngressRule, NetworkPolicyPeer, NetworkPolicyPort,
    NetworkPolicySpec,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use super::Owner;

/// The policy: ingress to the pods' port from `peers` only. With no peers nothing may
/// connect (Kubernetes' meaning of an empty `from` is "anyone", so that case gets no rule).
/// With `groups` (a LeaderWorkerSet), it covers every pod of the service, and the pods of
/// the service may reach each other on any port (Ray, NCCL), which nothing else may: Ray
/// runs whatever code reaches it.
pub(crate) fn network_policy(
    owner: &Owner,
    port: i32,
    peers: &[NetworkPolicyPeer],
    groups: bool,
) -> NetworkPolicy {
    let rule = NetworkPolicyIngressRule {
        from: Some(peers.to_vec()),
        ports: Some(vec![NetworkPolicyPort {
            port: Some(IntOrString::Int(port)),
            protocol: Some("TCP".into()),
            ..NetworkPolicyPort::default()
        }]),
    };
    let mut ingress = if peers.is_empty() {
        Vec::new()
    } else {
        vec![rule]
    };
    let pods = owner.replica_pods_labels(groups);
    if groups {
        ingress.push(NetworkPolicyIngressRule {
            from: Some(vec![NetworkPolicyPeer {
                pod_selector: Some(LabelSelector {
                    match_labels: Some(pods.clone()),
                    ..LabelSelector::default()
                }),
                ..NetworkPolicyPeer::default()
            }]),
            ports: None,
        });
    }
    NetworkPolicy {
        metadata: owner.meta(owner.name.clone(), &Default::default()),
        spec: Some(NetworkPolicySpec {
            pod_selector: Some(LabelSelector {
                match_labels: Some(pods),
                ..LabelSelector::default()
            }),
            policy_types: Some(vec!["Ingress".into()]),
            ingress: Some(ingress),
            ..NetworkPolicySpec::default()
        }),
    }
}

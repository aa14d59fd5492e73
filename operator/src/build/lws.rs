//! The LeaderWorkerSet (kubernetes-sigs/lws) of a spec whose replica spans pods: a model too
//! big for one node. Each replica is a group of `size` pods that LWS starts, scales, rolls and
//! recreates as one; the operator scales groups through `spec.replicas` as it scales a
//! Deployment's pods.
//!
//! The group runs vLLM's multi-node start as vLLM documents it for LWS: the leader starts a
//! Ray head (vLLM's `multi-node-serving.sh leader`, waiting for `LWS_GROUP_SIZE` nodes) and
//! then `vllm serve` with the Ray backend; each worker joins the leader's Ray cluster
//! (`LWS_LEADER_ADDRESS`, which LWS sets). Only the leader serves the API: it carries the
//! `server` component label, so the Service, the router, the autoscaler's scrapes and the
//! adapter API reach leaders only, and `status.selector` (the HPA's) selects leaders. Workers
//! carry `worker`, the same image, resources, volumes and security settings, and no probes or
//! ports. LWS itself makes the headless Service the group's pods find each other by.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Container, PodTemplateSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::Validated;
use super::deployment::{self, pod_template};
use crate::config::OperatorConfig;
use ferrite_api::labels::{COMPONENT_LABEL, WORKER_COMPONENT};

/// The CRD that must be installed for multi-node specs.
pub const LEADER_WORKER_SET_CRD: &str = "leaderworkersets.leaderworkerset.x-k8s.io";

/// vLLM's helper that starts or joins the group's Ray cluster, in vLLM's image (the path
/// vLLM's LWS guide uses).
pub const MULTI_NODE_SCRIPT: &str = "/vllm-workspace/examples/online_serving/multi-node-serving.sh";

/// The subset of LeaderWorkerSet's spec the operator writes.
#[derive(CustomResource, JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "leaderworkerset.x-k8s.io",
    version = "v1",
    kind = "LeaderWorkerSet",
    plural = "leaderworkersets",
    namespaced,
    status = "LeaderWorkerSetStatus",
    derive = "PartialEq"
)]
#[serde(rename_all = "camelCase")]
pub struct LeaderWorkerSetSpec {
    /// Groups (the InferenceService's replicas).
    pub replicas: i32,
    pub leader_worker_template: LeaderWorkerTemplate,
    pub rollout_strategy: LwsRolloutStrategy,
    /// `LeaderCreated`: workers start with their leader, whose readiness needs them.
    pub startup_policy: String,
}

#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct LeaderWorkerTemplate {
    pub size: i32,
    /// `RecreateGroupOnPodRestart`: a group that lost a pod has lost its model shard.
    pub restart_policy: String,
    pub leader_template: PodTemplateSpec,
    pub worker_template: PodTemplateSpec,
}

#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct LwsRolloutStrategy {
    #[serde(rename = "type")]
    pub type_: String,
    pub rolling_update_configuration: RollingUpdateConfiguration,
}

#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct RollingUpdateConfiguration {
    pub max_unavailable: IntOrString,
    pub max_surge: IntOrString,
}

/// What status reads of a LeaderWorkerSet, counted in groups.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct LeaderWorkerSetStatus {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    #[serde(default)]
    pub ready_replicas: i32,
    #[serde(default)]
    pub updated_replicas: i32,
    #[serde(default)]
    pub replicas: i32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
}

/// The LeaderWorkerSet of groups of `size` pods.
pub(crate) fn leader_worker_set(
    v: &Validated<'_>,
    config: &OperatorConfig,
    size: i32,
) -> LeaderWorkerSet {
    let (isvc, owner) = (&*v.isvc, &v.owner);
    let mut leader = pod_template(v, config);
    let worker = worker_template(&leader);
    for c in containers(&mut leader) {
        // vLLM's image starts `vllm serve` with the arguments; the leader first starts the
        // group's Ray head, then execs the same command with the same arguments.
        c.command = Some(vec![
            "/bin/sh".into(),
            "-c".into(),
            format!(
                "bash {MULTI_NODE_SCRIPT} leader --ray_cluster_size=\"$LWS_GROUP_SIZE\" && \
                 exec vllm serve \"$@\""
            ),
            "vllm".into(),
        ]);
    }
    let mut lws = LeaderWorkerSet::new(
        &owner.name,
        LeaderWorkerSetSpec {
            replicas: isvc.desired_replicas(),
            leader_worker_template: LeaderWorkerTemplate {
                size,
                restart_policy: "RecreateGroupOnPodRestart".into(),
                leader_template: leader,
                worker_template: worker,
            },
            rollout_strategy: rollout_strategy(isvc),
            startup_policy: "LeaderCreated".into(),
        },
    );
    lws.metadata = owner.meta(owner.name.clone(), &BTreeMap::new());
    lws
}

fn containers(t: &mut PodTemplateSpec) -> impl Iterator<Item = &mut Container> {
    t.spec.iter_mut().flat_map(|s| s.containers.iter_mut())
}

/// A worker: the leader's pod (image, resources, volumes, security, scheduling) labelled
/// `worker`, joining the leader's Ray cluster instead of serving: no ports, probes, API key
/// or scrape annotations.
fn worker_template(leader: &PodTemplateSpec) -> PodTemplateSpec {
    let mut t = leader.clone();
    if let Some(meta) = t.metadata.as_mut() {
        if let Some(labels) = meta.labels.as_mut() {
            labels.insert(COMPONENT_LABEL.into(), WORKER_COMPONENT.into());
        }
        if let Some(a) = meta.annotations.as_mut() {
            a.retain(|k, _| !k.starts_with("prometheus.io/"));
        }
    }
    for c in containers(&mut t) {
        c.command = Some(vec![
            "/bin/sh".into(),
            "-c".into(),
            format!("exec bash {MULTI_NODE_SCRIPT} worker --ray_address=\"$LWS_LEADER_ADDRESS\""),
        ]);
        c.args = None;
        c.ports = None;
        c.startup_probe = None;
        c.readiness_probe = None;
        c.liveness_probe = None;
        if let Some(env) = c.env.as_mut() {
            env.retain(|e| !deployment::API_KEY_VARIABLES.contains(&e.name.as_str()));
        }
    }
    t
}

/// The Deployment's rollout bounds in groups. LWS has no Recreate: every group may go at
/// once instead.
fn rollout_strategy(isvc: &ferrite_api::crd::InferenceService) -> LwsRolloutStrategy {
    let (max_surge, max_unavailable) = match deployment::strategy(isvc).rolling_update {
        Some(r) => (
            r.max_surge.unwrap_or(IntOrString::Int(0)),
            r.max_unavailable.unwrap_or(IntOrString::Int(1)),
        ),
        None => (IntOrString::Int(0), IntOrString::String("100%".into())),
    };
    LwsRolloutStrategy {
        type_: "RollingUpdate".into(),
        rolling_update_configuration: RollingUpdateConfiguration {
            max_unavailable,
            max_surge,
        },
    }
}

//! The status step, pure: what was applied and observed in, `InferenceServiceStatus` out.
//! Conditions keep their `lastTransitionTime` while their status holds, so an unchanged world
//! yields an identical status and the reconciler writes nothing.

use crate::build::lws::LeaderWorkerSet;
use ferrite_api::conditions;
use ferrite_api::termination::REASONS;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ContainerStatus, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

use ferrite_api::crd::{AdapterStatus, CurrentMetrics, InferenceService, InferenceServiceStatus};

/// Now, as the API server stores a `Time`: in whole seconds. Status holding a finer time would
/// never compare equal to what was stored, so every reconcile would rewrite it, and every write
/// would trigger another reconcile.
pub fn now() -> Time {
    let now = k8s_openapi::jiff::Timestamp::now();
    Time(k8s_openapi::jiff::Timestamp::from_second(now.as_second()).unwrap_or(now))
}

pub use ferrite_api::conditions::{
    DEGRADED, MONITORING, PROGRESSING, READY, SCALED_TO_ZERO, SCALING_ACTIVE, SCALING_LIMITED,
    SERVED_NAME_CONFLICT, condition,
};

/// What the autoscaler last concluded for one InferenceService, for the status step.
#[derive(Debug, Clone, PartialEq)]
pub struct AutoscaleView {
    /// Builtin mode: the autoscaler's decision (HPA mode leaves this to the HPA's status).
    pub desired_replicas: Option<i32>,
    pub last_scale_time: Option<Time>,
    pub metrics: Option<CurrentMetrics>,
    /// `ScalingActive`.
    pub active: Verdict,
    /// `ScalingLimited` (Builtin mode only).
    pub limited: Option<Verdict>,
    /// `ScaledToZero` (only with minReplicas 0).
    pub scaled_to_zero: Option<Verdict>,
}

impl AutoscaleView {
    /// Before the first evaluation.
    pub fn pending() -> Self {
        Self {
            desired_replicas: None,
            last_scale_time: None,
            metrics: None,
            active: (
                false,
                Finding::new("Pending", "the autoscaler has not read the pods yet"),
            ),
            limited: None,
            scaled_to_zero: None,
        }
    }
}

/// A condition's truth and why.
pub type Verdict = (bool, Finding);

/// A reason and a human-readable message for a condition.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finding {
    pub reason: String,
    pub message: String,
}

impl Finding {
    pub fn new(reason: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            reason: reason.into(),
            message: message.into(),
        }
    }
}

/// Where the ServiceMonitor stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MonitorState {
    Applied,
    Disabled,
    CrdMissing,
    /// The spec is blocked (`why`), so its ServiceMonitor was not applied; `earlier` when the
    /// one from the previous spec is still in place.
    NotApplied {
        earlier: bool,
        why: String,
    },
}

/// Everything the status is computed from.
#[derive(Debug, Clone)]
pub struct Observation<'a> {
    pub generation: Option<i64>,
    /// Why the spec could not be applied (a build error, a missing claim); the workload, if
    /// any, keeps running as it was.
    pub blocked: Option<Finding>,
    pub desired_replicas: i32,
    /// The workload (Deployment or LeaderWorkerSet) as applied or last seen.
    pub workload: Option<Workload<'a>>,
    /// A failure seen on the pods (image pull, crash loop), from [`pod_failure`].
    pub pod_failure: Option<Finding>,
    pub monitor: MonitorState,
    pub selector: Option<String>,
    pub url: Option<String>,
    /// Present when spec.autoscaling is set.
    pub autoscaling: Option<AutoscaleView>,
    /// Another InferenceService holds this one's served name ([`served_name_conflict`]).
    pub served_name_conflict: Option<Finding>,
    /// What the adapter sync last found, per declared adapter.
    pub adapters: Vec<AdapterStatus>,
}

/// Why `isvc` does not hold its served name, if it does not: an older InferenceService (in any
/// namespace) claims the same name, so the router sends that name's traffic there, and `isvc`
/// is not in its weighted group (`spec.routing.weight`, the holder's namespace). Clients still
/// reach this one by its `namespace/name`.
pub fn served_name_conflict<'a>(
    isvc: &InferenceService,
    all: impl IntoIterator<Item = &'a InferenceService>,
) -> Option<Finding> {
    let name = ferrite_api::served::served_name(isvc);
    let claimants: Vec<&InferenceService> = all
        .into_iter()
        .filter(|o| {
            o.metadata.deletion_timestamp.is_none() && ferrite_api::served::served_name(o) == name
        })
        .collect();
    // The holder, and with weights the services sharing its traffic, hold the name.
    let group = ferrite_api::served::split_group(claimants.iter().copied());
    if group
        .iter()
        .any(|(i, _)| i.metadata.uid == isvc.metadata.uid)
    {
        return None;
    }
    let holder = ferrite_api::served::served_name_holder(claimants)?;
    let id = |i: &InferenceService| {
        format!(
            "{}/{}",
            i.metadata.namespace.as_deref().unwrap_or_default(),
            i.metadata.name.as_deref().unwrap_or_default()
        )
    };
    Some(Finding::new(
        SERVED_NAME_CONFLICT,
        format!(
            "the served name `{name}` is held by {}, created earlier; the router sends it no \
             traffic for that name. Choose another spec.model.servedName, or use the model id \
             `{}`",
            id(holder),
            id(isvc)
        ),
    ))
}

/// Waiting reasons that will not fix themselves without a change to the spec or the cluster.
const FAILING_WAIT_REASONS: &[&str] = &[
    "ErrImagePull",
    "ImagePullBackOff",
    "InvalidImageName",
    "CrashLoopBackOff",
    "CreateContainerConfigError",
    "CreateContainerError",
    "RunContainerError",
];

/// A container that is down (waiting to restart, or terminated) after the server said why:
/// `<Reason>: <detail>` in its last termination message.
fn server_failure(pod: &str, c: &ContainerStatus) -> Option<Finding> {
    let state = c.state.as_ref()?;
    let down = state.waiting.is_some() || state.terminated.is_some();
    if !down {
        return None;
    }
    let terminated = state
        .terminated
        .as_ref()
        .or_else(|| c.last_state.as_ref()?.terminated.as_ref())?;
    let message = terminated.message.as_deref()?.trim();
    let (reason, detail) = message.split_once(": ")?;
    let reason = REASONS.iter().find(|r| **r == reason)?;
    // The first line is the server's; FallbackToLogsOnError may append log lines after it.
    let detail = detail.lines().next().unwrap_or_default();
    Some(Finding::new(
        *reason,
        format!("pod {pod}, container {}: {detail}", c.name),
    ))
}

/// The first hard failure among the pods' containers, or an unschedulable pod.
pub fn pod_failure(pods: &[Pod]) -> Option<Finding> {
    for pod in pods {
        let name = pod.metadata.name.as_deref().unwrap_or("?");
        let Some(status) = &pod.status else { continue };
        let containers = status
            .init_container_statuses
            .iter()
            .flatten()
            .chain(status.container_statuses.iter().flatten());
        for c in containers {
            if let Some(f) = server_failure(name, c) {
                return Some(f);
            }
            let waiting = c.state.as_ref().and_then(|s| s.waiting.as_ref());
            if let Some(w) = waiting {
                let reason = w.reason.as_deref().unwrap_or_default();
                if FAILING_WAIT_REASONS.contains(&reason) {
                    let detail = w.message.as_deref().unwrap_or("no message");
                    return Some(Finding::new(
                        reason,
                        format!("pod {name}, container {}: {reason}: {detail}", c.name),
                    ));
                }
            }
        }
        let unschedulable = status.conditions.iter().flatten().find(|c| {
            c.type_ == "PodScheduled"
                && c.status == "False"
                && c.reason.as_deref() == Some("Unschedulable")
        });
        if let Some(c) = unschedulable {
            let detail = c.message.as_deref().unwrap_or("no message");
            return Some(Finding::new(
                conditions::UNSCHEDULABLE,
                format!("pod {name} cannot be scheduled: {detail}"),
            ));
        }
    }
    None
}

/// What runs the replicas, as observed.
#[derive(Debug, Clone, Copy)]
pub enum Workload<'a> {
    Deployment(&'a Deployment),
    /// A LeaderWorkerSet: each replica a group of pods.
    Groups(&'a LeaderWorkerSet),
}

impl Workload<'_> {
    /// Replica counts and whether the rollout is complete.
    pub fn rollout(self) -> Rollout {
        match self {
            Workload::Deployment(d) => rollout(d),
            Workload::Groups(g) => group_rollout(g),
        }
    }

    /// Why pods cannot be made, where the workload's controller says so.
    fn replica_failure(self) -> Option<Finding> {
        match self {
            Workload::Deployment(d) => replica_failure(d),
            Workload::Groups(_) => None,
        }
    }
}

/// A LeaderWorkerSet's groups and whether its rollout is complete: every wanted group
/// updated and ready, none left over, no update in progress.
pub fn group_rollout(g: &LeaderWorkerSet) -> Rollout {
    let want = g.spec.replicas;
    let generation = g.metadata.generation.unwrap_or(0);
    let Some(s) = &g.status else {
        return Rollout::default();
    };
    let updating = s
        .conditions
        .iter()
        .any(|c| c.type_ == "UpdateInProgress" && c.status == "True");
    // Before LWS reported observedGeneration, its counts are taken as current.
    let observed = s.observed_generation.is_none_or(|o| o >= generation);
    let complete = observed
        && !updating
        && s.updated_replicas == want
        && s.replicas == want
        && s.ready_replicas == want;
    Rollout {
        replicas: s.replicas,
        ready: s.ready_replicas,
        complete,
        stalled: false,
    }
}

/// The Deployment's `ReplicaFailure` condition: its ReplicaSet cannot create pods (a missing
/// PriorityClass, an exceeded ResourceQuota, a rejected pod spec).
pub fn replica_failure(d: &Deployment) -> Option<Finding> {
    let c = d
        .status
        .as_ref()?
        .conditions
        .iter()
        .flatten()
        .find(|c| c.type_ == "ReplicaFailure" && c.status == "True")?;
    let reason = c.reason.as_deref().unwrap_or("FailedCreate");
    let detail = c.message.as_deref().unwrap_or("no message");
    Some(Finding::new(
        conditions::REPLICA_FAILURE,
        format!("the Deployment cannot create pods ({reason}): {detail}"),
    ))
}

/// Replica counts of a Deployment and whether its rollout is complete, with the rules
/// `kubectl rollout status` uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Rollout {
    pub replicas: i32,
    pub ready: i32,
    pub complete: bool,
    /// The Deployment controller gave up (ProgressDeadlineExceeded).
    pub stalled: bool,
}

pub fn rollout(d: &Deployment) -> Rollout {
    let want = d.spec.as_ref().and_then(|s| s.replicas).unwrap_or(1);
    let generation = d.metadata.generation.unwrap_or(0);
    let Some(s) = &d.status else {
        return Rollout::default();
    };
    let updated = s.updated_replicas.unwrap_or(0);
    let replicas = s.replicas.unwrap_or(0);
    let available = s.available_replicas.unwrap_or(0);
    let complete = s.observed_generation.unwrap_or(0) >= generation
        && updated == want
        && replicas == updated
        && available == updated;
    let stalled = s.conditions.iter().flatten().any(|c| {
        c.type_ == "Progressing" && c.reason.as_deref() == Some("ProgressDeadlineExceeded")
    });
    Rollout {
        replicas,
        ready: s.ready_replicas.unwrap_or(0),
        complete,
        stalled,
    }
}

/// Computes the status. `previous` supplies the transition times of unchanged conditions.
pub fn compute(
    obs: &Observation<'_>,
    previous: Option<&InferenceServiceStatus>,
    now: &Time,
) -> InferenceServiceStatus {
    let r = obs.workload.map(Workload::rollout).unwrap_or_default();
    let replica_failure = obs.workload.and_then(Workload::replica_failure);
    let pod_failure = obs.pod_failure.clone().or(replica_failure);
    let make = |type_: &str, (ok, f): Verdict| {
        let status = if ok { "True" } else { "False" };
        let last = previous
            .and_then(|p| p.conditions.iter().find(|c| c.type_ == type_))
            .filter(|c| c.status == status)
            .map_or_else(|| now.clone(), |c| c.last_transition_time.clone());
        Condition {
            type_: type_.into(),
            status: status.into(),
            reason: f.reason,
            message: f.message,
            observed_generation: obs.generation,
            last_transition_time: last,
        }
    };
    let mut conditions = vec![
        make(READY, ready(obs, &r)),
        make(PROGRESSING, progressing(obs, &r, pod_failure.as_ref())),
        make(DEGRADED, degraded(obs, &r, pod_failure)),
        make(MONITORING, monitoring(&obs.monitor)),
    ];
    let scaling = obs.autoscaling.as_ref();
    if let Some(a) = scaling {
        conditions.push(make(SCALING_ACTIVE, a.active.clone()));
        if let Some(l) = &a.limited {
            conditions.push(make(SCALING_LIMITED, l.clone()));
        }
        if let Some(z) = &a.scaled_to_zero {
            conditions.push(make(SCALED_TO_ZERO, z.clone()));
        }
    }
    InferenceServiceStatus {
        conditions,
        observed_generation: obs.generation,
        replicas: r.replicas,
        ready_replicas: r.ready,
        selector: obs.selector.clone(),
        url: obs.url.clone(),
        desired_replicas: scaling.and_then(|a| a.desired_replicas),
        last_scale_time: scaling.and_then(|a| a.last_scale_time.clone()),
        current_metrics: scaling.and_then(|a| a.metrics.clone()),
        adapters: obs.adapters.clone(),
    }
}

/// `Ready`: a served-name conflict, no Deployment yet, scaled to zero, serving (possibly on
/// the previous spec) or rolling out.
fn ready(obs: &Observation<'_>, r: &Rollout) -> Verdict {
    if let Some(conflict) = &obs.served_name_conflict {
        return (false, conflict.clone());
    }
    if obs.workload.is_none() {
        let f = obs.blocked.clone().unwrap_or_else(|| {
            Finding::new(
                "Pending",
                "the Deployment or LeaderWorkerSet does not exist yet",
            )
        });
        return (false, f);
    }
    if obs.desired_replicas == 0 {
        return (
            false,
            Finding::new("ScaledToZero", "no replicas are wanted"),
        );
    }
    if r.ready >= 1 && r.complete {
        let mut message = format!(
            "{}/{} replicas ready, serving at {}",
            r.ready,
            obs.desired_replicas,
            obs.url.as_deref().unwrap_or("?")
        );
        if let Some(b) = &obs.blocked {
            message = format!("{message}; still on the previous spec: {}", b.message);
        }
        return (true, Finding::new("Available", message));
    }
    (
        false,
        Finding::new(
            "RolloutInProgress",
            format!("{}/{} replicas ready", r.ready, obs.desired_replicas),
        ),
    )
}

/// `Progressing`: true while a rollout is under way; false when blocked, stuck or complete.
fn progressing(obs: &Observation<'_>, r: &Rollout, pod_failure: Option<&Finding>) -> Verdict {
    if let Some(b) = &obs.blocked {
        return (false, b.clone());
    }
    if r.stalled {
        return (
            false,
            Finding::new("ProgressDeadlineExceeded", "the rollout is stuck"),
        );
    }
    if obs.workload.is_some() && r.complete {
        return (
            false,
            Finding::new("RolloutComplete", "the rollout is complete"),
        );
    }
    let why = pod_failure.map_or_else(
        || format!("{}/{} replicas ready", r.ready, obs.desired_replicas),
        |f| f.message.clone(),
    );
    (true, Finding::new("RollingOut", why))
}

/// `Degraded`: the first of a blocked spec, a failing pod or ReplicaSet, a stuck rollout.
fn degraded(obs: &Observation<'_>, r: &Rollout, pod_failure: Option<Finding>) -> Verdict {
    let found = obs.blocked.clone().or(pod_failure).or_else(|| {
        r.stalled.then(|| {
            Finding::new(
                "ProgressDeadlineExceeded",
                "the Deployment's rollout exceeded its progress deadline",
            )
        })
    });
    match found {
        Some(f) => (true, f),
        None => (false, Finding::new("AsExpected", "no problems found")),
    }
}

/// `Monitoring`: whether the ServiceMonitor is in place, and why not.
fn monitoring(monitor: &MonitorState) -> Verdict {
    match monitor {
        MonitorState::Applied => (
            true,
            Finding::new("ServiceMonitorApplied", "the ServiceMonitor is in place"),
        ),
        MonitorState::Disabled => (
            true,
            Finding::new(
                "ServiceMonitorDisabled",
                "spec.monitoring.serviceMonitor.enabled is false",
            ),
        ),
        MonitorState::CrdMissing => (
            false,
            Finding::new(
                "ServiceMonitorCRDNotInstalled",
                "the monitoring.coreos.com/v1 ServiceMonitor CRD is not installed; install the Prometheus Operator or scrape the pods' prometheus.io annotations",
            ),
        ),
        MonitorState::NotApplied { earlier: true, why } => (
            true,
            Finding::new(
                "PreviousServiceMonitor",
                format!(
                    "the ServiceMonitor of the previous spec is in place; the current spec is not applied: {why}"
                ),
            ),
        ),
        MonitorState::NotApplied {
            earlier: false,
            why,
        } => (
            false,
            Finding::new(
                "SpecNotApplied",
                format!("no ServiceMonitor: the spec is not applied: {why}"),
            ),
        ),
    }
}

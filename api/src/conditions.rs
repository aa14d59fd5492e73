//! The InferenceService's condition types and the reasons other binaries act on: the operator
//! writes them, the router reads them (a `Degraded` service is not waited for unless its
//! reason is transient), and users' alerts and `kubectl wait` name them.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;

use crate::crd::InferenceServiceStatus;

pub const READY: &str = "Ready";
pub const PROGRESSING: &str = "Progressing";
pub const DEGRADED: &str = "Degraded";
/// Whether the ServiceMonitor exists as asked (or why not).
pub const MONITORING: &str = "MonitoringReady";
/// Whether the autoscaler can read its signals.
pub const SCALING_ACTIVE: &str = "ScalingActive";
/// Whether the autoscaler's wish is being held back (bounds, windows, rates, panic).
pub const SCALING_LIMITED: &str = "ScalingLimited";
/// Whether the workload was scaled to zero for being idle.
pub const SCALED_TO_ZERO: &str = "ScaledToZero";

/// The reason of `Ready=False` for an InferenceService whose served name an older one holds.
pub const SERVED_NAME_CONFLICT: &str = "ServedNameConflict";

/// `Degraded`: pods that no node can take yet (a node autoscaler may add one).
pub const UNSCHEDULABLE: &str = "Unschedulable";
/// `Degraded`: a ReplicaSet cannot make pods (a quota, which may free).
pub const REPLICA_FAILURE: &str = "ReplicaFailure";
/// `Degraded`: a child object could not be applied (the API server refused or failed).
pub const CHILD_APPLY_FAILED: &str = "ChildApplyFailed";

/// The `status` of condition `type_`, if present.
pub fn condition<'a>(status: &'a InferenceServiceStatus, type_: &str) -> Option<&'a Condition> {
    status.conditions.iter().find(|c| c.type_ == type_)
}

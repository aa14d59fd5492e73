//! The labels the operator puts on what it makes, named once: the build step writes them, the
//! watch caches select by them, and the External Metrics API matches selectors against them.

/// Label carrying the owning InferenceService's name on everything the operator makes.
pub const INSTANCE_LABEL: &str = "ferrite.dev/inferenceservice";
/// The standard component label; pods that serve the API carry `server` (a Deployment's, a
/// LeaderWorkerSet's leaders), a LeaderWorkerSet's other pods `worker`, dashboard ConfigMaps
/// `dashboard`.
pub const COMPONENT_LABEL: &str = "app.kubernetes.io/component";
/// [`COMPONENT_LABEL`] of the pods that serve the API: the Service, the router, the
/// autoscaler's scrapes and the adapter API reach only these.
pub const SERVER_COMPONENT: &str = "server";
/// [`COMPONENT_LABEL`] of the pods of a multi-node replica that hold part of the model but
/// serve nothing (a LeaderWorkerSet's workers).
pub const WORKER_COMPONENT: &str = "worker";
/// Label selector matching every object the operator makes (children and pods alike).
pub const MANAGED_SELECTOR: &str = "app.kubernetes.io/managed-by=ferrite-operator";

/// Whether `obj` (a pod, a child) belongs to the InferenceService `namespace/name`: the
/// operator's watch caches and ferrite-router pick an InferenceService's pods by this.
pub fn belongs_to<K: kube::ResourceExt>(obj: &K, namespace: &str, name: &str) -> bool {
    obj.meta().namespace.as_deref() == Some(namespace)
        && obj.labels().get(INSTANCE_LABEL).map(String::as_str) == Some(name)
}

/// Whether `obj` (a pod) serves the API ([`SERVER_COMPONENT`]).
pub fn serves<K: kube::ResourceExt>(obj: &K) -> bool {
    obj.labels().get(COMPONENT_LABEL).map(String::as_str) == Some(SERVER_COMPONENT)
}

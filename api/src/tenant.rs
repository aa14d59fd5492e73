//! The `InferenceTenant` custom resource (`ferrite.dev/v1alpha1`): a team that sends requests
//! through ferrite-router. Cluster-scoped, so only whoever may write cluster-scoped objects
//! (the platform team) grants access and limits: a tenant cannot raise its own. Its API keys
//! live in Secrets labelled [`TENANT_LABEL`] in the router's namespace, also the platform's.

use kube::{CustomResource, KubeSchema};
use serde::{Deserialize, Serialize};

/// The label naming the tenant a Secret's keys belong to (`ferrite.dev/tenant: <name>`): every
/// value in the Secret's `data` is one API key, so a key is rotated by adding the new one and
/// then removing the old.
pub const TENANT_LABEL: &str = "ferrite.dev/tenant";

/// Who may use which models through ferrite-router, and how much.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[kube(
    group = "ferrite.dev",
    version = "v1alpha1",
    kind = "InferenceTenant",
    plural = "inferencetenants",
    singular = "inferencetenant",
    shortname = "ften",
    category = "ferrite",
    cel,
    doc = "A team that sends requests through ferrite-router: the models it may use, its priority and its limits. Its API keys are the values of Secrets labelled ferrite.dev/tenant=<name> in the router's namespace.",
    validation = Rule::new("self.metadata.name.size() <= 63").message("the name must be at most 63 characters (it is a metric label)"),
    printcolumn(name = "Priority", type_ = "integer", json_path = ".spec.priority"),
    printcolumn(name = "RPM", type_ = "integer", json_path = ".spec.limits.requestsPerMinute"),
    printcolumn(name = "TPM", type_ = "integer", json_path = ".spec.limits.tokensPerMinute"),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp")
)]
#[x_kube(validation = Rule::new(
    "self.namespaces.size() + self.models.size() > 0"
).message("give the namespaces or the models the tenant may use"))]
#[serde(rename_all = "camelCase")]
pub struct InferenceTenantSpec {
    /// Every InferenceService in these namespaces may be used.
    #[serde(default)]
    #[x_kube(validation = Rule::new("self.all(n, n.size() > 0 && n.size() <= 63)").message("namespace names are 1 to 63 characters"))]
    pub namespaces: Vec<String>,
    /// These models may be used: served names, `namespace/name` of an InferenceService, or
    /// LoRA adapter names.
    #[serde(default)]
    #[x_kube(validation = Rule::new("self.all(m, m.size() > 0)").message("model names are not empty"))]
    pub models: Vec<String>,
    /// When requests wait for a saturated service, higher priorities go first (default 0).
    #[serde(default)]
    pub priority: i32,
    /// Limits, each held over a sliding minute; an unset one is unlimited.
    #[serde(default)]
    pub limits: TenantLimits,
}

/// A tenant's limits.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct TenantLimits {
    /// Requests started per minute.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self >= 1").message("requestsPerMinute must be at least 1"))]
    pub requests_per_minute: Option<i64>,
    /// Prompt and completion tokens per minute: each request is charged its estimate (prompt
    /// tokens and max_tokens) when it starts and settled to what it used when it ends.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self >= 1").message("tokensPerMinute must be at least 1"))]
    pub tokens_per_minute: Option<i64>,
    /// Requests open at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self >= 1").message("concurrentRequests must be at least 1"))]
    pub concurrent_requests: Option<i64>,
}

/// The CRD as YAML, keys sorted ([`crate::crd::crd_yaml`]'s form).
pub fn crd_yaml() -> Result<String, serde_yaml_ng::Error> {
    use kube::CustomResourceExt;
    crate::crd::generated_yaml(serde_yaml_ng::to_value(InferenceTenant::crd())?)
}

//! The grant that lets ferrite-router read one InferenceService's API key. A router with
//! tenants authenticates clients by their tenant keys and never passes those on; a service
//! with `spec.auth` still wants its own key, so the router sends it. The router gets no
//! standing right to Secrets: the operator, which reads the key already, grants it `get` on
//! exactly the Secret the spec names, in the service's namespace, for as long as the spec
//! names it (the Role and RoleBinding are owned by the InferenceService).

use k8s_openapi::api::rbac::v1::{PolicyRule, Role, RoleBinding, RoleRef, Subject};

use super::Owner;
use crate::config::ServiceAccountRef;
use ferrite_api::crd::AuthSpec;

/// The Role's and RoleBinding's name: one of each per InferenceService.
pub fn name_of(inferenceservice: &str) -> String {
    format!("{inferenceservice}-router-key")
}

fn name(owner: &Owner) -> String {
    name_of(&owner.name)
}

/// `get` on the one Secret holding the service's key, for the router's ServiceAccount.
pub(crate) fn router_key(
    owner: &Owner,
    auth: &AuthSpec,
    router: &ServiceAccountRef,
) -> (Role, RoleBinding) {
    let role = Role {
        metadata: owner.meta(name(owner), &Default::default()),
        rules: Some(vec![PolicyRule {
            api_groups: Some(vec![String::new()]),
            resources: Some(vec!["secrets".into()]),
            resource_names: Some(vec![auth.api_key_secret_ref.name.clone()]),
            verbs: vec!["get".into()],
            ..PolicyRule::default()
        }]),
    };
    let binding = RoleBinding {
        metadata: owner.meta(name(owner), &Default::default()),
        role_ref: RoleRef {
            api_group: "rbac.authorization.k8s.io".into(),
            kind: "Role".into(),
            name: name(owner),
        },
        subjects: Some(vec![Subject {
            kind: "ServiceAccount".into(),
            name: router.name.clone(),
            namespace: Some(router.namespace.clone()),
            ..Subject::default()
        }]),
    };
    (role, binding)
}

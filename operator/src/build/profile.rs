//! Resource profiles: operator-wide defaults for a kind of node (`nvidia-h100`, `amd-mi300x`)
//! that an InferenceService names in `spec.resourceProfile: NAME[:COUNT]`, so every service
//! need not repeat the same tolerations, node selector, runtime class and pull secrets. The
//! admin writes them once in the chart's `resourceProfiles` values (a ConfigMap the operator
//! reads at start; the chart restarts it when they change).
//!
//! A profile is merged *under* the spec: a field the spec sets wins, maps merge key by key
//! (the spec's keys win), lists are joined (the spec's entries first, duplicates dropped).

use std::collections::BTreeMap;

use super::BuildError;
pub use crate::config::ResourceProfile;
use ferrite_api::crd::InferenceService;

/// `NAME[:COUNT]` split; the schema has checked the form.
fn parse(reference: &str) -> Result<(&str, Option<i32>), BuildError> {
    let bad = |why: &str| BuildError::ResourceProfile(format!("{reference:?}: {why}"));
    match reference.split_once(':') {
        None => Ok((reference, None)),
        Some((name, count)) => {
            let n = count
                .parse::<i32>()
                .map_err(|_| bad("the count after ':' must be a whole number of GPUs"))?;
            Ok((name, Some(n)))
        }
    }
}

/// The spec with its profile merged under it, or `None` when it names none.
pub fn resolve(
    isvc: &InferenceService,
    profiles: &BTreeMap<String, ResourceProfile>,
) -> Result<Option<InferenceService>, BuildError> {
    let Some(reference) = isvc.spec.resource_profile.as_deref() else {
        return Ok(None);
    };
    let (name, count) = parse(reference)?;
    let profile = profiles.get(name).ok_or_else(|| {
        let known: Vec<&str> = profiles.keys().map(String::as_str).collect();
        BuildError::ResourceProfile(format!(
            "no resource profile {name:?} in the operator's configuration (it has: {})",
            if known.is_empty() {
                "none".to_string()
            } else {
                known.join(", ")
            }
        ))
    })?;
    let mut out = isvc.clone();
    let spec = &mut out.spec;
    let s = &mut spec.scheduling;
    for (k, v) in &profile.node_selector {
        s.node_selector
            .entry(k.clone())
            .or_insert_with(|| v.clone());
    }
    join(&mut s.tolerations, &profile.tolerations);
    under(&mut s.affinity, &profile.affinity);
    under(&mut s.runtime_class_name, &profile.runtime_class_name);
    under(&mut s.priority_class_name, &profile.priority_class_name);
    under(&mut spec.pod.scheduler_name, &profile.scheduler_name);
    join(
        &mut spec.pod.image_pull_secrets,
        &profile.image_pull_secrets,
    );
    under(
        &mut spec.resources.gpu_resource_name,
        &profile.gpu_resource_name,
    );
    under(&mut spec.resources.gpus, &count);
    Ok(Some(out))
}

/// Sets `field` from the profile when the spec left it unset.
fn under<T: Clone>(field: &mut Option<T>, profile: &Option<T>) {
    if field.is_none() {
        field.clone_from(profile);
    }
}

/// The spec's entries, then the profile's that are not already there.
fn join<T: Clone + PartialEq>(list: &mut Vec<T>, profile: &[T]) {
    for p in profile {
        if !list.contains(p) {
            list.push(p.clone());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn isvc(spec: serde_json::Value) -> InferenceService {
        serde_json::from_value(json!({
            "apiVersion": "ferrite.dev/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": "chat", "namespace": "ml", "uid": "u"},
            "spec": spec,
        }))
        .expect("valid")
    }

    fn profiles() -> BTreeMap<String, ResourceProfile> {
        serde_json::from_value(json!({
            "nvidia-h100": {
                "nodeSelector": {"nvidia.com/gpu.product": "H100", "pool": "gpu"},
                "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                "runtimeClassName": "nvidia",
                "imagePullSecrets": [{"name": "ngc"}],
                "gpuResourceName": "nvidia.com/gpu"
            }
        }))
        .expect("profiles")
    }

    #[test]
    fn the_profile_fills_what_the_spec_leaves_and_the_spec_wins() {
        let mine = isvc(json!({
            "model": {"source": "/m.gguf"},
            "resourceProfile": "nvidia-h100:2",
            "scheduling": {"nodeSelector": {"pool": "reserved"}, "runtimeClassName": "kata",
                           "tolerations": [{"key": "dedicated", "operator": "Exists"}]},
            "pod": {"imagePullSecrets": [{"name": "mine"}, {"name": "ngc"}]}
        }));
        let out = resolve(&mine, &profiles())
            .expect("resolves")
            .expect("a profile");
        let s = &out.spec.scheduling;
        assert_eq!(s.node_selector["pool"], "reserved", "the spec's key wins");
        assert_eq!(s.node_selector["nvidia.com/gpu.product"], "H100");
        assert_eq!(s.runtime_class_name.as_deref(), Some("kata"));
        let keys: Vec<_> = s
            .tolerations
            .iter()
            .filter_map(|t| t.key.as_deref())
            .collect();
        assert_eq!(keys, ["dedicated", "nvidia.com/gpu"]);
        let secrets: Vec<_> = out
            .spec
            .pod
            .image_pull_secrets
            .iter()
            .map(|r| r.name.as_str())
            .collect();
        assert_eq!(secrets, ["mine", "ngc"], "joined without duplicates");
        assert_eq!(out.spec.resources.gpus, Some(2), "the count is the GPUs");
        // gpus in the spec wins over the count.
        let set = isvc(
            json!({"model": {"source": "/m.gguf"}, "resourceProfile": "nvidia-h100:2",
                              "resources": {"gpus": 4}}),
        );
        let out = resolve(&set, &profiles()).expect("ok").expect("profile");
        assert_eq!(out.spec.resources.gpus, Some(4));
    }

    #[test]
    fn no_profile_no_change_and_unknown_profiles_say_which_exist() {
        let plain = isvc(json!({"model": {"source": "/m.gguf"}}));
        assert!(matches!(resolve(&plain, &profiles()), Ok(None)));
        let unknown = isvc(json!({"model": {"source": "/m.gguf"}, "resourceProfile": "tpu-v5"}));
        let e = resolve(&unknown, &profiles()).expect_err("unknown");
        assert_eq!(e.reason(), "ResourceProfileNotFound");
        assert!(
            e.to_string().contains("\"tpu-v5\"") && e.to_string().contains("nvidia-h100"),
            "{e}"
        );
        let e = resolve(&unknown, &BTreeMap::new()).expect_err("none configured");
        assert!(e.to_string().contains("(it has: none)"), "{e}");
    }
}

//! Which InferenceService serves a model name: the operator gives each server its served name
//! and marks losing claimants `ServedNameConflict`, and the router sends the name's traffic to
//! the holder, or splits it among the holder's weighted group ([`split_group`]). One rule, so
//! the two cannot disagree.

use kube::ResourceExt;

use crate::crd::InferenceService;

/// The served model name: spec.model.servedName or the resource name.
pub fn served_name(isvc: &InferenceService) -> String {
    isvc.spec
        .model
        .served_name
        .clone()
        .unwrap_or_else(|| isvc.name_any())
}

/// Of the InferenceServices claiming one served name, the one that holds it: the oldest
/// (creation time, which the API server sets and no tenant can choose), then by namespace and
/// name. The router sends the name's traffic only there; the operator marks the others
/// `ServedNameConflict`. Generic over how the caller holds the objects.
pub fn served_name_holder<I, T>(claimants: I) -> Option<T>
where
    I: IntoIterator<Item = T>,
    T: std::ops::Deref<Target = InferenceService>,
{
    claimants.into_iter().min_by(|a, b| {
        let key = |i: &InferenceService| {
            (
                // No creation time (never, from the API server) sorts last.
                i.metadata.creation_timestamp.is_none(),
                i.metadata.creation_timestamp.clone().map(|t| t.0),
                i.namespace(),
                i.name_any(),
            )
        };
        key(a).cmp(&key(b))
    })
}

/// The services that share a served name's traffic, with their weights: the holder
/// ([`served_name_holder`]) alone, unless it sets `spec.routing.weight`; then also every other
/// claimant in the holder's namespace that sets one. A claimant in another namespace never
/// joins, so no tenant can take a share of another's name.
pub fn split_group<'a>(
    claimants: impl IntoIterator<Item = &'a InferenceService>,
) -> Vec<(&'a InferenceService, u32)> {
    let claimants: Vec<&InferenceService> = claimants.into_iter().collect();
    let Some(holder) = served_name_holder(claimants.iter().copied()) else {
        return Vec::new();
    };
    let weight = |i: &InferenceService| {
        i.spec
            .routing
            .as_ref()
            .and_then(|r| r.weight)
            .map(|w| w.max(0) as u32)
    };
    if weight(holder).is_none() {
        return vec![(holder, 1)];
    }
    let mut group: Vec<(&InferenceService, u32)> = claimants
        .into_iter()
        .filter(|i| i.namespace() == holder.namespace())
        .filter_map(|i| Some((i, weight(i)?)))
        .collect();
    group.sort_by_key(|(i, _)| i.name_any());
    group
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    fn isvc(ns: &str, name: &str, age: i64, weight: Option<i32>) -> InferenceService {
        let mut i: InferenceService = serde_json::from_value(serde_json::json!({
            "apiVersion": "ferrite.dev/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": name, "namespace": ns},
            "spec": {"model": {"source": "/m.gguf", "servedName": "chat"},
                     "routing": {"weight": weight}}}))
        .expect("an InferenceService");
        let t = k8s_openapi::jiff::Timestamp::from_second(1_700_000_000 - age).expect("time");
        i.metadata.creation_timestamp = Some(Time(t));
        i
    }

    fn names(g: &[(&InferenceService, u32)]) -> Vec<(String, u32)> {
        g.iter().map(|(i, w)| (i.name_any(), *w)).collect()
    }

    #[test]
    fn a_weighted_holder_shares_with_its_namespaces_weighted_claimants_only() {
        let all = [
            isvc("a", "stable", 100, Some(95)),
            isvc("a", "canary", 10, Some(5)),
            isvc("a", "unweighted", 20, None),
            isvc("b", "intruder", 5, Some(1000)),
        ];
        assert_eq!(
            names(&split_group(&all)),
            [("canary".into(), 5), ("stable".into(), 95)]
        );
        // Without a weight on the holder, it serves alone.
        let plain = [
            isvc("a", "stable", 100, None),
            isvc("a", "canary", 10, Some(5)),
        ];
        assert_eq!(names(&split_group(&plain)), [("stable".into(), 1)]);
        // An older claimant in another namespace holds the name alone when it has no weight.
        let older = [
            isvc("b", "first", 500, None),
            isvc("a", "stable", 100, Some(95)),
        ];
        assert_eq!(names(&split_group(&older)), [("first".into(), 1)]);
        assert!(split_group(&[]).is_empty());
    }
}

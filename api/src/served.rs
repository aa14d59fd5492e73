//! Which InferenceService serves a model name: the operator gives each server its served name
//! and marks losing claimants `ServedNameConflict`, and the router sends the name's traffic to
//! the holder. One rule, so the two cannot disagree.

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

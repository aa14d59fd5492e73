//! The Service in front of the pods, and the PodDisruptionBudget that keeps one serving during
//! node drains.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Service, ServicePort, ServiceSpec};
use k8s_openapi::api::policy::v1::{PodDisruptionBudget, PodDisruptionBudgetSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use super::Owner;
use ferrite_api::crd::InferenceService;

pub(crate) fn service(isvc: &InferenceService, owner: &Owner) -> Service {
    Service {
        metadata: owner.meta(owner.name.clone(), &BTreeMap::new()),
        spec: Some(ServiceSpec {
            type_: Some("ClusterIP".into()),
            selector: Some(owner.selector_labels()),
            ports: Some(vec![ServicePort {
                name: Some("http".into()),
                port: isvc.port(),
                target_port: Some(IntOrString::String("http".into())),
                protocol: Some("TCP".into()),
                app_protocol: Some("http".into()),
                ..ServicePort::default()
            }]),
            ..ServiceSpec::default()
        }),
        ..Service::default()
    }
}

/// At most one pod of `pods` (a selector) down at a time from voluntary disruptions.
pub(crate) fn pdb(owner: &Owner, pods: BTreeMap<String, String>) -> PodDisruptionBudget {
    PodDisruptionBudget {
        metadata: owner.meta(owner.name.clone(), &BTreeMap::new()),
        spec: Some(PodDisruptionBudgetSpec {
            max_unavailable: Some(IntOrString::Int(1)),
            selector: Some(LabelSelector {
                match_labels: Some(pods),
                ..LabelSelector::default()
            }),
            ..PodDisruptionBudgetSpec::default()
        }),
        ..PodDisruptionBudget::default()
    }
}

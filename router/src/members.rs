//! Where a service's ready pods come from: the EndpointSlices Kubernetes' own EndpointSlice
//! controller writes for the operator's Service (the default: they hold addresses and
//! readiness only, so the router needs no read access to Pods, whose specs may carry
//! environment values), or the Pods themselves (`--endpoints-from=pods`, for clusters whose
//! pods sit at addresses EndpointSlices refuse, such as the loopback test clusters).

use std::collections::BTreeMap;

use ferrite_api::labels::{COMPONENT_LABEL, MANAGED_SELECTOR, SERVER_COMPONENT, belongs_to};
use ferrite_api::scrape::{base_url, pod_targets};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::ResourceExt;
use kube::runtime::reflector::Store;

/// One ready pod to send requests to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    /// Pod name: the hash ring is built from names.
    pub name: String,
    /// `http://ip:port`.
    pub base_url: String,
}

/// The source of every service's endpoints (`--endpoints-from`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum EndpointsFrom {
    /// EndpointSlices of the operator's Services (RBAC: list and watch
    /// `discovery.k8s.io/endpointslices`).
    #[default]
    EndpointSlices,
    /// The operator's server pods (RBAC: list and watch `pods`).
    Pods,
}

/// The label the EndpointSlice controller puts on every slice it writes for a Service.
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";
/// Which controller manages a slice; only the cluster's own are trusted (whoever may write a
/// slice by hand could otherwise point a service's traffic at any address).
const SLICE_MANAGER_LABEL: &str = "endpointslice.kubernetes.io/managed-by";
const SLICE_CONTROLLER: &str = "endpointslice-controller.k8s.io";

/// The label selector of the watch for `from`: the operator's server pods, or the slices the
/// cluster's controller writes for the operator's Services (which carry the Service's labels).
pub fn selector(from: EndpointsFrom) -> String {
    match from {
        // Serving pods only: a LeaderWorkerSet's workers hold model shards and serve nothing.
        EndpointsFrom::Pods => format!("{MANAGED_SELECTOR},{COMPONENT_LABEL}={SERVER_COMPONENT}"),
        EndpointsFrom::EndpointSlices => {
            format!("{MANAGED_SELECTOR},{SLICE_MANAGER_LABEL}={SLICE_CONTROLLER}")
        }
    }
}

/// The watch cache of one source.
#[derive(Clone)]
pub enum Members {
    Slices(Store<EndpointSlice>),
    Pods(Store<Pod>),
}

impl std::fmt::Debug for Members {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self {
            Members::Slices(_) => "EndpointSlices",
            Members::Pods(_) => "Pods",
        };
        write!(f, "{kind}({})", self.count())
    }
}

impl Members {
    /// Ready endpoints of InferenceService `namespace/name` (whose Service has its name), by
    /// name, each at `port`.
    pub fn ready(&self, namespace: &str, name: &str, port: i32) -> Vec<Endpoint> {
        let mut endpoints = match self {
            Members::Pods(pods) => {
                let pods = pods.state_filter(|p| belongs_to(p, namespace, name));
                pod_targets(pods.iter().map(|p| &**p), port)
                    .into_iter()
                    .filter(|t| t.ready)
                    .map(|t| Endpoint {
                        name: t.name,
                        base_url: t.base_url,
                    })
                    .collect()
            }
            Members::Slices(slices) => {
                let slices = slices.state_filter(|s| {
                    s.namespace().as_deref() == Some(namespace)
                        && s.labels().get(SERVICE_NAME_LABEL).map(String::as_str) == Some(name)
                });
                slice_endpoints(slices.iter().map(|s| &**s), port)
            }
        };
        endpoints.sort_by(|a, b| a.name.cmp(&b.name));
        endpoints
    }

    /// Objects in the cache.
    fn count(&self) -> usize {
        match self {
            Members::Slices(s) => s.state().len(),
            Members::Pods(p) => p.state().len(),
        }
    }

    /// Waits until the cache has been listed once.
    pub async fn wait_until_ready(
        &self,
    ) -> Result<(), kube::runtime::reflector::store::WriterDropped> {
        match self {
            Members::Slices(s) => s.wait_until_ready().await,
            Members::Pods(p) => p.wait_until_ready().await,
        }
    }
}

/// The ready endpoints of `slices` (one Service's), once each: a pod is named by its
/// `targetRef` (the hash ring is built from names, which stay put while a pod lives), or by
/// its address when the slice names none. An endpoint is ready unless its `ready` condition
/// is false or it is terminating (the API says an unknown `ready` means ready); FQDN slices
/// are skipped (the controller writes IP slices for a selector Service).
pub fn slice_endpoints<'a>(
    slices: impl IntoIterator<Item = &'a EndpointSlice>,
    port: i32,
) -> Vec<Endpoint> {
    let mut by_name = BTreeMap::new();
    for slice in slices {
        if !matches!(slice.address_type.as_str(), "IPv4" | "IPv6") {
            continue;
        }
        for e in &slice.endpoints {
            let conditions = e.conditions.as_ref();
            let ready = conditions.and_then(|c| c.ready) != Some(false)
                && conditions.and_then(|c| c.terminating) != Some(true);
            let Some(address) = e.addresses.first().filter(|_| ready) else {
                continue;
            };
            let name = e
                .target_ref
                .as_ref()
                .filter(|r| r.kind.as_deref() == Some("Pod"))
                .and_then(|r| r.name.clone())
                .unwrap_or_else(|| address.clone());
            by_name.entry(name.clone()).or_insert_with(|| Endpoint {
                name,
                base_url: base_url(address, port),
            });
        }
    }
    by_name.into_values().collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn slice(address_type: &str, endpoints: serde_json::Value) -> EndpointSlice {
        serde_json::from_value(json!({
            "metadata": {"name": "s", "namespace": "ns"},
            "addressType": address_type,
            "endpoints": endpoints,
        }))
        .expect("an EndpointSlice")
    }

    fn pod_ref(name: &str) -> serde_json::Value {
        json!({"kind": "Pod", "name": name, "namespace": "ns"})
    }

    #[test]
    fn ready_endpoints_are_kept_once_each_by_pod_name() {
        let a = slice(
            "IPv4",
            json!([
                {"addresses": ["10.1.0.5"], "conditions": {"ready": true}, "targetRef": pod_ref("llm-b")},
                {"addresses": ["10.1.0.6"], "conditions": {"ready": false}, "targetRef": pod_ref("llm-c")},
                {"addresses": ["10.1.0.7"], "conditions": {"ready": false, "serving": true, "terminating": true},
                 "targetRef": pod_ref("llm-d")},
                {"addresses": ["10.1.0.8"], "targetRef": pod_ref("llm-a")},
            ]),
        );
        // During a rollout a pod may sit in two slices for a moment.
        let b = slice(
            "IPv4",
            json!([{"addresses": ["10.1.0.5"], "conditions": {"ready": true}, "targetRef": pod_ref("llm-b")}]),
        );
        let got = slice_endpoints([&a, &b], 8000);
        let names: Vec<_> = got.iter().map(|e| e.name.as_str()).collect();
        assert_eq!(names, ["llm-a", "llm-b"], "{got:?}");
        assert_eq!(got[1].base_url, "http://10.1.0.5:8000");
    }

    #[test]
    fn ipv6_addresses_are_bracketed_and_fqdn_slices_skipped() {
        let v6 = slice(
            "IPv6",
            json!([{"addresses": ["fd00::5"], "conditions": {"ready": true}, "targetRef": pod_ref("p")}]),
        );
        let fqdn = slice(
            "FQDN",
            json!([{"addresses": ["evil.example.com"], "conditions": {"ready": true}}]),
        );
        let got = slice_endpoints([&v6, &fqdn], 8000);
        assert_eq!(
            got,
            [Endpoint {
                name: "p".into(),
                base_url: "http://[fd00::5]:8000".into()
            }]
        );
    }

    #[test]
    fn an_endpoint_without_a_pod_reference_is_named_by_its_address() {
        let s = slice(
            "IPv4",
            json!([{"addresses": ["10.1.0.9"], "conditions": {"ready": true}}, {"addresses": []}]),
        );
        let got = slice_endpoints([&s], 80);
        assert_eq!(got.len(), 1, "{got:?}");
        assert_eq!(got[0].name, "10.1.0.9");
    }

    #[test]
    fn the_slice_watch_trusts_only_the_clusters_controller() {
        let s = selector(EndpointsFrom::EndpointSlices);
        assert!(
            s.contains("endpointslice.kubernetes.io/managed-by=endpointslice-controller.k8s.io"),
            "{s}"
        );
        assert!(s.contains(MANAGED_SELECTOR), "{s}");
    }
}

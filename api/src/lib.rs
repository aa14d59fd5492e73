//! ferrite-api: what crosses a process boundary between ferrite's binaries, and nothing that
//! runs a controller or a model. As Kubernetes keeps `k8s.io/api` apart from its controllers,
//! the operator, the router and the server each depend on this crate and never on one
//! another:
//!
//! - [`source`] and [`termination`]: the model source grammar the operator mounts and the server
//!   downloads, and the reasons the server gives when it cannot start (no dependencies: the
//!   server builds this crate without its default features);
//! - [`vllm`]: the metric names the pods export and the operator and router read;
//! - with `k8s`: [`crd`] (the InferenceService types; `crdgen` writes `crds/` from them),
//!   [`labels`], [`conditions`], [`served`] (who holds a served name), [`signal`], [`tenant`]
//!   (the InferenceTenant types the router authenticates and limits by);
//! - with `scrape`: [`exposition`] and [`scrape`], the bounded streaming reader of the pods'
//!   `/metrics`;
//! - with `keys`: [`keys`], the API keys `spec.auth` names, read from their Secrets (the
//!   operator's adapter sync and a router with tenants send them to the pods).

pub mod hash;
pub mod source;
pub mod termination;
pub mod vllm;

#[cfg(feature = "k8s")]
pub mod conditions;
#[cfg(feature = "k8s")]
pub mod crd;
#[cfg(feature = "k8s")]
pub mod labels;
#[cfg(feature = "k8s")]
pub mod served;
#[cfg(feature = "k8s")]
pub mod signal;
#[cfg(feature = "k8s")]
pub mod tenant;

#[cfg(feature = "scrape")]
pub mod exposition;
#[cfg(feature = "scrape")]
pub mod scrape;

#[cfg(feature = "keys")]
pub mod keys;

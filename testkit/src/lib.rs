//! Test support for the workspace's tests and benchmarks (a dev-dependency only): child
//! processes that die with the test, free ports, polling, the default model, whether a GPU is
//! here, the Prometheus runner, a stand-in Hugging Face Hub and web server, a real Kubernetes
//! control plane, deterministic random test data, and the setup scripts' tools; for the
//! operator's tests and the workspace's suites (tests/), the Helm chart rendered by the real
//! Helm SDK, the schema validators, HTTPS clients that trust one certificate, and the chart
//! installed on that control plane with the operator and router binaries run as its
//! Deployments would run them.

pub mod chart;
#[cfg(feature = "kube")]
pub mod e2e;
pub mod gpu;
pub mod hub;
#[cfg(feature = "kube")]
pub mod kube;
pub mod model;
pub mod paths;
pub mod process;
pub mod prometheus;
pub mod random;
pub mod server;
#[cfg(feature = "kube")]
pub mod tls;
pub mod tools;
pub mod validate;

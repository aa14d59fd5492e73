//! Test support for the workspace's tests and benchmarks (a dev-dependency only): child
//! processes that die with the test, free ports, polling, and a real Kubernetes control plane.

pub mod kube;
pub mod process;

//! ferrite-operator: reconciles `InferenceService` resources (group `ferrite.dev`) into
//! Deployments, Services, PodDisruptionBudgets, ServiceMonitors and Grafana dashboard
//! ConfigMaps.
//!
//! Reconcile runs dereference → validate → build → apply → status; `build` is pure.

pub mod build;
pub mod config;
pub mod crd;

//! ferrite-operator: reconciles `InferenceService` resources (group `ferrite.dev`) into
//! Deployments, Services, PodDisruptionBudgets, ServiceMonitors and Grafana dashboard
//! ConfigMaps.
//!
//! Reconcile runs dereference → validate → build → apply → status; `build` and `status` are
//! pure, `controller` does the I/O.

pub mod adapters;
pub mod autoscale;
pub mod backoff;
pub mod build;
pub mod cache;
pub mod certs;
pub mod config;
pub mod controller;
pub mod external_metrics;
pub mod keda_scaler;
pub mod leader;
pub mod status;
pub mod telemetry;

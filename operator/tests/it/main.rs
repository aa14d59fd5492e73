//! The operator's integration tests, one binary (each file below was its own, linked against
//! kube and the operator every time): builders, the controller on a scripted API server, and
//! end to end on a real kube-apiserver. The workspace's suites (the chart, the images, the
//! dashboards, the router's RBAC, the CRD) are in tests/.

// The scripted API server of the request-sequence tests (`controller`, `leader`).
mod apiserver;

mod autoscale_algorithm;
mod autoscale_e2e;
mod build;
mod controller;
mod e2e_adapters;
mod e2e_api;
mod e2e_keda;
mod e2e_leader;
mod e2e_reconcile;
mod e2e_scale;
mod e2e_tenancy;
mod e2e_tls;
mod e2e_traffic;
mod external_metrics;
mod hpa;
mod leader;
mod manifests;
mod scrape_limits;
mod status;

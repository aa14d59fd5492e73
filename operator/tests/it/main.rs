//! The operator's integration tests, one binary (each file below was its own, linked against
//! kube and the operator every time): builders and the chart, and end to end on a real
//! kube-apiserver.

mod common;

mod autoscale_algorithm;
mod autoscale_e2e;
mod build;
mod chart;
mod controller;
mod crd;
mod dashboards;
mod e2e_api;
mod e2e_leader;
mod e2e_reconcile;
mod e2e_router_rbac;
mod e2e_scale;
mod e2e_tenancy;
mod e2e_tls;
mod e2e_traffic;
mod external_metrics;
mod hpa;
mod images;
mod leader;
mod manifests;
mod scrape_limits;
mod status;

//! The workspace's own suites, one binary: what no one crate owns. The Helm chart (`chart`),
//! the container images (`images`), the Grafana dashboards and alert rules against a real
//! Prometheus scraping real servers and the operator (`dashboards`), ferrite-router with the
//! chart's RBAC on a real API server (`e2e_router_rbac`), the operator scaling on the requests
//! the router holds (`e2e_router_queue`), replicas that span pods as LeaderWorkerSets behind
//! the router (`e2e_lws`), and the generated `crds/` against
//! `ferrite_api` (`crd`). The shared helpers are ferrite-testkit's.

mod chart;
mod crd;
mod dashboards;
mod e2e_lws;
mod e2e_router_queue;
mod e2e_router_rbac;
mod images;

//! ferrite-router end to end, on a real API server (etcd, kube-apiserver,
//! kube-controller-manager) with real ferrite-servers behind stand-in pods: one test binary,
//! so CI links it once.

mod balance;
mod common;
mod fairness;
mod hostile;
mod routing;
mod splits;
mod streams;
mod tenants;
mod tls;
mod uploads;

//! Autoscaling on LLM signals. `algorithm` decides (pure), `ferrite_api::scrape` reads the
//! pods (shared with the router), `store` keeps the latest signals for the External
//! Metrics API (`crate::external_metrics`), `routers` reads what the ferrite-routers hold for
//! saturated services, and `runner` is the loop that ties them to the API server: it follows
//! the InferenceServices itself and publishes a view for the status step.

pub mod algorithm;
pub mod routers;
pub mod runner;
pub mod store;

//! Autoscaling on LLM signals. `algorithm` decides (pure), `exposition` parses the pods'
//! Prometheus text, `scrape` reads the pods, `store` keeps the latest signals for the External
//! Metrics API (`crate::external_metrics`), and `runner` is the loop that ties them to the API
//! server: it follows the InferenceServices itself and publishes a view for the status step.

pub mod algorithm;
pub mod exposition;
pub mod runner;
pub mod scrape;
pub mod store;

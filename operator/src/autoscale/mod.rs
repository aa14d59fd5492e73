//! Autoscaling on LLM signals. `algorithm` decides (pure), `exposition` parses the pods'
//! Prometheus text, `scrape` reads the pods, `store` keeps the latest signals, `runner` is the
//! loop that ties them to the API server, and `external` serves the signals to HPA on the
//! External Metrics API.

pub mod algorithm;
pub mod exposition;
pub mod external;
pub mod runner;
pub mod scrape;
pub mod selector;
pub mod store;

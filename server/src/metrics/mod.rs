//! vLLM-compatible Prometheus metrics (names, types, labels and buckets of
//! `shared/metrics-protocol.md`). [`EngineMetrics`] is the Prometheus sink of the engine's stats
//! records: the engine thread is its only writer (one process, one engine: nothing partial or
//! doubled), and a scrape only reads atomics, so it never waits for an engine step.

mod engine;
pub mod http;
pub mod stats_log;

pub use engine::{CacheInfo, EngineMetrics};

use prometheus::{Encoder, Registry, TextEncoder};

/// Labels every engine metric carries.
const LABELS: &[&str] = &["model_name", "engine"];
/// The single engine of this process.
const ENGINE: &str = "0";

/// 1, 2, 5, 10, 20, 50, … up to `max` (the seed's `build_1_2_5_buckets`).
pub fn buckets_1_2_5(max: usize) -> Vec<f64> {
    let mut out = Vec::new();
    let mut exp = 1usize;
    'outer: loop {
        for m in [1, 2, 5] {
            let v = m * exp;
            if v > max {
                break 'outer;
            }
            out.push(v as f64);
        }
        exp *= 10;
    }
    out
}

#[derive(Debug, thiserror::Error)]
#[error("metrics: {0}")]
pub struct MetricsError(#[from] prometheus::Error);

/// The registry of the process: process metrics from the start, engine metrics once the model
/// is loaded, HTTP metrics from the router.
pub fn process_registry() -> Result<Registry, MetricsError> {
    let registry = Registry::new();
    #[cfg(target_os = "linux")]
    registry.register(Box::new(
        prometheus::process_collector::ProcessCollector::for_self(),
    ))?;
    Ok(registry)
}

/// The text exposition of every metric on `registry`.
pub fn encode(registry: &Registry) -> Result<String, MetricsError> {
    let mut buf = Vec::new();
    TextEncoder::new().encode(&registry.gather(), &mut buf)?;
    Ok(String::from_utf8_lossy(&buf).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_two_five_buckets() {
        assert_eq!(
            buckets_1_2_5(512),
            vec![1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0]
        );
        assert_eq!(buckets_1_2_5(1), vec![1.0]);
    }
}

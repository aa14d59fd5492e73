//! Reads the pods' `/metrics` directly, concurrently and with a timeout, and turns each into a
//! [`PodSample`]. This is the autoscaler's only view of load: no Prometheus in between, so the
//! signal is as fresh as the scrape.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Limited};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

use super::exposition;
use crate::signal::{KV_USAGE, PodMetrics, PodSample, RUNNING, WAITING};

/// Largest exposition read from one pod; a vLLM pod's is well under 1 MiB.
const MAX_BODY: usize = 8 << 20;

/// A pod to read, as pod discovery (or a test) finds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodTarget {
    pub name: String,
    /// Base URL of the pod's server, e.g. `http://10.0.0.7:8000`.
    pub base_url: String,
    /// Ready and not terminating: it receives traffic, so its load counts.
    pub ready: bool,
}

/// Why a pod's metrics could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ScrapeError {
    #[error("invalid URL {0:?}")]
    Url(String),
    #[error("request failed: {0}")]
    Http(String),
    #[error("HTTP status {0}")]
    Status(u16),
    #[error("timed out after {0:?}")]
    Timeout(Duration),
    #[error("body: {0}")]
    Body(String),
    #[error("exposition: {0}")]
    Parse(#[from] exposition::ParseError),
    #[error("no {WAITING} in the exposition")]
    NoQueueMetric,
}

impl ScrapeError {
    /// Low-cardinality label for the scrape errors metric.
    pub fn kind(&self) -> &'static str {
        match self {
            ScrapeError::Url(_) | ScrapeError::Http(_) => "connect",
            ScrapeError::Status(_) => "status",
            ScrapeError::Timeout(_) => "timeout",
            ScrapeError::Body(_) | ScrapeError::Parse(_) => "parse",
            ScrapeError::NoQueueMetric => "missing_metric",
        }
    }
}

/// One pod's outcome: the sample for the algorithm, and the error when there was one.
#[derive(Debug, Clone, PartialEq)]
pub struct PodResult {
    pub name: String,
    pub sample: PodSample,
    pub error: Option<ScrapeError>,
}

/// A reusable HTTP client for scraping (keeps connections to the pods alive).
#[derive(Clone, Debug)]
pub struct Scraper {
    client: Client<HttpConnector, Empty<Bytes>>,
    timeout: Duration,
}

impl Scraper {
    pub fn new(timeout: Duration) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(timeout));
        connector.set_nodelay(true);
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(90))
            .build(connector);
        Self { client, timeout }
    }

    /// Scrapes every ready pod concurrently; pods that are not ready are not contacted.
    pub async fn scrape_all(&self, pods: &[PodTarget]) -> Vec<PodResult> {
        let futures = pods.iter().map(|pod| async move {
            if !pod.ready {
                return PodResult {
                    name: pod.name.clone(),
                    sample: PodSample::Unready,
                    error: None,
                };
            }
            match self.scrape(&pod.base_url).await {
                Ok(m) => PodResult {
                    name: pod.name.clone(),
                    sample: PodSample::Ready(m),
                    error: None,
                },
                Err(e) => PodResult {
                    name: pod.name.clone(),
                    sample: PodSample::Missing,
                    error: Some(e),
                },
            }
        });
        futures::future::join_all(futures).await
    }

    /// Reads one pod's signals.
    pub async fn scrape(&self, base_url: &str) -> Result<PodMetrics, ScrapeError> {
        let url = format!("{}/metrics", base_url.trim_end_matches('/'));
        let uri: http::Uri = url.parse().map_err(|_| ScrapeError::Url(url.clone()))?;
        let request = http::Request::get(uri)
            .header(http::header::ACCEPT, "text/plain;version=0.0.4")
            .body(Empty::new())
            .map_err(|e| ScrapeError::Http(e.to_string()))?;
        let read = async {
            let response = self
                .client
                .request(request)
                .await
                .map_err(|e| ScrapeError::Http(e.to_string()))?;
            if !response.status().is_success() {
                return Err(ScrapeError::Status(response.status().as_u16()));
            }
            let body = Limited::new(response.into_body(), MAX_BODY)
                .collect()
                .await
                .map_err(|e| ScrapeError::Body(e.to_string()))?
                .to_bytes();
            String::from_utf8(body.to_vec()).map_err(|e| ScrapeError::Body(e.to_string()))
        };
        let text = tokio::time::timeout(self.timeout, read)
            .await
            .map_err(|_| ScrapeError::Timeout(self.timeout))??;
        pod_metrics(&exposition::parse(&text)?)
    }
}

/// The signals in one exposition. Gauges are summed over their series (one per model, or
/// per engine in data-parallel vLLM); KV usage is averaged over its series.
pub fn pod_metrics(samples: &[exposition::Sample]) -> Result<PodMetrics, ScrapeError> {
    let sum = |name: &str| {
        let mut values = samples
            .iter()
            .filter(|s| s.name == name)
            .map(|s| s.value)
            .peekable();
        values.peek().is_some().then(|| values.sum::<f64>())
    };
    let waiting = sum(WAITING).ok_or(ScrapeError::NoQueueMetric)?;
    let running = sum(RUNNING).unwrap_or(0.0);
    let kv_usage = KV_USAGE.iter().find_map(|name| {
        let values: Vec<f64> = samples
            .iter()
            .filter(|s| s.name == *name)
            .map(|s| s.value)
            .collect();
        (!values.is_empty()).then(|| values.iter().sum::<f64>() / values.len() as f64)
    });
    let finite = |v: f64| if v.is_finite() { v.max(0.0) } else { 0.0 };
    Ok(PodMetrics {
        waiting: finite(waiting),
        running: finite(running),
        kv_usage: kv_usage
            .filter(|v| v.is_finite())
            .map(|v| v.clamp(0.0, 1.0)),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn metrics(text: &str) -> Result<PodMetrics, ScrapeError> {
        pod_metrics(&exposition::parse(text).expect("parses"))
    }

    #[test]
    fn sums_gauges_and_averages_kv_over_series() {
        let m = metrics(
            "vllm:num_requests_waiting{engine=\"0\"} 2\n\
             vllm:num_requests_waiting{engine=\"1\"} 3\n\
             vllm:num_requests_running{engine=\"0\"} 4\n\
             vllm:kv_cache_usage_perc{engine=\"0\"} 0.5\n\
             vllm:kv_cache_usage_perc{engine=\"1\"} 0.7\n",
        )
        .expect("signals");
        assert_eq!(m.waiting, 5.0);
        assert_eq!(m.running, 4.0);
        assert!((m.kv_usage.expect("kv") - 0.6).abs() < 1e-12);
    }

    #[test]
    fn accepts_the_old_kv_name_and_a_missing_kv() {
        let old = metrics("vllm:num_requests_waiting 1\nvllm:gpu_cache_usage_perc 0.25\n")
            .expect("signals");
        assert_eq!(old.kv_usage, Some(0.25));
        let none = metrics("vllm:num_requests_waiting 1\n").expect("signals");
        assert_eq!(none.kv_usage, None);
        assert_eq!(none.running, 0.0);
    }

    #[test]
    fn a_missing_queue_metric_is_an_error() {
        assert_eq!(
            metrics("vllm:num_requests_running 1\n"),
            Err(ScrapeError::NoQueueMetric)
        );
    }
}

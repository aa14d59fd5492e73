//! Reads the pods' `/metrics` directly, concurrently and with a timeout, and turns each into a
//! [`PodSample`]. This is the autoscaler's only view of load: no Prometheus in between, so the
//! signal is as fresh as the scrape.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use tokio::sync::Semaphore;

use crate::exposition;
use crate::signal::{
    KV_USAGE, PodMetrics, PodSample, ROUTER_HELD, ROUTER_QUEUED, RUNNING, WAITING,
};
use crate::vllm;

/// Most adapter names kept from one pod's `vllm:lora_requests_info`.
const MAX_ADAPTERS: usize = 256;

/// What one pod's `/metrics` may cost. The exposition is the pod's (so the tenant's image's)
/// to write: it is read as a stream, line by line, keeping only the signals' series, and a
/// pod past any bound is a failed scrape with the reason, never memory. A vLLM pod's
/// exposition is well under 1 MiB and a few thousand lines.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScrapeLimits {
    /// Bytes of one exposition.
    pub max_bytes: usize,
    /// Bytes of one line (a label value can be long, not megabytes).
    pub max_line: usize,
    /// Lines of one exposition.
    pub max_lines: usize,
    /// Series of the signals' metrics kept from one exposition.
    pub max_series: usize,
    /// Pods read at once by one scraper.
    pub concurrency: usize,
}

impl Default for ScrapeLimits {
    fn default() -> Self {
        ScrapeLimits {
            max_bytes: 4 << 20,
            max_line: 64 << 10,
            max_lines: 200_000,
            max_series: 1024,
            concurrency: 32,
        }
    }
}

/// A pod to read, as pod discovery (or a test) finds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodTarget {
    pub name: String,
    /// Base URL of the pod's server, e.g. `http://10.0.0.7:8000`.
    pub base_url: String,
    /// Ready and not terminating: it receives traffic, so its load counts.
    pub ready: bool,
}

/// The pods to scrape: ready ones (with an IP) by their IP; pods still starting as unready,
/// so that they count as capacity on the way.
pub fn pod_targets<'a>(pods: impl IntoIterator<Item = &'a Pod>, port: i32) -> Vec<PodTarget> {
    // Pods being deleted or finished will never take load: they are not capacity at all.
    pods.into_iter()
        .filter(|p| {
            p.metadata.deletion_timestamp.is_none()
                && !matches!(
                    p.status.as_ref().and_then(|s| s.phase.as_deref()),
                    Some("Succeeded" | "Failed")
                )
        })
        .map(|p| {
            let ip = p.status.as_ref().and_then(|s| s.pod_ip.clone());
            let ready = ip.is_some()
                && p.status
                    .as_ref()
                    .and_then(|s| s.conditions.as_ref())
                    .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
            PodTarget {
                name: p.name_any(),
                base_url: base_url(&ip.unwrap_or_default(), port),
                ready,
            }
        })
        .collect()
}

/// `http://ip:port`, an IPv6 address in brackets.
pub fn base_url(ip: &str, port: i32) -> String {
    if ip.contains(':') {
        format!("http://[{ip}]:{port}")
    } else {
        format!("http://{ip}:{port}")
    }
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
    #[error("the exposition is over the limit: {0}")]
    TooLarge(String),
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
            ScrapeError::TooLarge(_) => "too_large",
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
    /// The LoRA adapters the pod has running or waiting requests for (vLLM's
    /// `vllm:lora_requests_info`): the ones it holds in its batch slots.
    pub adapters: Vec<String>,
}

/// An HTTP/1 client for talking to the pods (the operator's scrapes and adapter calls, the
/// router's requests), keeping connections alive. One builder, so every client the project
/// points at a pod closes pooled connections before the pods' servers do.
pub fn pod_client<B>(connect_timeout: Duration) -> Client<HttpConnector, B>
where
    B: http_body::Body + Send,
    B::Data: Send,
{
    let mut connector = HttpConnector::new();
    connector.set_connect_timeout(Some(connect_timeout));
    connector.set_nodelay(true);
    Client::builder(TokioExecutor::new())
        // Below the servers' idle timeout (30 s), so a pooled connection is not reused just
        // as the server closes it.
        .pool_idle_timeout(Duration::from_secs(20))
        .build(connector)
}

/// A reusable HTTP client for scraping (keeps connections to the pods alive).
#[derive(Clone, Debug)]
pub struct Scraper {
    client: Client<HttpConnector, Empty<Bytes>>,
    timeout: Duration,
    limits: ScrapeLimits,
    /// Bounds the pods read at once.
    slots: Arc<Semaphore>,
}

impl Scraper {
    pub fn new(timeout: Duration) -> Self {
        let limits = ScrapeLimits::default();
        Self {
            client: pod_client(timeout),
            timeout,
            limits,
            slots: Arc::new(Semaphore::new(limits.concurrency.max(1))),
        }
    }

    /// Scrapes every ready pod concurrently; pods that are not ready are not contacted.
    pub async fn scrape_all(&self, pods: &[PodTarget]) -> Vec<PodResult> {
        let futures = pods.iter().map(|pod| async move {
            let result = |sample, error, adapters| PodResult {
                name: pod.name.clone(),
                sample,
                error,
                adapters,
            };
            if !pod.ready {
                return result(PodSample::Unready, None, Vec::new());
            }
            match self.read(&pod.base_url).await {
                Ok((m, adapters)) => result(PodSample::Ready(m), None, adapters),
                Err(e) => result(PodSample::Missing, Some(e), Vec::new()),
            }
        });
        futures::future::join_all(futures).await
    }

    /// Reads one pod's signals (waiting for a slot among the scraper's concurrent reads;
    /// the timeout covers the read, not the wait).
    pub async fn scrape(&self, base_url: &str) -> Result<PodMetrics, ScrapeError> {
        self.read(base_url).await.map(|(m, _)| m)
    }

    /// [`Scraper::scrape`], with the adapters the pod holds.
    async fn read(&self, base_url: &str) -> Result<(PodMetrics, Vec<String>), ScrapeError> {
        self.read_with(base_url, Signals::default()).await
    }

    /// Requests waiting in a ferrite-router, per InferenceService (`namespace`, `name`): its
    /// `/metrics` read within the same limits as a pod's.
    pub async fn router_queues(&self, base_url: &str) -> Result<RouterQueues, ScrapeError> {
        self.read_with(base_url, RouterQueues::default()).await
    }

    /// Reads `base_url`'s `/metrics` into `fold`.
    async fn read_with<F: Fold>(&self, base_url: &str, fold: F) -> Result<F::Out, ScrapeError> {
        let url = format!("{}/metrics", base_url.trim_end_matches('/'));
        let uri: http::Uri = url.parse().map_err(|_| ScrapeError::Url(url.clone()))?;
        let request = http::Request::get(uri)
            .header(http::header::ACCEPT, "text/plain;version=0.0.4")
            .body(Empty::new())
            .map_err(|e| ScrapeError::Http(e.to_string()))?;
        let _slot = self
            .slots
            .acquire()
            .await
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
            read_folded(response.into_body(), &self.limits, fold).await
        };
        tokio::time::timeout(self.timeout, read)
            .await
            .map_err(|_| ScrapeError::Timeout(self.timeout))?
    }
}

/// What a read keeps of an exposition, sample by sample: only what it needs, never the
/// samples.
trait Fold {
    type Out;
    /// Takes one sample.
    fn add(&mut self, sample: &exposition::Sample);
    /// Series kept so far, bounded by [`ScrapeLimits::max_series`].
    fn series(&self) -> usize;
    fn finish(self) -> Result<Self::Out, ScrapeError>;
}

/// Reads an exposition as it arrives, within `limits`, folding its samples into `fold`.
async fn read_folded<B, F: Fold>(
    mut body: B,
    limits: &ScrapeLimits,
    fold: F,
) -> Result<F::Out, ScrapeError>
where
    B: http_body::Body<Data = Bytes> + Unpin,
    B::Error: std::fmt::Display,
{
    let mut lines = LineReader::new(*limits, fold);
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| ScrapeError::Body(e.to_string()))?;
        if let Ok(data) = frame.into_data() {
            lines.feed(&data)?;
        }
    }
    lines.finish()
}

/// Splits the stream into lines and folds each, holding at most one line.
struct LineReader<F> {
    limits: ScrapeLimits,
    pending: Vec<u8>,
    bytes: usize,
    lines: usize,
    fold: F,
}

impl<F: Fold> LineReader<F> {
    fn new(limits: ScrapeLimits, fold: F) -> Self {
        Self {
            limits,
            pending: Vec::new(),
            bytes: 0,
            lines: 0,
            fold,
        }
    }

    fn feed(&mut self, mut data: &[u8]) -> Result<(), ScrapeError> {
        self.bytes += data.len();
        if self.bytes > self.limits.max_bytes {
            return Err(ScrapeError::TooLarge(format!(
                "more than {} bytes",
                self.limits.max_bytes
            )));
        }
        while let Some(end) = data.iter().position(|&b| b == b'\n') {
            self.pending.extend_from_slice(&data[..end]);
            self.line()?;
            data = &data[end + 1..];
        }
        self.pending.extend_from_slice(data);
        if self.pending.len() > self.limits.max_line {
            return Err(ScrapeError::TooLarge(format!(
                "a line of more than {} bytes",
                self.limits.max_line
            )));
        }
        Ok(())
    }

    fn line(&mut self) -> Result<(), ScrapeError> {
        self.lines += 1;
        if self.lines > self.limits.max_lines {
            return Err(ScrapeError::TooLarge(format!(
                "more than {} lines",
                self.limits.max_lines
            )));
        }
        if self.pending.len() > self.limits.max_line {
            return Err(ScrapeError::TooLarge(format!(
                "a line of more than {} bytes",
                self.limits.max_line
            )));
        }
        let line = std::str::from_utf8(&self.pending).map_err(|e| {
            ScrapeError::Parse(exposition::ParseError {
                line: self.lines,
                message: e.to_string(),
            })
        })?;
        let sample = exposition::parse_line(line).map_err(|message| {
            ScrapeError::Parse(exposition::ParseError {
                line: self.lines,
                message,
            })
        })?;
        self.pending.clear();
        if let Some(sample) = sample {
            self.fold.add(&sample);
            if self.fold.series() > self.limits.max_series {
                return Err(ScrapeError::TooLarge(format!(
                    "more than {} series of the signals",
                    self.limits.max_series
                )));
            }
        }
        Ok(())
    }

    fn finish(mut self) -> Result<F::Out, ScrapeError> {
        if !self.pending.is_empty() {
            self.line()?;
        }
        self.fold.finish()
    }
}

/// Requests waiting in one ferrite-router, by InferenceService (`namespace`, `name`), from
/// its [`ROUTER_QUEUED`] and [`ROUTER_HELD`] gauges (a service's requests are held while it
/// has no ready replica, queued while all of them are saturated).
#[derive(Debug, Default, Clone, PartialEq)]
pub struct RouterQueues {
    pub queued: std::collections::HashMap<(String, String), f64>,
}

impl Fold for RouterQueues {
    type Out = RouterQueues;

    fn add(&mut self, s: &exposition::Sample) {
        if (s.name != ROUTER_QUEUED && s.name != ROUTER_HELD) || !s.value.is_finite() {
            return;
        }
        let (Some(ns), Some(name)) = (s.label("namespace"), s.label("inferenceservice")) else {
            return;
        };
        *self
            .queued
            .entry((ns.to_string(), name.to_string()))
            .or_default() += s.value.max(0.0);
    }

    fn series(&self) -> usize {
        self.queued.len()
    }

    fn finish(self) -> Result<RouterQueues, ScrapeError> {
        Ok(self)
    }
}

/// The signals folded from samples as they come: sums and counts, never the samples.
#[derive(Debug, Default)]
struct Signals {
    waiting: Option<f64>,
    running: Option<f64>,
    /// Per KV name (current, then old): sum and count.
    kv: [(f64, usize); 2],
    /// The newest `vllm:lora_requests_info` series (vLLM keeps one per label set it has
    /// shown, valued at the time it was set): its value and its adapters.
    lora: Option<(f64, Vec<String>)>,
    series: usize,
}

impl Fold for Signals {
    type Out = (PodMetrics, Vec<String>);

    fn series(&self) -> usize {
        self.series
    }

    fn add(&mut self, s: &exposition::Sample) {
        let add = |acc: &mut Option<f64>, v: f64| *acc = Some(acc.unwrap_or(0.0) + v);
        if s.name == WAITING {
            add(&mut self.waiting, s.value);
        } else if s.name == RUNNING {
            add(&mut self.running, s.value);
        } else if let Some(i) = KV_USAGE.iter().position(|n| *n == s.name) {
            self.kv[i].0 += s.value;
            self.kv[i].1 += 1;
        } else if s.name == vllm::LORA_REQUESTS_INFO {
            if self.lora.as_ref().is_none_or(|(t, _)| s.value > *t) {
                let adapters = [vllm::LORA_RUNNING, vllm::LORA_WAITING]
                    .iter()
                    .filter_map(|l| s.label(l))
                    .flat_map(|v| v.split(','))
                    .map(str::trim)
                    .filter(|a| !a.is_empty())
                    .take(MAX_ADAPTERS)
                    .map(str::to_string)
                    .collect();
                self.lora = Some((s.value, adapters));
            }
        } else {
            return;
        }
        self.series += 1;
    }

    fn finish(self) -> Result<(PodMetrics, Vec<String>), ScrapeError> {
        let waiting = self.waiting.ok_or(ScrapeError::NoQueueMetric)?;
        let kv_usage = self
            .kv
            .iter()
            .find(|(_, n)| *n > 0)
            .map(|(sum, n)| sum / *n as f64);
        let finite = |v: f64| if v.is_finite() { v.max(0.0) } else { 0.0 };
        let mut adapters = self.lora.map(|(_, a)| a).unwrap_or_default();
        adapters.sort_unstable();
        adapters.dedup();
        let metrics = PodMetrics {
            waiting: finite(waiting),
            running: finite(self.running.unwrap_or(0.0)),
            kv_usage: kv_usage
                .filter(|v| v.is_finite())
                .map(|v| v.clamp(0.0, 1.0)),
        };
        Ok((metrics, adapters))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The signals of a whole exposition parsed at once (the streamed reader folds the same
    /// samples line by line). Gauges are summed over their series (one per model, or per
    /// engine in data-parallel vLLM); KV usage is averaged over its series.
    fn pod_metrics(samples: &[exposition::Sample]) -> Result<PodMetrics, ScrapeError> {
        let mut signals = Signals::default();
        samples.iter().for_each(|s| signals.add(s));
        signals.finish().map(|(m, _)| m)
    }

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

    /// Feeds `text` in chunks of `chunk` bytes, as frames arrive.
    fn streamed(
        text: &[u8],
        chunk: usize,
        limits: ScrapeLimits,
    ) -> Result<PodMetrics, ScrapeError> {
        let mut r = LineReader::new(limits, Signals::default());
        for c in text.chunks(chunk.max(1)) {
            r.feed(c)?;
        }
        r.finish().map(|(m, _)| m)
    }

    #[test]
    fn streaming_reads_match_whole_ones_at_any_chunking() {
        let text = "# HELP vllm:num_requests_waiting x\n\
                    # TYPE vllm:num_requests_waiting gauge\n\
                    vllm:num_requests_waiting{model_name=\"a\"} 2\n\
                    other_metric{x=\"y\"} 7\n\
                    vllm:num_requests_running 3\n\
                    vllm:kv_cache_usage_perc 0.5";
        let whole = metrics(text).expect("whole");
        for chunk in [1, 2, 7, 64, 4096] {
            let s = streamed(text.as_bytes(), chunk, ScrapeLimits::default()).expect("streamed");
            assert_eq!(s, whole, "chunks of {chunk}");
        }
    }

    #[test]
    fn an_exposition_past_a_limit_is_a_failed_scrape() {
        let limits = ScrapeLimits {
            max_bytes: 1000,
            max_line: 100,
            max_lines: 20,
            max_series: 5,
            concurrency: 1,
        };
        let kind = |text: String| {
            streamed(text.as_bytes(), 37, limits)
                .err()
                .map(|e| (e.kind(), e.to_string()))
        };
        let (k, why) =
            kind(format!("x{{a=\"{}\"}} 1\n", "v".repeat(80)).repeat(12)).expect("bytes");
        assert_eq!(k, "too_large");
        assert!(why.contains("bytes"), "{why}");
        let (_, why) = kind(format!("x{{a=\"{}\"}} 1\n", "v".repeat(200))).expect("line");
        assert!(why.contains("line of more than 100"), "{why}");
        // A line that never ends is cut at the line limit, not buffered.
        let (_, why) = kind("x".repeat(900)).expect("endless line");
        assert!(why.contains("line of more than 100"), "{why}");
        let (_, why) = kind("# c\n".repeat(21)).expect("lines");
        assert!(why.contains("lines"), "{why}");
        let many = (0..6)
            .map(|i| format!("vllm:num_requests_waiting{{e=\"{i}\"}} 1\n"))
            .collect::<String>();
        let (_, why) = kind(many).expect("series");
        assert!(why.contains("series"), "{why}");
    }

    /// vLLM keeps a series per label set it has shown; the newest (largest value, the time it
    /// was set) says which adapters are in the batch now.
    #[test]
    fn the_adapters_come_from_the_newest_lora_info_series() {
        let text = "vllm:num_requests_waiting 0\n\
             vllm:lora_requests_info{max_lora=\"2\",running_lora_adapters=\"old\",waiting_lora_adapters=\"\"} 100\n\
             vllm:lora_requests_info{max_lora=\"2\",running_lora_adapters=\"sql,tone\",waiting_lora_adapters=\"fresh\"} 200\n\
             vllm:lora_requests_info{max_lora=\"2\",running_lora_adapters=\"\",waiting_lora_adapters=\"\"} 150\n";
        let mut signals = Signals::default();
        for sample in exposition::parse(text).expect("parses") {
            signals.add(&sample);
        }
        let (_, adapters) = signals.finish().expect("signals");
        assert_eq!(adapters, ["fresh", "sql", "tone"]);
        // A pod listing endless names costs at most MAX_ADAPTERS of them.
        let many: Vec<String> = (0..1000).map(|i| format!("a{i}")).collect();
        let line = format!(
            "vllm:lora_requests_info{{running_lora_adapters=\"{}\"}} 1\n",
            many.join(",")
        );
        let mut signals = Signals::default();
        for sample in
            exposition::parse(&format!("vllm:num_requests_waiting 0\n{line}")).expect("parses")
        {
            signals.add(&sample);
        }
        assert_eq!(signals.finish().expect("signals").1.len(), MAX_ADAPTERS);
        let mut r = LineReader::new(ScrapeLimits::default(), Signals::default());
        r.feed(b"vllm:num_requests_waiting 0\n").expect("feeds");
        assert!(
            r.finish().expect("signals").1.is_empty(),
            "no LoRA, no adapters"
        );
    }

    #[test]
    fn a_routers_queues_are_read_per_service_within_the_limits() {
        let text = "# TYPE ferrite_router_queued_requests gauge\n\
                    ferrite_router_queued_requests{inferenceservice=\"chat\",model_name=\"c\",namespace=\"a\"} 3\n\
                    ferrite_router_queued_requests{inferenceservice=\"chat\",model_name=\"c\",namespace=\"b\"} 0\n\
                    ferrite_router_queued_requests{namespace=\"a\"} 9\n\
                    ferrite_router_queued_requests{inferenceservice=\"x\",namespace=\"a\"} NaN\n\
                    ferrite_router_held_requests{inferenceservice=\"chat\",model_name=\"c\",namespace=\"a\"} 2\n\
                    vllm:num_requests_waiting 7\n";
        let mut r = LineReader::new(ScrapeLimits::default(), RouterQueues::default());
        r.feed(text.as_bytes()).expect("feeds");
        let q = r.finish().expect("queues").queued;
        // Queued and held alike.
        assert_eq!(q.get(&("a".into(), "chat".into())), Some(&5.0));
        assert_eq!(q.get(&("b".into(), "chat".into())), Some(&0.0));
        assert_eq!(
            q.len(),
            2,
            "no service label, or no number: not counted: {q:?}"
        );
        // A router listing more services than the bound is a failed read, not memory.
        let limits = ScrapeLimits {
            max_series: 2,
            ..ScrapeLimits::default()
        };
        let mut r = LineReader::new(limits, RouterQueues::default());
        let many: String = (0..3)
            .map(|i| format!("{ROUTER_QUEUED}{{namespace=\"n\",inferenceservice=\"s{i}\"}} 1\n"))
            .collect();
        assert!(matches!(
            r.feed(many.as_bytes()),
            Err(ScrapeError::TooLarge(_))
        ));
    }

    #[test]
    fn a_missing_queue_metric_is_an_error() {
        assert_eq!(
            metrics("vllm:num_requests_running 1\n"),
            Err(ScrapeError::NoQueueMetric)
        );
    }
}

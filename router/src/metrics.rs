//! The router's own metrics, in the operator's style (`ferrite_router_*`), on `/metrics`.

use prometheus::{
    Encoder, HistogramOpts, HistogramVec, IntCounterVec, IntGaugeVec, Opts, Registry, TextEncoder,
};

/// Upstream latency buckets: a cache hit's first byte in milliseconds up to a long
/// generation's minutes.
const LATENCY_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
];
/// Cold starts: a pod's start, from seconds to the 10-minute default timeout.
const COLD_START_BUCKETS: &[f64] = &[
    1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 180.0, 300.0, 450.0, 600.0,
];

/// Every metric, registered once.
#[derive(Debug, Clone)]
pub struct Metrics {
    registry: Registry,
    /// Requests by model, policy and outcome.
    pub requests: IntCounterVec,
    /// Requests held while their service has no ready replica.
    pub held: IntGaugeVec,
    /// How long held requests waited for a replica (also those that timed out).
    pub cold_start: HistogramVec,
    /// Replica choices, and whether prefix affinity was kept or overflowed.
    pub decisions: IntCounterVec,
    /// Upstream time to response headers.
    pub upstream_headers: HistogramVec,
    /// Upstream time until the response body ended.
    pub upstream_duration: HistogramVec,
    /// Requests retried on another replica, by reason.
    pub retries: IntCounterVec,
    /// Requests open per replica.
    pub in_flight: IntGaugeVec,
    /// Event streams cut short because their replica failed after the first byte.
    pub broken_streams: IntCounterVec,
    /// Event streams resumed on another replica after theirs failed.
    pub resumed_streams: IntCounterVec,
    /// Requests refused at a limit, by which (`busy`, `hold_full`).
    pub refused: IntCounterVec,
    /// Writes of a service's scale subresource to wake it from zero.
    pub wakes: IntCounterVec,
    /// Tenants' requests by outcome (admitted, forbidden, throttled_*), declared tenants only.
    pub tenant_requests: IntCounterVec,
    /// Tokens charged to each tenant (settled to what its requests used).
    pub tenant_tokens: IntCounterVec,
    /// Requests refused with 401 (no tenant label: the key named none).
    pub unauthorized: prometheus::IntCounter,
    /// Requests for a name split by weight, by the service each went to.
    pub split_requests: IntCounterVec,
    /// Requests waiting for a saturated service (flow control), per service: a signal to
    /// scale on before the servers' own queues fill.
    pub queued: IntGaugeVec,
    /// Time requests waited for a saturated service, by model and tenant.
    pub queue_duration: HistogramVec,
    /// Router replicas this one splits tenants' limits among (`state="ready"`) and the others
    /// it heard from lately (`state="heard"`); with `--peers` only.
    pub peer_replicas: IntGaugeVec,
}

impl Metrics {
    pub fn new() -> Result<Metrics, prometheus::Error> {
        let registry = Registry::new();
        let counter =
            |name: &str, help: &str, labels: &[&str]| -> Result<IntCounterVec, prometheus::Error> {
                let c = IntCounterVec::new(Opts::new(name, help), labels)?;
                registry.register(Box::new(c.clone()))?;
                Ok(c)
            };
        let histogram =
            |name: &str, help: &str, buckets: &[f64]| -> Result<HistogramVec, prometheus::Error> {
                let h = HistogramVec::new(
                    HistogramOpts::new(name, help).buckets(buckets.to_vec()),
                    &["model_name"],
                )?;
                registry.register(Box::new(h.clone()))?;
                Ok(h)
            };
        let gauge =
            |name: &str, help: &str, labels: &[&str]| -> Result<IntGaugeVec, prometheus::Error> {
                let g = IntGaugeVec::new(Opts::new(name, help), labels)?;
                registry.register(Box::new(g.clone()))?;
                Ok(g)
            };
        let m = Metrics {
            requests: counter(
                "ferrite_router_requests_total",
                "Requests by model, routing policy and outcome.",
                &["model_name", "policy", "outcome"],
            )?,
            held: gauge(
                "ferrite_router_held_requests",
                "Requests held while their InferenceService has no ready replica.",
                &["namespace", "inferenceservice", "model_name"],
            )?,
            cold_start: histogram(
                "ferrite_router_cold_start_seconds",
                "Time held requests waited for a ready replica.",
                COLD_START_BUCKETS,
            )?,
            decisions: counter(
                "ferrite_router_routing_decisions_total",
                "Replica choices by model, policy and prefix affinity (kept, overflowed, none).",
                &["model_name", "policy", "affinity"],
            )?,
            upstream_headers: histogram(
                "ferrite_router_upstream_headers_seconds",
                "Time from sending a request to a replica to its response headers.",
                LATENCY_BUCKETS,
            )?,
            upstream_duration: histogram(
                "ferrite_router_upstream_duration_seconds",
                "Time from sending a request to a replica to the end of its response.",
                LATENCY_BUCKETS,
            )?,
            retries: counter(
                "ferrite_router_retries_total",
                "Requests retried on another replica before any byte was streamed, by reason.",
                &["model_name", "reason"],
            )?,
            in_flight: gauge(
                "ferrite_router_in_flight_requests",
                "Requests open to each replica.",
                &["model_name", "pod"],
            )?,
            broken_streams: counter(
                "ferrite_router_broken_streams_total",
                "Event streams ended with an error event because their replica failed mid-stream.",
                &["model_name"],
            )?,
            resumed_streams: counter(
                "ferrite_router_resumed_streams_total",
                "Event streams continued on another replica after theirs failed mid-stream.",
                &["model_name"],
            )?,
            refused: counter(
                "ferrite_router_refused_requests_total",
                "Requests refused with 503 at one of the router's limits (busy: open requests or \
                 buffered bytes; hold_full: requests held for services scaling from zero).",
                &["reason"],
            )?,
            wakes: counter(
                "ferrite_router_wakes_total",
                "Writes of an InferenceService's scale subresource to wake it from zero.",
                &["model_name"],
            )?,
            tenant_requests: counter(
                "ferrite_router_tenant_requests_total",
                "Requests of each tenant by model and outcome: admitted, forbidden (a model \
                 outside its list), throttled_requests, throttled_tokens, throttled_concurrent.",
                &["tenant", "model_name", "outcome"],
            )?,
            tenant_tokens: counter(
                "ferrite_router_tenant_tokens_total",
                "Tokens charged to each tenant by model, settled to what its requests used.",
                &["tenant", "model_name"],
            )?,
            split_requests: counter(
                "ferrite_router_split_requests_total",
                "Requests for a model name several InferenceServices share by weight, by the \
                 service (namespace/name) each went to.",
                &["model_name", "inferenceservice"],
            )?,
            queued: gauge(
                ferrite_api::signal::ROUTER_QUEUED,
                "Requests waiting in the router because every replica of their \
                 InferenceService is saturated (flow control).",
                &["namespace", "inferenceservice", "model_name"],
            )?,
            peer_replicas: gauge(
                "ferrite_router_peer_replicas",
                "Router replicas this one splits every tenant's limits among: the Ready pods \
                 matching --peers, itself included (state=\"ready\"), and the other replicas \
                 whose tenant rates it read within the last 3 s (state=\"heard\"). Fewer than \
                 run: this replica enforces a larger share than its own.",
                &["state"],
            )?,
            queue_duration: {
                let h = HistogramVec::new(
                    HistogramOpts::new(
                        "ferrite_router_queue_duration_seconds",
                        "Time requests waited in the router for a saturated InferenceService \
                         (0 for those dispatched at once), by model and tenant (\"\" without \
                         tenants).",
                    )
                    .buckets(LATENCY_BUCKETS.to_vec()),
                    &["model_name", "tenant"],
                )?;
                registry.register(Box::new(h.clone()))?;
                h
            },
            unauthorized: {
                let c = prometheus::IntCounter::new(
                    "ferrite_router_unauthorized_requests_total",
                    "Requests refused with 401: no API key, or one no tenant holds.",
                )?;
                registry.register(Box::new(c.clone()))?;
                c
            },
            registry,
        };
        Ok(m)
    }

    /// Removes the per-pod series of pods that are gone (and have nothing open), so the
    /// exposition does not grow with every pod a service ever had.
    pub fn forget_pods(&self, live: &std::collections::HashSet<(String, String)>) {
        for family in prometheus::core::Collector::collect(&self.in_flight) {
            for m in family.get_metric() {
                let label = |name: &str| {
                    m.get_label()
                        .iter()
                        .find(|l| l.name() == name)
                        .map(|l| l.value().to_string())
                        .unwrap_or_default()
                };
                let (model, pod) = (label("model_name"), label("pod"));
                let idle = m.get_gauge().get_value() == 0.0;
                if idle && !live.contains(&(model.clone(), pod.clone())) {
                    let _ = self.in_flight.remove_label_values(&[&model, &pod]);
                }
            }
        }
    }

    /// Removes the split series of services (`namespace/name`) that are gone.
    pub fn forget_services(&self, live: &std::collections::HashSet<String>) {
        forget_unless(&self.split_requests, "inferenceservice", live);
    }

    /// Removes the series of tenants that are no longer declared.
    pub fn forget_tenants(&self, live: &std::collections::HashSet<String>) {
        forget_unless(&self.tenant_requests, "tenant", live);
        forget_unless(&self.tenant_tokens, "tenant", live);
    }

    /// The text exposition.
    pub fn render(&self) -> String {
        let mut buf = Vec::new();
        if let Err(e) = TextEncoder::new().encode(&self.registry.gather(), &mut buf) {
            tracing::warn!(error = %e, "encoding metrics");
        }
        String::from_utf8(buf).unwrap_or_default()
    }
}

/// Removes the series of `vec` whose `label` is not in `live`.
fn forget_unless(vec: &IntCounterVec, label: &str, live: &std::collections::HashSet<String>) {
    for family in prometheus::core::Collector::collect(vec) {
        for m in family.get_metric() {
            let value = m
                .get_label()
                .iter()
                .find(|l| l.name() == label)
                .map(|l| l.value());
            if value.is_some_and(|v| !live.contains(v)) {
                // By name: an exposition lists a series' labels sorted, not in the vec's order.
                let labels: std::collections::HashMap<&str, &str> = m
                    .get_label()
                    .iter()
                    .map(|l| (l.name(), l.value()))
                    .collect();
                let _ = vec.remove(&labels);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn series_of_tenants_and_services_that_are_gone_are_removed() {
        let m = Metrics::new().expect("metrics");
        m.tenant_requests
            .with_label_values(&["a", "chat", "admitted"])
            .inc();
        m.tenant_requests
            .with_label_values(&["b", "chat", "admitted"])
            .inc();
        m.tenant_tokens.with_label_values(&["b", "chat"]).inc();
        m.split_requests
            .with_label_values(&["chat", "ns/old"])
            .inc();
        m.split_requests
            .with_label_values(&["chat", "ns/new"])
            .inc();
        m.forget_tenants(&["a".to_string()].into());
        m.forget_services(&["ns/new".to_string()].into());
        let text = m.render();
        assert!(text.contains(r#"tenant="a""#), "{text}");
        assert!(!text.contains(r#"tenant="b""#), "{text}");
        assert!(
            text.contains("ns/new") && !text.contains("ns/old"),
            "{text}"
        );
    }
}

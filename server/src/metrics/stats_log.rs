//! The periodic stats log line (the seed's `LoggingStatLogger`) and the average-throughput
//! gauges that go with it. [`LogSink`] is a second consumer of the engine's stats records, next
//! to the Prometheus sink: it sums the same token counts the counters add, so the line, the
//! gauges and `rate()` on the counters always agree, without reading any gauge back.

use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use prometheus::{GaugeVec, Opts, Registry};

use super::{ENGINE, LABELS, MetricsError};
use ferrite_runtime::engine::EngineHandle;
use ferrite_runtime::engine::stats::{IterationStats, SchedulerStats, StatsSink};

/// One reading of the engine's counters and gauges.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Snapshot {
    pub prompt_tokens: u64,
    pub generation_tokens: u64,
    pub prefix_cache_queries: u64,
    pub prefix_cache_hits: u64,
    pub running: usize,
    pub swapped: usize,
    /// Waiting in the scheduler plus not yet taken in by the engine.
    pub pending: usize,
    /// Fractions 0..1.
    pub gpu_cache_usage: f64,
    pub cpu_cache_usage: f64,
}

/// The stats line's sink: token totals and the latest scheduler state, shared with the task
/// that logs.
#[derive(Debug, Clone, Default)]
pub struct LogSink(Arc<Mutex<Totals>>);

#[derive(Debug, Default)]
struct Totals {
    prompt_tokens: u64,
    generation_tokens: u64,
    prefix_cache_queries: u64,
    prefix_cache_hits: u64,
    scheduler: SchedulerStats,
}

impl StatsSink for LogSink {
    fn record(&mut self, scheduler: &SchedulerStats, iteration: &IterationStats) {
        if let Ok(mut t) = self.0.lock() {
            t.prompt_tokens += iteration.num_prompt_tokens;
            t.generation_tokens += iteration.num_generation_tokens;
            t.prefix_cache_queries += iteration.prefix_cache_queries;
            t.prefix_cache_hits += iteration.prefix_cache_hits;
            t.scheduler = *scheduler;
        }
    }
}

impl LogSink {
    /// The totals now, with the queue depth of `engine` (which also counts requests not yet
    /// taken in by the engine).
    pub fn snapshot(&self, engine: &EngineHandle) -> Snapshot {
        let (prompt_tokens, generation_tokens, queries, hits, s) = self
            .0
            .lock()
            .map(|t| {
                (
                    t.prompt_tokens,
                    t.generation_tokens,
                    t.prefix_cache_queries,
                    t.prefix_cache_hits,
                    t.scheduler,
                )
            })
            .unwrap_or_default();
        Snapshot {
            prompt_tokens,
            generation_tokens,
            prefix_cache_queries: queries,
            prefix_cache_hits: hits,
            running: s.num_running,
            swapped: s.num_swapped,
            pending: engine.queue_depth(),
            gpu_cache_usage: s.kv_cache_usage,
            cpu_cache_usage: s.cpu_cache_usage,
        }
    }
}

impl Snapshot {
    fn is_busy(&self) -> bool {
        self.running + self.swapped + self.pending > 0
    }
}

/// What one interval showed; `Display` is the seed's wording.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct IntervalStats {
    pub prompt_throughput: f64,
    pub generation_throughput: f64,
    /// Cached over queried prompt tokens of the requests admitted in the interval (0 to 1).
    pub prefix_cache_hit_rate: f64,
    pub now: Snapshot,
}

impl IntervalStats {
    fn is_idle(&self) -> bool {
        self.prompt_throughput == 0.0 && self.generation_throughput == 0.0 && !self.now.is_busy()
    }
}

impl fmt::Display for IntervalStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Avg prompt throughput: {:.1} tokens/s, Avg generation throughput: {:.1} tokens/s, \
             Running: {} reqs, Swapped: {} reqs, Pending: {} reqs, \
             GPU KV cache usage: {:.1}%, CPU KV cache usage: {:.1}%, \
             Prefix cache hit rate: {:.1}%.",
            self.prompt_throughput,
            self.generation_throughput,
            self.now.running,
            self.now.swapped,
            self.now.pending,
            self.now.gpu_cache_usage * 100.0,
            self.now.cpu_cache_usage * 100.0,
            self.prefix_cache_hit_rate * 100.0,
        )
    }
}

/// Turns successive snapshots into interval stats, sets the throughput gauges, and decides
/// which intervals are worth a log line.
#[derive(Debug)]
pub struct StatsLogger {
    prompt_throughput: prometheus::Gauge,
    generation_throughput: prometheus::Gauge,
    last_at: Instant,
    last: Snapshot,
    /// Whether the previous interval was idle: an idle system logs once, then stays quiet.
    last_idle: bool,
}

impl StatsLogger {
    /// Registers `vllm:avg_{prompt,generation}_throughput_toks_per_s` on `registry`.
    pub fn new(
        registry: &Registry,
        model_name: &str,
        start: Instant,
        first: Snapshot,
    ) -> Result<Self, MetricsError> {
        let gauge = |name: &str, help: &str| -> Result<prometheus::Gauge, MetricsError> {
            let v = GaugeVec::new(Opts::new(name, help), LABELS)?;
            registry.register(Box::new(v.clone()))?;
            Ok(v.with_label_values(&[model_name, ENGINE]))
        };
        Ok(Self {
            prompt_throughput: gauge(
                "vllm:avg_prompt_throughput_toks_per_s",
                "Average prefill throughput in tokens/s over the last log interval.",
            )?,
            generation_throughput: gauge(
                "vllm:avg_generation_throughput_toks_per_s",
                "Average generation throughput in tokens/s over the last log interval.",
            )?,
            last_at: start,
            last: first,
            last_idle: false,
        })
    }

    /// Closes the interval ending at `at`. Returns the stats to log, or `None` for an idle
    /// interval that follows another idle one.
    pub fn tick(&mut self, at: Instant, now: Snapshot) -> Option<IntervalStats> {
        let secs = at.saturating_duration_since(self.last_at).as_secs_f64();
        let rate = |cur: u64, prev: u64| {
            if secs > 0.0 {
                cur.saturating_sub(prev) as f64 / secs
            } else {
                0.0
            }
        };
        let queries = now
            .prefix_cache_queries
            .saturating_sub(self.last.prefix_cache_queries);
        let hits = now
            .prefix_cache_hits
            .saturating_sub(self.last.prefix_cache_hits);
        let stats = IntervalStats {
            prompt_throughput: rate(now.prompt_tokens, self.last.prompt_tokens),
            generation_throughput: rate(now.generation_tokens, self.last.generation_tokens),
            prefix_cache_hit_rate: if queries > 0 {
                hits as f64 / queries as f64
            } else {
                0.0
            },
            now,
        };
        self.prompt_throughput.set(stats.prompt_throughput);
        self.generation_throughput.set(stats.generation_throughput);
        self.last_at = at;
        self.last = now;
        let idle = stats.is_idle();
        let quiet = idle && self.last_idle;
        self.last_idle = idle;
        (!quiet).then_some(stats)
    }
}

/// Logs the stats line every `interval` until the process ends. Reads only what `sink` was
/// given and the published queue depth, so it never waits for an engine step.
pub fn spawn(
    registry: &Registry,
    model_name: &str,
    sink: LogSink,
    engine: EngineHandle,
    interval: Duration,
) -> Result<tokio::task::JoinHandle<()>, MetricsError> {
    let start = tokio::time::Instant::now();
    let mut logger = StatsLogger::new(
        registry,
        model_name,
        start.into_std(),
        sink.snapshot(&engine),
    )?;
    Ok(tokio::spawn(async move {
        let mut ticks = tokio::time::interval_at(start + interval, interval);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let at = ticks.tick().await;
            if let Some(stats) = logger.tick(at.into_std(), sink.snapshot(&engine)) {
                tracing::info!(target: "ferrite_server::stats", "{stats}");
            }
        }
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snap(prompt: u64, gen_: u64, running: usize) -> Snapshot {
        Snapshot {
            prompt_tokens: prompt,
            generation_tokens: gen_,
            running,
            ..Snapshot::default()
        }
    }

    #[test]
    fn line_uses_the_seed_wording() {
        let s = IntervalStats {
            prompt_throughput: 12.345,
            generation_throughput: 6.0,
            prefix_cache_hit_rate: 0.8125,
            now: Snapshot {
                running: 3,
                swapped: 1,
                pending: 2,
                gpu_cache_usage: 0.4567,
                cpu_cache_usage: 0.0,
                ..Snapshot::default()
            },
        };
        assert_eq!(
            s.to_string(),
            "Avg prompt throughput: 12.3 tokens/s, Avg generation throughput: 6.0 tokens/s, \
             Running: 3 reqs, Swapped: 1 reqs, Pending: 2 reqs, GPU KV cache usage: 45.7%, \
             CPU KV cache usage: 0.0%, Prefix cache hit rate: 81.2%."
        );
    }

    #[test]
    fn throughput_is_counter_change_over_interval_and_sets_gauges() {
        let registry = Registry::new();
        let t0 = Instant::now();
        let mut l = StatsLogger::new(&registry, "m", t0, snap(100, 50, 0)).expect("logger");
        let s = l
            .tick(t0 + Duration::from_secs(10), snap(300, 150, 2))
            .expect("busy interval logs");
        assert_eq!(s.prompt_throughput, 20.0);
        assert_eq!(s.generation_throughput, 10.0);
        assert_eq!(s.prefix_cache_hit_rate, 0.0, "no lookups in the interval");
        let text = super::super::encode(&registry).expect("encode");
        assert!(text.contains(
            "vllm:avg_generation_throughput_toks_per_s{engine=\"0\",model_name=\"m\"} 10"
        ));
        assert!(
            text.contains(
                "vllm:avg_prompt_throughput_toks_per_s{engine=\"0\",model_name=\"m\"} 20"
            )
        );
        let cached = Snapshot {
            prefix_cache_queries: 400,
            prefix_cache_hits: 100,
            ..snap(300, 150, 2)
        };
        let s = l.tick(t0 + Duration::from_secs(20), cached).expect("busy");
        assert_eq!(s.prefix_cache_hit_rate, 0.25);
    }

    #[test]
    fn idle_logs_once_then_stays_quiet_until_work_returns() {
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let mut l = StatsLogger::new(&Registry::new(), "m", t0, snap(0, 0, 0)).expect("logger");
        assert!(l.tick(at(10), snap(10, 5, 1)).is_some(), "busy");
        let first_idle = l
            .tick(at(20), snap(10, 5, 0))
            .expect("first idle interval logs");
        assert_eq!(first_idle.generation_throughput, 0.0);
        assert!(
            l.tick(at(30), snap(10, 5, 0)).is_none(),
            "second idle is quiet"
        );
        assert!(
            l.tick(at(40), snap(10, 5, 0)).is_none(),
            "third idle is quiet"
        );
        // A request that is only waiting (no tokens yet) is not idle.
        let waiting = Snapshot {
            pending: 1,
            ..snap(10, 5, 0)
        };
        assert!(l.tick(at(50), waiting).is_some(), "waiting work logs");
        assert!(
            l.tick(at(60), snap(10, 5, 0)).is_some(),
            "idle after work logs once"
        );
        assert!(l.tick(at(70), snap(10, 5, 0)).is_none());
    }
}

//! bench-autoscale: replays one bursty arrival trace through a simulated cluster of LLM pods,
//! once per autoscaler, on a simulated clock (100 ms ticks), and compares ferrite's Builtin
//! autoscaler (`ferrite_operator::autoscale::algorithm`, the code the operator runs) against two
//! baselines measured in the same run: the Kubernetes HPA fed by prometheus-adapter (30 s
//! Prometheus scrape, 15 s sync, 300 s down-stabilization) and a KEDA-like poller (15 s
//! polling, 300 s cooldown). Reports the time from each burst to the first scale-up and to
//! enough ready replicas, SLO attainment (queue wait < 2 s), replica-seconds, and ratios
//! against the HPA + adapter baseline.
//!
//! Everything is deterministic for a given `--seed`: the trace, Prometheus' scrape phases and
//! the evaluation phases come from one inline splitmix64 generator.
//!
//!   cargo build --release -p ferrite-bench --bin bench-autoscale
//!   target/release/bench-autoscale --seed 1 --hours 2

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use anyhow::{Context as _, Result, bail};
use clap::Parser;
use ferrite_api::crd::AutoscalingSpec;
use ferrite_api::signal::{PodMetrics, PodSample};
use ferrite_bench::stats::percentile;
use ferrite_operator::autoscale::algorithm::{Policy, ScalerState};
use serde_json::{Value, json};

#[derive(Debug, Parser)]
struct Args {
    /// Seed of the trace and of every random phase.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Simulated hours measured after the warm-up (three bursts per hour).
    #[arg(long, default_value_t = 2.0)]
    hours: f64,
    /// Seconds from a scale-up until the new pod is ready (scheduling, image, weights).
    #[arg(long, default_value_t = 30.0)]
    start_delay: f64,
    /// Arrival rate between bursts, requests per second.
    #[arg(long, default_value_t = 10.0)]
    base_rate: f64,
    /// Target waiting requests per replica, shared by all three autoscalers.
    #[arg(long, default_value_t = 3.0)]
    queue_target: f64,
    /// Target KV-cache usage fraction, shared by all three autoscalers.
    #[arg(long, default_value_t = 0.5)]
    kv_target: f64,
    /// An extra ferrite run: NAME=JSON, the JSON merged over the default AutoscalingSpec
    /// (camelCase CRD fields, e.g. 'fast-down={"behavior":{"maxScaleDownPercentPerMinute":100}}').
    /// Repeatable.
    #[arg(long = "variant", value_name = "NAME=JSON")]
    variants: Vec<String>,
    /// Also print every replica change of every run (time, from → to, serving pods).
    #[arg(long)]
    changes: bool,
}

/// Ticks per simulated second: the clock advances in 100 ms steps.
const TICKS_PER_SEC: u64 = 10;
/// Seconds per tick.
const DT: f64 = 1.0 / TICKS_PER_SEC as f64;
/// The SLO: a request meets it when it waits less than this for a batch slot.
const SLO_WAIT_S: f64 = 2.0;
const MIN_REPLICAS: i32 = 1;
const MAX_REPLICAS: i32 = 40;
/// HPA's default tolerance around a target.
const HPA_TOLERANCE: f64 = 0.1;
/// The longest the simulation runs on after the trace to admit the last queued requests.
const DRAIN_LIMIT_S: u64 = 3600;

fn ticks(seconds: f64) -> u64 {
    (seconds * TICKS_PER_SEC as f64).round() as u64
}

fn secs(ticks: u64) -> f64 {
    ticks as f64 * DT
}

/// Whether a periodic action (scrape, sync, poll) with this phase runs at tick `now`: each has
/// its own random phase, as independent loops in a real cluster do.
fn due(now: u64, phase: u64, period: u64) -> bool {
    (now + phase).is_multiple_of(period)
}

/// splitmix64: small, fast, and good enough for arrivals; written here to add no crate.
#[derive(Debug, Clone)]
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * self.unit()
    }

    /// An exponential interval with the given rate: Poisson arrivals.
    fn exp(&mut self, rate: f64) -> f64 {
        -(1.0 - self.unit()).ln() / rate
    }

    /// Uniform in 0..n (n > 0).
    fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }

    /// An independent stream for one purpose, so that e.g. one run's phases do not shift the
    /// trace.
    fn fork(&mut self) -> Rng {
        Rng(self.next_u64())
    }
}

/// A step change in the arrival rate.
#[derive(Debug, Clone)]
struct Burst {
    start: f64,
    duration: f64,
    multiplier: f64,
}

impl Burst {
    fn end(&self) -> f64 {
        self.start + self.duration
    }
}

#[derive(Debug, Clone, Copy)]
struct Request {
    arrival: f64,
    prompt: u32,
    output: u32,
}

/// Request sizes, uniform in these ranges (tokens).
const PROMPT_TOKENS: (u32, u32) = (200, 800);
const OUTPUT_TOKENS: (u32, u32) = (50, 350);
/// Bursts: one per this many seconds of trace, starting at a random point of its slot.
const BURST_SLOT_S: f64 = 1200.0;
const BURST_OFFSET_S: (f64, f64) = (240.0, 720.0);
const BURST_DURATION_S: (f64, f64) = (60.0, 120.0);
const BURST_MULTIPLIER: (f64, f64) = (5.0, 10.0);

/// Base load only before the measured window: every autoscaler settles from the same start (an
/// autoscaler's first evaluations have no history), and nothing here counts in the figures.
const WARMUP_S: f64 = 900.0;

#[derive(Debug)]
struct Trace {
    /// Start of the measured window (the end of the warm-up).
    warmup: f64,
    /// End of the trace.
    horizon: f64,
    base_rate: f64,
    bursts: Vec<Burst>,
    requests: Vec<Request>,
}

impl Trace {
    /// Bursts sit in 20-minute slots, so consecutive ones are at least 10 minutes apart: longer
    /// than every scale-down window, so each burst starts from a cluster sized for base load.
    fn generate(measured: f64, base_rate: f64, rng: &mut Rng) -> Self {
        let slots = (measured / BURST_SLOT_S).floor() as usize;
        let bursts = (0..slots)
            .map(|i| Burst {
                start: (WARMUP_S
                    + i as f64 * BURST_SLOT_S
                    + rng.uniform(BURST_OFFSET_S.0, BURST_OFFSET_S.1))
                .round(),
                duration: rng.uniform(BURST_DURATION_S.0, BURST_DURATION_S.1).round(),
                multiplier: (rng.uniform(BURST_MULTIPLIER.0, BURST_MULTIPLIER.1) * 10.0).round()
                    / 10.0,
            })
            .collect();
        let mut trace = Trace {
            warmup: WARMUP_S,
            horizon: WARMUP_S + measured,
            base_rate,
            bursts,
            requests: Vec::new(),
        };
        trace.requests = trace.arrivals(rng);
        trace
    }

    /// The arrival rate at `t` and the time it next changes.
    fn rate_at(&self, t: f64) -> (f64, f64) {
        for b in &self.bursts {
            if t < b.start {
                return (self.base_rate, b.start);
            }
            if t < b.end() {
                return (self.base_rate * b.multiplier, b.end());
            }
        }
        (self.base_rate, f64::INFINITY)
    }

    /// Poisson arrivals of a piecewise-constant rate: an interval that crosses a rate change
    /// is redrawn from the change (exponentials are memoryless).
    fn arrivals(&self, rng: &mut Rng) -> Vec<Request> {
        let mut out = Vec::new();
        let mut t = 0.0;
        loop {
            let (rate, change) = self.rate_at(t);
            let next = t + rng.exp(rate);
            if next >= change {
                t = change;
                continue;
            }
            t = next;
            if t >= self.horizon {
                return out;
            }
            out.push(Request {
                arrival: t,
                prompt: PROMPT_TOKENS.0
                    + rng.below(u64::from(PROMPT_TOKENS.1 - PROMPT_TOKENS.0 + 1)) as u32,
                output: OUTPUT_TOKENS.0
                    + rng.below(u64::from(OUTPUT_TOKENS.1 - OUTPUT_TOKENS.0 + 1)) as u32,
            });
        }
    }
}

/// One replica's serving model: a continuous-batching server.
#[derive(Debug, Clone)]
struct PodModel {
    start_delay: f64,
    max_num_seqs: usize,
    /// KV-cache capacity in tokens; a request reserves prompt + output tokens on admission.
    kv_capacity: u32,
    /// Decode tokens per second the whole batch shares.
    throughput: f64,
    /// Decode tokens per second one sequence gets at most (small batches are latency-bound).
    per_seq: f64,
}

impl PodModel {
    /// The stated model; only the start delay is a flag.
    fn new(start_delay: f64) -> Self {
        Self {
            start_delay,
            max_num_seqs: 64,
            kv_capacity: 32_768,
            throughput: 1500.0,
            per_seq: 50.0,
        }
    }

    /// Requests per second one saturated replica completes.
    fn capacity(&self) -> f64 {
        let mean_output = f64::from(OUTPUT_TOKENS.0 + OUTPUT_TOKENS.1) / 2.0;
        self.throughput / mean_output
    }
}

/// A request in a pod's batch.
#[derive(Debug, Clone, Copy)]
struct Seq {
    left: f64,
    kv: u32,
}

#[derive(Debug)]
struct Pod {
    created: u64,
    ready_at: u64,
    /// Removed by a scale-down: takes no new requests, finishes what it holds, then is gone.
    draining: bool,
    /// Prometheus scrapes this pod when `(now + offset) % interval == 0`.
    scrape_offset: u64,
    id: usize,
    queue: VecDeque<usize>,
    running: Vec<Seq>,
    kv_reserved: u32,
}

impl Pod {
    fn ready(&self, now: u64) -> bool {
        now >= self.ready_at
    }

    /// Ready and not draining: receives traffic and counts as serving capacity.
    fn serving(&self, now: u64) -> bool {
        self.ready(now) && !self.draining
    }

    fn in_flight(&self) -> usize {
        self.queue.len() + self.running.len()
    }

    fn metrics(&self, model: &PodModel) -> PodMetrics {
        PodMetrics {
            waiting: self.queue.len() as f64,
            running: self.running.len() as f64,
            kv_usage: Some(f64::from(self.kv_reserved) / f64::from(model.kv_capacity)),
        }
    }

    /// One tick of decode: the batch shares the pod's throughput, each sequence capped.
    fn decode(&mut self, model: &PodModel) {
        if self.running.is_empty() {
            return;
        }
        let rate = model
            .per_seq
            .min(model.throughput / self.running.len() as f64);
        let step = rate * DT;
        let mut freed = 0;
        self.running.retain_mut(|s| {
            s.left -= step;
            if s.left <= 0.0 {
                freed += s.kv;
                false
            } else {
                true
            }
        });
        self.kv_reserved -= freed;
    }

    /// Admits queued requests in order while a batch slot and their KV are free (strict FIFO:
    /// the head blocks the rest), appending them to `admitted`.
    fn admit(&mut self, model: &PodModel, requests: &[Request], admitted: &mut Vec<usize>) {
        while let Some(&r) = self.queue.front() {
            let req = requests[r];
            let kv = req.prompt + req.output;
            if self.running.len() >= model.max_num_seqs || self.kv_reserved + kv > model.kv_capacity
            {
                return;
            }
            self.queue.pop_front();
            self.kv_reserved += kv;
            self.running.push(Seq {
                left: f64::from(req.output),
                kv,
            });
            admitted.push(r);
        }
    }
}

/// The pods of one workload and the requests they serve.
#[derive(Debug)]
struct Cluster<'a> {
    model: &'a PodModel,
    trace: &'a Trace,
    pods: Vec<Pod>,
    next_id: usize,
    /// Index of the next request of the trace to arrive.
    next_arrival: usize,
    /// Arrivals while no pod could serve them; routed as soon as one is ready.
    unrouted: VecDeque<usize>,
    /// Queue wait of every request, NaN until admitted.
    waits: Vec<f64>,
    unadmitted: usize,
    /// Sum over the ticks of the measured window of the pods that existed.
    replica_ticks: u64,
    rng: Rng,
}

impl<'a> Cluster<'a> {
    /// `initial` replicas, ready from the start.
    fn new(model: &'a PodModel, trace: &'a Trace, initial: i32, rng: Rng) -> Self {
        let mut c = Self {
            model,
            trace,
            pods: Vec::new(),
            next_id: 0,
            next_arrival: 0,
            unrouted: VecDeque::new(),
            waits: vec![f64::NAN; trace.requests.len()],
            unadmitted: trace.requests.len(),
            replica_ticks: 0,
            rng,
        };
        for _ in 0..initial {
            c.add_pod(0, 0);
        }
        c
    }

    fn add_pod(&mut self, now: u64, ready_at: u64) {
        let scrape_offset = self.rng.below(ticks(PROM_SCRAPE_S));
        self.pods.push(Pod {
            created: now,
            ready_at,
            draining: false,
            scrape_offset,
            id: self.next_id,
            queue: VecDeque::new(),
            running: Vec::new(),
            kv_reserved: 0,
        });
        self.next_id += 1;
    }

    /// The replica count set on the workload: pods not draining.
    fn replicas(&self) -> i32 {
        self.pods.iter().filter(|p| !p.draining).count() as i32
    }

    fn serving(&self, now: u64) -> usize {
        self.pods.iter().filter(|p| p.serving(now)).count()
    }

    /// The serving pod with the fewest waiting + running requests (ties: the oldest).
    fn least_loaded(&self, now: u64) -> Option<usize> {
        self.pods
            .iter()
            .enumerate()
            .filter(|(_, p)| p.serving(now))
            .min_by_key(|(_, p)| p.in_flight())
            .map(|(i, _)| i)
    }

    fn route(&mut self, r: usize, now: u64) {
        match self.least_loaded(now) {
            Some(i) => self.pods[i].queue.push_back(r),
            None => self.unrouted.push_back(r),
        }
    }

    /// Advances tick `k` → `k + 1`: arrivals during the tick are routed, batches decode, and at
    /// `k + 1` queues admit and empty draining pods go.
    fn step(&mut self, k: u64) {
        let now = k + 1;
        if (ticks(self.trace.warmup)..ticks(self.trace.horizon)).contains(&k) {
            self.replica_ticks += self.pods.len() as u64;
        }
        while !self.unrouted.is_empty()
            && let Some(i) = self.least_loaded(k)
            && let Some(r) = self.unrouted.pop_front()
        {
            self.pods[i].queue.push_back(r);
        }
        let end = secs(now);
        while let Some(req) = self.trace.requests.get(self.next_arrival) {
            if req.arrival >= end {
                break;
            }
            self.route(self.next_arrival, k);
            self.next_arrival += 1;
        }
        let mut admitted = Vec::new();
        for pod in &mut self.pods {
            pod.decode(self.model);
            pod.admit(self.model, &self.trace.requests, &mut admitted);
        }
        for r in admitted {
            self.waits[r] = end - self.trace.requests[r].arrival;
            self.unadmitted -= 1;
        }
        self.pods.retain(|p| !(p.draining && p.in_flight() == 0));
    }

    /// Sets the replica count. New pods are ready after the start delay; removed pods are
    /// chosen as a ReplicaSet would, starting (not ready) pods first, newest first, then the
    /// ready pods with the fewest requests in flight.
    fn scale_to(&mut self, desired: i32, now: u64) {
        let current = self.replicas();
        if desired > current {
            let ready_at = now + ticks(self.model.start_delay);
            for _ in current..desired {
                self.add_pod(now, ready_at);
            }
            return;
        }
        let mut candidates: Vec<usize> = (0..self.pods.len())
            .filter(|&i| !self.pods[i].draining)
            .collect();
        candidates.sort_by_key(|&i| {
            let p = &self.pods[i];
            (p.ready(now), p.in_flight(), std::cmp::Reverse(p.created))
        });
        for &i in candidates.iter().take((current - desired).max(0) as usize) {
            self.pods[i].draining = true;
        }
    }

    /// Per-pod samples as the operator's runner builds them (`runner::pod_targets`): ready,
    /// non-terminating pods are read; starting and terminating pods are `Unready`.
    fn samples(&self, now: u64) -> Vec<PodSample> {
        self.pods
            .iter()
            .map(|p| {
                if p.serving(now) {
                    PodSample::Ready(p.metrics(self.model))
                } else {
                    PodSample::Unready
                }
            })
            .collect()
    }

    /// Fresh metrics of the serving pods, as a poller reading the pods directly sees them.
    fn fresh_metrics(&self, now: u64) -> Vec<PodMetrics> {
        self.pods
            .iter()
            .filter(|p| p.serving(now))
            .map(|p| p.metrics(self.model))
            .collect()
    }
}

/// Something that sets the replica count, evaluated at every tick boundary.
trait Autoscaler {
    /// Called at `now` after the cluster stepped; returns the count to set when it evaluates.
    fn tick(&mut self, now: u64, cluster: &Cluster) -> Option<i32>;
}

/// ferrite's Builtin mode: `ScalerState::decide` on fresh per-pod samples every scrape interval.
#[derive(Debug)]
struct Ferrite {
    policy: Policy,
    state: ScalerState,
    period: u64,
    phase: u64,
}

impl Ferrite {
    fn new(policy: Policy, rng: &mut Rng) -> Self {
        let period = ticks(policy.scrape_interval.as_secs_f64()).max(1);
        Self {
            policy,
            state: ScalerState::default(),
            period,
            phase: rng.below(period),
        }
    }
}

impl Autoscaler for Ferrite {
    fn tick(&mut self, now: u64, cluster: &Cluster) -> Option<i32> {
        if !due(now, self.phase, self.period) {
            return None;
        }
        let decision = self.state.decide(
            &self.policy,
            Duration::from_millis(now * 1000 / TICKS_PER_SEC),
            cluster.replicas(),
            &cluster.samples(now),
        );
        Some(decision.desired)
    }
}

/// prometheus-adapter's default: Prometheus scrapes each pod every 30 s at its own phase.
const PROM_SCRAPE_S: f64 = 30.0;
/// The HPA controller's default `--horizontal-pod-autoscaler-sync-period`.
const HPA_SYNC_S: f64 = 15.0;
/// HPA's default scale-down stabilization window (and the KEDA-like cooldown).
const DOWN_WINDOW_S: f64 = 300.0;
/// HPA's default policy period, for both directions.
const HPA_POLICY_PERIOD_S: f64 = 15.0;
/// HPA's default scale-up policies: 100% or 4 pods per 15 s, whichever allows more.
const HPA_UP_PERCENT: f64 = 100.0;
const HPA_UP_PODS: i32 = 4;
/// HPA's default scale-down policy: 100% per 15 s.
const HPA_DOWN_PERCENT: f64 = 100.0;

/// The replica counts two HPA External metrics ask for, as the HPA's replica calculator
/// computes them: the queue as an `AverageValue` target on `sum(waiting)` (compared with
/// the pods that exist, `status.replicas`), KV usage as a `Value` target on `avg(kv_usage)`
/// (scaled by the ready pods). Each holds at `current` within the tolerance. `None` without
/// metrics.
fn hpa_formulas(
    metrics: &[PodMetrics],
    current: i32,
    ready: usize,
    queue_target: f64,
    kv_target: f64,
) -> Option<i32> {
    if metrics.is_empty() {
        return None;
    }
    let waiting: f64 = metrics.iter().map(|m| m.waiting).sum();
    let queue_ratio = waiting / (queue_target * f64::from(current.max(1)));
    let by_queue = if (1.0 - queue_ratio).abs() <= HPA_TOLERANCE {
        current
    } else {
        (waiting / queue_target).ceil() as i32
    };
    let kv: Vec<f64> = metrics.iter().filter_map(|m| m.kv_usage).collect();
    let kv_ratio = kv.iter().sum::<f64>() / kv.len().max(1) as f64 / kv_target;
    let by_kv = if (1.0 - kv_ratio).abs() <= HPA_TOLERANCE {
        current
    } else {
        (kv_ratio * ready as f64).ceil() as i32
    };
    Some(by_queue.max(by_kv))
}

/// The HorizontalPodAutoscaler (autoscaling/v2, default behavior) reading two External
/// metrics through prometheus-adapter: every value is what Prometheus last scraped.
#[derive(Debug)]
struct Hpa {
    queue_target: f64,
    kv_target: f64,
    phase: u64,
    /// Prometheus' latest sample of each pod it scrapes, by pod id.
    scraped: HashMap<usize, PodMetrics>,
    /// (time, unstabilized recommendation).
    recommendations: VecDeque<(u64, i32)>,
    /// (time, replicas added); (time, replicas removed).
    up_events: VecDeque<(u64, i32)>,
    down_events: VecDeque<(u64, i32)>,
    /// Whether the down window was seeded with the count found at the first sync.
    initialized: bool,
}

impl Hpa {
    fn new(queue_target: f64, kv_target: f64, rng: &mut Rng) -> Self {
        Self {
            queue_target,
            kv_target,
            phase: rng.below(ticks(HPA_SYNC_S)),
            scraped: HashMap::new(),
            recommendations: VecDeque::new(),
            up_events: VecDeque::new(),
            down_events: VecDeque::new(),
            initialized: false,
        }
    }

    /// Prometheus: scrapes each ready, non-terminating pod on its own 30 s phase; a pod that
    /// leaves the Endpoints (terminating) gets a staleness marker and drops out of queries.
    fn scrape(&mut self, now: u64, cluster: &Cluster) {
        let interval = ticks(PROM_SCRAPE_S);
        self.scraped
            .retain(|id, _| cluster.pods.iter().any(|p| p.id == *id && !p.draining));
        for p in cluster.pods.iter().filter(|p| p.serving(now)) {
            if due(now, p.scrape_offset, interval) {
                self.scraped.insert(p.id, p.metrics(cluster.model));
            }
        }
    }

    /// `stabilizeRecommendationWithBehaviors`: up to the lowest recommendation of the up window
    /// (0 s: the current one), down only to the highest of the 300 s down window.
    fn stabilize(&mut self, now: u64, current: i32, recommendation: i32) -> i32 {
        if !self.initialized {
            // maybeInitScaleDownStabilizationWindow: a new HPA first remembers the current
            // count, so it never scales down before a whole window has passed.
            self.recommendations.push_back((now, current));
            self.initialized = true;
        }
        let down_cutoff = now.saturating_sub(ticks(DOWN_WINDOW_S));
        self.recommendations.retain(|(t, _)| *t > down_cutoff);
        let down_to = self
            .recommendations
            .iter()
            .map(|(_, r)| *r)
            .fold(recommendation, i32::max);
        self.recommendations.push_back((now, recommendation));
        let up_to = recommendation;
        current.max(up_to).min(down_to)
    }

    /// `convertDesiredReplicasWithBehaviorRate` with the default policies, clamped to
    /// [min, max].
    fn rate_limit(&mut self, now: u64, current: i32, desired: i32) -> i32 {
        let cutoff = now.saturating_sub(ticks(HPA_POLICY_PERIOD_S));
        self.up_events.retain(|(t, _)| *t > cutoff);
        self.down_events.retain(|(t, _)| *t > cutoff);
        let added: i32 = self.up_events.iter().map(|(_, n)| n).sum();
        let removed: i32 = self.down_events.iter().map(|(_, n)| n).sum();
        let period_start = current - added + removed;
        if desired > current {
            let by_percent =
                (f64::from(period_start) * (1.0 + HPA_UP_PERCENT / 100.0)).ceil() as i32;
            let limit = by_percent.max(period_start + HPA_UP_PODS).max(current);
            desired.min(limit).min(MAX_REPLICAS)
        } else if desired < current {
            let by_percent = (f64::from(period_start) * (1.0 - HPA_DOWN_PERCENT / 100.0)) as i32;
            desired.max(by_percent.min(current)).max(MIN_REPLICAS)
        } else {
            desired
        }
    }
}

impl Autoscaler for Hpa {
    fn tick(&mut self, now: u64, cluster: &Cluster) -> Option<i32> {
        self.scrape(now, cluster);
        if !due(now, self.phase, ticks(HPA_SYNC_S)) {
            return None;
        }
        let current = cluster.replicas();
        let metrics: Vec<PodMetrics> = self.scraped.values().copied().collect();
        let raw = hpa_formulas(
            &metrics,
            current,
            cluster.serving(now),
            self.queue_target,
            self.kv_target,
        )?;
        let stabilized = self.stabilize(now, current, raw);
        let desired = self.rate_limit(now, current, stabilized);
        if desired > current {
            self.up_events.push_back((now, desired - current));
        } else if desired < current {
            self.down_events.push_back((now, current - desired));
        }
        Some(desired)
    }
}

/// A KEDA-like poller: reads the pods' current values every 15 s (no Prometheus in between),
/// computes the HPA formulas, scales up at once, and scales down only to the highest count
/// asked for during the 300 s cooldown.
#[derive(Debug)]
struct Keda {
    queue_target: f64,
    kv_target: f64,
    phase: u64,
    history: VecDeque<(u64, i32)>,
}

/// KEDA's default pollingInterval; the cooldown is `DOWN_WINDOW_S`.
const KEDA_POLL_S: f64 = 15.0;

impl Keda {
    fn new(queue_target: f64, kv_target: f64, rng: &mut Rng) -> Self {
        Self {
            queue_target,
            kv_target,
            phase: rng.below(ticks(KEDA_POLL_S)),
            history: VecDeque::new(),
        }
    }
}

impl Autoscaler for Keda {
    fn tick(&mut self, now: u64, cluster: &Cluster) -> Option<i32> {
        if !due(now, self.phase, ticks(KEDA_POLL_S)) {
            return None;
        }
        let current = cluster.replicas();
        let wanted = hpa_formulas(
            &cluster.fresh_metrics(now),
            current,
            cluster.serving(now),
            self.queue_target,
            self.kv_target,
        )?
        .clamp(MIN_REPLICAS, MAX_REPLICAS);
        let cutoff = now.saturating_sub(ticks(DOWN_WINDOW_S));
        self.history.retain(|(t, _)| *t > cutoff);
        self.history.push_back((now, wanted));
        if wanted >= current {
            return Some(wanted);
        }
        let hold = self.history.iter().map(|(_, w)| *w).max().unwrap_or(wanted);
        Some(hold.min(current))
    }
}

/// What one autoscaler's run produced.
#[derive(Debug)]
struct Outcome {
    name: String,
    /// Queue wait of every request (NaN: never admitted).
    waits: Vec<f64>,
    replica_seconds: f64,
    max_replicas: i32,
    /// (time, from, to) of every change of the replica count, warm-up included.
    changes: Vec<(u64, i32, i32)>,
    /// Serving pods after every tick (index = tick).
    serving: Vec<u16>,
    /// The replica count set after every tick.
    replicas: Vec<u16>,
}

/// Runs the trace through a fresh cluster under one autoscaler, on past the trace's end
/// until every request has been admitted (replica-seconds stop at the trace's end).
fn simulate(
    name: &str,
    trace: &Trace,
    model: &PodModel,
    scaler: &mut dyn Autoscaler,
    rng: Rng,
) -> Outcome {
    let initial = replicas_for_rate(trace.base_rate, model);
    let mut cluster = Cluster::new(model, trace, initial, rng);
    let horizon = ticks(trace.horizon);
    let mut changes = Vec::new();
    let mut serving = Vec::with_capacity(horizon as usize);
    let mut replicas = Vec::with_capacity(horizon as usize);
    let warmup = ticks(trace.warmup);
    let mut max_replicas = 0;
    let mut k = 0;
    while k < horizon || (cluster.unadmitted > 0 && k < horizon + DRAIN_LIMIT_S * TICKS_PER_SEC) {
        cluster.step(k);
        let now = k + 1;
        let current = cluster.replicas();
        if let Some(desired) = scaler.tick(now, &cluster)
            && desired != current
        {
            cluster.scale_to(desired, now);
            changes.push((now, current, desired));
        }
        if now >= warmup {
            max_replicas = max_replicas.max(cluster.replicas());
        }
        serving.push(cluster.serving(now) as u16);
        replicas.push(cluster.replicas() as u16);
        k += 1;
    }
    Outcome {
        name: name.to_string(),
        waits: cluster.waits,
        replica_seconds: secs(cluster.replica_ticks),
        max_replicas,
        changes,
        serving,
        replicas,
    }
}

/// Replicas that complete `rate` requests per second when saturated: the least that can
/// serve that rate without an ever-growing queue.
fn replicas_for_rate(rate: f64, model: &PodModel) -> i32 {
    (rate / model.capacity()).ceil() as i32
}

/// Per burst: seconds from its start to the first scale-up, and to enough serving replicas;
/// the most replicas set before the next burst.
#[derive(Debug, Clone, Copy)]
struct Reaction {
    decision: Option<f64>,
    capacity: Option<f64>,
    peak: u16,
}

/// The reaction to each burst, looking only until the next burst starts.
fn reactions(out: &Outcome, trace: &Trace, model: &PodModel) -> Vec<Reaction> {
    trace
        .bursts
        .iter()
        .enumerate()
        .map(|(i, b)| {
            let start = ticks(b.start);
            let until = trace
                .bursts
                .get(i + 1)
                .map_or(out.serving.len() as u64, |n| ticks(n.start));
            let decision = out
                .changes
                .iter()
                .find(|(t, from, to)| *t >= start && *t < until && to > from)
                .map(|(t, _, _)| secs(t - start));
            let need = replicas_for_rate(trace.base_rate * b.multiplier, model);
            let window = start as usize..(until as usize).min(out.serving.len());
            let capacity = out.serving[window.clone()]
                .iter()
                .position(|&n| i32::from(n) >= need)
                .map(|k| secs(k as u64 + 1));
            let peak = out.replicas[window].iter().copied().max().unwrap_or(0);
            Reaction {
                decision,
                capacity,
                peak,
            }
        })
        .collect()
}

fn mean(v: impl Iterator<Item = f64>) -> Option<f64> {
    let (sum, n) = v.fold((0.0, 0usize), |(s, n), x| (s + x, n + 1));
    (n > 0).then(|| sum / n as f64)
}

/// Share of the requests meeting the SLO (a request never admitted misses it).
fn slo(waits: &[f64], pick: impl Fn(usize) -> bool) -> f64 {
    let (met, n) = waits
        .iter()
        .enumerate()
        .filter(|(i, _)| pick(*i))
        .fold((0usize, 0usize), |(m, n), (_, w)| {
            (m + usize::from(*w < SLO_WAIT_S), n + 1)
        });
    met as f64 / n.max(1) as f64
}

/// The summary figures of one run.
#[derive(Debug)]
struct Summary {
    name: String,
    reaction: Option<f64>,
    capacity: Option<f64>,
    /// Bursts with a scale-up, and with enough serving replicas, before the next burst.
    decided: usize,
    reacted: usize,
    slo: f64,
    slo_bursts: f64,
    wait_p99: f64,
    replica_seconds: f64,
    max_replicas: i32,
    changes: usize,
    reversals: usize,
}

/// The replica changes after the warm-up.
fn measured_changes<'o>(out: &'o Outcome, trace: &Trace) -> &'o [(u64, i32, i32)] {
    let warmup = ticks(trace.warmup);
    let first = out.changes.partition_point(|(t, _, _)| *t < warmup);
    &out.changes[first..]
}

fn summarize(out: &Outcome, trace: &Trace, model: &PodModel) -> Summary {
    let rs = reactions(out, trace, model);
    let measured = |i: usize| trace.requests[i].arrival >= trace.warmup;
    let in_burst = |i: usize| {
        let t = trace.requests[i].arrival;
        trace.bursts.iter().any(|b| t >= b.start && t < b.end())
    };
    // A request never admitted waits forever.
    let waits: Vec<f64> = out
        .waits
        .iter()
        .map(|w| if w.is_nan() { f64::INFINITY } else { *w })
        .collect();
    let measured_waits: Vec<f64> = (0..waits.len())
        .filter(|&i| measured(i))
        .map(|i| waits[i])
        .collect();
    let changes = measured_changes(out, trace);
    // Reversals: a scale-down followed by a scale-up or the other way round (flapping).
    let reversals = changes
        .windows(2)
        .filter(|w| (w[0].2 > w[0].1) != (w[1].2 > w[1].1))
        .count();
    Summary {
        name: out.name.clone(),
        reaction: mean(rs.iter().filter_map(|r| r.decision)),
        capacity: mean(rs.iter().filter_map(|r| r.capacity)),
        decided: rs.iter().filter(|r| r.decision.is_some()).count(),
        reacted: rs.iter().filter(|r| r.capacity.is_some()).count(),
        slo: slo(&waits, measured),
        slo_bursts: slo(&waits, in_burst),
        wait_p99: percentile(&measured_waits, 99.0),
        replica_seconds: out.replica_seconds,
        max_replicas: out.max_replicas,
        changes: changes.len(),
        reversals,
    }
}

/// The AutoscalingSpec every ferrite run starts from: the shared targets, defaults elsewhere.
fn base_spec(args: &Args) -> Value {
    json!({
        "minReplicas": MIN_REPLICAS,
        "maxReplicas": MAX_REPLICAS,
        "targets": {"queuePerReplica": args.queue_target, "kvCacheUsage": args.kv_target},
    })
}

/// Merges `patch` into `base`, objects key by key.
fn merge(base: &mut Value, patch: &Value) {
    match (base, patch) {
        (Value::Object(b), Value::Object(p)) => {
            for (k, v) in p {
                merge(b.entry(k.clone()).or_insert(Value::Null), v);
            }
        }
        (b, p) => *b = p.clone(),
    }
}

/// The ferrite runs: defaults, then each `--variant NAME=JSON`.
fn ferrite_specs(args: &Args) -> Result<Vec<(String, Value)>> {
    let mut specs = vec![("ferrite".to_string(), base_spec(args))];
    for v in &args.variants {
        let (name, patch) = v
            .split_once('=')
            .with_context(|| format!("--variant {v:?}: expected NAME=JSON"))?;
        let patch: Value =
            serde_json::from_str(patch).with_context(|| format!("--variant {name}: JSON"))?;
        if !patch.is_object() {
            bail!("--variant {name}: the JSON must be an object of AutoscalingSpec fields");
        }
        let mut spec = base_spec(args);
        merge(&mut spec, &patch);
        specs.push((format!("ferrite:{name}"), spec));
    }
    Ok(specs)
}

fn policy_of(spec: &Value) -> Result<Policy> {
    let spec: AutoscalingSpec =
        serde_json::from_value(spec.clone()).context("not a valid AutoscalingSpec")?;
    Ok(Policy::from_spec(&spec))
}

fn opt(v: Option<f64>, unit: &str) -> String {
    v.map_or("—".into(), |v| format!("{v:.1}{unit}"))
}

fn print_setup(args: &Args, trace: &Trace, model: &PodModel) {
    println!(
        "bench-autoscale: seed {}, {:.1} h measured after {:.0} min of base load (warm-up, not \
         counted), simulated in {} ms ticks",
        args.seed,
        (trace.horizon - trace.warmup) / 3600.0,
        trace.warmup / 60.0,
        1000 / TICKS_PER_SEC
    );
    println!(
        "trace: Poisson arrivals, {} req/s base; {} bursts ({}–{}× for {}–{} s, one per {} min); \
         {} requests; prompt U[{},{}], output U[{},{}] tokens",
        trace.base_rate,
        trace.bursts.len(),
        BURST_MULTIPLIER.0,
        BURST_MULTIPLIER.1,
        BURST_DURATION_S.0,
        BURST_DURATION_S.1,
        BURST_SLOT_S / 60.0,
        trace.requests.len(),
        PROMPT_TOKENS.0,
        PROMPT_TOKENS.1,
        OUTPUT_TOKENS.0,
        OUTPUT_TOKENS.1,
    );
    println!(
        "pod: ready {} s after the scale-up; {} decode tok/s shared by the batch, ≤ {} tok/s per \
         sequence, maxNumSeqs {}, KV {} tokens (prompt + output reserved at admission, FIFO) \
         → {:.2} req/s per saturated replica",
        model.start_delay,
        model.throughput,
        model.per_seq,
        model.max_num_seqs,
        model.kv_capacity,
        model.capacity()
    );
    println!(
        "routing: each arrival joins the queue of the ready, non-draining pod with the fewest \
         waiting + running (ties: oldest); it stays there"
    );
    println!(
        "scale-down: starting pods first (newest first), then ready pods with the fewest in \
         flight; a removed pod takes no new request, finishes its queue, then is gone"
    );
    println!(
        "replica-seconds: every pod from creation (start delay included) until gone, within the \
         measured window; SLO: queue wait (arrival → admission to a batch) < {SLO_WAIT_S} s"
    );
    println!(
        "targets (all autoscalers): {} waiting per replica, KV usage {}; replicas {}–{}; start \
         at {} ready",
        args.queue_target,
        args.kv_target,
        MIN_REPLICAS,
        MAX_REPLICAS,
        replicas_for_rate(trace.base_rate, model)
    );
    println!();
    println!(
        "hpa+adapter: Prometheus scrapes each ready pod every {PROM_SCRAPE_S} s (own random \
         phase); HPA syncs every {HPA_SYNC_S} s on External metrics sum(waiting) AverageValue \
         and avg(kv) Value, tolerance {HPA_TOLERANCE}; up: no window, max({HPA_UP_PERCENT}%, \
         {HPA_UP_PODS} pods) per {HPA_POLICY_PERIOD_S} s; down: {DOWN_WINDOW_S} s window, \
         {HPA_DOWN_PERCENT}% per {HPA_POLICY_PERIOD_S} s"
    );
    println!(
        "keda-like: polls the pods' current values every {KEDA_POLL_S} s (no Prometheus lag), \
         same formulas; up at once; down only to the highest count asked in the last \
         {DOWN_WINDOW_S} s (cooldown)"
    );
}

fn print_bursts(trace: &Trace, model: &PodModel, outs: &[Outcome]) {
    println!();
    println!(
        "per burst: seconds from burst start to the first scale-up / to enough ready replicas \
         (need = ⌈rate ÷ {:.2}⌉) / peak replicas before the next burst",
        model.capacity()
    );
    let all: Vec<Vec<Reaction>> = outs.iter().map(|o| reactions(o, trace, model)).collect();
    let mut header = format!(
        "{:>2} {:>7} {:>5} {:>6} {:>4}",
        "#", "start", "dur", "req/s", "need"
    );
    for o in outs {
        header.push_str(&format!(" | {:>21}", o.name));
    }
    println!("{header}");
    for (i, b) in trace.bursts.iter().enumerate() {
        let mut line = format!(
            "{:>2} {:>6.0}s {:>4.0}s {:>6.1} {:>4}",
            i + 1,
            b.start,
            b.duration,
            trace.base_rate * b.multiplier,
            replicas_for_rate(trace.base_rate * b.multiplier, model)
        );
        for rs in &all {
            let r = rs[i];
            line.push_str(&format!(
                " | {:>6} / {:>5} / {:>3}",
                opt(r.decision, ""),
                opt(r.capacity, ""),
                r.peak
            ));
        }
        println!("{line}");
    }
}

/// What each autoscaler did during the warm-up: its first evaluations have no history.
fn print_warmup(outs: &[Outcome], trace: &Trace) {
    println!();
    println!(
        "warm-up (not counted): replica changes in the first {:.0} s",
        trace.warmup
    );
    for o in outs {
        let warm: Vec<String> = o
            .changes
            .iter()
            .take_while(|(t, _, _)| secs(*t) < trace.warmup)
            .map(|(t, from, to)| format!("{:.1} s {from}→{to}", secs(*t)))
            .collect();
        let peak = o
            .changes
            .iter()
            .take_while(|(t, _, _)| secs(*t) < trace.warmup)
            .map(|(_, _, to)| *to)
            .max();
        println!(
            "  {:<18} {} change(s){}{}",
            o.name,
            warm.len(),
            peak.map_or(String::new(), |p| format!(", peak {p} replicas")),
            if warm.is_empty() {
                String::new()
            } else {
                format!(
                    ": {}",
                    warm.iter().take(6).cloned().collect::<Vec<_>>().join(", ")
                )
            }
        );
    }
}

fn print_changes(outs: &[Outcome]) {
    for o in outs {
        println!();
        println!(
            "{}: replica changes (time s: from → to, serving pods then)",
            o.name
        );
        let line: Vec<String> = o
            .changes
            .iter()
            .map(|(t, from, to)| {
                let serving = o.serving.get(*t as usize - 1).copied().unwrap_or(0);
                format!("{:.1}: {from}→{to} ({serving})", secs(*t))
            })
            .collect();
        println!("  {}", line.join(", "));
    }
}

fn print_summary(sums: &[Summary], bursts: usize) {
    println!();
    println!(
        "{:<18} {:>9} {:>9} {:>8} {:>8} {:>8} {:>10} {:>4} {:>7} {:>5}",
        "autoscaler",
        "react s",
        "ready s",
        "SLO",
        "SLO brst",
        "wait p99",
        "replica-s",
        "max",
        "changes",
        "flips"
    );
    for s in sums {
        println!(
            "{:<18} {:>9} {:>9} {:>7.2}% {:>7.2}% {:>7.2}s {:>10.0} {:>4} {:>7} {:>5}{}",
            s.name,
            opt(s.reaction, ""),
            opt(s.capacity, ""),
            s.slo * 100.0,
            s.slo_bursts * 100.0,
            s.wait_p99,
            s.replica_seconds,
            s.max_replicas,
            s.changes,
            s.reversals,
            if s.decided.min(s.reacted) < bursts {
                format!(
                    "  (scaled up in {}/{bursts} bursts, enough replicas in {}/{bursts})",
                    s.decided, s.reacted
                )
            } else {
                String::new()
            }
        );
    }
    println!(
        "react: mean burst start → first scale-up; ready: mean burst start → enough serving \
         replicas; SLO brst: requests arriving during bursts; flips: direction reversals"
    );
}

/// Ratios against the baseline (the first summary) and the targets.
fn print_ratios(sums: &[Summary]) {
    let Some(base) = sums.first() else { return };
    println!();
    println!("ratios vs {} (same run):", base.name);
    for s in &sums[1..] {
        let speed = |b: Option<f64>, x: Option<f64>| match (b, x) {
            (Some(b), Some(x)) if x > 0.0 => Some(b / x),
            _ => None,
        };
        let react = speed(base.reaction, s.reaction);
        let ready = speed(base.capacity, s.capacity);
        let rs = s.replica_seconds / base.replica_seconds;
        println!(
            "  {:<18} reaction {}× faster, ready {}× faster, SLO {:+.2} pp (bursts {:+.2} pp), \
             replica-s {:.3}×",
            s.name,
            react.map_or("—".into(), |v| format!("{v:.2}")),
            ready.map_or("—".into(), |v| format!("{v:.2}")),
            (s.slo - base.slo) * 100.0,
            (s.slo_bursts - base.slo_bursts) * 100.0,
            rs
        );
        let met = |ok: bool| if ok { "met" } else { "NOT met" };
        println!(
            "  {:<18} targets: reaction ≥ 3× {}; SLO ≥ baseline {}; replica-s ≤ 1.10× {}",
            "",
            met(react.is_some_and(|r| r >= 3.0)),
            met(s.slo >= base.slo),
            met(rs <= 1.10)
        );
    }
}

fn main() -> Result<()> {
    let args = Args::parse();
    if !(args.hours > 0.0 && args.hours <= 48.0) {
        bail!("--hours must be in (0, 48]");
    }
    if !(args.base_rate > 0.0 && args.start_delay >= 0.0) {
        bail!("--base-rate must be positive and --start-delay not negative");
    }
    if !(args.queue_target > 0.0 && args.kv_target > 0.0 && args.kv_target <= 1.0) {
        bail!("--queue-target must be positive and --kv-target in (0, 1]");
    }
    let specs = ferrite_specs(&args)?;
    let mut rng = Rng(args.seed);
    let trace = Trace::generate(args.hours * 3600.0, args.base_rate, &mut rng.fork());
    let model = PodModel::new(args.start_delay);
    print_setup(&args, &trace, &model);

    let cluster_rng = rng.fork();
    let mut phases = rng.fork();
    let mut outs = vec![
        simulate(
            "hpa+adapter",
            &trace,
            &model,
            &mut Hpa::new(args.queue_target, args.kv_target, &mut phases),
            cluster_rng.clone(),
        ),
        simulate(
            "keda-like",
            &trace,
            &model,
            &mut Keda::new(args.queue_target, args.kv_target, &mut phases),
            cluster_rng.clone(),
        ),
    ];
    for (name, spec) in &specs {
        let policy = policy_of(spec).with_context(|| format!("{name}: {spec}"))?;
        println!("{name}: AutoscalingSpec {spec} → {policy:?}");
        let mut scaler = Ferrite::new(policy, &mut phases);
        outs.push(simulate(
            name,
            &trace,
            &model,
            &mut scaler,
            cluster_rng.clone(),
        ));
    }
    if args.changes {
        print_changes(&outs);
    }
    print_warmup(&outs, &trace);
    print_bursts(&trace, &model, &outs);
    let sums: Vec<Summary> = outs.iter().map(|o| summarize(o, &trace, &model)).collect();
    print_summary(&sums, trace.bursts.len());
    print_ratios(&sums);
    Ok(())
}

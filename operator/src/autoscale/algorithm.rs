//! The scaling decision, pure: per-pod samples and the clock in, a replica count out. It follows
//! the Kubernetes HPA's algorithm (per-signal ratios with a tolerance, missing and unready pods
//! handled so that missing data never scales down, stabilization windows, rate policies) and
//! adds a panic mode for queue bursts. Time is a `Duration` since an arbitrary epoch, so the
//! same code runs on the wall clock in the operator and on a simulated clock in `bench/`.

use std::collections::VecDeque;
use std::time::Duration;

use ferrite_api::crd::AutoscalingSpec;
use ferrite_api::signal::{PodSample, Signal, Signals};

/// Default seconds between scrapes.
pub const DEFAULT_SCRAPE_SECONDS: u64 = 5;
/// Default queue multiple of its target that triggers panic mode.
pub const DEFAULT_PANIC_THRESHOLD: f64 = 3.0;

/// The scaling policy with every default filled in.
#[derive(Debug, Clone, PartialEq)]
pub struct Policy {
    pub min_replicas: i32,
    pub max_replicas: i32,
    /// Target waiting requests per replica.
    pub queue_target: Option<f64>,
    /// Target KV-cache usage fraction.
    pub kv_target: Option<f64>,
    /// Relative band around each target inside which nothing changes.
    pub tolerance: f64,
    pub scale_up_window: Duration,
    pub scale_down_window: Duration,
    /// Most replicas added in any 60 s, as a percentage of the count 60 s before.
    pub max_up_percent_per_minute: i32,
    /// Most replicas removed in any 60 s, as a percentage of the count 60 s before.
    pub max_down_percent_per_minute: i32,
    pub scrape_interval: Duration,
    /// Queue multiple of its target that starts panic mode; `None` turns it off.
    pub panic_threshold: Option<f64>,
    /// With `min_replicas == 0`: how long without any request before scaling to zero.
    pub idle_timeout: Option<Duration>,
}

impl Policy {
    /// The spec's target for `signal`, where it has one.
    pub fn target(&self, signal: Signal) -> Option<f64> {
        match signal {
            Signal::QueuePerReplica => self.queue_target,
            Signal::KvCacheUsage => self.kv_target,
            Signal::RequestsWaiting | Signal::RequestsRunning => None,
        }
    }
}

/// The window rate policies look back over.
pub const RATE_PERIOD: Duration = Duration::from_secs(60);

impl Policy {
    pub fn from_spec(spec: &AutoscalingSpec) -> Self {
        let b = &spec.behavior;
        let secs = |v: Option<i32>, d: u64| Duration::from_secs(v.map_or(d, |s| s.max(0) as u64));
        Self {
            min_replicas: spec.min_replicas.max(0),
            max_replicas: spec.max_replicas.max(spec.min_replicas.max(1)),
            queue_target: spec.targets.queue_per_replica.filter(|t| *t > 0.0),
            kv_target: spec.targets.kv_cache_usage.filter(|t| *t > 0.0),
            tolerance: b.tolerance.unwrap_or(0.1).clamp(0.0, 0.99),
            scale_up_window: secs(b.scale_up_stabilization_seconds, 0),
            scale_down_window: secs(b.scale_down_stabilization_seconds, 300),
            max_up_percent_per_minute: b.max_scale_up_percent_per_minute.unwrap_or(100).max(1),
            max_down_percent_per_minute: b
                .max_scale_down_percent_per_minute
                .unwrap_or(50)
                .clamp(1, 100),
            scrape_interval: secs(spec.scrape_interval_seconds, DEFAULT_SCRAPE_SECONDS)
                .max(Duration::from_secs(1)),
            panic_threshold: Some(spec.panic_threshold.unwrap_or(DEFAULT_PANIC_THRESHOLD)),
            idle_timeout: spec
                .idle_timeout_seconds
                .map(|s| Duration::from_secs(s.max(0) as u64)),
        }
    }
}

/// Which signal drove a recommendation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Driver {
    Queue,
    KvCache,
}

impl Driver {
    pub fn as_str(self) -> &'static str {
        match self {
            Driver::Queue => "queue",
            Driver::KvCache => "kv_cache",
        }
    }
}

/// Why the decision is not the raw recommendation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Limit {
    /// Clamped to maxReplicas.
    TooMany,
    /// Clamped to minReplicas (or 1 while traffic is not idle).
    TooFew,
    /// Held by the scale-up stabilization window.
    ScaleUpStabilized,
    /// Held by the scale-down stabilization window.
    ScaleDownStabilized,
    /// Held by the per-minute scale-up rate.
    ScaleUpRate,
    /// Held by the per-minute scale-down rate.
    ScaleDownRate,
    /// Scale-down held by panic mode.
    Panic,
}

impl Limit {
    /// CamelCase reason for the `ScalingLimited` condition.
    pub fn reason(self) -> &'static str {
        match self {
            Limit::TooMany => "TooManyReplicas",
            Limit::TooFew => "TooFewReplicas",
            Limit::ScaleUpStabilized => "ScaleUpStabilized",
            Limit::ScaleDownStabilized => "ScaleDownStabilized",
            Limit::ScaleUpRate => "ScaleUpLimit",
            Limit::ScaleDownRate => "ScaleDownLimit",
            Limit::Panic => "PanicMode",
        }
    }
}

/// One evaluation's outcome.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    /// The replica count to write (equal to the current count when nothing changes).
    pub desired: i32,
    /// The raw recommendation: the highest any signal asked for, clamped to [min, max].
    pub recommendation: i32,
    /// The signal behind the recommendation, when one asked for a change.
    pub driver: Option<Driver>,
    pub signals: Signals,
    /// Why `desired` differs from `recommendation`, if it does.
    pub limit: Option<Limit>,
    /// No signal could be computed: nothing changes (`ScalingActive` false).
    pub no_data: bool,
    /// The queue is beyond panicThreshold × target, or was within the scale-down window.
    pub panic: bool,
    /// No request seen for idleTimeout: scaled (or kept) at zero.
    pub idle: bool,
}

impl Decision {
    /// Scaled to zero with nothing to read: it stays there.
    fn asleep(signals: Signals) -> Self {
        Decision {
            desired: 0,
            recommendation: 0,
            driver: None,
            signals,
            limit: None,
            no_data: false,
            panic: false,
            idle: true,
        }
    }

    /// A one-line reason for events and logs.
    pub fn describe(&self, current: i32) -> String {
        let mut parts = Vec::new();
        if let Some(q) = self.signals.queue_per_replica {
            parts.push(format!("queue/replica {q:.2}"));
        }
        if let Some(kv) = self.signals.kv_usage {
            parts.push(format!("KV usage {:.0}%", kv * 100.0));
        }
        let why = if self.idle {
            "idle".to_string()
        } else if self.panic {
            "panic mode".to_string()
        } else {
            self.driver
                .map_or("signals".into(), |d| d.as_str().to_string())
        };
        format!(
            "{current} → {} replicas ({why}; {})",
            self.desired,
            if parts.is_empty() {
                "no metrics".into()
            } else {
                parts.join(", ")
            }
        )
    }
}

/// What one evaluation has established before it limits the change.
#[derive(Debug, Clone, Copy)]
struct Evaluation {
    now: Duration,
    current: i32,
    /// Clamped to `[lower, max_replicas]`.
    recommendation: i32,
    lower: i32,
    /// The queue is beyond its panic threshold in this evaluation.
    panicking_now: bool,
    /// In panic mode (now or within the scale-down window since).
    panic: bool,
    /// The first evaluation's time and count.
    start: (Duration, i32),
}

/// The highest replica count any signal with a target asks for, and the signal, when it asks
/// for a change; `None` when no signal could be computed.
fn recommend(
    policy: &Policy,
    samples: &[PodSample],
    signals: &Signals,
    current: i32,
) -> (Option<i32>, Option<Driver>) {
    let mut driver = None;
    let mut raw: Option<i32> = None;
    let per_signal = [
        (Driver::Queue, policy.queue_target),
        (Driver::KvCache, policy.kv_target),
    ];
    for (signal, target) in per_signal {
        let Some(target) = target else { continue };
        let values: Vec<Option<f64>> = samples
            .iter()
            .filter_map(|s| match s {
                PodSample::Ready(m) => Some(match signal {
                    Driver::Queue => Some(m.waiting),
                    Driver::KvCache => m.kv_usage,
                }),
                PodSample::Missing => Some(None),
                PodSample::Unready => None,
            })
            .collect();
        let Some(r) = replicas_for(&values, signals.unready, target, current, policy.tolerance)
        else {
            continue;
        };
        if raw.is_none_or(|best| r > best) {
            raw = Some(r);
            if r != current {
                driver = Some(signal);
            }
        }
    }
    (raw, driver)
}

/// What the autoscaler remembers between evaluations of one InferenceService.
#[derive(Debug, Clone, Default)]
pub struct ScalerState {
    /// (time, recommendation), newest last, kept for the longer stabilization window.
    recommendations: VecDeque<(Duration, i32)>,
    /// (time, change in replicas), newest last, kept for [`RATE_PERIOD`].
    changes: VecDeque<(Duration, i32)>,
    panic_until: Option<Duration>,
    /// Since when every reporting pod has been idle.
    idle_since: Option<Duration>,
    /// The first evaluation's time and replica count.
    started: Option<(Duration, i32)>,
}

impl ScalerState {
    /// Evaluates once. `current` is the replica count now set (spec.replicas); `samples` has
    /// one entry per pod of the workload. The caller writes `desired` when it differs from
    /// `current` and then calls nothing else: the change is recorded here.
    pub fn decide(
        &mut self,
        policy: &Policy,
        now: Duration,
        current: i32,
        samples: &[PodSample],
    ) -> Decision {
        let signals = Signals::of(samples);
        let idle = self.track_idle(policy, now, &signals);
        // Scaled to zero: nothing to scrape; only an outside write (kubectl scale, an
        // activator) wakes it.
        if policy.min_replicas == 0
            && current == 0
            && signals.reporting == 0
            && signals.missing == 0
        {
            return Decision::asleep(signals);
        }
        let (raw, driver) = recommend(policy, samples, &signals, current);
        let mut unclamped = raw.unwrap_or(current);
        if signals.missing > 0 {
            // A pod we could not read may be the busy one: never scale down on partial data.
            unclamped = unclamped.max(current);
        }
        let lower = if idle { 0 } else { policy.min_replicas.max(1) };
        let upper = policy.max_replicas.max(lower);
        let recommendation = unclamped.clamp(lower, upper);
        let clamped = match unclamped.cmp(&recommendation) {
            std::cmp::Ordering::Greater => Some(Limit::TooMany),
            std::cmp::Ordering::Less => Some(Limit::TooFew),
            std::cmp::Ordering::Equal => None,
        };
        let (panicking_now, panic) = self.track_panic(policy, now, &signals);
        let start = self.remember(policy, now, current, recommendation);
        let e = Evaluation {
            now,
            current,
            recommendation,
            lower,
            panicking_now,
            panic,
            start,
        };
        // Idle for the whole timeout is its own window: straight to zero.
        let (held, held_by) = if idle {
            (0, None)
        } else {
            self.hold(policy, &e)
        };
        // Never act against the raw direction, and never leave the bounds.
        let desired = held.clamp(lower, upper);
        if desired != current {
            self.changes.push_back((now, desired - current));
        }
        Decision {
            desired,
            recommendation,
            driver,
            signals,
            limit: if desired == recommendation {
                clamped
            } else {
                held_by.or(clamped)
            },
            no_data: raw.is_none(),
            panic,
            idle,
        }
    }

    /// Whether the service has been idle for its idle timeout (only with `min_replicas == 0`):
    /// every pod reported and none has work, continuously since `idle_since`.
    fn track_idle(&mut self, policy: &Policy, now: Duration, signals: &Signals) -> bool {
        let idle_now = signals.reporting > 0
            && signals.missing == 0
            && signals.waiting == 0.0
            && signals.running == 0.0;
        if idle_now {
            self.idle_since.get_or_insert(now);
        } else if signals.reporting > 0 || signals.missing > 0 {
            self.idle_since = None;
        }
        policy.min_replicas == 0
            && policy
                .idle_timeout
                .zip(self.idle_since)
                .is_some_and(|(timeout, since)| now.saturating_sub(since) >= timeout)
    }

    /// Panic: a queue far beyond its target skips the up window and the rate limit, and
    /// holds scale-down for the scale-down window. Returns (beyond the threshold now, in
    /// panic mode).
    fn track_panic(&mut self, policy: &Policy, now: Duration, signals: &Signals) -> (bool, bool) {
        let panicking_now = matches!(
            (policy.panic_threshold, policy.queue_target, signals.queue_per_replica),
            (Some(p), Some(t), Some(q)) if q >= p * t
        );
        if panicking_now {
            self.panic_until = Some(now + policy.scale_down_window);
        }
        let panic = self.panic_until.is_some_and(|until| now < until);
        (panicking_now, panic)
    }

    /// Records the recommendation and forgets what has left both windows. Returns the first
    /// evaluation's time and count: a fresh state (a new task, an operator restart) starts its
    /// scale-down window holding the current count, as HPA does, so a restart never skips it.
    fn remember(
        &mut self,
        policy: &Policy,
        now: Duration,
        current: i32,
        recommendation: i32,
    ) -> (Duration, i32) {
        let start = *self.started.get_or_insert((now, current));
        self.recommendations.push_back((now, recommendation));
        let keep = policy.scale_up_window.max(policy.scale_down_window);
        while self
            .recommendations
            .front()
            .is_some_and(|(t, _)| now.saturating_sub(*t) > keep)
        {
            self.recommendations.pop_front();
        }
        while self
            .changes
            .front()
            .is_some_and(|(t, _)| now.saturating_sub(*t) >= RATE_PERIOD)
        {
            self.changes.pop_front();
        }
        start
    }

    /// The count the stabilization windows and the rate policies allow, and which of them held
    /// it (the last to act).
    fn hold(&self, policy: &Policy, e: &Evaluation) -> (i32, Option<Limit>) {
        let stabilized = self.stabilize(policy, e);
        let stabilized_by =
            (stabilized != e.recommendation).then_some(if e.recommendation > e.current {
                Limit::ScaleUpStabilized
            } else {
                Limit::ScaleDownStabilized
            });
        let (d, rate) = self.rate_limit(policy, e, stabilized);
        (d, rate.or(stabilized_by))
    }

    /// Scale up only to what every recommendation in the up window supports; scale down only
    /// to what every recommendation in the down window allows.
    fn stabilize(&self, policy: &Policy, e: &Evaluation) -> i32 {
        let now = e.now;
        let within = |w: Duration| {
            self.recommendations
                .iter()
                .filter(move |(t, _)| now.saturating_sub(*t) <= w)
                .map(|(_, r)| *r)
        };
        let up_to = if e.panicking_now {
            e.recommendation
        } else {
            within(policy.scale_up_window)
                .min()
                .unwrap_or(e.recommendation)
        };
        let held_from_start =
            (now.saturating_sub(e.start.0) < policy.scale_down_window).then_some(e.start.1);
        let down_to = within(policy.scale_down_window)
            .chain(held_from_start)
            .max()
            .unwrap_or(e.recommendation);
        if up_to > e.current {
            up_to
        } else if down_to < e.current {
            down_to
        } else {
            e.current
        }
    }

    /// The per-minute rate policies (up unless panicking; down unless in panic mode, which
    /// holds the count). The up limit counts from the count 60 s ago, so after a panic jump it
    /// can fall below the current count; the down rules then apply to what it left.
    fn rate_limit(&self, policy: &Policy, e: &Evaluation, d: i32) -> (i32, Option<Limit>) {
        let (mut d, mut limit) = (d, None);
        if d > e.current && !e.panicking_now {
            let limit_to = self.up_limit(policy, e.current);
            if d > limit_to {
                d = limit_to;
                limit = Some(Limit::ScaleUpRate);
            }
        }
        if d < e.current {
            if e.panic {
                return (e.current, Some(Limit::Panic));
            }
            let limit_to = self.down_limit(policy, e.current).max(e.lower);
            if d < limit_to {
                return (limit_to, Some(Limit::ScaleDownRate));
            }
        }
        (d, limit)
    }

    /// The replica count 60 s ago, from the changes made since.
    fn base(&self, current: i32) -> i32 {
        current - self.changes.iter().map(|(_, d)| d).sum::<i32>()
    }

    /// HPA's percent policy: at most `base × (1 + pct)`, and at least one more pod.
    fn up_limit(&self, policy: &Policy, current: i32) -> i32 {
        let base = self.base(current).max(0);
        let by_percent =
            (base as f64 * (1.0 + policy.max_up_percent_per_minute as f64 / 100.0)).ceil() as i32;
        by_percent.max(base + 1)
    }

    /// HPA's percent policy for scale-down: at least `base × (1 − pct)`.
    fn down_limit(&self, policy: &Policy, current: i32) -> i32 {
        let base = self.base(current).max(0);
        (base as f64 * (1.0 - policy.max_down_percent_per_minute as f64 / 100.0)).ceil() as i32
    }
}

/// HPA's replica calculation for one per-pod signal. `values` has one entry per ready pod:
/// `Some` when it reported, `None` when its scrape failed. Returns `None` when no pod reported.
///
/// A missing pod counts as 0 when the others ask to scale up and as exactly on target when they
/// ask to scale down; unready pods count as 0 when scaling up and are otherwise left out. So
/// missing data damps a change and can never cause a scale-down.
pub fn replicas_for(
    values: &[Option<f64>],
    unready: usize,
    target: f64,
    current: i32,
    tolerance: f64,
) -> Option<i32> {
    let known: Vec<f64> = values.iter().flatten().copied().collect();
    if known.is_empty() || target <= 0.0 {
        return None;
    }
    let missing = values.len() - known.len();
    let ratio = known.iter().sum::<f64>() / (known.len() as f64 * target);
    let within = |r: f64| (r - 1.0).abs() <= tolerance;
    let scale_up_with_unready = unready > 0 && ratio > 1.0;
    if missing == 0 && !scale_up_with_unready {
        if within(ratio) {
            return Some(current);
        }
        return Some((ratio * known.len() as f64).ceil() as i32);
    }
    let mut total: f64 = known.iter().sum();
    let mut count = known.len();
    if missing > 0 {
        if ratio < 1.0 {
            total += missing as f64 * target;
        }
        count += missing;
    }
    if scale_up_with_unready {
        count += unready;
    }
    let new_ratio = total / (count as f64 * target);
    if within(new_ratio) || (ratio < 1.0 && new_ratio > 1.0) || (ratio > 1.0 && new_ratio < 1.0) {
        return Some(current);
    }
    let replicas = (new_ratio * count as f64).ceil() as i32;
    if (new_ratio < 1.0 && replicas > current) || (new_ratio > 1.0 && replicas < current) {
        return Some(current);
    }
    Some(replicas)
}

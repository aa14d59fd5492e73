//! Each tenant's limits (`InferenceTenant.spec.limits`) as token buckets: requests and tokens
//! per minute (the bucket holds a minute's worth and refills continuously, so a tenant may
//! spend its minute at once and then goes at the steady rate), and requests open at once.
//! A request is charged its estimated tokens when admitted ([`Quotas::admit`]) and settled to
//! what it used when it ends ([`Charge::settle`]): a refund, or a debt the next requests wait
//! out. Pure bookkeeping over a clock the caller passes, so every rule is tested alone.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A tenant's limits as the router enforces them (`None`: unlimited).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Limits {
    pub requests_per_minute: Option<f64>,
    pub tokens_per_minute: Option<f64>,
    pub concurrent: Option<u64>,
}

impl Limits {
    /// This replica's part of the limits when `share` of them is its own (1: all): per-minute
    /// limits scaled, concurrency rounded up (so each replica can always run one).
    pub fn share(self, share: f64) -> Limits {
        let share = share.clamp(f64::MIN_POSITIVE, 1.0);
        Limits {
            requests_per_minute: self.requests_per_minute.map(|l| l * share),
            tokens_per_minute: self.tokens_per_minute.map(|l| l * share),
            concurrent: self
                .concurrent
                .map(|c| ((c as f64 * share).ceil() as u64).max(1)),
        }
    }
}

/// Which limit refused a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Limit {
    Requests,
    Tokens,
    Concurrent,
}

impl Limit {
    pub fn as_str(self) -> &'static str {
        match self {
            Limit::Requests => "requests",
            Limit::Tokens => "tokens",
            Limit::Concurrent => "concurrent",
        }
    }
}

/// A refusal: which limit, and when a retry may pass (`None`: never, the request alone is
/// larger than the tenant's minute).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Throttled {
    pub limit: Limit,
    pub retry_after: Option<Duration>,
    pub state: State,
}

/// What the `x-ratelimit-*` headers say after a decision.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct State {
    pub requests: Option<Level>,
    pub tokens: Option<Level>,
}

/// One bucket's limit, what remains, and how long until it is full again.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Level {
    pub limit: f64,
    pub remaining: f64,
    pub reset: Duration,
}

/// A bucket holding up to `limit` (a minute's worth), refilled at `limit / 60` per second.
#[derive(Debug, Clone, Copy)]
struct Bucket {
    limit: f64,
    level: f64,
    at: Instant,
}

impl Bucket {
    fn new(limit: f64, now: Instant) -> Self {
        Bucket {
            limit,
            level: limit,
            at: now,
        }
    }

    fn per_sec(&self) -> f64 {
        self.limit / 60.0
    }

    fn refill(&mut self, now: Instant) {
        let secs = now.saturating_duration_since(self.at).as_secs_f64();
        self.level = (self.level + secs * self.per_sec()).min(self.limit);
        self.at = now;
    }

    /// Time until `amount` is available.
    fn wait_for(&self, amount: f64) -> Duration {
        Duration::from_secs_f64(((amount - self.level) / self.per_sec()).max(0.0))
    }

    fn level(&self) -> Level {
        Level {
            limit: self.limit,
            remaining: self.level.max(0.0),
            reset: self.wait_for(self.limit),
        }
    }

    /// Keeps the level when the limit changes (a tenant edited while requests run).
    fn set_limit(&mut self, limit: f64) {
        self.limit = limit;
        self.level = self.level.min(limit);
    }
}

/// One tenant's buckets and open requests.
#[derive(Debug)]
struct Account {
    limits: Limits,
    requests: Option<Bucket>,
    tokens: Option<Bucket>,
    open: u64,
}

impl Account {
    fn new(limits: Limits, now: Instant) -> Self {
        let mut a = Account {
            limits: Limits::default(),
            requests: None,
            tokens: None,
            open: 0,
        };
        a.update(limits, now);
        a
    }

    fn update(&mut self, limits: Limits, now: Instant) {
        let bucket = |b: &mut Option<Bucket>, limit: Option<f64>| match (b.as_mut(), limit) {
            (_, None) => *b = None,
            (Some(b), Some(l)) => b.set_limit(l),
            (None, Some(l)) => *b = Some(Bucket::new(l, now)),
        };
        bucket(&mut self.requests, limits.requests_per_minute);
        bucket(&mut self.tokens, limits.tokens_per_minute);
        self.limits = limits;
    }

    fn state(&self) -> State {
        State {
            requests: self.requests.as_ref().map(Bucket::level),
            tokens: self.tokens.as_ref().map(Bucket::level),
        }
    }
}

/// Every tenant's account.
#[derive(Debug, Clone, Default)]
pub struct Quotas {
    accounts: Arc<Mutex<HashMap<String, Account>>>,
}

impl Quotas {
    /// Admits a request of `tenant` (whose limits are `limits`) estimated at `tokens`, or says
    /// which limit refuses it.
    pub fn admit(
        &self,
        tenant: &str,
        limits: Limits,
        tokens: f64,
        now: Instant,
    ) -> Result<Charge, Throttled> {
        let mut accounts = self.lock();
        let a = accounts
            .entry(tenant.to_string())
            .or_insert_with(|| Account::new(limits, now));
        if a.limits != limits {
            a.update(limits, now);
        }
        for b in [a.requests.as_mut(), a.tokens.as_mut()]
            .into_iter()
            .flatten()
        {
            b.refill(now);
        }
        let refuse = |a: &Account, limit, retry_after| Throttled {
            limit,
            retry_after,
            state: a.state(),
        };
        if a.limits.concurrent.is_some_and(|max| a.open >= max) {
            return Err(refuse(a, Limit::Concurrent, Some(Duration::from_secs(1))));
        }
        if let Some(b) = &a.requests
            && b.level < 1.0
        {
            return Err(refuse(a, Limit::Requests, Some(b.wait_for(1.0))));
        }
        if let Some(b) = &a.tokens {
            if tokens > b.limit {
                return Err(refuse(a, Limit::Tokens, None));
            }
            if b.level < tokens {
                return Err(refuse(a, Limit::Tokens, Some(b.wait_for(tokens))));
            }
        }
        if let Some(b) = a.requests.as_mut() {
            b.level -= 1.0;
        }
        if let Some(b) = a.tokens.as_mut() {
            b.level -= tokens;
        }
        a.open += 1;
        let state = a.state();
        Ok(Charge {
            quotas: self.clone(),
            tenant: tenant.to_string(),
            estimate: tokens,
            used: None,
            state,
        })
    }

    /// Forgets tenants not in `live` (deleted InferenceTenants) that have nothing open.
    pub fn retain(&self, live: &std::collections::HashSet<String>) {
        self.lock()
            .retain(|name, a| a.open > 0 || live.contains(name));
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Account>> {
        // The map holds plain numbers: a panic elsewhere cannot leave it inconsistent.
        self.accounts.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// An admitted request's charge: settled when it ends (dropped), to what it used if
/// [`Charge::settle`] said, else to its estimate.
#[derive(Debug)]
pub struct Charge {
    quotas: Quotas,
    tenant: String,
    estimate: f64,
    used: Option<f64>,
    /// The buckets just after admission, for the response's headers.
    pub state: State,
}

impl Charge {
    /// The tokens the request turned out to use.
    pub fn settle(&mut self, used: f64) {
        self.used = Some(used.max(0.0));
    }

    /// The tokens it was admitted for.
    pub fn estimate(&self) -> f64 {
        self.estimate
    }

    /// The tokens it will be charged when dropped.
    pub fn tokens(&self) -> f64 {
        self.used.unwrap_or(self.estimate)
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        let refund = self.estimate - self.tokens();
        let mut accounts = self.quotas.lock();
        if let Some(a) = accounts.get_mut(&self.tenant) {
            a.open = a.open.saturating_sub(1);
            if let Some(b) = a.tokens.as_mut() {
                // Up to the bucket's limit; below zero is a debt the next requests wait out.
                b.level = (b.level + refund).min(b.limit);
            }
        }
    }
}

/// The `x-ratelimit-*` headers OpenAI's clients read, for `state`.
pub fn headers(state: &State) -> Vec<(&'static str, String)> {
    const REQUESTS: [&str; 3] = [
        "x-ratelimit-limit-requests",
        "x-ratelimit-remaining-requests",
        "x-ratelimit-reset-requests",
    ];
    const TOKENS: [&str; 3] = [
        "x-ratelimit-limit-tokens",
        "x-ratelimit-remaining-tokens",
        "x-ratelimit-reset-tokens",
    ];
    [(REQUESTS, &state.requests), (TOKENS, &state.tokens)]
        .into_iter()
        .filter_map(|(names, level)| Some((names, level.as_ref()?)))
        .flat_map(|([limit, remaining, reset], l)| {
            [
                (limit, format!("{}", l.limit.round() as u64)),
                (remaining, format!("{}", l.remaining.floor() as u64)),
                (reset, duration(l.reset)),
            ]
        })
        .collect()
}

/// OpenAI's duration form: `1s`, `6m0s`, `120ms`.
fn duration(d: Duration) -> String {
    let ms = d.as_millis();
    if ms < 1000 {
        return format!("{ms}ms");
    }
    let secs = d.as_secs_f64().ceil() as u64;
    match secs / 60 {
        0 => format!("{secs}s"),
        m => format!("{m}m{}s", secs % 60),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(rpm: Option<f64>, tpm: Option<f64>, concurrent: Option<u64>) -> Limits {
        Limits {
            requests_per_minute: rpm,
            tokens_per_minute: tpm,
            concurrent,
        }
    }

    #[test]
    fn requests_per_minute_allow_a_burst_then_the_steady_rate() {
        let q = Quotas::default();
        let l = limits(Some(60.0), None, None);
        let t0 = Instant::now();
        let held: Vec<Charge> = (0..60)
            .map(|_| q.admit("a", l, 10.0, t0).expect("within the minute"))
            .collect();
        let t = q.admit("a", l, 10.0, t0).expect_err("the minute is spent");
        assert_eq!(t.limit, Limit::Requests);
        assert_eq!(t.retry_after, Some(Duration::from_secs(1)));
        drop(held);
        // One a second comes back; ending requests gives none back.
        let later = t0 + Duration::from_secs(1);
        let _one = q.admit("a", l, 10.0, later).expect("refilled");
        assert!(q.admit("a", l, 10.0, later).is_err());
        // Other tenants have their own buckets.
        assert!(q.admit("b", l, 10.0, later).is_ok());
    }

    #[test]
    fn tokens_are_charged_by_estimate_and_settled_to_use() {
        let q = Quotas::default();
        let l = limits(None, Some(1000.0), None);
        let t0 = Instant::now();
        let mut c = q.admit("a", l, 600.0, t0).expect("fits");
        assert_eq!(c.state.tokens.map(|l| l.remaining), Some(400.0));
        // 600 would not fit now ...
        let t = q.admit("a", l, 600.0, t0).expect_err("over");
        assert_eq!(t.limit, Limit::Tokens);
        assert_eq!(t.retry_after, Some(Duration::from_secs(12)));
        // ... but it used only 100: 500 come back when it ends.
        c.settle(100.0);
        drop(c);
        let c2 = q.admit("a", l, 600.0, t0).expect("refunded");
        // A request that used more than its estimate leaves a debt.
        let mut c2 = c2;
        c2.settle(1_900.0);
        drop(c2);
        let t = q.admit("a", l, 1.0, t0).expect_err("in debt");
        // 1,000 tokens of debt and the one asked for, at 1,000 a minute.
        let wait = t.retry_after.expect("a wait").as_secs_f64();
        assert!((wait - 60.06).abs() < 1e-6, "{wait}");
        // Larger than the whole minute: never, so no Retry-After.
        let t = q
            .admit("a", l, 1001.0, t0 + Duration::from_secs(600))
            .expect_err("too large");
        assert_eq!((t.limit, t.retry_after), (Limit::Tokens, None));
    }

    #[test]
    fn concurrent_requests_are_counted_until_they_end() {
        let q = Quotas::default();
        let l = limits(None, None, Some(2));
        let t0 = Instant::now();
        let a = q.admit("a", l, 1.0, t0).expect("1");
        let _b = q.admit("a", l, 1.0, t0).expect("2");
        assert_eq!(
            q.admit("a", l, 1.0, t0).expect_err("3").limit,
            Limit::Concurrent
        );
        drop(a);
        assert!(q.admit("a", l, 1.0, t0).is_ok());
    }

    #[test]
    fn a_refused_request_is_not_charged() {
        let q = Quotas::default();
        let l = limits(Some(2.0), Some(100.0), None);
        let t0 = Instant::now();
        assert!(q.admit("a", l, 200.0, t0).is_err());
        let a = q.admit("a", l, 50.0, t0).expect("the refusal took nothing");
        assert_eq!(a.state.requests.map(|l| l.remaining), Some(1.0));
    }

    #[test]
    fn headers_follow_openais_names_and_durations() {
        let q = Quotas::default();
        let c = q
            .admit(
                "a",
                limits(Some(60.0), Some(6000.0), None),
                100.0,
                Instant::now(),
            )
            .expect("fits");
        let h: HashMap<_, _> = headers(&c.state).into_iter().collect();
        assert_eq!(h["x-ratelimit-limit-requests"], "60");
        assert_eq!(h["x-ratelimit-remaining-requests"], "59");
        assert_eq!(h["x-ratelimit-reset-requests"], "1s");
        assert_eq!(h["x-ratelimit-remaining-tokens"], "5900");
        assert_eq!(h["x-ratelimit-reset-tokens"], "1s");
        assert_eq!(duration(Duration::from_secs(360)), "6m0s");
        assert_eq!(duration(Duration::from_millis(120)), "120ms");
    }

    #[test]
    fn a_share_scales_the_minute_and_rounds_concurrency_up() {
        let l = limits(Some(60.0), Some(1000.0), Some(3)).share(0.5);
        assert_eq!(l, limits(Some(30.0), Some(500.0), Some(2)));
        assert_eq!(
            limits(None, None, Some(1)).share(1.0 / 3.0).concurrent,
            Some(1)
        );
        // Two replicas with half each admit the whole minute between them, and no more.
        let (a, b) = (Quotas::default(), Quotas::default());
        let t0 = Instant::now();
        let half = limits(Some(10.0), None, None).share(0.5);
        let admitted = (0..20)
            .map(|i| if i % 2 == 0 { &a } else { &b })
            .filter_map(|q| q.admit("t", half, 1.0, t0).ok())
            .count();
        assert_eq!(admitted, 10);
    }

    #[test]
    fn an_edited_limit_takes_effect_at_once() {
        let q = Quotas::default();
        let t0 = Instant::now();
        let _a = q
            .admit("a", limits(Some(10.0), None, None), 1.0, t0)
            .expect("1");
        // 9 left of 10; the new limit of 3 caps what is left at 3, and this takes one.
        let b = q
            .admit("a", limits(Some(3.0), None, None), 1.0, t0)
            .expect("2");
        assert_eq!(b.state.requests.map(|l| l.remaining), Some(2.0));
    }
}

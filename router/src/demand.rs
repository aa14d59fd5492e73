//! What each tenant asks of this router replica: a decaying rate of the tokens its requests
//! are estimated at, admitted or not. Replicas publish it to each other
//! ([`crate::peers`]) so that each enforces a share of a tenant's limits in proportion to the
//! tenant's traffic it sees: a tenant whose requests all reach one replica (one keep-alive
//! connection through a Service) gets most of its limits there, not `1/N`.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The decay time of the rates: a tenant that moves to another replica has its share follow
/// within a few of these.
pub const DECAY: Duration = Duration::from_secs(5);

/// Rates below this (tokens a second) are dropped: the tenant is idle here.
const IDLE: f64 = 1e-3;

/// Each tenant's decaying rate, in tokens a second.
#[derive(Debug, Default)]
pub struct Demand {
    rates: Mutex<HashMap<String, Rate>>,
}

#[derive(Debug, Clone, Copy)]
struct Rate {
    per_sec: f64,
    at: Instant,
}

impl Rate {
    fn at(self, now: Instant) -> f64 {
        let dt = now.saturating_duration_since(self.at).as_secs_f64();
        self.per_sec * (-dt / DECAY.as_secs_f64()).exp()
    }
}

impl Demand {
    /// `tenant` asked for `tokens` at `now`.
    pub fn record(&self, tenant: &str, tokens: f64, now: Instant) {
        let mut rates = self.lock();
        let r = rates.entry(tenant.to_string()).or_insert(Rate {
            per_sec: 0.0,
            at: now,
        });
        // An exponentially decaying sum, scaled to a rate: one request of `tokens` adds
        // `tokens / DECAY`, which decays away over DECAY.
        *r = Rate {
            per_sec: r.at(now) + tokens.max(0.0) / DECAY.as_secs_f64(),
            at: now,
        };
    }

    /// Every tenant's rate at `now`, idle ones forgotten.
    pub fn rates(&self, now: Instant) -> BTreeMap<String, f64> {
        let mut rates = self.lock();
        rates.retain(|_, r| r.at(now) >= IDLE);
        rates.iter().map(|(t, r)| (t.clone(), r.at(now))).collect()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Rate>> {
        // Plain numbers: a panic elsewhere cannot leave them inconsistent.
        self.rates.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// This replica's share of a tenant's limits, given its own rate and those of the other
/// Ready replicas (`None` for one whose rate is not known lately). Each replica gets a
/// floor of `FLOOR / n` of the total (so a replica that gets the tenant's next request can
/// serve it), the rest in proportion to its rate. Replicas that see the same rates get
/// shares that add up to 1. Without any rate (an idle tenant), or with one not known, the
/// even split `1/n`.
pub fn share(own: f64, others: &[Option<f64>]) -> f64 {
    let n = (others.len() + 1) as f64;
    let even = 1.0 / n;
    let Some(others) = others.iter().copied().collect::<Option<Vec<f64>>>() else {
        return even;
    };
    let clean = |r: f64| if r.is_finite() { r.max(0.0) } else { 0.0 };
    let own = clean(own);
    let total = own + others.into_iter().map(clean).sum::<f64>();
    if total < IDLE {
        return even;
    }
    let floor = FLOOR * total / n;
    ((own + floor) / (total * (1.0 + FLOOR))).clamp(0.0, 1.0)
}

/// The part of a tenant's limits spread evenly over the replicas, whatever their traffic.
pub const FLOOR: f64 = 0.1;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rate_decays_and_an_idle_tenant_is_forgotten() {
        let d = Demand::default();
        let t0 = Instant::now();
        for i in 0..50 {
            d.record("a", 10.0, t0 + Duration::from_millis(100 * i));
        }
        // 100 tokens a second for 5 s: the decaying rate is 1 − e^-1 of it.
        let now = t0 + Duration::from_secs(5);
        let r = d.rates(now)["a"];
        assert!((r - 100.0 * (1.0 - (-1.0f64).exp())).abs() < 3.0, "{r}");
        assert!(d.rates(now + DECAY * 4)["a"] < r * 0.02);
        assert!(d.rates(now + DECAY * 40).is_empty());
    }

    #[test]
    fn shares_follow_traffic_and_add_up_to_one() {
        // All of it on this replica: all but the other's floor.
        let s = share(100.0, &[Some(0.0)]);
        assert!((s - (1.0 + 0.05) / 1.1).abs() < 1e-9, "{s}");
        assert!((s + share(0.0, &[Some(100.0)]) - 1.0).abs() < 1e-9);
        // Three replicas, uneven: each computes its own from the same rates.
        let rates = [60.0, 30.0, 10.0];
        let total: f64 = (0..3)
            .map(|i| {
                let others: Vec<Option<f64>> =
                    (0..3).filter(|&j| j != i).map(|j| Some(rates[j])).collect();
                share(rates[i], &others)
            })
            .sum();
        assert!((total - 1.0).abs() < 1e-9, "{total}");
        // Idle, alone, or a replica not heard from: the even split.
        assert_eq!(share(0.0, &[Some(0.0)]), 0.5);
        assert_eq!(share(5.0, &[]), 1.0);
        assert_eq!(share(100.0, &[Some(1.0), None]), 1.0 / 3.0);
        // A replica's claim is no more than a rate: nonsense counts as none.
        assert!(share(1.0, &[Some(f64::NAN)]) > 0.9);
        assert!(share(1.0, &[Some(-5.0)]) > 0.9);
        let s = share(1.0, &[Some(f64::INFINITY)]);
        assert!(s > 0.9, "{s}");
    }
}

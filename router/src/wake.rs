//! Waking a service scaled to zero: one write of the scale subresource per service however
//! many requests are held for it (single flight), and after a failed write, the next only
//! after a backoff that doubles. Before, every held request wrote `/scale` itself: 1,000 held
//! requests were 18 writes in 20 seconds.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use ferrite_api::crd::InferenceService;
use kube::api::{Api, Patch, PatchParams};
use serde_json::json;
use tokio::time::Instant;

/// The wait after a write before another may go out for the same service: long enough for
/// the operator to act on the first.
pub const AFTER_WRITE: Duration = Duration::from_secs(30);
/// The first wait after a failed write; it doubles up to [`MAX_BACKOFF`].
pub const FIRST_BACKOFF: Duration = Duration::from_secs(2);
pub const MAX_BACKOFF: Duration = Duration::from_secs(60);

/// Per service (`namespace/name`): when the next write may go out, and how long the last
/// failure made it wait.
#[derive(Debug, Default)]
pub struct Wakes {
    state: Mutex<HashMap<String, Turn>>,
}

#[derive(Debug, Clone, Copy)]
struct Turn {
    next: Instant,
    backoff: Duration,
}

impl Wakes {
    /// Whether this caller should write now; if so, no other caller will until `done` or
    /// the wait after it.
    pub fn claim(&self, service: &str, now: Instant) -> bool {
        let Ok(mut s) = self.state.lock() else {
            return false;
        };
        match s.get_mut(service) {
            Some(t) if now < t.next => false,
            Some(t) => {
                // In flight until `done` says how it went.
                t.next = now + MAX_BACKOFF;
                true
            }
            None => {
                s.insert(
                    service.to_string(),
                    Turn {
                        next: now + MAX_BACKOFF,
                        backoff: Duration::ZERO,
                    },
                );
                true
            }
        }
    }

    /// Records how a claimed write went.
    pub fn done(&self, service: &str, ok: bool, now: Instant) {
        let Ok(mut s) = self.state.lock() else {
            return;
        };
        let t = s.entry(service.to_string()).or_insert(Turn {
            next: now,
            backoff: Duration::ZERO,
        });
        if ok {
            t.backoff = Duration::ZERO;
            t.next = now + AFTER_WRITE;
        } else {
            t.backoff = (t.backoff * 2).clamp(FIRST_BACKOFF, MAX_BACKOFF);
            t.next = now + t.backoff;
        }
    }

    /// Forgets services that have not been woken for a while (bounded by the services that
    /// exist, but a deleted one should not stay).
    pub fn forget_older_than(&self, now: Instant, age: Duration) {
        if let Ok(mut s) = self.state.lock() {
            s.retain(|_, t| t.next + age > now);
        }
    }
}

/// Sets `spec.replicas` to 1 through the scale subresource (what `kubectl scale` does), so
/// a service scaled to zero starts; with autoscaling on, the autoscaler takes it from there.
pub async fn scale_up(client: &kube::Client, namespace: &str, name: &str) -> bool {
    let api: Api<InferenceService> = Api::namespaced(client.clone(), namespace);
    let patch = Patch::Merge(json!({"spec": {"replicas": 1}}));
    match api.patch_scale(name, &PatchParams::default(), &patch).await {
        Ok(_) => {
            tracing::info!(namespace, name, "scaled from zero for held requests");
            true
        }
        Err(e) => {
            tracing::warn!(namespace, name, error = %e, "could not scale from zero; waiting");
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_write_per_service_at_a_time() {
        let w = Wakes::default();
        let t0 = Instant::now();
        assert!(w.claim("a/x", t0));
        assert!(!w.claim("a/x", t0), "in flight");
        assert!(w.claim("a/y", t0), "another service is apart");
        w.done("a/x", true, t0);
        assert!(!w.claim("a/x", t0 + AFTER_WRITE - Duration::from_secs(1)));
        assert!(w.claim("a/x", t0 + AFTER_WRITE));
    }

    #[test]
    fn failures_back_off_doubling_to_a_cap() {
        let w = Wakes::default();
        let mut now = Instant::now();
        let mut waits = Vec::new();
        assert!(w.claim("a/x", now));
        for _ in 0..7 {
            w.done("a/x", false, now);
            let mut wait = 0;
            while !w.claim("a/x", now + Duration::from_secs(wait)) {
                wait += 1;
            }
            waits.push(wait);
            now += Duration::from_secs(wait);
        }
        assert_eq!(waits, [2, 4, 8, 16, 32, 60, 60]);
    }

    #[test]
    fn a_thousand_held_requests_write_once() {
        let w = Wakes::default();
        let now = Instant::now();
        let writes = (0..1000).filter(|_| w.claim("a/x", now)).count();
        assert_eq!(writes, 1);
    }
}

//! Each replica's load as the router weighs it: the requests this router has open there right
//! now, plus the queue and running requests of everyone else as last scraped from its
//! `/metrics` (the operator's scraper and parser, the autoscaler's view). Counting its own
//! requests exactly, and not through the scrape, means a burst between two scrapes spreads
//! out instead of piling onto the replica that looked idle, and a request that ended stops
//! counting at once instead of making an idle replica look busy until the next scrape.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ferrite_operator::autoscale::scrape::{PodTarget, Scraper};
use ferrite_operator::signal::PodSample;

use crate::registry::Registry;

#[derive(Debug, Default, Clone, Copy)]
struct PodLoad {
    /// Waiting + running at the last scrape, less this router's requests open when that
    /// scrape began: other routers' and direct clients' requests.
    others: f64,
    /// Requests this router has open there.
    open: u64,
    /// Set aside until then: it refused a connection (its pod may still be listed Ready
    /// while it is gone).
    aside_until: Option<Instant>,
}

/// Loads by replica base URL.
#[derive(Debug, Clone, Default)]
pub struct Loads {
    pods: Arc<Mutex<HashMap<String, PodLoad>>>,
}

impl Loads {
    /// The load the policies weigh for the replica at `base_url`.
    pub fn get(&self, base_url: &str) -> f64 {
        let pods = self.pods.lock().unwrap_or_else(|e| e.into_inner());
        pods.get(base_url).map_or(0.0, |p| p.others + p.open as f64)
    }

    /// Counts a request sent to `base_url` until the guard drops.
    pub fn open(&self, base_url: &str) -> Open {
        let mut pods = self.pods.lock().unwrap_or_else(|e| e.into_inner());
        pods.entry(base_url.to_string()).or_default().open += 1;
        Open {
            loads: self.clone(),
            base_url: base_url.to_string(),
        }
    }

    fn close(&self, base_url: &str) {
        let mut pods = self.pods.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(p) = pods.get_mut(base_url) {
            p.open = p.open.saturating_sub(1);
        }
    }

    /// Sets `base_url` aside for `span` (or until a scrape reaches it): it refused a
    /// connection.
    pub fn set_aside(&self, base_url: &str, span: Duration) {
        let mut pods = self.pods.lock().unwrap_or_else(|e| e.into_inner());
        pods.entry(base_url.to_string()).or_default().aside_until = Some(Instant::now() + span);
    }

    /// Whether `base_url` is set aside now.
    pub fn is_set_aside(&self, base_url: &str) -> bool {
        let pods = self.pods.lock().unwrap_or_else(|e| e.into_inner());
        pods.get(base_url)
            .and_then(|p| p.aside_until)
            .is_some_and(|t| Instant::now() < t)
    }

    /// Records a scrape of `base_url` that began while this router had `open_then` requests
    /// open there: the scraped count includes those, so the rest is everyone else's. A
    /// failed scrape (`None`) keeps the last estimate.
    fn scraped(&self, base_url: &str, value: Option<f64>, open_then: u64) {
        let mut pods = self.pods.lock().unwrap_or_else(|e| e.into_inner());
        let p = pods.entry(base_url.to_string()).or_default();
        if let Some(v) = value {
            p.others = (v - open_then as f64).max(0.0);
            // It answered: back in.
            p.aside_until = None;
        }
    }

    fn open_now(&self, base_url: &str) -> u64 {
        let pods = self.pods.lock().unwrap_or_else(|e| e.into_inner());
        pods.get(base_url).map_or(0, |p| p.open)
    }

    /// Forgets replicas that are gone and have nothing open.
    fn retain(&self, live: &[String]) {
        let mut pods = self.pods.lock().unwrap_or_else(|e| e.into_inner());
        pods.retain(|url, p| p.open > 0 || live.contains(url));
    }

    /// Scrapes every ready replica of every service every `every`, for ever.
    pub async fn refresh(self, registry: Registry, every: Duration) {
        let scraper = Scraper::new(every.max(Duration::from_millis(200)));
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let targets: Vec<PodTarget> = registry
                .all()
                .into_iter()
                .flat_map(|s| s.endpoints)
                .map(|e| PodTarget {
                    name: e.name,
                    base_url: e.base_url,
                    ready: true,
                })
                .collect();
            let open_then: Vec<u64> = targets.iter().map(|t| self.open_now(&t.base_url)).collect();
            let results = scraper.scrape_all(&targets).await;
            for ((t, r), open_then) in targets.iter().zip(results).zip(open_then) {
                let value = match r.sample {
                    PodSample::Ready(m) => Some(m.waiting + m.running),
                    _ => None,
                };
                if let Some(e) = r.error {
                    tracing::debug!(pod = %t.name, error = %e, "scrape failed; keeping the last load");
                }
                self.scraped(&t.base_url, value, open_then);
            }
            let live: Vec<String> = targets.into_iter().map(|t| t.base_url).collect();
            self.retain(&live);
        }
    }
}

/// A request open to one replica; dropping it closes it.
#[derive(Debug)]
pub struct Open {
    loads: Loads,
    base_url: String,
}

impl Drop for Open {
    fn drop(&mut self) {
        self.loads.close(&self.base_url);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_requests_count_at_once_and_others_come_from_the_scrape() {
        let loads = Loads::default();
        let a = "http://10.0.0.1:8000";
        loads.scraped(a, Some(3.0), 0);
        let first = loads.open(a);
        let second = loads.open(a);
        assert_eq!(loads.get(a), 5.0, "3 others + 2 of ours");
        // A scrape that began with both open counts them: the others are still 3.
        loads.scraped(a, Some(5.0), 2);
        assert_eq!(loads.get(a), 5.0);
        drop(first);
        drop(second);
        assert_eq!(loads.get(a), 3.0, "ours stop counting when they end");
        loads.scraped(a, Some(0.0), 0);
        assert_eq!(loads.get(a), 0.0);
        // A failed scrape keeps the last value, and gone replicas with nothing open go.
        loads.scraped(a, Some(2.0), 0);
        loads.scraped(a, None, 0);
        assert_eq!(loads.get(a), 2.0);
        loads.retain(&[]);
        assert_eq!(loads.pods.lock().expect("lock").len(), 0);
    }

    #[test]
    fn a_replica_set_aside_comes_back_when_a_scrape_reaches_it() {
        let loads = Loads::default();
        let a = "http://10.0.0.3:8000";
        assert!(!loads.is_set_aside(a));
        loads.set_aside(a, Duration::from_secs(10));
        assert!(loads.is_set_aside(a));
        loads.scraped(a, None, 0);
        assert!(loads.is_set_aside(a), "a failed scrape leaves it aside");
        loads.scraped(a, Some(0.0), 0);
        assert!(!loads.is_set_aside(a));
    }

    #[test]
    fn a_scrape_that_missed_our_requests_does_not_go_negative() {
        let loads = Loads::default();
        let a = "http://10.0.0.2:8000";
        let r = loads.open(a);
        // Sent, but not yet admitted when the replica answered the scrape.
        loads.scraped(a, Some(0.0), 1);
        assert_eq!(loads.get(a), 1.0);
        drop(r);
        assert_eq!(loads.get(a), 0.0);
    }
}

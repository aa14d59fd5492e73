//! Each replica's load as the router weighs it, in tokens of work (see [`crate::work`]): the
//! requests this router has open there right now, each weighed by its own estimate, plus the
//! queue and running requests of everyone else as last scraped from its `/metrics` (the
//! operator's scraper and parser, the autoscaler's view), each weighed as a typical request
//! of this router. Counting its own requests exactly, and not through the scrape, means a
//! burst between two scrapes spreads out instead of piling onto the replica that looked idle,
//! and a request that ended stops counting at once instead of making an idle replica look
//! busy until the next scrape. Weighing them by work means a replica prefilling a long prompt
//! looks as busy as it is.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ferrite_api::scrape::{PodTarget, Scraper};
use ferrite_api::signal::{PodMetrics, PodSample};

use crate::flow::{FlowConfig, Room};
use crate::registry::Registry;
use crate::work::Work;

#[derive(Debug, Default, Clone)]
struct PodLoad {
    /// Waiting + running at the last scrape, less this router's requests open when that
    /// scrape began: other routers' and direct clients' requests.
    others: f64,
    /// Requests this router has open there.
    open: u64,
    /// Their work, summed.
    open_work: f64,
    /// Set aside until then: it refused a connection (its pod may still be listed Ready
    /// while it is gone).
    aside_until: Option<Instant>,
    /// The LoRA adapters in its batch slots at the last scrape (running or waiting).
    adapters: Vec<String>,
    /// Adapters it refused (it has not loaded them yet), each set aside for it until then;
    /// at most [`MAX_LACKING`].
    lacking: Vec<(String, Instant)>,
    /// The last answered scrape: its own queue and KV-cache use, and how many of this
    /// router's requests were open there when it began.
    scraped: Option<PodMetrics>,
    open_then: u64,
    /// Requests it runs at once, learned from scrapes that found some waiting (then it runs
    /// all it can): its batch slots or what its KV cache holds now.
    capacity: Option<f64>,
    /// The most it was seen running with some waiting: its batch slots, which a capacity
    /// lowered by a full KV cache grows back to.
    slots: f64,
}

/// Most adapters remembered as refused per replica: clients choose adapter names, so the list
/// is bounded; past it the one set aside longest ago is forgotten.
const MAX_LACKING: usize = 64;

/// Learns a replica's capacity from a scrape: what it ran while others waited. While none
/// wait and it runs all it was thought to hold, one more, up to the most it was ever seen
/// running (its KV cache may have room again; past its batch slots it never has, and probing
/// there would put a request in its queue).
fn learn_capacity(p: &mut PodLoad, m: &PodMetrics) {
    if m.waiting >= 1.0 && m.running >= 1.0 {
        p.capacity = Some(m.running);
        p.slots = p.slots.max(m.running);
    } else if let Some(c) = p.capacity
        && m.running >= c
    {
        p.capacity = Some((c + 1.0).min(p.slots).max(c));
    }
}

impl PodLoad {
    /// Requests it takes before it is saturated (`usize::MAX`: no bound seen yet).
    fn room(&self, config: &FlowConfig) -> usize {
        let Some(m) = self.scraped else {
            return usize::MAX;
        };
        if m.kv_usage.is_some_and(|kv| kv >= config.kv_usage) {
            return 0;
        }
        // This router's requests sent since the scrape (less those that ended).
        let since = self.open as f64 - self.open_then as f64;
        let slack = match self.capacity {
            // Its queue once everything open there is running or waiting.
            Some(c) => c + config.queue_depth - (self.others + self.open as f64),
            // Unknown capacity: only a queue it already has grows.
            None if m.waiting >= 1.0 => config.queue_depth - (m.waiting + since),
            None => return usize::MAX,
        };
        if slack <= 0.0 {
            0
        } else {
            slack.ceil() as usize
        }
    }

    /// Takes `work` off the open work. Summing floats up and down drifts: nothing open is
    /// exactly nothing.
    fn give_back(&mut self, work: f64) {
        self.open_work = if self.open == 0 {
            0.0
        } else {
            (self.open_work - work).max(0.0)
        };
    }
}

/// How fast the typical request's work follows the router's recent requests.
const TYPICAL_ALPHA: f64 = 0.05;

#[derive(Debug)]
struct Inner {
    pods: HashMap<String, PodLoad>,
    /// A moving average of the work of the requests this router sent: what one scraped
    /// request of someone else's counts for.
    typical: f64,
}

impl Default for Inner {
    fn default() -> Inner {
        Inner {
            pods: HashMap::new(),
            typical: crate::work::DEFAULT_MAX_TOKENS,
        }
    }
}

/// Loads by replica base URL.
#[derive(Debug, Clone, Default)]
pub struct Loads {
    inner: Arc<Mutex<Inner>>,
}

impl Loads {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The load the policies weigh for the replica at `base_url`, in tokens of work.
    pub fn get(&self, base_url: &str) -> f64 {
        let inner = self.lock();
        inner
            .pods
            .get(base_url)
            .map_or(0.0, |p| p.others * inner.typical + p.open_work)
    }

    /// Counts a request of `work` sent to `base_url` until the guard drops. `preamble` is
    /// the number of stream events that come before its first token (a chat stream's role
    /// event), for [`Open::events`].
    pub fn open(&self, base_url: &str, work: Work, preamble: u64) -> Open {
        let clean = |v: f64| if v.is_finite() { v.max(0.0) } else { 0.0 };
        let (prompt, output) = (clean(work.prompt), clean(work.output));
        let mut inner = self.lock();
        let total = prompt + output;
        inner.typical += TYPICAL_ALPHA * (total - inner.typical);
        let p = inner.pods.entry(base_url.to_string()).or_default();
        p.open += 1;
        p.open_work += total;
        Open {
            loads: self.clone(),
            base_url: base_url.to_string(),
            prompt,
            output,
            preamble,
            seen: 0,
        }
    }

    /// Takes `work` off a request still open at `base_url`.
    fn release(&self, base_url: &str, work: f64) {
        if work <= 0.0 {
            return;
        }
        if let Some(p) = self.lock().pods.get_mut(base_url) {
            p.give_back(work);
        }
    }

    fn close(&self, base_url: &str, work: f64) {
        let mut inner = self.lock();
        if let Some(p) = inner.pods.get_mut(base_url) {
            p.open = p.open.saturating_sub(1);
            p.give_back(work);
        }
    }

    /// Sets `base_url` aside for `span` (or until a scrape reaches it): it refused a
    /// connection.
    pub fn set_aside(&self, base_url: &str, span: Duration) {
        self.lock()
            .pods
            .entry(base_url.to_string())
            .or_default()
            .aside_until = Some(Instant::now() + span);
    }

    /// Whether `base_url` is set aside now.
    pub fn is_set_aside(&self, base_url: &str) -> bool {
        self.lock()
            .pods
            .get(base_url)
            .and_then(|p| p.aside_until)
            .is_some_and(|t| Instant::now() < t)
    }

    /// Sets `base_url` aside for `adapter`'s requests for `span`, or until a scrape finds the
    /// adapter in its batch slots: it refused the adapter (not loaded there yet).
    pub fn set_aside_for(&self, base_url: &str, adapter: &str, span: Duration) {
        let now = Instant::now();
        let mut inner = self.lock();
        let p = inner.pods.entry(base_url.to_string()).or_default();
        p.lacking.retain(|(a, until)| a != adapter && *until > now);
        if p.lacking.len() >= MAX_LACKING {
            p.lacking.remove(0);
        }
        p.lacking.push((adapter.to_string(), now + span));
    }

    /// Whether `base_url` is set aside for `adapter` now.
    pub fn is_set_aside_for(&self, base_url: &str, adapter: &str) -> bool {
        let now = Instant::now();
        self.lock().pods.get(base_url).is_some_and(|p| {
            p.lacking
                .iter()
                .any(|(a, until)| a == adapter && *until > now)
        })
    }

    /// Whether the replica at `base_url` had `adapter` in its batch slots at the last
    /// scrape, so a request for it starts without swapping an adapter in.
    pub fn holds(&self, base_url: &str, adapter: &str) -> bool {
        self.lock()
            .pods
            .get(base_url)
            .is_some_and(|p| p.adapters.iter().any(|a| a == adapter))
    }

    /// Records a scrape of `base_url` that began while this router had `open_then` requests
    /// open there: the scraped count includes those, so the rest is everyone else's. A
    /// failed scrape (`None`) keeps the last estimate.
    fn scraped(
        &self,
        base_url: &str,
        value: Option<PodMetrics>,
        open_then: u64,
        adapters: Vec<String>,
    ) {
        let mut inner = self.lock();
        let p = inner.pods.entry(base_url.to_string()).or_default();
        if let Some(m) = value {
            p.others = (m.waiting + m.running - open_then as f64).max(0.0);
            learn_capacity(p, &m);
            p.scraped = Some(m);
            p.open_then = open_then;
            // Running or waiting there: it has them now.
            p.lacking.retain(|(a, _)| !adapters.contains(a));
            p.adapters = adapters;
            // It answered: back in.
            p.aside_until = None;
        }
    }

    /// How many more requests the replicas at `base_urls` take before each is saturated (its
    /// own queue at `config.queue_depth`, or its KV cache at `config.kv_usage`), and how many
    /// they run at once where known. A replica set aside takes none.
    pub fn room(&self, base_urls: &[&str], config: &FlowConfig) -> Room {
        let inner = self.lock();
        let now = Instant::now();
        let mut free = 0usize;
        let mut capacity = Some(0usize);
        for url in base_urls {
            let Some(p) = inner.pods.get(*url) else {
                // Never scraped yet: nothing says it is saturated.
                return Room::UNBOUNDED;
            };
            capacity = capacity.zip(p.capacity).map(|(a, b)| a + b as usize);
            if p.aside_until.is_some_and(|t| now < t) {
                continue;
            }
            free = free.saturating_add(p.room(config));
        }
        Room { free, capacity }
    }

    fn open_now(&self, base_url: &str) -> u64 {
        self.lock().pods.get(base_url).map_or(0, |p| p.open)
    }

    /// Forgets replicas that are gone and have nothing open.
    fn retain(&self, live: &[String]) {
        self.lock()
            .pods
            .retain(|url, p| p.open > 0 || live.contains(url));
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
                    PodSample::Ready(m) => Some(m),
                    _ => None,
                };
                if let Some(e) = r.error {
                    tracing::debug!(pod = %t.name, error = %e, "scrape failed; keeping the last load");
                }
                self.scraped(&t.base_url, value, open_then, r.adapters);
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
    /// Work still counted: the prompt until its first token, then the output not yet seen.
    prompt: f64,
    output: f64,
    /// Stream events before the first token.
    preamble: u64,
    /// Stream events seen so far.
    seen: u64,
}

impl Open {
    /// Stream events seen so far.
    pub fn seen(&self) -> u64 {
        self.seen
    }

    /// Stream events expected before the first token.
    pub fn preamble(&self) -> u64 {
        self.preamble
    }

    /// Notes `n` more events of the response's stream: once the first token arrives the
    /// prompt has been prefilled and stops counting, and each token after takes one off the
    /// output still to come.
    pub fn events(&mut self, n: u64) {
        if n == 0 {
            return;
        }
        let before = self.seen;
        self.seen += n;
        let mut done = 0.0;
        if before <= self.preamble && self.seen > self.preamble {
            done += std::mem::take(&mut self.prompt);
        }
        let tokens = self.seen.saturating_sub(self.preamble) - before.saturating_sub(self.preamble);
        let out = (tokens as f64).min(self.output);
        self.output -= out;
        self.loads.release(&self.base_url, done + out);
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        self.loads.close(&self.base_url, self.prompt + self.output);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::work::DEFAULT_MAX_TOKENS as U;

    /// A scrape that found `n` requests running.
    fn m(n: f64) -> PodMetrics {
        PodMetrics {
            waiting: 0.0,
            running: n,
            kv_usage: None,
        }
    }

    /// A request of `w` tokens, all of them output.
    fn w(w: f64) -> Work {
        Work {
            prompt: 0.0,
            output: w,
        }
    }

    #[test]
    fn own_requests_count_at_once_and_others_come_from_the_scrape() {
        let loads = Loads::default();
        let a = "http://10.0.0.1:8000";
        loads.scraped(a, Some(m(3.0)), 0, Vec::new());
        // Requests of the typical size: the counts read in units of U.
        let first = loads.open(a, w(U), 0);
        let second = loads.open(a, w(U), 0);
        assert_eq!(loads.get(a), 5.0 * U, "3 others + 2 of ours");
        // A scrape that began with both open counts them: the others are still 3.
        loads.scraped(a, Some(m(5.0)), 2, Vec::new());
        assert_eq!(loads.get(a), 5.0 * U);
        drop(first);
        drop(second);
        assert_eq!(loads.get(a), 3.0 * U, "ours stop counting when they end");
        loads.scraped(a, Some(m(0.0)), 0, Vec::new());
        assert_eq!(loads.get(a), 0.0);
        // A failed scrape keeps the last value, and gone replicas with nothing open go.
        loads.scraped(a, Some(m(2.0)), 0, Vec::new());
        loads.scraped(a, None, 0, Vec::new());
        assert_eq!(loads.get(a), 2.0 * U);
        loads.retain(&[]);
        assert_eq!(loads.lock().pods.len(), 0);
    }

    #[test]
    fn room_is_what_a_replica_takes_before_its_own_queue_or_kv_cache_fills() {
        let loads = Loads::default();
        let config = FlowConfig {
            queue_depth: 2.0,
            kv_usage: 0.8,
            ..FlowConfig::default()
        };
        let (a, b) = ("http://10.0.0.1:8000", "http://10.0.0.2:8000");
        // Never scraped, or never seen queueing: no bound known.
        assert_eq!(loads.room(&[a], &config), Room::UNBOUNDED);
        loads.scraped(a, Some(m(3.0)), 0, Vec::new());
        assert_eq!(loads.room(&[a], &config).free, usize::MAX);
        // It ran 4 while 1 waited: it runs 4 at once, and takes 4 + 2 - 5 = 1 more.
        let queued = PodMetrics {
            waiting: 1.0,
            running: 4.0,
            kv_usage: Some(0.5),
        };
        loads.scraped(a, Some(queued), 0, Vec::new());
        let room = loads.room(&[a], &config);
        assert_eq!((room.free, room.capacity), (1, Some(4)));
        // A request of ours sent since counts at once.
        let open = loads.open(a, w(U), 0);
        assert_eq!(loads.room(&[a], &config).free, 0);
        drop(open);
        // A full KV cache takes nothing, whatever the queue.
        let full = PodMetrics {
            kv_usage: Some(0.85),
            ..queued
        };
        loads.scraped(b, Some(full), 0, Vec::new());
        let room = loads.room(&[a, b], &config);
        assert_eq!((room.free, room.capacity), (1, Some(8)));
        // A replica set aside takes nothing; its capacity still counts.
        loads.set_aside(a, Duration::from_secs(10));
        assert_eq!(loads.room(&[a, b], &config).free, 0);
        // Running all it holds with none waiting: no more than its batch slots.
        loads.scraped(b, Some(m(4.0)), 0, Vec::new());
        assert_eq!(loads.room(&[b], &config).capacity, Some(4));
        // A full KV cache held it to 2 with some waiting; once it runs those 2 with none
        // waiting, it grows back a slot at a time, up to the 4 it was seen running.
        let kv_bound = PodMetrics {
            waiting: 3.0,
            running: 2.0,
            kv_usage: Some(0.5),
        };
        loads.scraped(b, Some(kv_bound), 0, Vec::new());
        assert_eq!(loads.room(&[b], &config).capacity, Some(2));
        for want in [3, 4, 4] {
            loads.scraped(b, Some(m(want as f64)), 0, Vec::new());
            assert_eq!(loads.room(&[b], &config).capacity, Some(want));
        }
    }

    #[test]
    fn a_replica_holds_the_adapters_its_last_answered_scrape_listed() {
        let loads = Loads::default();
        let a = "http://10.0.0.1:8000";
        assert!(!loads.holds(a, "sql"));
        loads.scraped(a, Some(m(1.0)), 0, vec!["sql".into()]);
        assert!(loads.holds(a, "sql") && !loads.holds(a, "tone"));
        // A failed scrape keeps what the last one said.
        loads.scraped(a, None, 0, Vec::new());
        assert!(loads.holds(a, "sql"));
        loads.scraped(a, Some(m(0.0)), 0, Vec::new());
        assert!(!loads.holds(a, "sql"));
    }

    #[test]
    fn a_replica_that_refused_an_adapter_sits_out_for_it_alone() {
        let loads = Loads::default();
        let a = "http://10.0.0.4:8000";
        loads.set_aside_for(a, "sql", Duration::from_secs(10));
        assert!(loads.is_set_aside_for(a, "sql"));
        assert!(!loads.is_set_aside_for(a, "tone") && !loads.is_set_aside(a));
        // A scrape without it changes nothing; one that finds it running there ends it.
        loads.scraped(a, Some(m(0.0)), 0, Vec::new());
        assert!(loads.is_set_aside_for(a, "sql"));
        loads.scraped(a, Some(m(1.0)), 0, vec!["sql".into()]);
        assert!(!loads.is_set_aside_for(a, "sql"));
        // It ends by itself too.
        loads.set_aside_for(a, "tone", Duration::ZERO);
        assert!(!loads.is_set_aside_for(a, "tone"));
        // Client-chosen names cannot grow the list past its bound; the oldest goes first.
        for i in 0..3 * MAX_LACKING {
            loads.set_aside_for(a, &format!("x{i}"), Duration::from_secs(10));
        }
        let kept = loads.lock().pods[a].lacking.len();
        assert_eq!(kept, MAX_LACKING);
        assert!(loads.is_set_aside_for(a, &format!("x{}", 3 * MAX_LACKING - 1)));
        assert!(!loads.is_set_aside_for(a, "x0"));
    }

    #[test]
    fn a_replica_set_aside_comes_back_when_a_scrape_reaches_it() {
        let loads = Loads::default();
        let a = "http://10.0.0.3:8000";
        assert!(!loads.is_set_aside(a));
        loads.set_aside(a, Duration::from_secs(10));
        assert!(loads.is_set_aside(a));
        loads.scraped(a, None, 0, Vec::new());
        assert!(loads.is_set_aside(a), "a failed scrape leaves it aside");
        loads.scraped(a, Some(m(0.0)), 0, Vec::new());
        assert!(!loads.is_set_aside(a));
    }

    #[test]
    fn a_scrape_that_missed_our_requests_does_not_go_negative() {
        let loads = Loads::default();
        let a = "http://10.0.0.2:8000";
        let r = loads.open(a, w(U), 0);
        // Sent, but not yet admitted when the replica answered the scrape.
        loads.scraped(a, Some(m(0.0)), 1, Vec::new());
        assert_eq!(loads.get(a), U);
        drop(r);
        assert_eq!(loads.get(a), 0.0);
    }

    #[test]
    fn open_requests_weigh_their_work_and_others_the_typical_request() {
        let loads = Loads::default();
        let (a, b) = ("http://10.0.0.1:8000", "http://10.0.0.2:8000");
        let long = loads.open(a, w(1128.0), 0);
        let short = loads.open(b, w(80.0), 0);
        assert_eq!(loads.get(a), 1128.0);
        assert_eq!(loads.get(b), 80.0);
        // The typical request moved from U toward what was sent.
        let typical = loads.lock().typical;
        assert!(typical < 1128.0 && typical != U, "{typical}");
        // One request of someone else's on b counts as a typical one.
        loads.scraped(b, Some(m(2.0)), 1, Vec::new());
        assert_eq!(loads.get(b), 80.0 + typical);
        drop(long);
        drop(short);
        assert_eq!(loads.get(a), 0.0);
        // Nonsense weighs nothing rather than poisoning the sums.
        let bad = loads.open(a, w(f64::NAN), 0);
        assert_eq!(loads.get(a), 0.0);
        drop(bad);
    }

    #[test]
    fn a_stream_gives_back_its_prompt_at_the_first_token_then_one_per_token() {
        let loads = Loads::default();
        let a = "http://10.0.0.4:8000";
        let work = Work {
            prompt: 1000.0,
            output: 3.0,
        };
        // A chat stream: the role event comes before the first token.
        let mut open = loads.open(a, work, 1);
        assert_eq!(loads.get(a), 1003.0);
        open.events(1);
        assert_eq!(loads.get(a), 1003.0, "the role event: still prefilling");
        open.events(1);
        assert_eq!(
            loads.get(a),
            2.0,
            "first token: prefill done, one token out"
        );
        open.events(5);
        assert_eq!(loads.get(a), 0.0, "never below nothing");
        drop(open);
        assert_eq!(loads.get(a), 0.0);
        // A completion stream's first event is its first token; a request that ends early
        // gives back what is left.
        let mut open = loads.open(a, work, 0);
        let other = loads.open(a, work, 0);
        open.events(2);
        assert_eq!(loads.get(a), 1.0 + 1003.0);
        drop(open);
        assert_eq!(loads.get(a), 1003.0);
        drop(other);
        assert_eq!(loads.get(a), 0.0);
    }
}

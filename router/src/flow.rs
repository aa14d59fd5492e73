//! Flow control: when every replica of a service is saturated, requests wait here instead of
//! piling onto the servers, and leave in an order that is fair to tenants.
//!
//! - **Priority bands.** A higher tenant priority always goes first.
//! - **Fair by tokens within a band** (a virtual token counter, as in Sheng et al.,
//!   "Fairness in Serving Large Language Models", OSDI '24): each flow (a tenant; one flow
//!   without tenants) has a counter of the work it was given (charged a request's estimate
//!   when it is dispatched, corrected to its reported usage when it ends); the backlogged
//!   flow with the lowest counter goes next. A flow that becomes backlogged is lifted to the lowest
//!   counter of those already waiting, so idling banks no credit.
//! - **A slot kept for the light.** Once the service's capacity is known, a flow may hold at
//!   most that capacity less one slot for each other recently active flow (at most half of
//!   it): a tenant sending one request at a time finds a free batch slot instead of a queue,
//!   however many the heavy one sends.
//! - **Bounded.** Per service and in all; when full, the newest request of the heaviest flow
//!   of the lowest band below the newcomer's priority is shed (429), else the newcomer is.
//!
//! How much a service takes now ([`Room`]) is the caller's to say, from the replicas' scraped
//! queues and KV-cache use ([`crate::load::Loads::room`]).

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::sync::{Notify, oneshot};

/// Flow control's settings, from the command line.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FlowConfig {
    /// A replica is saturated at this many requests waiting in its own queue (scraped, plus
    /// this router's sent since)...
    pub queue_depth: f64,
    /// ...or at this KV-cache usage (0..1).
    pub kv_usage: f64,
    /// Requests waiting here for one service, and in all.
    pub max_queued_per_service: usize,
    pub max_queued: usize,
    /// The longest a request waits here before a 503.
    pub max_wait: Duration,
    /// How long after its last request a flow still counts as active, and keeps its slot.
    pub active_window: Duration,
}

impl Default for FlowConfig {
    fn default() -> Self {
        FlowConfig {
            // The Gateway API inference extension's saturation thresholds.
            queue_depth: 5.0,
            kv_usage: 0.8,
            max_queued_per_service: 512,
            max_queued: 2048,
            max_wait: Duration::from_secs(60),
            active_window: Duration::from_secs(10),
        }
    }
}

/// What a service takes now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Room {
    /// More requests its replicas take before they are saturated (`usize::MAX`: no bound
    /// known).
    pub free: usize,
    /// Requests its replicas run at once, where learned from their scrapes.
    pub capacity: Option<usize>,
}

impl Room {
    pub const UNBOUNDED: Room = Room {
        free: usize::MAX,
        capacity: None,
    };
}

/// One request asking to be dispatched.
#[derive(Debug, Clone, Copy)]
pub struct Ask<'a> {
    /// `namespace/name` of the service.
    pub service: &'a str,
    /// The tenant's name; `""` without tenants.
    pub flow: &'a str,
    pub priority: i32,
    /// Tokens of work, the counter's unit.
    pub cost: f64,
}

/// Why a request did not get through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// The queue was full and this request was the one to go (429).
    Shed,
    /// It waited [`FlowConfig::max_wait`] (503).
    TimedOut,
}

/// The shared queues.
#[derive(Debug)]
pub struct Flows {
    config: FlowConfig,
    state: Mutex<State>,
    /// Woken when something may be dispatched: a request queued or ended.
    pub wake: Notify,
}

#[derive(Debug, Default)]
struct State {
    services: HashMap<String, Service>,
    queued: usize,
    next_id: u64,
}

#[derive(Debug, Default)]
struct Service {
    flows: HashMap<String, Flow>,
    queued: usize,
    /// Dispatched, but not yet counted at a replica: the room the caller measured does not
    /// include them.
    pending: usize,
    /// The counter of the last flow dispatched: where a flow that starts while nothing waits
    /// is lifted to.
    vtime: f64,
}

#[derive(Debug)]
struct Flow {
    priority: i32,
    counter: f64,
    queue: VecDeque<Entry>,
    /// Dispatched and not ended.
    open: usize,
    last_active: Instant,
}

#[derive(Debug)]
struct Entry {
    id: u64,
    cost: f64,
    tx: oneshot::Sender<Result<(), Refused>>,
}

/// How an ask went.
#[derive(Debug)]
pub enum Admit {
    /// Go now.
    Go(Dispatched),
    /// Wait for [`Waiting::until_dispatched`].
    Wait(Waiting),
    Refused(Refused),
}

/// A request on its way to or at a replica: its flow's open count (and until
/// [`Dispatched::placed`], the service's pending count) until dropped.
#[derive(Debug)]
pub struct Dispatched {
    flows: Arc<Flows>,
    service: String,
    flow: String,
    pending: bool,
    /// What its flow's counter was charged: the estimate.
    cost: f64,
    /// What it turned out to use, where known ([`Dispatched::settle`]).
    used: Option<f64>,
}

impl Dispatched {
    /// The tokens the request turned out to use (its response's `usage`): when it ends, its
    /// flow's counter is corrected from the estimate to these, so a tenant whose estimates
    /// run high (a large `max_tokens` it never uses) is not held back for work it never got.
    pub fn settle(&mut self, used: f64) {
        self.used = Some(used);
    }

    /// The request is now counted at its replica.
    pub fn placed(&mut self) {
        if std::mem::take(&mut self.pending) {
            let mut st = self.flows.lock();
            if let Some(s) = st.services.get_mut(&self.service) {
                s.pending = s.pending.saturating_sub(1);
            }
        }
    }
}

impl Drop for Dispatched {
    fn drop(&mut self) {
        {
            let mut st = self.flows.lock();
            if let Some(s) = st.services.get_mut(&self.service) {
                if self.pending {
                    s.pending = s.pending.saturating_sub(1);
                }
                if let Some(f) = s.flows.get_mut(&self.flow) {
                    f.open = f.open.saturating_sub(1);
                    f.last_active = Instant::now();
                    if let Some(used) = self.used {
                        f.counter += charged(used) - self.cost;
                    }
                }
            }
        }
        // A slot is free.
        self.flows.wake.notify_one();
    }
}

/// A request waiting in a queue; dropping it (the client left) takes it out.
#[derive(Debug)]
pub struct Waiting {
    flows: Arc<Flows>,
    service: String,
    flow: String,
    id: u64,
    cost: f64,
    /// Taken by [`Waiting::until_dispatched`].
    rx: Option<oneshot::Receiver<Result<(), Refused>>>,
}

impl Waiting {
    /// Waits until the request is dispatched, shed, or has waited too long.
    pub async fn until_dispatched(mut self) -> Result<Dispatched, Refused> {
        let max_wait = self.flows.config.max_wait;
        let Some(mut rx) = self.rx.take() else {
            return Err(Refused::Shed);
        };
        let verdict = match tokio::time::timeout(max_wait, &mut rx).await {
            Ok(Ok(v)) => v,
            // The sender went without a word: only when the queue was dropped.
            Ok(Err(_)) => Err(Refused::Shed),
            Err(_) => Err(Refused::TimedOut),
        };
        verdict.map(|()| self.flows.dispatched(&self.service, &self.flow, self.cost))
    }
}

impl Drop for Waiting {
    /// Out of the queue; or, if it was dispatched just as its client left, the dispatch
    /// undone.
    fn drop(&mut self) {
        if let Some(mut rx) = self.rx.take()
            && let Ok(Ok(())) = rx.try_recv()
        {
            self.flows.undo(&self.service, &self.flow);
            return;
        }
        let mut st = self.flows.lock();
        let Some(s) = st.services.get_mut(&self.service) else {
            return;
        };
        let Some(f) = s.flows.get_mut(&self.flow) else {
            return;
        };
        if let Some(at) = f.queue.iter().position(|e| e.id == self.id) {
            f.queue.remove(at);
            s.queued -= 1;
            st.queued -= 1;
        }
    }
}

impl Flows {
    pub fn new(config: FlowConfig) -> Arc<Flows> {
        Arc::new(Flows {
            config,
            state: Mutex::default(),
            wake: Notify::new(),
        })
    }

    pub fn config(&self) -> &FlowConfig {
        &self.config
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Dispatches `ask` at once when nothing of its service waits and the service has room
    /// for it; else queues it (shedding if full) and dispatches what the room takes, which
    /// may be this one.
    pub fn admit(self: &Arc<Self>, ask: Ask<'_>, room: Room, now: Instant) -> Admit {
        let mut shed = None;
        let admit = {
            let mut st = self.lock();
            let id = st.next_id;
            st.next_id += 1;
            let full = {
                let s = st.services.entry(ask.service.to_string()).or_default();
                s.queued >= self.config.max_queued_per_service
            } || st.queued >= self.config.max_queued;
            let window = self.config.active_window;
            let s = st.services.get_mut(ask.service).expect("inserted above");
            let f = s.flow(ask.flow, ask.priority, now);
            f.last_active = now;
            if s.queued == 0 && s.may_dispatch(ask.flow, room, now, window) {
                s.dispatch(ask.flow, ask.cost);
                Admit::Go(self.dispatched(ask.service, ask.flow, ask.cost))
            } else {
                if full {
                    // Room is made by shedding someone of lower priority, or not at all.
                    match s.shed_below(ask.priority) {
                        Some(victim) => {
                            st.queued -= 1;
                            shed = Some(victim);
                        }
                        None => return Admit::Refused(Refused::Shed),
                    }
                }
                let (tx, rx) = oneshot::channel();
                let s = st.services.get_mut(ask.service).expect("inserted above");
                s.enqueue(
                    ask.flow,
                    Entry {
                        id,
                        cost: ask.cost,
                        tx,
                    },
                );
                st.queued += 1;
                Admit::Wait(Waiting {
                    flows: self.clone(),
                    service: ask.service.to_string(),
                    flow: ask.flow.to_string(),
                    id,
                    cost: ask.cost,
                    rx: Some(rx),
                })
            }
        };
        if let Some(victim) = shed {
            let _ = victim.tx.send(Err(Refused::Shed));
        }
        if matches!(admit, Admit::Wait(_)) {
            // It may go before those waiting already (a higher priority, a lighter flow).
            self.pump(ask.service, room, now);
        }
        admit
    }

    fn dispatched(self: &Arc<Self>, service: &str, flow: &str, cost: f64) -> Dispatched {
        Dispatched {
            flows: self.clone(),
            service: service.to_string(),
            flow: flow.to_string(),
            pending: true,
            cost: charged(cost),
            used: None,
        }
    }

    /// Dispatches as many of `service`'s waiting requests as its `room` takes, in order;
    /// returns how many.
    pub fn pump(&self, service: &str, room: Room, now: Instant) -> usize {
        let window = self.config.active_window;
        let mut go = Vec::new();
        {
            let mut st = self.lock();
            let Some(s) = st.services.get_mut(service) else {
                return 0;
            };
            let mut popped = 0;
            while let Some(flow) = s.next(room, now, window) {
                let Some(e) = s.flows.get_mut(&flow).and_then(|f| f.queue.pop_front()) else {
                    break;
                };
                s.queued -= 1;
                popped += 1;
                if e.tx.is_closed() {
                    continue;
                }
                s.dispatch(&flow, e.cost);
                go.push((flow, e.tx));
            }
            st.queued -= popped.min(st.queued);
        }
        // Sent outside the lock: a receiver that went meanwhile drops nothing that locks.
        let mut sent = 0;
        for (flow, tx) in go {
            if tx.send(Ok(())).is_ok() {
                sent += 1;
            } else {
                // Its client left between the check and now.
                self.undo(service, &flow);
            }
        }
        if sent > 0 {
            // A sibling may find more room than this pass used.
            self.wake.notify_one();
        }
        sent
    }

    /// Takes back a dispatch nobody will use.
    fn undo(&self, service: &str, flow: &str) {
        let mut st = self.lock();
        if let Some(s) = st.services.get_mut(service) {
            s.pending = s.pending.saturating_sub(1);
            if let Some(f) = s.flows.get_mut(flow) {
                f.open = f.open.saturating_sub(1);
            }
        }
    }

    /// Services with requests waiting.
    pub fn waiting_services(&self) -> Vec<String> {
        let st = self.lock();
        st.services
            .iter()
            .filter(|(_, s)| s.queued > 0)
            .map(|(k, _)| k.clone())
            .collect()
    }

    /// Requests waiting for each service that has had any.
    pub fn queued(&self) -> Vec<(String, usize)> {
        let st = self.lock();
        st.services
            .iter()
            .map(|(k, s)| (k.clone(), s.queued))
            .collect()
    }

    /// Forgets flows idle past the window and services with nothing left: they are bounded
    /// by the tenants and services that exist, but those that went should not stay.
    pub fn forget_idle(&self, now: Instant) {
        let window = self.config.active_window;
        let mut st = self.lock();
        st.services.retain(|_, s| {
            s.flows
                .retain(|_, f| f.busy() || !f.idle_since(now, window));
            s.pending > 0 || !s.flows.is_empty()
        });
    }
}

/// What a request's tokens count on its flow's counter: at least one, so that requests of
/// no measured work still take turns.
fn charged(tokens: f64) -> f64 {
    tokens.max(1.0)
}

impl Flow {
    fn busy(&self) -> bool {
        self.open > 0 || !self.queue.is_empty()
    }

    fn idle_since(&self, now: Instant, window: Duration) -> bool {
        now.saturating_duration_since(self.last_active) > window
    }

    /// Keeps a slot the others cannot take: it has requests open or waiting, or had lately.
    fn active(&self, now: Instant, window: Duration) -> bool {
        self.busy() || !self.idle_since(now, window)
    }
}

impl Service {
    fn flow(&mut self, name: &str, priority: i32, now: Instant) -> &mut Flow {
        let f = self.flows.entry(name.to_string()).or_insert_with(|| Flow {
            priority,
            counter: 0.0,
            queue: VecDeque::new(),
            open: 0,
            last_active: now,
        });
        // A tenant's priority may change while it has a flow.
        f.priority = priority;
        f
    }

    /// Whether `flow` may take a slot now: the service has room beyond what is pending, and
    /// the flow is within its share.
    fn may_dispatch(&self, flow: &str, room: Room, now: Instant, window: Duration) -> bool {
        room.free > self.pending && self.within_share(flow, room, now, window)
    }

    /// The capacity less a slot for each other active flow (at most half of it): a flow
    /// sending one request at a time finds its slot free whether or not its last request has
    /// ended.
    fn within_share(&self, flow: &str, room: Room, now: Instant, window: Duration) -> bool {
        let Some(capacity) = room.capacity else {
            return true;
        };
        let Some(f) = self.flows.get(flow) else {
            return true;
        };
        let others = self
            .flows
            .iter()
            .filter(|(name, g)| *name != flow && g.active(now, window))
            .count();
        let cap = capacity.saturating_sub(others.min(capacity / 2)).max(1);
        f.open < cap
    }

    /// The flow whose request goes next, if the room takes one: the highest priority, then
    /// the lowest counter, among backlogged flows within their share.
    fn next(&self, room: Room, now: Instant, window: Duration) -> Option<String> {
        if room.free <= self.pending {
            return None;
        }
        self.flows
            .iter()
            .filter(|(name, f)| !f.queue.is_empty() && self.within_share(name, room, now, window))
            .min_by(|(an, a), (bn, b)| {
                b.priority
                    .cmp(&a.priority)
                    .then(a.counter.total_cmp(&b.counter))
                    .then(an.cmp(bn))
            })
            .map(|(name, _)| name.clone())
    }

    fn dispatch(&mut self, flow: &str, cost: f64) {
        self.pending += 1;
        if let Some(f) = self.flows.get_mut(flow) {
            self.vtime = self.vtime.max(f.counter);
            f.counter += charged(cost);
            f.open += 1;
        }
    }

    fn enqueue(&mut self, flow: &str, entry: Entry) {
        // A flow that starts waiting is lifted to the lowest counter of those waiting in its
        // band (or to where dispatch has got to): idling banks no credit.
        let Some(priority) = self.flows.get(flow).map(|f| f.priority) else {
            return;
        };
        let floor = self
            .flows
            .iter()
            .filter(|(n, g)| *n != flow && g.priority == priority && !g.queue.is_empty())
            .map(|(_, g)| g.counter)
            .min_by(f64::total_cmp)
            .unwrap_or(self.vtime);
        if let Some(f) = self.flows.get_mut(flow) {
            if f.queue.is_empty() {
                f.counter = f.counter.max(floor);
            }
            f.queue.push_back(entry);
        }
        self.queued += 1;
    }

    /// Takes out the newest request of the heaviest flow of the lowest band below
    /// `priority`, if there is one.
    fn shed_below(&mut self, priority: i32) -> Option<Entry> {
        let victim = self
            .flows
            .iter()
            .filter(|(_, f)| !f.queue.is_empty() && f.priority < priority)
            .min_by(|(_, a), (_, b)| {
                a.priority
                    .cmp(&b.priority)
                    .then(b.counter.total_cmp(&a.counter))
            })
            .map(|(name, _)| name.clone())?;
        let e = self.flows.get_mut(&victim)?.queue.pop_back()?;
        self.queued -= 1;
        Some(e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flows(max_per_service: usize) -> Arc<Flows> {
        Flows::new(FlowConfig {
            max_queued_per_service: max_per_service,
            max_queued: 100,
            ..FlowConfig::default()
        })
    }

    fn ask<'a>(flow: &'a str, priority: i32, cost: f64) -> Ask<'a> {
        Ask {
            service: "ns/chat",
            flow,
            priority,
            cost,
        }
    }

    const FULL: Room = Room {
        free: 0,
        capacity: None,
    };

    fn room(free: usize) -> Room {
        Room {
            free,
            capacity: None,
        }
    }

    fn waiting(a: Admit) -> Waiting {
        match a {
            Admit::Wait(w) => w,
            Admit::Go(_) => panic!("dispatched at once"),
            Admit::Refused(r) => panic!("refused: {r:?}"),
        }
    }

    fn go(a: Admit) -> Dispatched {
        match a {
            Admit::Go(d) => d,
            Admit::Wait(_) => panic!("queued"),
            Admit::Refused(r) => panic!("refused: {r:?}"),
        }
    }

    /// Pumps one at a time and says which of `waits` (by flow name) went, in order.
    fn order(f: &Arc<Flows>, waits: Vec<(&'static str, Waiting)>) -> Vec<&'static str> {
        let mut waits: Vec<_> = waits.into_iter().map(|(n, w)| (n, Some(w))).collect();
        let mut out = Vec::new();
        let mut held = Vec::new();
        let now = Instant::now();
        while f.pump("ns/chat", room(1), now) == 1 {
            for (name, w) in waits.iter_mut() {
                if let Some(mut wt) = w.take() {
                    let rx = wt.rx.as_mut().expect("not taken");
                    match rx.try_recv() {
                        Ok(Ok(())) => {
                            out.push(*name);
                            // As `until_dispatched` would: the verdict is taken.
                            wt.rx = None;
                            let mut d = f.dispatched("ns/chat", name, 0.0);
                            d.placed();
                            held.push(d);
                        }
                        _ => *w = Some(wt),
                    }
                }
            }
        }
        drop(held);
        out
    }

    #[test]
    fn with_room_and_nothing_waiting_a_request_goes_at_once() {
        let f = flows(10);
        let now = Instant::now();
        let mut d = go(f.admit(ask("a", 0, 10.0), room(1), now));
        // Pending until placed: a second one sees no room left.
        let w = waiting(f.admit(ask("a", 0, 10.0), room(1), now));
        d.placed();
        assert_eq!(f.pump("ns/chat", room(1), now), 1);
        drop(w);
        drop(d);
        assert_eq!(f.queued(), vec![("ns/chat".to_string(), 0)]);
    }

    #[test]
    fn a_saturated_service_queues_and_higher_priority_goes_first() {
        let f = flows(10);
        let now = Instant::now();
        let low = waiting(f.admit(ask("batch", 0, 10.0), FULL, now));
        let high = waiting(f.admit(ask("prod", 5, 10.0), FULL, now));
        assert_eq!(f.pump("ns/chat", FULL, now), 0, "no room, nothing goes");
        assert_eq!(
            order(&f, vec![("batch", low), ("prod", high)]),
            ["prod", "batch"]
        );
    }

    #[test]
    fn within_a_priority_flows_share_by_tokens() {
        let f = flows(100);
        let now = Instant::now();
        let mut waits = Vec::new();
        // The heavy flow queues 10 requests of 1,000 tokens first; the light one 10 of 100.
        for _ in 0..10 {
            waits.push((
                "heavy",
                waiting(f.admit(ask("heavy", 0, 1000.0), FULL, now)),
            ));
        }
        for _ in 0..10 {
            waits.push(("light", waiting(f.admit(ask("light", 0, 100.0), FULL, now))));
        }
        let got = order(&f, waits);
        // Equal tokens: after each heavy request, ten light ones may go.
        assert_eq!(&got[..3], ["heavy", "light", "light"], "{got:?}");
        let light_done = got.iter().rposition(|n| *n == "light").expect("light went");
        let heavy_before = got[..light_done].iter().filter(|n| **n == "heavy").count();
        assert!(heavy_before <= 2, "{got:?}");
    }

    #[test]
    fn a_flow_is_charged_what_its_requests_used_not_their_estimates() {
        let f = flows(100);
        let now = Instant::now();
        // "over" asks for 1,000 tokens and uses 10; "exact" asks for and uses 100.
        let mut d = go(f.admit(ask("over", 0, 1000.0), room(usize::MAX), now));
        d.settle(10.0);
        drop(d);
        let mut d = go(f.admit(ask("exact", 0, 100.0), room(usize::MAX), now));
        d.settle(100.0);
        drop(d);
        let w_over = waiting(f.admit(ask("over", 0, 1000.0), FULL, now));
        let w_exact = waiting(f.admit(ask("exact", 0, 100.0), FULL, now));
        // On estimates "over" would have had 1,000 against 100 and gone second.
        assert_eq!(
            order(&f, vec![("exact", w_exact), ("over", w_over)]),
            ["over", "exact"]
        );
    }

    #[test]
    fn a_flow_that_starts_waiting_banks_no_credit() {
        let f = flows(100);
        let now = Instant::now();
        // "old" used 10,000 tokens long ago; "new" never ran. Both now wait behind "busy".
        for _ in 0..10 {
            drop(go(f.admit(ask("old", 0, 1000.0), room(usize::MAX), now)));
        }
        let mut waits = Vec::new();
        for _ in 0..4 {
            waits.push(("busy", waiting(f.admit(ask("busy", 0, 100.0), FULL, now))));
        }
        let w_new = waiting(f.admit(ask("new", 0, 100.0), FULL, now));
        let w_new2 = waiting(f.admit(ask("new", 0, 100.0), FULL, now));
        waits.push(("new", w_new));
        waits.push(("new", w_new2));
        // "new" is lifted to "busy"'s counter, not left at 0: it does not take every slot
        // until it has caught up with the others.
        let got = order(&f, waits);
        assert_eq!(got.len(), 6);
        assert_ne!(&got[..2], ["new", "new"], "{got:?}");
    }

    #[test]
    fn the_light_flow_keeps_a_slot_the_heavy_one_cannot_take() {
        let f = flows(100);
        let now = Instant::now();
        let cap = |free| Room {
            free,
            capacity: Some(4),
        };
        // The light tenant was here a moment ago.
        drop(go(f.admit(ask("light", 0, 10.0), cap(4), now)));
        // The heavy one gets three of the four slots; the fourth waits for the light.
        let mut heavy: Vec<Dispatched> = Vec::new();
        for _ in 0..3 {
            let mut d = go(f.admit(ask("heavy", 0, 100.0), cap(4), now));
            d.placed();
            heavy.push(d);
        }
        let w = waiting(f.admit(ask("heavy", 0, 100.0), cap(1), now));
        assert_eq!(f.pump("ns/chat", cap(1), now), 0, "the last slot is kept");
        // The light one's next request goes straight to it, past the heavy one waiting.
        let mut light = waiting(f.admit(ask("light", 0, 10.0), cap(1), now));
        let rx = light.rx.as_mut().expect("waiting");
        assert_eq!(rx.try_recv().ok(), Some(Ok(())), "dispatched on arrival");
        light.rx = None;
        drop(f.dispatched("ns/chat", "light", 10.0));
        // After the window the light tenant no longer holds a slot.
        let later = now + FlowConfig::default().active_window + Duration::from_secs(1);
        assert_eq!(f.pump("ns/chat", cap(1), later), 1);
        drop(w);
    }

    #[test]
    fn a_full_queue_sheds_the_lowest_priority_then_the_newcomer() {
        let f = flows(2);
        let now = Instant::now();
        let mut a = waiting(f.admit(ask("batch", 0, 10.0), FULL, now));
        let _b = waiting(f.admit(ask("batch", 0, 10.0), FULL, now));
        // Full: a higher priority pushes the newest low one out.
        let _c = waiting(f.admit(ask("prod", 1, 10.0), FULL, now));
        let shed: Vec<_> = f.queued();
        assert_eq!(shed, vec![("ns/chat".to_string(), 2)]);
        // The first low one is still there; the newest was told.
        assert!(a.rx.as_mut().expect("waiting").try_recv().is_err());
        // Same priority as the lowest waiting: the newcomer is refused.
        assert!(matches!(
            f.admit(ask("batch", 0, 10.0), FULL, now),
            Admit::Refused(Refused::Shed)
        ));
    }

    #[test]
    fn a_client_that_leaves_takes_its_place_out() {
        let f = flows(10);
        let now = Instant::now();
        let w = waiting(f.admit(ask("a", 0, 10.0), FULL, now));
        assert_eq!(f.waiting_services(), vec!["ns/chat".to_string()]);
        drop(w);
        assert!(f.waiting_services().is_empty());
        f.forget_idle(now + Duration::from_secs(3600));
        assert!(f.queued().is_empty());
    }

    #[tokio::test]
    async fn a_request_waits_at_most_max_wait() {
        let f = Flows::new(FlowConfig {
            max_wait: Duration::from_millis(20),
            ..FlowConfig::default()
        });
        let w = waiting(f.admit(ask("a", 0, 10.0), FULL, Instant::now()));
        assert_eq!(w.until_dispatched().await.err(), Some(Refused::TimedOut));
        assert!(f.waiting_services().is_empty());
    }
}

//! The engine loop: owns the model, the KV cache and the scheduler on its own thread, takes
//! requests over a channel and streams events back per request. It is the only place that sees
//! whole steps, so iteration statistics come from here and nowhere else.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use tokio::sync::mpsc;

use super::detok::IncrementalDecoder;
use super::sampler::{Rng, SamplingParams, sample};
use super::scheduler::{Scheduler, SchedulerConfig, SchedulerError, SeqId};
use super::stop::{StopChecker, StopUpdate};
use crate::kv::KvCache;
use crate::metrics::EngineMetrics;
use crate::model::{LoadedModel, SeqInput};

/// One sequence to generate.
#[derive(Debug)]
pub struct Request {
    pub prompt: Vec<u32>,
    pub sampling: SamplingParams,
    pub max_tokens: usize,
    pub stop: Vec<String>,
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    /// Dropping the receiver aborts the request within one step.
    pub events: mpsc::UnboundedSender<Event>,
    /// When the API received it: TTFT, queue time and e2e latency count from here.
    pub arrival: Instant,
    /// The API request this sequence is one choice of (`None`: a request of its own).
    pub group: Option<Arc<RequestGroup>>,
}

/// What the `n` sequences of one API request share, so that per-request metrics (`n`,
/// `max_tokens`, the longest generation) are recorded once, when the last one finishes.
#[derive(Debug)]
pub struct RequestGroup {
    pub n: usize,
    pub max_tokens: usize,
    remaining: AtomicUsize,
    max_generated: AtomicUsize,
}

impl RequestGroup {
    pub fn new(n: usize, max_tokens: usize) -> Arc<Self> {
        Arc::new(Self {
            n,
            max_tokens,
            remaining: AtomicUsize::new(n),
            max_generated: AtomicUsize::new(0),
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    Stop,
    Length,
    Abort,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// A generated token and the text it released (possibly empty while a stop string may be
    /// forming or a UTF-8 character is incomplete).
    Token {
        token: u32,
        text: String,
        logprob: f32,
        top_logprobs: Vec<(u32, f32)>,
    },
    Finished {
        reason: FinishReason,
        /// Held-back text released at the end.
        text: String,
        prompt_tokens: usize,
        completion_tokens: usize,
    },
    /// The engine could not run this request (the text says why).
    Failed(String),
}

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("the engine has stopped")]
    Stopped,
}

enum Command {
    Add(Box<Request>),
    Shutdown,
}

/// Engine state published after every step; reading it never waits for a step.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct EngineStats {
    pub num_running: usize,
    pub num_waiting: usize,
    pub num_swapped: usize,
    pub num_preemptions: u64,
    pub blocks_used: usize,
    pub blocks_total: usize,
    pub host_blocks_used: usize,
    pub steps: u64,
}

/// The HTTP side's handle: cheap to clone, sends requests to the engine thread.
#[derive(Debug, Clone)]
pub struct EngineHandle {
    tx: std_mpsc::Sender<Command>,
    stats: Arc<Mutex<EngineStats>>,
    /// Requests sent but not yet taken in by the engine: with the published waiting count this
    /// gives a queue depth that is right between steps too.
    pending: Arc<AtomicUsize>,
}

impl std::fmt::Debug for Command {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Command::Add(_) => f.write_str("Add"),
            Command::Shutdown => f.write_str("Shutdown"),
        }
    }
}

impl EngineHandle {
    pub fn submit(&self, req: Request) -> Result<(), EngineError> {
        self.pending.fetch_add(1, Ordering::SeqCst);
        self.tx.send(Command::Add(Box::new(req))).map_err(|_| {
            self.pending.fetch_sub(1, Ordering::SeqCst);
            EngineError::Stopped
        })
    }

    /// Requests waiting to be scheduled, including those still in the channel.
    pub fn queue_depth(&self) -> usize {
        self.pending.load(Ordering::SeqCst) + self.stats().num_waiting
    }

    pub fn stats(&self) -> EngineStats {
        self.stats.lock().map(|s| *s).unwrap_or_default()
    }

    /// Asks the engine to finish what it has and stop.
    pub fn shutdown(&self) {
        let _ = self.tx.send(Command::Shutdown);
    }
}

struct SeqData {
    tokens: Vec<u32>,
    prompt_len: usize,
    req: Request,
    rng: Rng,
    stop: StopChecker,
    decoder: IncrementalDecoder,
    /// Output text decoded so far (what the stop checker scans).
    text: String,
    /// Whether the prompt's tokens were added to the prompt-token counter (once per request,
    /// however often it is recomputed).
    prompt_counted: bool,
    first_scheduled: Option<Instant>,
    first_token: Option<Instant>,
    last_token: Option<Instant>,
}

/// Starts the engine thread.
pub fn spawn(
    model: LoadedModel,
    cache: KvCache,
    cfg: SchedulerConfig,
    metrics: EngineMetrics,
) -> Result<(EngineHandle, JoinHandle<()>), SchedulerError> {
    let scheduler = Scheduler::new(cfg, cache.allocator().num_blocks())?;
    let (tx, rx) = std_mpsc::channel();
    let stats = Arc::new(Mutex::new(EngineStats::default()));
    let pending = Arc::new(AtomicUsize::new(0));
    let engine = Engine {
        metrics,
        pending: pending.clone(),
        stats: stats.clone(),
        steps: 0,
        model,
        cache,
        scheduler,
        seqs: HashMap::new(),
        next_id: 0,
        rx,
        accepting: true,
    };
    let join = std::thread::Builder::new()
        .name("ferrite-engine".into())
        .spawn(move || engine.run())
        .map_err(|_| SchedulerError::Invalid("cannot start the engine thread"))?;
    Ok((EngineHandle { tx, stats, pending }, join))
}

struct Engine {
    model: LoadedModel,
    cache: KvCache,
    scheduler: Scheduler,
    seqs: HashMap<SeqId, SeqData>,
    next_id: SeqId,
    rx: std_mpsc::Receiver<Command>,
    accepting: bool,
    stats: Arc<Mutex<EngineStats>>,
    pending: Arc<AtomicUsize>,
    steps: u64,
    metrics: EngineMetrics,
}

impl Engine {
    fn publish(&self) {
        let s = EngineStats {
            num_running: self.scheduler.num_running(),
            num_waiting: self.scheduler.num_waiting(),
            num_swapped: self.scheduler.num_swapped(),
            num_preemptions: self.scheduler.num_preemptions(),
            blocks_used: self.cache.allocator().num_used(),
            blocks_total: self.cache.allocator().num_blocks(),
            host_blocks_used: self.cache.host_allocator().num_used(),
            steps: self.steps,
        };
        let m = &self.metrics;
        m.num_requests_running.set(s.num_running as i64);
        m.num_requests_waiting.set(s.num_waiting as i64);
        m.num_requests_swapped.set(s.num_swapped as i64);
        let usage = self.cache.allocator().usage();
        m.kv_cache_usage_perc.set(usage);
        m.gpu_cache_usage_perc.set(usage);
        m.cpu_cache_usage_perc
            .set(self.cache.host_allocator().usage());
        if let Ok(mut g) = self.stats.lock() {
            *g = s;
        }
    }

    fn run(mut self) {
        crate::priority::lower_current_thread();
        loop {
            if self.scheduler.is_idle() {
                if !self.accepting {
                    break;
                }
                match self.rx.recv() {
                    Ok(cmd) => self.handle(cmd),
                    Err(_) => break,
                }
            }
            while let Ok(cmd) = self.rx.try_recv() {
                self.handle(cmd);
            }
            self.reap_aborted();
            if !self.scheduler.is_idle()
                && let Err(e) = self.step()
            {
                tracing::error!(error = %e, "engine step failed; failing its requests");
                self.fail_all(&e.to_string());
            }
            self.publish();
        }
        tracing::info!("engine stopped");
    }

    fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::Shutdown => self.accepting = false,
            Command::Add(req) => {
                self.pending.fetch_sub(1, Ordering::SeqCst);
                if !self.accepting {
                    let _ = req
                        .events
                        .send(Event::Failed("the server is shutting down".into()));
                    return;
                }
                let id = self.next_id;
                self.next_id += 1;
                let rng = req
                    .sampling
                    .seed
                    .map(Rng::new)
                    .unwrap_or_else(Rng::from_entropy);
                self.scheduler.add(id, req.prompt.len());
                let stop = StopChecker::new(req.stop.clone());
                let data = SeqData {
                    tokens: req.prompt.clone(),
                    prompt_len: req.prompt.len(),
                    req: *req,
                    rng,
                    stop,
                    decoder: IncrementalDecoder::default(),
                    text: String::new(),
                    prompt_counted: false,
                    first_scheduled: None,
                    first_token: None,
                    last_token: None,
                };
                self.seqs.insert(id, data);
            }
        }
    }

    /// Requests whose receiver is gone (client disconnected) give their blocks back now.
    fn reap_aborted(&mut self) {
        let gone: Vec<SeqId> = self
            .seqs
            .iter()
            .filter(|(_, d)| d.req.events.is_closed())
            .map(|(&id, _)| id)
            .collect();
        for id in gone {
            self.finish(id, FinishReason::Abort, String::new());
        }
    }

    fn finish(&mut self, id: SeqId, reason: FinishReason, text: String) {
        if let Err(e) = self.scheduler.finish(id, &mut self.cache) {
            tracing::error!(seq = id, error = %e, "freeing a finished sequence failed");
        }
        self.metrics.request_finished(reason);
        if let Some(d) = self.seqs.remove(&id) {
            if !d.prompt_counted {
                self.metrics.prompt_tokens.inc_by(d.prompt_len as u64);
            }
            let generated = d.tokens.len() - d.prompt_len;
            self.observe_finished(&d, generated);
            let _ = d.req.events.send(Event::Finished {
                reason,
                text,
                prompt_tokens: d.prompt_len,
                completion_tokens: generated,
            });
        }
    }

    /// Per-request histograms, from the request's own timestamps.
    fn observe_finished(&self, d: &SeqData, generated: usize) {
        let m = &self.metrics;
        let now = Instant::now();
        let secs = |a: Instant, b: Instant| b.saturating_duration_since(a).as_secs_f64();
        m.e2e_request_latency.observe(secs(d.req.arrival, now));
        if let Some(sched) = d.first_scheduled {
            m.request_inference_time.observe(secs(sched, now));
            if let Some(first) = d.first_token {
                m.request_prefill_time.observe(secs(sched, first));
            }
        }
        if let (Some(first), Some(last)) = (d.first_token, d.last_token) {
            m.request_decode_time.observe(secs(first, last));
            if generated > 1 {
                m.request_time_per_output_token
                    .observe(secs(first, last) / (generated - 1) as f64);
            }
        }
        m.request_prompt_tokens.observe(d.prompt_len as f64);
        m.request_generation_tokens.observe(generated as f64);
        let (n, max_tokens, longest) = match &d.req.group {
            None => (1, d.req.max_tokens, generated),
            Some(g) => {
                g.max_generated.fetch_max(generated, Ordering::SeqCst);
                if g.remaining.fetch_sub(1, Ordering::SeqCst) != 1 {
                    return;
                }
                (g.n, g.max_tokens, g.max_generated.load(Ordering::SeqCst))
            }
        };
        m.request_max_num_generation_tokens.observe(longest as f64);
        m.request_params_n.observe(n as f64);
        m.request_params_best_of.observe(n as f64);
        m.request_params_max_tokens.observe(max_tokens as f64);
    }

    fn fail_all(&mut self, msg: &str) {
        let ids: Vec<SeqId> = self.seqs.keys().copied().collect();
        for id in ids {
            let _ = self.scheduler.finish(id, &mut self.cache);
            if let Some(d) = self.seqs.remove(&id) {
                let _ = d.req.events.send(Event::Failed(msg.to_string()));
            }
        }
    }

    fn step(&mut self) -> Result<(), Box<dyn std::error::Error>> {
        let started = Instant::now();
        let plan = self.scheduler.schedule(&mut self.cache)?;
        self.metrics
            .num_preemptions
            .inc_by(plan.preempted.len() as u64);
        if plan.scheduled.is_empty() {
            // Nothing fits right now (should not persist); wait for a command briefly.
            if let Ok(cmd) = self.rx.recv_timeout(std::time::Duration::from_millis(5)) {
                self.handle(cmd);
            }
            return Ok(());
        }
        let tables: Vec<Vec<u32>> = plan
            .scheduled
            .iter()
            .map(|s| {
                self.scheduler
                    .get(s.id)
                    .map(|q| q.blocks.clone())
                    .unwrap_or_default()
            })
            .collect();
        let inputs: Vec<SeqInput> = plan
            .scheduled
            .iter()
            .zip(&tables)
            .map(|(s, t)| SeqInput {
                tokens: &self.seqs[&s.id].tokens[s.start..s.start + s.len],
                start_pos: s.start,
                block_table: t,
            })
            .collect();
        let logits = self.model.model.forward(&inputs, &self.cache)?;
        let scheduled_at = started;
        for sch in &plan.scheduled {
            if let Some(d) = self.seqs.get_mut(&sch.id)
                && d.first_scheduled.is_none()
            {
                d.first_scheduled = Some(scheduled_at);
                self.metrics.request_queue_time.observe(
                    scheduled_at
                        .saturating_duration_since(d.req.arrival)
                        .as_secs_f64(),
                );
            }
        }
        self.metrics
            .iteration_tokens
            .observe(plan.num_tokens() as f64);
        self.steps += 1;
        self.scheduler.commit(&plan);
        let rows = logits.to_vec2::<f32>()?;
        let eos = self.model.eos_token_ids.clone();
        let max_len = self.model.model.max_len();
        for (row, s) in rows.iter().zip(&plan.scheduled) {
            if !s.samples {
                continue;
            }
            let Some(d) = self.seqs.get_mut(&s.id) else {
                continue;
            };
            let (prompt, output) = d.tokens.split_at(d.prompt_len);
            let sampled = sample(row, &d.req.sampling, prompt, output, &mut d.rng);
            d.tokens.push(sampled.token);
            self.metrics.generation_tokens.inc();
            let now = Instant::now();
            match d.last_token {
                None => {
                    d.first_token = Some(now);
                    self.metrics
                        .time_to_first_token
                        .observe(now.saturating_duration_since(d.req.arrival).as_secs_f64());
                }
                Some(prev) => {
                    let gap = now.saturating_duration_since(prev).as_secs_f64();
                    self.metrics.inter_token_latency.observe(gap);
                    self.metrics.time_per_output_token.observe(gap);
                }
            }
            d.last_token = Some(now);
            if !d.prompt_counted {
                d.prompt_counted = true;
                self.metrics.prompt_tokens.inc_by(d.prompt_len as u64);
            }
            let n_out = d.tokens.len() - d.prompt_len;
            let is_eos = !d.req.ignore_eos && eos.contains(&sampled.token);
            let is_stop_id = d.req.stop_token_ids.contains(&sampled.token);
            let mut finish = None;
            let mut text = String::new();
            if is_eos || is_stop_id {
                finish = Some(FinishReason::Stop);
            } else {
                let delta = d
                    .decoder
                    .next(&self.model.tokenizer, &d.tokens[d.prompt_len..])?;
                d.text.push_str(&delta);
                match d.stop.update(&d.text) {
                    StopUpdate::Delta(t) => text = t,
                    StopUpdate::Stopped(t) => {
                        text = t;
                        finish = Some(FinishReason::Stop);
                    }
                }
            }
            if finish.is_none() && (n_out >= d.req.max_tokens || d.tokens.len() >= max_len) {
                finish = Some(FinishReason::Length);
            }
            let _ = d.req.events.send(Event::Token {
                token: sampled.token,
                text,
                logprob: sampled.logprob,
                top_logprobs: sampled.top,
            });
            match finish {
                Some(reason) => {
                    // Text held back for a stop string that never completed belongs to the
                    // output, unless a stop string did match.
                    let stopped_by_string = reason == FinishReason::Stop && !is_eos && !is_stop_id;
                    let tail = if stopped_by_string {
                        String::new()
                    } else {
                        d.stop.flush()
                    };
                    self.finish(s.id, reason, tail);
                }
                None => self.scheduler.append_token(s.id)?,
            }
        }
        tracing::trace!(
            tokens = plan.num_tokens(),
            secs = started.elapsed().as_secs_f64(),
            "step"
        );
        Ok(())
    }
}

//! The engine loop: owns the model, the KV cache and the scheduler on its own thread, takes
//! requests over a channel and streams events back per request. Each step is schedule (the
//! scheduler's plan) → execute (one forward) → process outputs (sample, then the output
//! processor). It is the only place that sees whole steps, so it alone fills the statistics
//! records, which a [`StatsSink`] consumes.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use candle_core::Tensor;

use super::output::{OutputProcessor, RequestOutput};
use super::pooler::Pool;
use super::request::{Event, EventSender, FinishReason, PoolingKind, Request, SLOW_READER};
use super::sampler::{Rng, sample};
use super::scheduler::{Scheduler, SchedulerConfig, SchedulerError, SeqId, SeqOutput, StepPlan};
use super::stats::{IterationStats, LoraStats, SchedulerStats, StatsSink};
use super::structured::{Guide, StructuredError, TokenMask};
use crate::kv::KvCache;
use crate::model::lora::LoraAdapter;
use crate::model::{HiddenRows, LlamaModel, SeqInput};

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("the engine has stopped")]
    Stopped,
}

enum Command {
    Add(Box<Request>),
    Shutdown,
}

/// The HTTP side's handle: cheap to clone, sends requests to the engine thread.
#[derive(Debug, Clone)]
pub struct EngineHandle {
    tx: std_mpsc::Sender<Command>,
    /// Published after every step; reading it never waits for a step.
    stats: Arc<Mutex<SchedulerStats>>,
    /// Requests sent but not yet taken in by the engine: with the published waiting count this
    /// gives a queue depth that is right between steps too.
    pending: Arc<AtomicUsize>,
    /// False once the engine thread has ended, however it ended (a panic included).
    alive: Arc<AtomicBool>,
}

/// Clears the engine's `alive` flag when the thread ends, by return or by unwinding.
struct AliveGuard(Arc<AtomicBool>);

impl Drop for AliveGuard {
    fn drop(&mut self) {
        self.0.store(false, Ordering::SeqCst);
    }
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

    /// Whether the engine thread is still running: `/health` reports it, and the server exits
    /// when it is not (a process that cannot generate must not look ready).
    pub fn is_alive(&self) -> bool {
        self.alive.load(Ordering::SeqCst)
    }

    /// Requests waiting to be scheduled, including those still in the channel.
    pub fn queue_depth(&self) -> usize {
        self.pending.load(Ordering::SeqCst) + self.stats().num_waiting
    }

    pub fn stats(&self) -> SchedulerStats {
        self.stats.lock().map(|s| *s).unwrap_or_default()
    }

    /// Asks the engine to finish what it has and stop.
    pub fn shutdown(&self) {
        let _ = self.tx.send(Command::Shutdown);
    }
}

/// One sequence the engine holds.
struct SeqData {
    /// Prompt and output tokens.
    tokens: Vec<u32>,
    prompt_len: usize,
    req: Request,
    rng: Rng,
    output: RequestOutput,
    /// The grammar its output follows; out of here while a step computes its mask.
    guide: Option<Guide>,
    /// An embedding request's pool of its prompt's hidden states.
    pool: Option<Pool>,
}

/// A forward's results: a logit row per scheduled sequence, and the hidden states of the
/// embedding requests' tokens (`None` for the others).
struct Forward {
    logits: Tensor,
    hidden: Vec<Option<Tensor>>,
}

/// A guide taken out for a step, with the mask of tokens it allows next (or why there is
/// none: the guide is then gone, and its sequence ends).
type Masked = (SeqId, Result<(Guide, TokenMask), StructuredError>);

/// Starts the engine thread. `sink` receives the statistics records.
pub fn spawn(
    model: crate::model::LoadedModel,
    cache: KvCache,
    cfg: SchedulerConfig,
    sink: Box<dyn StatsSink>,
) -> Result<(EngineHandle, JoinHandle<()>), SchedulerError> {
    let scheduler = Scheduler::new(cfg, cache.allocator().num_blocks())?;
    let (tx, rx) = std_mpsc::channel();
    let stats = Arc::new(Mutex::new(SchedulerStats::default()));
    let pending = Arc::new(AtomicUsize::new(0));
    let output = OutputProcessor::new(model.tokenizer, model.eos_token_ids, model.model.max_len());
    let engine = Engine {
        sink,
        iteration: IterationStats::default(),
        outbox: Vec::new(),
        pending: pending.clone(),
        stats: stats.clone(),
        steps: 0,
        model: model.model,
        output,
        cache,
        scheduler,
        seqs: HashMap::new(),
        next_id: 0,
        rx,
        accepting: true,
    };
    let alive = Arc::new(AtomicBool::new(true));
    let guard = AliveGuard(alive.clone());
    let join = std::thread::Builder::new()
        .name("ferrite-engine".into())
        .spawn(move || {
            let _guard = guard;
            engine.run()
        })
        .map_err(|_| SchedulerError::Invalid("cannot start the engine thread"))?;
    let handle = EngineHandle {
        tx,
        stats,
        pending,
        alive,
    };
    Ok((handle, join))
}

struct Engine {
    model: LlamaModel,
    output: OutputProcessor,
    cache: KvCache,
    scheduler: Scheduler,
    seqs: HashMap<SeqId, SeqData>,
    next_id: SeqId,
    rx: std_mpsc::Receiver<Command>,
    accepting: bool,
    stats: Arc<Mutex<SchedulerStats>>,
    pending: Arc<AtomicUsize>,
    steps: u64,
    sink: Box<dyn StatsSink>,
    /// This pass's records, handed to the sink at its end.
    iteration: IterationStats,
    /// This pass's events, sent after the sink has recorded them.
    /// The sequence is `None` for a request refused before it became one.
    outbox: Vec<(Option<SeqId>, EventSender, Event)>,
}

impl Engine {
    fn scheduler_stats(&self) -> SchedulerStats {
        SchedulerStats {
            num_running: self.scheduler.num_running(),
            num_waiting: self.scheduler.num_waiting(),
            num_swapped: self.scheduler.num_swapped(),
            num_preemptions: self.scheduler.num_preemptions(),
            blocks_used: self.cache.allocator().num_used(),
            blocks_total: self.cache.allocator().num_blocks(),
            host_blocks_used: self.cache.host_allocator().num_used(),
            kv_cache_usage: self.cache.allocator().usage(),
            cpu_cache_usage: self.cache.host_allocator().usage(),
            steps: self.steps,
        }
    }

    /// The names of the adapters the scheduler's running and queued sequences use.
    fn lora_stats(&self) -> LoraStats {
        let adapters: Vec<&LoraAdapter> = self
            .seqs
            .values()
            .filter_map(|d| d.req.adapter.as_deref())
            .collect();
        if adapters.is_empty() {
            return LoraStats::default();
        }
        let names = |ids: Vec<u64>| {
            let mut v: Vec<String> = ids
                .into_iter()
                .filter_map(|id| adapters.iter().find(|a| a.id() == id))
                .map(|a| a.name().to_string())
                .collect();
            v.sort();
            v.dedup();
            v
        };
        let (running, waiting) = self.scheduler.loras();
        LoraStats {
            running: names(running),
            waiting: names(waiting),
        }
    }

    /// Ends a pass of the loop: publishes the state, hands the records to the sink, then
    /// sends the pass's events.
    fn publish(&mut self) {
        let s = self.scheduler_stats();
        if let Ok(mut g) = self.stats.lock() {
            *g = s;
        }
        self.iteration.lora = self.lora_stats();
        self.sink.record(&s, &self.iteration);
        self.iteration = IterationStats::default();
        let mut lagging = Vec::new();
        for (id, to, event) in std::mem::take(&mut self.outbox) {
            let last = matches!(
                event,
                Event::Finished { .. } | Event::Failed(_) | Event::Refused(_)
            );
            // The last slot is kept for the event that ends the sequence.
            if !last && to.capacity() <= 1 {
                lagging.extend(id);
                continue;
            }
            let _ = to.try_send(event);
        }
        if !lagging.is_empty() {
            for id in lagging {
                self.fail_one(id, SLOW_READER);
            }
            // Their failures go out now, not after the next step.
            for (_, to, event) in std::mem::take(&mut self.outbox) {
                let _ = to.try_send(event);
            }
        }
    }

    fn send(&mut self, id: Option<SeqId>, to: &EventSender, event: Event) {
        self.outbox.push((id, to.clone(), event));
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
                // Blocks registered for this step may never have been written.
                self.cache.allocator_mut().reset_prefix_cache();
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
                    let failed = Event::Failed("the server is shutting down".into());
                    self.send(None, &req.events, failed);
                    return;
                }
                let vocab = self.model.config().vocab_size;
                if let Some(&bad) = req.prompt.iter().find(|&&t| t as usize >= vocab) {
                    // Refused alone: in a batch it would fail every sequence's forward.
                    let msg =
                        format!("token id {bad} is not below the model's vocabulary size {vocab}");
                    self.send(None, &req.events, Event::Failed(msg));
                    return;
                }
                if req.prompt.is_empty() {
                    self.send(
                        None,
                        &req.events,
                        Event::Failed("the prompt is empty".into()),
                    );
                    return;
                }
                if let Some(a) = req
                    .adapter
                    .as_ref()
                    .filter(|a| !a.fits(self.model.config()))
                {
                    let msg = format!("adapter {} was loaded for another base model", a.name());
                    self.send(None, &req.events, Event::Failed(msg));
                    return;
                }
                let id = self.next_id;
                self.next_id += 1;
                let rng = req
                    .sampling
                    .seed
                    .map(Rng::new)
                    .unwrap_or_else(Rng::from_entropy);
                let lora = req.adapter.as_ref().map(|a| a.id());
                // A mean needs every token's state, which cached blocks do not keep.
                let reads_cache = req.pooling.is_none_or(|p| p.kind != PoolingKind::Mean);
                self.scheduler.add_seq(id, &req.prompt, lora, reads_cache);
                let mut req = req;
                let guide = req.guide.take();
                let data = SeqData {
                    guide,
                    pool: req.pooling.map(Pool::new),
                    tokens: req.prompt.clone(),
                    prompt_len: req.prompt.len(),
                    output: RequestOutput::new(&req),
                    req: *req,
                    rng,
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
            if let Err(e) = self.scheduler.finish(id, self.cache.pools_mut()) {
                tracing::error!(seq = id, error = %e, "freeing an aborted sequence failed");
            }
            self.finished(id, FinishReason::Abort, String::new());
        }
    }

    /// Sends the event that ends sequence `id`, whose blocks the scheduler has freed.
    fn finished(&mut self, id: SeqId, reason: FinishReason, text: String) {
        if let Some(d) = self.seqs.remove(&id) {
            let generated = d.tokens.len() - d.prompt_len;
            let event = d.output.finished(
                &d.req,
                d.prompt_len,
                generated,
                reason,
                text,
                &mut self.iteration,
            );
            self.send(Some(id), &d.req.events, event);
        }
    }

    fn fail_all(&mut self, msg: &str) {
        let ids: Vec<SeqId> = self.seqs.keys().copied().collect();
        for id in ids {
            self.fail_one(id, msg);
        }
    }

    fn fail_one(&mut self, id: SeqId, msg: &str) {
        self.end_one(id, Event::Failed(msg.to_string()));
    }

    /// Ends sequence `id` with `event` (a failure or a refusal), freeing its blocks.
    fn end_one(&mut self, id: SeqId, event: Event) {
        let _ = self.scheduler.finish(id, self.cache.pools_mut());
        if let Some(d) = self.seqs.remove(&id) {
            self.send(Some(id), &d.req.events, event);
        }
    }

    /// One step: schedule → execute → process outputs.
    fn step(&mut self) -> Result<(), Box<dyn std::error::Error>> {
        let started = Instant::now();
        let Some(plan) = self.schedule()? else {
            return Ok(());
        };
        let guides = self.take_guides(&plan);
        let (forward, masks) = self.execute_guided(&plan, guides);
        let Forward { logits, hidden } = forward?;
        self.pool_hidden(&plan, hidden)?;
        for lookup in &plan.prefix_lookups {
            self.iteration.prefix_cache_queries += lookup.queried as u64;
            self.iteration.prefix_cache_hits += lookup.hit as u64;
            if let Some(d) = self.seqs.get_mut(&lookup.id) {
                d.output.cached_tokens = lookup.hit;
            }
        }
        for sch in &plan.scheduled {
            if let Some(d) = self.seqs.get_mut(&sch.id) {
                self.output
                    .scheduled(&mut d.output, started, &mut self.iteration);
            }
        }
        self.iteration.batch_tokens = Some(plan.num_tokens());
        self.steps += 1;
        let (outputs, ends) = self.process_outputs(&plan, &logits, masks)?;
        self.scheduler
            .update_from_output(&plan, &outputs, self.cache.pools_mut())?;
        for (id, reason, tail) in ends {
            self.finished(id, reason, tail);
        }
        tracing::trace!(
            tokens = plan.num_tokens(),
            secs = started.elapsed().as_secs_f64(),
            "step"
        );
        Ok(())
    }

    /// The scheduler's plan for this step; `None` when nothing fits right now.
    fn schedule(&mut self) -> Result<Option<StepPlan>, SchedulerError> {
        let plan = self.scheduler.schedule(self.cache.pools_mut())?;
        self.iteration.num_preempted += plan.preempted.len() as u64;
        if plan.scheduled.is_empty() {
            // Nothing fits right now (should not persist); wait for a command briefly.
            if let Ok(cmd) = self.rx.recv_timeout(std::time::Duration::from_millis(5)) {
                self.handle(cmd);
            }
            return Ok(None);
        }
        Ok(Some(plan))
    }

    /// Takes out the guides of the sequences that sample this step, so that their masks can be
    /// computed while the forward runs.
    fn take_guides(&mut self, plan: &StepPlan) -> Vec<(SeqId, Guide)> {
        plan.scheduled
            .iter()
            .filter(|s| s.samples)
            .filter_map(|s| Some((s.id, self.seqs.get_mut(&s.id)?.guide.take()?)))
            .collect()
    }

    /// The forward, with the masks of `guides` computed on a thread beside it (vLLM, too,
    /// computes grammar bitmasks while the model runs), so that a constrained request costs the
    /// batch the mask work only where it is longer than the forward.
    fn execute_guided(
        &self,
        plan: &StepPlan,
        guides: Vec<(SeqId, Guide)>,
    ) -> (Result<Forward, Box<dyn std::error::Error>>, Vec<Masked>) {
        if guides.is_empty() {
            return (self.execute(plan), Vec::new());
        }
        let ids: Vec<SeqId> = guides.iter().map(|(id, _)| *id).collect();
        let compute = move || {
            guides
                .into_iter()
                .map(|(id, mut guide)| (id, guide.mask().map(|mask| (guide, mask))))
                .collect::<Vec<Masked>>()
        };
        std::thread::scope(|s| {
            let worker = std::thread::Builder::new()
                .name("ferrite-grammar".into())
                .spawn_scoped(s, compute);
            let logits = self.execute(plan);
            // No thread to be had, or it panicked: the guides went with it, so the sequences
            // end.
            let masks = worker.ok().and_then(|w| w.join().ok()).unwrap_or_else(|| {
                let lost = || Err(StructuredError::Stuck("computing the mask failed".into()));
                ids.into_iter().map(|id| (id, lost())).collect()
            });
            (logits, masks)
        })
    }

    /// The plan's swap copies, then one forward over its tokens: a logit row per scheduled
    /// sequence, and the hidden states of embedding requests' tokens.
    fn execute(&self, plan: &StepPlan) -> Result<Forward, Box<dyn std::error::Error>> {
        self.cache.copy_out(&plan.swap_out)?;
        self.cache.copy_in(&plan.swap_in)?;
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
            .map(|(s, t)| {
                let d = &self.seqs[&s.id];
                SeqInput {
                    tokens: &d.tokens[s.start..s.start + s.len],
                    start_pos: s.start,
                    block_table: t,
                    adapter: d.req.adapter.as_deref(),
                }
            })
            .collect();
        let wants: Vec<HiddenRows> = plan
            .scheduled
            .iter()
            .map(|s| {
                self.seqs[&s.id]
                    .pool
                    .as_ref()
                    .map_or(HiddenRows::None, Pool::rows)
            })
            .collect();
        let (logits, hidden) = self
            .model
            .forward_with_hidden(&inputs, &self.cache, &wants)?;
        Ok(Forward { logits, hidden })
    }

    /// Adds each embedding request's hidden states from this step to its pool.
    fn pool_hidden(
        &mut self,
        plan: &StepPlan,
        hidden: Vec<Option<Tensor>>,
    ) -> Result<(), Box<dyn std::error::Error>> {
        for (s, h) in plan.scheduled.iter().zip(hidden) {
            let (Some(h), Some(d)) = (h, self.seqs.get_mut(&s.id)) else {
                continue;
            };
            let (rows, width) = h.dims2()?;
            let values = h.flatten_all()?.to_vec1::<f32>()?;
            if let Some(pool) = d.pool.as_mut() {
                // The rows are the last of the step's tokens.
                pool.add(s.start + s.len - rows, &values, width);
            }
        }
        Ok(())
    }

    /// Ends embedding request `id`, whose prompt is all in: its vector is its one event.
    fn pooled(&mut self, id: SeqId) {
        let _ = self.scheduler.finish(id, self.cache.pools_mut());
        let Some(d) = self.seqs.remove(&id) else {
            return;
        };
        let values = d.pool.as_ref().map(Pool::finish).unwrap_or_default();
        let finished = d.output.finished(
            &d.req,
            d.prompt_len,
            0,
            FinishReason::Stop,
            String::new(),
            &mut self.iteration,
        );
        let cached_tokens = match finished {
            Event::Finished { cached_tokens, .. } => cached_tokens,
            _ => 0,
        };
        let event = Event::Embedding {
            values,
            prompt_tokens: d.prompt_len,
            cached_tokens,
        };
        self.send(Some(id), &d.req.events, event);
    }

    /// Samples a token for each sequence that finished its known tokens, and lets the output
    /// processor turn it into an event and a finish decision. Returns the scheduler's outputs
    /// and how each finished sequence ended.
    fn process_outputs(
        &mut self,
        plan: &StepPlan,
        logits: &Tensor,
        masks: Vec<Masked>,
    ) -> Result<(Vec<SeqOutput>, Vec<Ending>), Box<dyn std::error::Error>> {
        let rows = logits.to_vec2::<f32>()?;
        let mut masks: HashMap<_, _> = masks.into_iter().collect();
        let mut outputs = Vec::new();
        let mut ends = Vec::new();
        for (row, s) in rows.iter().zip(&plan.scheduled) {
            if !s.samples {
                continue;
            }
            if self.seqs.get(&s.id).is_some_and(|d| d.pool.is_some()) {
                self.pooled(s.id);
                continue;
            }
            let Some(d) = self.seqs.get_mut(&s.id) else {
                continue;
            };
            let (mut guide, mask) = match masks.remove(&s.id) {
                None => (None, None),
                Some(Ok((guide, mask))) => (Some(guide), Some(mask)),
                Some(Err(e)) => {
                    self.end_one(s.id, Event::Refused(format!("structured output: {e}")));
                    continue;
                }
            };
            let (prompt, output) = d.tokens.split_at(d.prompt_len);
            let sampled = sample(
                row,
                &d.req.sampling,
                prompt,
                output,
                mask.as_ref(),
                &mut d.rng,
            );
            let token = sampled.token;
            let grammar_done = match guide.as_mut().map(|g| g.accept(token)) {
                Some(Err(e)) => {
                    self.end_one(s.id, Event::Refused(format!("structured output: {e}")));
                    continue;
                }
                _ => guide.as_ref().is_some_and(Guide::is_finished),
            };
            d.guide = guide;
            d.tokens.push(token);
            let out = match self.output.token(
                &mut d.output,
                &d.req,
                &d.tokens,
                d.prompt_len,
                sampled,
                grammar_done,
                &mut self.iteration,
            ) {
                Ok(out) => out,
                Err(e) => {
                    // Only this sequence's text is broken; the batch goes on.
                    self.fail_one(s.id, &format!("detokenizing failed: {e}"));
                    continue;
                }
            };
            let events = d.req.events.clone();
            self.send(Some(s.id), &events, out.event);
            outputs.push(SeqOutput {
                id: s.id,
                token,
                finished: out.finish.is_some(),
            });
            ends.extend(out.finish.map(|(reason, tail)| (s.id, reason, tail)));
        }
        Ok((outputs, ends))
    }
}

/// How a sequence ended in a step: its reason and the text held back until then.
type Ending = (SeqId, FinishReason, String);

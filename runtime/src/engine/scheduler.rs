//! Continuous-batching scheduler: each step decides which sequences run and with how many
//! tokens, allocates their blocks, and preempts when blocks run out. It sees token counts and
//! block ids, and token ids only as input to the prefix cache's block hashes, never tensors, so
//! it is tested on synthetic sequences.
//!
//! With prefix caching, a sequence starting (or restarting after a recompute preemption) takes
//! the longest run of cached blocks for its leading full blocks and is scheduled from the first
//! token after them. Blocks are registered under their prefix hash when they are scheduled to be
//! filled, so a sequence admitted in the same step (the other choices of an `n > 1` request)
//! shares them: the forward writes each layer's keys and values before any attention reads them.
//!
//! The protocol is two calls a step, as vLLM's: [`Scheduler::schedule`] decides and books the
//! blocks, touching no tensor (the swap copies it implies travel in the plan), and
//! [`Scheduler::update_from_output`] applies what the step produced. Aborts use
//! [`Scheduler::finish`].

use std::collections::VecDeque;

use crate::kv::{BlockCopy, BlockHasher, BlockId, BlockPools, KvError, blocks_for_tokens};

pub type SeqId = u64;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// Most sequences in the running batch.
    pub max_num_seqs: usize,
    /// Most tokens (prefill + decode) in one forward.
    pub max_num_batched_tokens: usize,
    pub max_model_len: usize,
    pub block_size: usize,
    /// Split long prompts across steps instead of requiring the whole prompt in one step.
    pub chunked_prefill: bool,
    /// Free blocks kept back when admitting new work, so running sequences can grow a little
    /// before anything must be preempted.
    pub watermark_blocks: usize,
    /// Share full blocks between sequences with equal prefixes and keep freed ones cached.
    pub prefix_caching: bool,
    /// Most distinct LoRA adapters among the running sequences (vLLM's `--max-loras`): a
    /// queued sequence of another adapter waits, and sequences behind it may go first.
    pub max_loras: usize,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SchedulerError {
    #[error(
        "the KV cache ({num_blocks} blocks of {block_size} tokens) cannot hold one sequence of max_model_len {max_model_len}"
    )]
    CacheTooSmall {
        num_blocks: usize,
        block_size: usize,
        max_model_len: usize,
    },
    #[error(
        "max_num_batched_tokens ({0}) is smaller than max_model_len ({1}) without chunked prefill"
    )]
    BudgetTooSmall(usize, usize),
    #[error("invalid scheduler setting: {0}")]
    Invalid(&'static str),
    #[error("unknown sequence {0}")]
    UnknownSeq(SeqId),
    #[error(transparent)]
    Kv(#[from] KvError),
}

/// How a preempted sequence gives its blocks back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Preemption {
    /// Blocks copied to the host pool, copied back on resume.
    Swap,
    /// Blocks dropped; the prompt and the tokens generated so far are prefilled again.
    Recompute,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeqStatus {
    Waiting,
    Running,
    Swapped,
}

/// What the scheduler tracks of one sequence.
#[derive(Debug, Clone)]
pub struct SeqState {
    pub id: SeqId,
    /// Prompt plus generated tokens that exist so far.
    pub num_tokens: usize,
    /// Tokens whose keys and values are in the cache.
    pub num_computed: usize,
    /// Device block table.
    pub blocks: Vec<BlockId>,
    /// Host blocks while swapped out.
    pub host_blocks: Vec<BlockId>,
    pub status: SeqStatus,
    pub num_preemptions: u32,
    /// The LoRA adapter it runs with ([`crate::model::lora::LoraAdapter::id`]).
    pub lora: Option<u64>,
    /// Prefix hashes of the sequence's full blocks.
    hasher: BlockHasher,
    /// Leading entries of `blocks` registered in the prefix cache (or taken from it).
    num_registered: usize,
    /// Whether it may start from cached blocks.
    reads_cache: bool,
}

/// One sequence's work in a step: run tokens `[start, start + len)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Scheduled {
    pub id: SeqId,
    pub start: usize,
    pub len: usize,
    /// True when this finishes the sequence's known tokens, so the step yields its next token.
    pub samples: bool,
}

/// A sequence's prefix-cache lookup at its first admission (vLLM counts these in tokens).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefixLookup {
    pub id: SeqId,
    /// Tokens looked up: the whole prompt.
    pub queried: usize,
    /// Leading tokens found cached (whole blocks, never the whole prompt).
    pub hit: usize,
}

/// The decision for one step.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StepPlan {
    pub scheduled: Vec<Scheduled>,
    pub preempted: Vec<(SeqId, Preemption)>,
    pub swapped_in: Vec<SeqId>,
    /// Sequences admitted for the first time, with prefix caching on.
    pub prefix_lookups: Vec<PrefixLookup>,
    /// Device → host copies of the preempted sequences that swapped; they run before the
    /// forward, which may write the device blocks they free.
    pub swap_out: Vec<BlockCopy>,
    /// Host → device copies of the sequences swapped back in; they too run before the forward.
    pub swap_in: Vec<BlockCopy>,
}

/// What a step produced for one sequence it sampled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeqOutput {
    pub id: SeqId,
    pub token: u32,
    /// The sequence ends with this step (its token is not kept).
    pub finished: bool,
}

impl StepPlan {
    pub fn num_tokens(&self) -> usize {
        self.scheduled.iter().map(|s| s.len).sum()
    }
}

#[derive(Debug)]
pub struct Scheduler {
    cfg: SchedulerConfig,
    waiting: VecDeque<SeqState>,
    running: Vec<SeqState>,
    swapped: VecDeque<SeqState>,
    num_preemptions: u64,
}

impl Scheduler {
    pub fn new(cfg: SchedulerConfig, num_device_blocks: usize) -> Result<Self, SchedulerError> {
        if cfg.max_num_seqs == 0 || cfg.max_num_batched_tokens == 0 || cfg.block_size == 0 {
            return Err(SchedulerError::Invalid(
                "max_num_seqs, max_num_batched_tokens and block_size must be positive",
            ));
        }
        if blocks_for_tokens(cfg.max_model_len, cfg.block_size) > num_device_blocks {
            return Err(SchedulerError::CacheTooSmall {
                num_blocks: num_device_blocks,
                block_size: cfg.block_size,
                max_model_len: cfg.max_model_len,
            });
        }
        if !cfg.chunked_prefill && cfg.max_num_batched_tokens < cfg.max_model_len {
            return Err(SchedulerError::BudgetTooSmall(
                cfg.max_num_batched_tokens,
                cfg.max_model_len,
            ));
        }
        Ok(Self {
            cfg,
            waiting: VecDeque::new(),
            running: Vec::new(),
            swapped: VecDeque::new(),
            num_preemptions: 0,
        })
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    /// Queues a new sequence with this prompt.
    pub fn add(&mut self, id: SeqId, prompt: &[u32]) {
        self.add_with_lora(id, prompt, None);
    }

    /// Queues a new sequence with this prompt under LoRA adapter `lora` (an adapter's id): its
    /// cached blocks are keyed by the adapter, so other adapters and the base never share them.
    pub fn add_with_lora(&mut self, id: SeqId, prompt: &[u32], lora: Option<u64>) {
        self.add_seq(id, prompt, lora, true);
    }

    /// [`Scheduler::add_with_lora`]; with `reads_cache` false the sequence computes every one
    /// of its tokens (a mean-pooled embedding needs each token's hidden state), though its
    /// blocks still go to the prefix cache for others.
    pub fn add_seq(&mut self, id: SeqId, prompt: &[u32], lora: Option<u64>, reads_cache: bool) {
        let mut hasher = match lora {
            Some(l) => BlockHasher::with_extra(self.cfg.block_size, l),
            None => BlockHasher::new(self.cfg.block_size),
        };
        if self.cfg.prefix_caching {
            hasher.extend(prompt);
        }
        self.waiting.push_back(SeqState {
            id,
            num_tokens: prompt.len(),
            num_computed: 0,
            blocks: Vec::new(),
            host_blocks: Vec::new(),
            status: SeqStatus::Waiting,
            num_preemptions: 0,
            lora,
            hasher,
            num_registered: 0,
            reads_cache,
        });
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }
    pub fn num_running(&self) -> usize {
        self.running.len()
    }
    pub fn num_swapped(&self) -> usize {
        self.swapped.len()
    }
    pub fn num_preemptions(&self) -> u64 {
        self.num_preemptions
    }
    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty() && self.swapped.is_empty()
    }

    pub fn get(&self, id: SeqId) -> Option<&SeqState> {
        self.running
            .iter()
            .chain(self.waiting.iter())
            .chain(self.swapped.iter())
            .find(|s| s.id == id)
    }

    /// Decides the next step, booking blocks for everything scheduled.
    pub fn schedule(&mut self, space: &mut BlockPools) -> Result<StepPlan, SchedulerError> {
        let mut plan = StepPlan::default();
        self.schedule_running(space, &mut plan)?;
        // Queued work starts only when nothing had to make room, and swapped sequences come
        // back before new ones start.
        if plan.preempted.is_empty() {
            self.swap_in_queued(space, &mut plan)?;
        }
        if plan.preempted.is_empty() && self.swapped.is_empty() {
            self.admit_waiting(space, &mut plan)?;
        }
        Ok(plan)
    }

    /// Tokens the plan may still add: each phase reads it once and counts down what it adds,
    /// so a step stays linear in the sequences it schedules.
    fn budget(&self, plan: &StepPlan) -> usize {
        self.cfg.max_num_batched_tokens - plan.num_tokens()
    }

    /// Running sequences, oldest first; room is made by preempting the newest.
    fn schedule_running(
        &mut self,
        space: &mut BlockPools,
        plan: &mut StepPlan,
    ) -> Result<(), SchedulerError> {
        let bs = self.cfg.block_size;
        let mut budget = self.budget(plan);
        let mut i = 0;
        while i < self.running.len() {
            let n = self.chunk(&self.running[i], budget);
            if n == 0 {
                i += 1;
                continue;
            }
            loop {
                let seq = &self.running[i];
                let need =
                    blocks_for_tokens(seq.num_computed + n, bs).saturating_sub(seq.blocks.len());
                if need <= space.device.num_free() {
                    break;
                }
                let victim = self
                    .running
                    .pop()
                    .ok_or(SchedulerError::Invalid("empty running set"))?;
                let itself = self.running.len() == i;
                self.preempt(victim, space, plan)?;
                if itself {
                    return Ok(());
                }
            }
            let seq = &mut self.running[i];
            plan.scheduled.push(self.cfg.allocate(seq, n, space)?);
            budget -= n;
            i += 1;
        }
        Ok(())
    }

    /// Swapped sequences, first out first back, while they fit.
    fn swap_in_queued(
        &mut self,
        space: &mut BlockPools,
        plan: &mut StepPlan,
    ) -> Result<(), SchedulerError> {
        let mut budget = self.budget(plan);
        let mut active = distinct_loras(self.running.iter());
        while let Some((n, _)) = (self.swapped.front())
            .filter(|f| self.cfg.lora_fits(&active, f))
            .and_then(|f| self.admit(f, budget, space))
        {
            let mut seq = self
                .swapped
                .pop_front()
                .ok_or(SchedulerError::Invalid("empty swap queue"))?;
            let copies = space.swap_in(&seq.host_blocks)?;
            seq.blocks = copies.iter().map(|c| c.to).collect();
            seq.host_blocks.clear();
            plan.swap_in.extend(copies);
            seq.status = SeqStatus::Running;
            plan.swapped_in.push(seq.id);
            plan.scheduled.push(self.cfg.allocate(&mut seq, n, space)?);
            budget -= n;
            active.extend(seq.lora.filter(|l| !active.contains(l)));
            self.running.push(seq);
        }
        Ok(())
    }

    /// New (or recomputing) sequences, first come first served, each starting after the
    /// blocks the prefix cache holds for it.
    fn admit_waiting(
        &mut self,
        space: &mut BlockPools,
        plan: &mut StepPlan,
    ) -> Result<(), SchedulerError> {
        let bs = self.cfg.block_size;
        let mut budget = self.budget(plan);
        // First come first served, except that a sequence whose adapter cannot join yet is
        // passed over (vLLM's skip), so it does not hold up the sequences behind it. The
        // running adapters are gathered once, not for every sequence passed over.
        let mut active = distinct_loras(self.running.iter());
        let mut i = 0;
        while let Some(next) = self.waiting.get(i) {
            if !self.cfg.lora_fits(&active, next) {
                i += 1;
                continue;
            }
            let Some((n, cached)) = self.admit(next, budget, space) else {
                break;
            };
            let mut seq = self
                .waiting
                .remove(i)
                .ok_or(SchedulerError::Invalid("empty queue"))?;
            seq.status = SeqStatus::Running;
            if cached > 0 {
                seq.blocks = space.device.take_cached(&seq.hasher.hashes()[..cached])?;
                seq.num_computed = cached * bs;
                seq.num_registered = cached;
            }
            // The waiting queue holds new sequences and recompute victims; only a new one's
            // lookup is counted.
            if self.cfg.prefix_caching && seq.num_preemptions == 0 {
                plan.prefix_lookups.push(PrefixLookup {
                    id: seq.id,
                    queried: seq.num_tokens,
                    hit: cached * bs,
                });
            }
            plan.scheduled.push(self.cfg.allocate(&mut seq, n, space)?);
            budget -= n;
            active.extend(seq.lora.filter(|l| !active.contains(l)));
            self.running.push(seq);
        }
        Ok(())
    }

    /// Applies a step's results: the planned tokens are computed, each output's token joins
    /// its sequence, and finished sequences give their blocks back. `outputs` has one entry for
    /// every sequence the plan sampled that still runs (one aborted meanwhile has none).
    /// Returns the finished sequences.
    pub fn update_from_output(
        &mut self,
        plan: &StepPlan,
        outputs: &[SeqOutput],
        space: &mut BlockPools,
    ) -> Result<Vec<SeqState>, SchedulerError> {
        for s in &plan.scheduled {
            if let Some(seq) = self.running.iter_mut().find(|q| q.id == s.id) {
                seq.num_computed = s.start + s.len;
            }
        }
        let mut finished = Vec::new();
        for out in outputs {
            if out.finished {
                finished.push(self.finish(out.id, space)?);
                continue;
            }
            let seq = self
                .running
                .iter_mut()
                .find(|q| q.id == out.id)
                .ok_or(SchedulerError::UnknownSeq(out.id))?;
            seq.num_tokens += 1;
            if self.cfg.prefix_caching {
                seq.hasher.push(out.token);
            }
        }
        Ok(finished)
    }

    /// Removes a sequence in any state and frees its device and host blocks. Used both for
    /// completion and for aborts; the blocks are free before the next step.
    pub fn finish(
        &mut self,
        id: SeqId,
        space: &mut BlockPools,
    ) -> Result<SeqState, SchedulerError> {
        let seq = if let Some(p) = self.running.iter().position(|q| q.id == id) {
            self.running.remove(p)
        } else if let Some(p) = self.waiting.iter().position(|q| q.id == id) {
            self.waiting
                .remove(p)
                .ok_or(SchedulerError::UnknownSeq(id))?
        } else if let Some(p) = self.swapped.iter().position(|q| q.id == id) {
            self.swapped
                .remove(p)
                .ok_or(SchedulerError::UnknownSeq(id))?
        } else {
            return Err(SchedulerError::UnknownSeq(id));
        };
        space.device.free_all(&seq.blocks)?;
        space.host.free_all(&seq.host_blocks)?;
        Ok(seq)
    }

    /// Adapters of the running and of the queued (waiting or swapped) sequences, each once.
    pub fn loras(&self) -> (Vec<u64>, Vec<u64>) {
        (
            distinct_loras(self.running.iter()),
            distinct_loras(self.waiting.iter().chain(self.swapped.iter())),
        )
    }

    /// Tokens `seq` can run this step within `budget`, from its first uncomputed token.
    fn chunk(&self, seq: &SeqState, budget: usize) -> usize {
        self.chunk_from(seq, seq.num_computed, budget)
    }

    /// Tokens `seq` can run this step within `budget` when its first `start` are computed.
    fn chunk_from(&self, seq: &SeqState, start: usize, budget: usize) -> usize {
        let remaining = seq.num_tokens - start;
        if remaining <= budget {
            remaining
        } else if self.cfg.chunked_prefill {
            budget
        } else {
            0
        }
    }

    /// Tokens a queued (waiting or swapped) sequence would run if it joined the batch now, and
    /// how many of its leading blocks come from the prefix cache; `None` when the batch is
    /// full, the budget is spent, or its blocks do not fit.
    fn admit(&self, seq: &SeqState, budget: usize, space: &BlockPools) -> Option<(usize, usize)> {
        if self.running.len() >= self.cfg.max_num_seqs || budget == 0 {
            return None;
        }
        let bs = self.cfg.block_size;
        let cached = self.cached_blocks(seq, space);
        let start = seq.num_computed.max(cached * bs);
        let n = self.chunk_from(seq, start, budget);
        // A swapped sequence holds no device blocks; its host blocks come back as new ones.
        // Cached blocks nobody holds leave the free queue when taken, like new ones.
        let held = seq.blocks.len() + cached;
        let hashes = &seq.hasher.hashes()[..cached];
        let need = blocks_for_tokens(start + n, bs).saturating_sub(held)
            + space.device.free_among_cached(hashes);
        (n > 0 && self.fits(need, space)).then_some((n, cached))
    }

    /// Leading full blocks of a sequence that holds nothing yet which the prefix cache can
    /// supply. Never all of its tokens: at least one is computed, so there are logits.
    fn cached_blocks(&self, seq: &SeqState, space: &BlockPools) -> usize {
        if !self.cfg.prefix_caching
            || !seq.reads_cache
            || seq.num_computed > 0
            || !seq.blocks.is_empty()
        {
            return 0;
        }
        let max = seq.num_tokens.saturating_sub(1) / self.cfg.block_size;
        let hashes = seq.hasher.hashes();
        space.device.cached_prefix(&hashes[..max.min(hashes.len())])
    }

    /// Whether `need` more blocks may be taken for new work. The watermark is waived when
    /// nothing runs, or a sequence needing nearly the whole cache could never start.
    fn fits(&self, need: usize, space: &BlockPools) -> bool {
        let reserve = if self.running.is_empty() {
            0
        } else {
            self.cfg.watermark_blocks
        };
        need + reserve <= space.device.num_free()
    }
}

/// The adapters of `seqs`, each once, sorted.
fn distinct_loras<'a>(seqs: impl Iterator<Item = &'a SeqState>) -> Vec<u64> {
    let mut v: Vec<u64> = seqs.filter_map(|s| s.lora).collect();
    v.sort_unstable();
    v.dedup();
    v
}

impl SchedulerConfig {
    /// Whether `seq` may join running sequences whose adapters are `active` without exceeding
    /// `max_loras`.
    fn lora_fits(&self, active: &[u64], seq: &SeqState) -> bool {
        seq.lora
            .is_none_or(|l| active.contains(&l) || active.len() < self.max_loras)
    }

    /// Gives `seq` the blocks for its next `n` tokens and registers the blocks those tokens
    /// fill in the prefix cache.
    fn allocate(
        &self,
        seq: &mut SeqState,
        n: usize,
        space: &mut BlockPools,
    ) -> Result<Scheduled, SchedulerError> {
        let bs = self.block_size;
        let need = blocks_for_tokens(seq.num_computed + n, bs).saturating_sub(seq.blocks.len());
        seq.blocks.extend(space.device.allocate_n(need)?);
        if self.prefix_caching {
            let hashes = seq.hasher.hashes();
            let full = ((seq.num_computed + n) / bs).min(hashes.len());
            let newly = seq.blocks.iter().zip(hashes).take(full);
            for (&block, &hash) in newly.skip(seq.num_registered) {
                space.device.register(block, hash)?;
            }
            seq.num_registered = seq.num_registered.max(full);
        }
        Ok(Scheduled {
            id: seq.id,
            start: seq.num_computed,
            len: n,
            samples: seq.num_computed + n == seq.num_tokens,
        })
    }
}

impl Scheduler {
    /// Gives a victim's blocks back: to the host pool when it fits there (the copies join the
    /// plan), else dropped for a recompute.
    fn preempt(
        &mut self,
        mut seq: SeqState,
        space: &mut BlockPools,
        plan: &mut StepPlan,
    ) -> Result<(), SchedulerError> {
        self.num_preemptions += 1;
        seq.num_preemptions += 1;
        seq.num_registered = 0;
        let how = if !seq.blocks.is_empty() && space.host.num_free() >= seq.blocks.len() {
            let copies = space.swap_out(&seq.blocks)?;
            seq.host_blocks = copies.iter().map(|c| c.to).collect();
            plan.swap_out.extend(copies);
            seq.status = SeqStatus::Swapped;
            Preemption::Swap
        } else {
            space.device.free_all(&seq.blocks)?;
            seq.num_computed = 0;
            seq.status = SeqStatus::Waiting;
            Preemption::Recompute
        };
        seq.blocks.clear();
        plan.preempted.push((seq.id, how));
        match how {
            Preemption::Swap => self.swapped.push_front(seq),
            Preemption::Recompute => self.waiting.push_front(seq),
        }
        Ok(())
    }
}

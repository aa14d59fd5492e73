//! The scheduler on synthetic sequences (no model): batching, chunked prefill, preemption by
//! swap and by recompute, aborts, prefix caching, and property tests over random workloads.
//!
//! The simulation models the KV cache's contents: every slot a step writes records which
//! prefix it holds, and every step checks that each scheduled sequence reads, at every position
//! its attention covers, the keys and values of its own prefix. Sharing, eviction and
//! preemption bugs show up there as a wrong read, without a model.

use std::collections::{HashMap, HashSet};
use std::hash::{Hash, Hasher};

use ferrite_runtime::engine::scheduler::{
    Preemption, Scheduler, SchedulerConfig, SeqId, SeqOutput, SeqStatus, StepPlan,
};
use ferrite_runtime::kv::{BlockCopy, BlockId, BlockPools};
use proptest::prelude::*;

fn cfg() -> SchedulerConfig {
    SchedulerConfig {
        max_num_seqs: 64,
        max_num_batched_tokens: 256,
        max_model_len: 256,
        block_size: 16,
        chunked_prefill: true,
        watermark_blocks: 1,
        prefix_caching: false,
        max_loras: 4,
    }
}

fn cached_cfg() -> SchedulerConfig {
    SchedulerConfig {
        prefix_caching: true,
        ..cfg()
    }
}

/// Identity of the prefix ending at each position: what the keys and values there depend on.
/// Under a LoRA adapter the keys and values also depend on it.
fn prefix_ids(lora: Option<u64>, tokens: &[u32]) -> Vec<u64> {
    let mut out = Vec::with_capacity(tokens.len());
    let mut prev = lora.map_or(0, |l| l.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
    for t in tokens {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        (prev, t).hash(&mut h);
        prev = h.finish();
        out.push(prev);
    }
    out
}

/// Drives a scheduler the way the engine does: schedule, run the plan's copies and the step,
/// then hand back an output for every sequence whose step sampled.
struct Sim {
    sched: Scheduler,
    space: BlockPools,
    /// Tokens left to generate per sequence.
    left: HashMap<SeqId, usize>,
    generated: HashMap<SeqId, usize>,
    plans: Vec<StepPlan>,
    /// Prompt and generated tokens of live sequences.
    tokens: HashMap<SeqId, Vec<u32>>,
    /// What each written cache slot holds: the prefix identity of the token written there.
    slots: HashMap<(BlockId, usize), u64>,
    /// The same for the host swap pool.
    host_slots: HashMap<(BlockId, usize), u64>,
    /// The LoRA adapter of each sequence that has one.
    loras: HashMap<SeqId, u64>,
}

impl Sim {
    fn new(cfg: SchedulerConfig, blocks: usize, host: usize) -> Self {
        Self {
            sched: Scheduler::new(cfg, blocks).expect("config"),
            space: BlockPools::new(blocks, host),
            left: HashMap::new(),
            generated: HashMap::new(),
            plans: Vec::new(),
            tokens: HashMap::new(),
            slots: HashMap::new(),
            host_slots: HashMap::new(),
            loras: HashMap::new(),
        }
    }

    /// A sequence whose prompt shares nothing with any other.
    fn add(&mut self, id: SeqId, prompt: usize, max_tokens: usize) {
        let tokens: Vec<u32> = (0..prompt as u32)
            .map(|i| id as u32 * 100_000 + i)
            .collect();
        self.add_tokens(id, tokens, max_tokens);
    }

    fn add_tokens(&mut self, id: SeqId, prompt: Vec<u32>, max_tokens: usize) {
        self.add_adapted(id, prompt, max_tokens, None);
    }

    /// A sequence under LoRA adapter `lora`.
    fn add_adapted(&mut self, id: SeqId, prompt: Vec<u32>, max_tokens: usize, lora: Option<u64>) {
        self.sched.add_with_lora(id, &prompt, lora);
        if let Some(l) = lora {
            self.loras.insert(id, l);
        }
        self.tokens.insert(id, prompt);
        self.left.insert(id, max_tokens);
    }

    fn abort(&mut self, id: SeqId) {
        if self.tokens.remove(&id).is_some() {
            self.sched.finish(id, &mut self.space).expect("abort");
            self.left.remove(&id);
        }
    }

    fn step(&mut self) -> StepPlan {
        let plan = self.sched.schedule(&mut self.space).expect("schedule");
        self.swap(&plan);
        let c = *self.sched.config();
        assert!(plan.num_tokens() <= c.max_num_batched_tokens);
        assert!(self.sched.num_running() <= c.max_num_seqs);
        self.execute(&plan);
        self.check_ref_counts();
        let mut outputs = Vec::new();
        for s in plan.scheduled.iter().filter(|s| s.samples) {
            *self.generated.entry(s.id).or_default() += 1;
            let left = self.left.get_mut(&s.id).expect("known");
            *left -= 1;
            let toks = self.tokens.get_mut(&s.id).expect("live");
            // Generated tokens repeat across sequences, so decode blocks can match too.
            let token = (toks.len() % 7) as u32;
            let finished = *left == 0;
            if !finished {
                toks.push(token);
            }
            outputs.push(SeqOutput {
                id: s.id,
                token,
                finished,
            });
        }
        let ended = self
            .sched
            .update_from_output(&plan, &outputs, &mut self.space)
            .expect("update");
        let want: Vec<SeqId> = outputs
            .iter()
            .filter(|o| o.finished)
            .map(|o| o.id)
            .collect();
        let got: Vec<SeqId> = ended.iter().map(|q| q.id).collect();
        assert_eq!(got, want, "the finished outputs end, and only they");
        for id in got {
            self.tokens.remove(&id);
        }
        self.plans.push(plan.clone());
        plan
    }

    /// The cache's part of a plan, as the engine runs it before the forward: the swap-outs'
    /// copies to the host pool, then the swap-ins' back to their new device blocks. A copy the
    /// plan lacks or gets wrong shows up as a wrong read in [`Sim::execute`].
    fn swap(&mut self, plan: &StepPlan) {
        let bs = self.sched.config().block_size;
        let copy = |from: &HashMap<(BlockId, usize), u64>,
                    to: &mut HashMap<(BlockId, usize), u64>,
                    copies: &[BlockCopy]| {
            for c in copies {
                for o in 0..bs {
                    match from.get(&(c.from, o)) {
                        Some(&v) => to.insert((c.to, o), v),
                        None => to.remove(&(c.to, o)),
                    };
                }
            }
        };
        copy(&self.slots, &mut self.host_slots, &plan.swap_out);
        copy(&self.host_slots, &mut self.slots, &plan.swap_in);
        let swapped: usize = (plan.preempted.iter())
            .filter(|p| p.1 == Preemption::Swap)
            .map(|p| self.sched.get(p.0).expect("swapped").host_blocks.len())
            .sum();
        assert_eq!(
            plan.swap_out.len(),
            swapped,
            "one copy per swapped-out block"
        );
        let back: usize = (plan.swapped_in.iter())
            .map(|id| self.sched.get(*id).expect("swapped in").blocks.len())
            .sum();
        assert!(
            plan.swap_in.len() <= back,
            "swap-in copies only into the sequence's blocks"
        );
    }

    /// The model's part: write every scheduled token's slot (no slot twice in a step), then
    /// check what each sequence's attention reads, as the forward does layer by layer.
    fn execute(&mut self, plan: &StepPlan) {
        let bs = self.sched.config().block_size;
        let mut written = HashSet::new();
        for s in &plan.scheduled {
            let seq = self.sched.get(s.id).expect("scheduled sequences exist");
            let ids = prefix_ids(self.loras.get(&s.id).copied(), &self.tokens[&s.id]);
            for (pos, &id) in ids.iter().enumerate().skip(s.start).take(s.len) {
                let slot = (seq.blocks[pos / bs], pos % bs);
                assert!(
                    written.insert(slot),
                    "slot {slot:?} written twice in a step"
                );
                self.slots.insert(slot, id);
            }
        }
        for s in &plan.scheduled {
            let seq = self.sched.get(s.id).expect("scheduled sequences exist");
            let ids = prefix_ids(self.loras.get(&s.id).copied(), &self.tokens[&s.id]);
            for (pos, &id) in ids.iter().enumerate().take(s.start + s.len) {
                let slot = (seq.blocks[pos / bs], pos % bs);
                assert_eq!(
                    self.slots.get(&slot),
                    Some(&id),
                    "sequence {} reads the wrong keys and values at position {pos}",
                    s.id
                );
            }
        }
    }

    /// Each block is held exactly by the sequences whose tables name it; blocks nobody holds
    /// are in the free queue and no held block is.
    fn check_ref_counts(&self) {
        let mut holders: HashMap<BlockId, u32> = HashMap::new();
        for id in self.tokens.keys() {
            let seq = self.sched.get(*id).expect("live sequences exist");
            for &b in &seq.blocks {
                *holders.entry(b).or_default() += 1;
            }
        }
        let dev = &self.space.device;
        let queue: HashSet<BlockId> = dev.free_queue().into_iter().collect();
        assert_eq!(queue.len(), dev.num_free());
        for b in 0..dev.num_blocks() as BlockId {
            let held = holders.get(&b).copied().unwrap_or(0);
            assert_eq!(dev.ref_count(b), held, "block {b}");
            assert_eq!(queue.contains(&b), held == 0, "block {b} free and in use");
        }
    }

    fn run(&mut self, max_steps: usize) {
        let mut steps = 0;
        while !self.sched.is_idle() {
            self.step();
            steps += 1;
            assert!(steps <= max_steps, "no progress after {steps} steps");
        }
    }

    /// Nothing held: every block is free or cached-and-free.
    fn assert_all_free(&self) {
        let dev = &self.space.device;
        assert_eq!(dev.num_free(), dev.num_blocks());
        assert!((0..dev.num_blocks() as BlockId).all(|b| dev.ref_count(b) == 0));
        assert_eq!(self.space.host.num_used(), 0);
    }
}

#[test]
fn thirty_two_decodes_run_as_one_step() {
    let mut sim = Sim::new(cfg(), 256, 0);
    for id in 0..32 {
        sim.add(id, 5, 10);
    }
    let first = sim.step();
    assert_eq!(first.scheduled.len(), 32, "all prompts prefill together");
    assert_eq!(first.num_tokens(), 160);
    let second = sim.step();
    assert_eq!(second.scheduled.len(), 32);
    assert!(second.scheduled.iter().all(|s| s.len == 1 && s.samples));
    sim.run(100);
    assert_eq!(sim.space.device.num_used(), 0);
}

#[test]
fn long_prompts_are_chunked_and_share_steps_with_decodes() {
    let c = SchedulerConfig {
        max_num_batched_tokens: 64,
        ..cfg()
    };
    let mut sim = Sim::new(c, 256, 0);
    sim.add(1, 10, 50);
    sim.step(); // prefill of seq 1
    sim.add(2, 200, 5);
    let p = sim.step();
    // Seq 1 decodes one token, seq 2 gets the rest of the budget as its first chunk.
    assert_eq!(p.scheduled[0].id, 1);
    assert_eq!(p.scheduled[0].len, 1);
    assert_eq!(
        (p.scheduled[1].id, p.scheduled[1].start, p.scheduled[1].len),
        (2, 0, 63)
    );
    assert!(!p.scheduled[1].samples);
    let p = sim.step();
    assert_eq!((p.scheduled[1].start, p.scheduled[1].len), (63, 63));
    sim.run(200);
    assert_eq!(sim.generated[&2], 5);
}

#[test]
fn without_chunking_a_prompt_waits_for_a_whole_budget() {
    let c = SchedulerConfig {
        chunked_prefill: false,
        max_num_batched_tokens: 256,
        ..cfg()
    };
    let mut sim = Sim::new(c, 256, 0);
    sim.add(1, 200, 3);
    sim.add(2, 100, 3);
    let p = sim.step();
    assert_eq!(
        p.scheduled.len(),
        1,
        "the second prompt does not fit in the remaining budget"
    );
    assert_eq!(p.scheduled[0].len, 200);
    sim.run(50);
}

#[test]
fn max_num_seqs_caps_the_batch() {
    let c = SchedulerConfig {
        max_num_seqs: 4,
        ..cfg()
    };
    let mut sim = Sim::new(c, 256, 0);
    for id in 0..10 {
        sim.add(id, 3, 5);
    }
    let p = sim.step();
    assert_eq!(p.scheduled.len(), 4);
    assert_eq!(sim.sched.num_waiting(), 6);
    sim.run(100);
}

#[test]
fn block_pressure_preempts_the_newest_by_swap_then_resumes() {
    // 8 blocks of 16 tokens; three sequences of 30 prompt tokens growing to 60 cannot all fit.
    let c = SchedulerConfig {
        max_model_len: 128,
        watermark_blocks: 0,
        ..cfg()
    };
    let mut sim = Sim::new(c, 8, 16);
    for id in 0..3 {
        sim.add(id, 30, 30);
    }
    sim.run(500);
    let preempted: Vec<(SeqId, Preemption)> =
        sim.plans.iter().flat_map(|p| p.preempted.clone()).collect();
    assert!(!preempted.is_empty(), "the workload must force preemption");
    assert!(preempted.iter().all(|&(_, how)| how == Preemption::Swap));
    assert_eq!(preempted[0].0, 2, "the newest sequence goes first");
    assert!(sim.plans.iter().any(|p| !p.swapped_in.is_empty()));
    for id in 0..3 {
        assert_eq!(
            sim.generated[&id], 30,
            "sequence {id} did not finish its tokens"
        );
    }
    assert_eq!(sim.space.device.num_used(), 0);
    assert_eq!(sim.space.host.num_used(), 0);
}

#[test]
fn without_swap_space_preemption_recomputes() {
    let c = SchedulerConfig {
        max_model_len: 128,
        watermark_blocks: 0,
        ..cfg()
    };
    let mut sim = Sim::new(c, 8, 0);
    for id in 0..3 {
        sim.add(id, 30, 30);
    }
    sim.run(500);
    let preempted: Vec<_> = sim.plans.iter().flat_map(|p| p.preempted.clone()).collect();
    assert!(!preempted.is_empty());
    assert!(
        preempted
            .iter()
            .all(|&(_, how)| how == Preemption::Recompute)
    );
    // A recomputed sequence prefills its prompt and its generated tokens again from 0.
    let (victim, _) = preempted[0];
    let restart = sim
        .plans
        .iter()
        .skip_while(|p| !p.preempted.iter().any(|&(id, _)| id == victim))
        .flat_map(|p| p.scheduled.iter())
        .find(|s| s.id == victim)
        .copied()
        .expect("victim runs again");
    assert_eq!(restart.start, 0);
    assert!(
        restart.len > 30,
        "prompt plus generated tokens: {restart:?}"
    );
    for id in 0..3 {
        assert_eq!(sim.generated[&id], 30);
    }
    assert_eq!(sim.space.device.num_used(), 0);
}

#[test]
fn aborts_free_blocks_in_every_state() {
    let c = SchedulerConfig {
        max_model_len: 128,
        watermark_blocks: 0,
        ..cfg()
    };
    let mut sim = Sim::new(c, 8, 16);
    for id in 0..4 {
        sim.add(id, 30, 40);
    }
    for _ in 0..40 {
        sim.step();
    }
    let states: Vec<_> = (0..4)
        .filter_map(|id| sim.sched.get(id).map(|s| s.status))
        .collect();
    assert!(states.len() >= 2);
    for id in 0..4 {
        if sim.sched.get(id).is_some() {
            sim.sched.finish(id, &mut sim.space).expect("abort");
        }
    }
    assert!(sim.sched.is_idle());
    assert_eq!(sim.space.device.num_used(), 0);
    assert_eq!(sim.space.host.num_used(), 0);
    assert!(sim.sched.finish(99, &mut sim.space).is_err());
}

#[test]
fn rejects_a_cache_that_cannot_hold_one_sequence() {
    let e = Scheduler::new(
        SchedulerConfig {
            max_model_len: 1000,
            ..cfg()
        },
        10,
    )
    .expect_err("too small");
    assert!(e.to_string().contains("cannot hold one sequence"), "{e}");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    /// Random arrivals, prompt lengths and budgets under tight memory: every sequence finishes
    /// with exactly its tokens, computed ranges never skip or overlap, limits hold, nothing leaks.
    #[test]
    fn random_workloads_finish_without_leaks(
        seqs in proptest::collection::vec((1usize..120, 1usize..40, 0usize..20), 1..24),
        blocks in 8usize..40,
        host in 0usize..30,
        budget in 16usize..300,
        max_seqs in 1usize..16,
        chunked in any::<bool>(),
    ) {
        let c = SchedulerConfig {
            max_num_seqs: max_seqs,
            max_num_batched_tokens: if chunked { budget } else { budget.max(128) },
            max_model_len: 128,
            block_size: 16,
            chunked_prefill: chunked,
            watermark_blocks: 1,
            prefix_caching: false,
            max_loras: 4,
        };
        let mut sim = Sim::new(c, blocks.max(8), host);
        let mut computed: HashMap<SeqId, usize> = HashMap::new();
        // Prompt plus generated tokens stay within max_model_len (128).
        let mut pending: Vec<(usize, SeqId, usize, usize)> = seqs
            .iter()
            .enumerate()
            .map(|(i, &(prompt, new_tokens, at))| (at, i as SeqId, prompt, new_tokens.min(128 - prompt)))
            .collect();
        pending.sort();
        let mut step = 0;
        let mut steps_total = 0;
        while !pending.is_empty() || !sim.sched.is_idle() {
            while let Some(&(at, id, prompt, new_tokens)) = pending.first() {
                if at > step { break; }
                sim.add(id, prompt, new_tokens);
                pending.remove(0);
            }
            let plan = sim.step();
            for s in &plan.scheduled {
                let done = computed.entry(s.id).or_default();
                // After a recompute preemption a sequence restarts from 0.
                prop_assert!(s.start == *done || s.start == 0, "{s:?} after {done}");
                *done = s.start + s.len;
            }
            step += 1;
            steps_total += 1;
            prop_assert!(steps_total < 20_000, "no progress");
        }
        prop_assert_eq!(sim.left.len(), seqs.len());
        for (id, left) in &sim.left {
            prop_assert_eq!(*left, 0, "sequence {} did not finish", id);
        }
        sim.assert_all_free();
    }
}

/// Tokens `0..len` of prefix family `f`: prompts of one family share their leading tokens.
fn family(f: u32, len: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| 1_000_000 + f * 10_000 + i)
        .collect()
}

fn with_tail(mut prompt: Vec<u32>, id: SeqId, tail: usize) -> Vec<u32> {
    prompt.extend((0..tail as u32).map(|i| id as u32 * 100_000 + 50_000 + i));
    prompt
}

#[test]
fn a_later_request_starts_after_its_cached_prefix() {
    let mut sim = Sim::new(cached_cfg(), 64, 0);
    sim.add_tokens(1, family(0, 40), 3);
    sim.run(50);
    assert_eq!(sim.space.device.num_cached(), 2, "two full prompt blocks");
    // Same 40 tokens, then 10 of its own: the two full blocks (32 tokens) come from the cache.
    sim.add_tokens(2, with_tail(family(0, 40), 2, 10), 3);
    let p = sim.step();
    assert_eq!((p.scheduled[0].start, p.scheduled[0].len), (32, 18));
    assert_eq!(p.prefix_lookups.len(), 1);
    assert_eq!(
        (p.prefix_lookups[0].queried, p.prefix_lookups[0].hit),
        (50, 32)
    );
    sim.run(50);
    sim.assert_all_free();
}

#[test]
fn a_fully_cached_prompt_still_computes_its_last_token() {
    let mut sim = Sim::new(cached_cfg(), 64, 0);
    sim.add_tokens(1, family(0, 32), 2);
    sim.run(50);
    // Exactly two blocks: the last one is recomputed so there are logits to sample.
    sim.add_tokens(2, family(0, 32), 2);
    let p = sim.step();
    assert_eq!((p.scheduled[0].start, p.scheduled[0].len), (16, 16));
    assert!(p.scheduled[0].samples);
    // One token past a block boundary: both blocks hit, one token runs.
    sim.run(50);
    sim.add_tokens(3, family(0, 33), 2);
    let p = sim.step();
    assert_eq!((p.scheduled[0].start, p.scheduled[0].len), (32, 1));
    sim.run(50);
    sim.assert_all_free();
}

#[test]
fn choices_admitted_together_share_the_prompt_blocks() {
    let mut sim = Sim::new(cached_cfg(), 64, 0);
    for id in 0..3 {
        sim.add_tokens(id, family(0, 40), 4);
    }
    let p = sim.step();
    assert_eq!((p.scheduled[0].start, p.scheduled[0].len), (0, 40));
    for s in &p.scheduled[1..] {
        assert_eq!(
            (s.start, s.len),
            (32, 8),
            "later choices reuse the first's blocks"
        );
    }
    let first = sim.sched.get(0).expect("running").blocks.clone();
    for id in 1..3 {
        let blocks = &sim.sched.get(id).expect("running").blocks;
        assert_eq!(blocks[..2], first[..2]);
        assert_ne!(blocks[2], first[2], "the partial block is private");
    }
    assert_eq!(sim.space.device.ref_count(first[0]), 3);
    sim.run(50);
    sim.assert_all_free();
}

#[test]
fn evicted_prefixes_are_computed_again() {
    let c = SchedulerConfig {
        max_model_len: 128,
        watermark_blocks: 0,
        ..cached_cfg()
    };
    // 8 blocks: one 64-token prompt, then others that need every block.
    let mut sim = Sim::new(c, 8, 0);
    sim.add_tokens(1, family(0, 64), 1);
    sim.run(10);
    assert_eq!(sim.space.device.num_cached(), 4);
    sim.add_tokens(2, family(1, 120), 1);
    sim.run(10);
    sim.add_tokens(3, family(0, 64), 1);
    let p = sim.step();
    assert!(
        p.scheduled[0].start < 48,
        "evicted blocks cannot be hits: {:?}",
        p.scheduled[0]
    );
    sim.run(10);
    sim.assert_all_free();
}

#[test]
fn recompute_preemption_with_caching_restarts_on_block_boundaries() {
    let c = SchedulerConfig {
        max_model_len: 128,
        watermark_blocks: 0,
        ..cached_cfg()
    };
    let mut sim = Sim::new(c, 8, 0);
    for id in 0..3 {
        sim.add(id, 30, 30);
    }
    sim.run(500);
    let restarts: Vec<_> = sim
        .plans
        .iter()
        .enumerate()
        .flat_map(|(i, p)| p.preempted.iter().map(move |&(id, how)| (i, id, how)))
        .collect();
    assert!(!restarts.is_empty(), "the workload must force preemption");
    assert!(
        restarts
            .iter()
            .all(|&(_, _, how)| how == Preemption::Recompute)
    );
    // A victim restarts after whatever of its own freed blocks are still cached (its reads are
    // checked against its prefix at every step).
    for &(i, victim, _) in &restarts {
        let restart = sim.plans[i + 1..]
            .iter()
            .flat_map(|p| p.scheduled.iter())
            .find(|s| s.id == victim)
            .expect("victims run again");
        assert_eq!(restart.start % 16, 0, "{restart:?}");
    }
    // Lookups are counted once per sequence, at its first admission.
    let lookups: Vec<_> = sim
        .plans
        .iter()
        .flat_map(|p| p.prefix_lookups.clone())
        .collect();
    assert_eq!(lookups.len(), 3);
    for id in 0..3 {
        assert_eq!(sim.generated[&id], 30);
    }
    sim.assert_all_free();
}

#[test]
fn swapped_out_shared_blocks_stay_with_their_other_holders() {
    let c = SchedulerConfig {
        max_model_len: 128,
        watermark_blocks: 0,
        ..cached_cfg()
    };
    let mut sim = Sim::new(c, 10, 32);
    for id in 0..4 {
        sim.add_tokens(id, with_tail(family(0, 32), id, 4), 40);
    }
    let mut swapped = false;
    for _ in 0..400 {
        if sim.sched.is_idle() {
            break;
        }
        sim.step();
        swapped |= (0..4).any(|id| {
            sim.sched
                .get(id)
                .is_some_and(|s| s.status == SeqStatus::Swapped)
        });
    }
    assert!(swapped, "the workload must swap a sequence out");
    assert!(sim.sched.is_idle());
    sim.assert_all_free();
}

#[derive(Debug, Clone)]
enum Arrival {
    /// Family, shared length, own tail, tokens to generate.
    Add(u32, usize, usize, usize),
    Abort(usize),
}

fn arrival() -> impl Strategy<Value = Arrival> {
    prop_oneof![
        4 => (0u32..3, 0usize..70, 1usize..30, 1usize..30)
            .prop_map(|(f, shared, tail, n)| Arrival::Add(f, shared, tail, n)),
        1 => (0usize..64).prop_map(Arrival::Abort),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    /// Random streams of requests sharing prefixes, with aborts and forced preemption (tight
    /// memory, swap space or none): every read sees its own prefix's keys and values, reference
    /// counts match the block tables at every step, and once all finish every block is free
    /// or cached with no holder.
    #[test]
    fn shared_prefixes_with_aborts_and_preemption_stay_consistent(
        arrivals in proptest::collection::vec((arrival(), 0usize..12), 1..30),
        blocks in 8usize..30,
        host in prop_oneof![Just(0usize), 4usize..30],
        budget in 16usize..200,
        caching in any::<bool>(),
    ) {
        let c = SchedulerConfig {
            max_num_seqs: 8,
            max_num_batched_tokens: budget,
            max_model_len: 128,
            block_size: 16,
            chunked_prefill: true,
            watermark_blocks: 1,
            prefix_caching: caching,
            max_loras: 4,
        };
        let mut sim = Sim::new(c, blocks, host);
        let mut pending: Vec<(usize, usize, Arrival)> = arrivals
            .into_iter()
            .enumerate()
            .map(|(i, (a, at))| (at, i, a))
            .collect();
        pending.sort_by_key(|&(at, i, _)| (at, i));
        let mut step = 0;
        let mut added = 0u64;
        while !pending.is_empty() || !sim.sched.is_idle() {
            while pending.first().is_some_and(|p| p.0 <= step) {
                let (_, _, a) = pending.remove(0);
                match a {
                    Arrival::Add(f, shared, tail, n) => {
                        let id = added;
                        added += 1;
                        let prompt = with_tail(family(f, shared), id, tail);
                        let n = n.min(128 - prompt.len());
                        sim.add_tokens(id, prompt, n.max(1));
                    }
                    Arrival::Abort(i) if added > 0 => sim.abort(i as u64 % added),
                    Arrival::Abort(_) => {}
                }
            }
            if !sim.sched.is_idle() {
                sim.step();
            }
            step += 1;
            prop_assert!(step < 20_000, "no progress");
        }
        sim.assert_all_free();
        if !caching {
            prop_assert_eq!(sim.space.device.num_cached(), 0);
        }
    }
}

/// Equal prompts under different adapters (or none) have different keys and values: a
/// sequence finds cached blocks only of its own adapter, and the slot check of every step
/// (`Sim::execute`) would catch one reading another adapter's.
#[test]
fn the_prefix_cache_keeps_adapters_apart() {
    let mut sim = Sim::new(cached_cfg(), 64, 0);
    let prompt: Vec<u32> = (0..50).collect();
    let hit = |sim: &mut Sim, id: SeqId, lora: Option<u64>| {
        sim.add_adapted(id, prompt.clone(), 2, lora);
        let plan = sim.step();
        sim.run(100);
        let lookup = plan
            .prefix_lookups
            .iter()
            .find(|l| l.id == id)
            .expect("looked up");
        lookup.hit
    };
    assert_eq!(hit(&mut sim, 1, Some(7)), 0, "nothing cached yet");
    assert_eq!(
        hit(&mut sim, 2, Some(8)),
        0,
        "another adapter's blocks are not ours"
    );
    assert_eq!(hit(&mut sim, 3, None), 0, "nor are they the base model's");
    assert_eq!(hit(&mut sim, 4, Some(7)), 48, "the same adapter's are");
    assert_eq!(hit(&mut sim, 5, None), 48);
}

/// With `max_loras` 1, a queued sequence of a second adapter waits while the first runs, and
/// the sequences queued behind it (the base model's, the first adapter's) go ahead of it.
#[test]
fn max_loras_bounds_the_running_adapters_and_others_pass_the_waiting_one() {
    let c = SchedulerConfig {
        max_loras: 1,
        ..cfg()
    };
    let mut sim = Sim::new(c, 64, 0);
    let p = |id: u32| (0..20).map(|i| id * 1000 + i).collect::<Vec<u32>>();
    sim.add_adapted(1, p(1), 5, Some(10));
    sim.add_adapted(2, p(2), 5, Some(20));
    sim.add_adapted(3, p(3), 5, None);
    sim.add_adapted(4, p(4), 5, Some(10));
    let first = sim.step();
    let ran: Vec<SeqId> = first.scheduled.iter().map(|s| s.id).collect();
    assert_eq!(ran, vec![1, 3, 4], "2's adapter waits; 3 and 4 pass it");
    let mut second_ran_at = None;
    for step in 1..50 {
        let plan = sim.step();
        let (running, _) = sim.sched.loras();
        assert!(
            running.len() <= 1,
            "step {step}: adapters {running:?} run together"
        );
        if second_ran_at.is_none() && plan.scheduled.iter().any(|s| s.id == 2) {
            second_ran_at = Some(step);
            assert!(
                !plan.scheduled.iter().any(|s| s.id == 1 || s.id == 4),
                "2 runs only once adapter 10's sequences are done"
            );
        }
        if sim.sched.is_idle() {
            break;
        }
    }
    assert!(
        second_ran_at.is_some(),
        "the waiting adapter's sequence ran"
    );
    assert!(sim.sched.is_idle(), "every sequence finished");
}

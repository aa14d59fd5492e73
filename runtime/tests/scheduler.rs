//! The scheduler on synthetic sequences (no model): batching, chunked prefill, preemption by
//! swap and by recompute, aborts, and a property test over random workloads.

use std::collections::HashMap;

use ferrite_runtime::engine::scheduler::{Preemption, Scheduler, SchedulerConfig, SeqId, StepPlan};
use ferrite_runtime::kv::{BlockSpace, CountingBlocks};
use proptest::prelude::*;

fn cfg() -> SchedulerConfig {
    SchedulerConfig {
        max_num_seqs: 64,
        max_num_batched_tokens: 256,
        max_model_len: 256,
        block_size: 16,
        chunked_prefill: true,
        watermark_blocks: 1,
    }
}

/// Drives a scheduler the way the engine does: commit each plan, then append a token (or
/// finish) for every sequence whose step sampled.
struct Sim {
    sched: Scheduler,
    space: CountingBlocks,
    /// Tokens left to generate per sequence.
    left: HashMap<SeqId, usize>,
    generated: HashMap<SeqId, usize>,
    plans: Vec<StepPlan>,
}

impl Sim {
    fn new(cfg: SchedulerConfig, blocks: usize, host: usize) -> Self {
        Self {
            sched: Scheduler::new(cfg, blocks).expect("config"),
            space: CountingBlocks::new(blocks, host),
            left: HashMap::new(),
            generated: HashMap::new(),
            plans: Vec::new(),
        }
    }

    fn add(&mut self, id: SeqId, prompt: usize, max_tokens: usize) {
        self.sched.add(id, prompt);
        self.left.insert(id, max_tokens);
    }

    fn step(&mut self) -> StepPlan {
        let plan = self.sched.schedule(&mut self.space).expect("schedule");
        let c = *self.sched.config();
        assert!(plan.num_tokens() <= c.max_num_batched_tokens);
        assert!(self.sched.num_running() <= c.max_num_seqs);
        self.sched.commit(&plan);
        for s in &plan.scheduled {
            if !s.samples {
                continue;
            }
            *self.generated.entry(s.id).or_default() += 1;
            let left = self.left.get_mut(&s.id).expect("known");
            *left -= 1;
            if *left == 0 {
                self.sched.finish(s.id, &mut self.space).expect("finish");
            } else {
                self.sched.append_token(s.id).expect("append");
            }
        }
        self.plans.push(plan.clone());
        plan
    }

    fn run(&mut self, max_steps: usize) {
        let mut steps = 0;
        while !self.sched.is_idle() {
            self.step();
            steps += 1;
            assert!(steps <= max_steps, "no progress after {steps} steps");
        }
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
        prop_assert_eq!(sim.space.num_free(), sim.space.num_blocks());
        prop_assert_eq!(sim.space.host.num_used(), 0);
    }
}

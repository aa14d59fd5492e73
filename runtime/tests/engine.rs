//! The engine thread with the default model: concurrent requests under KV pressure finish with
//! the output they have alone, stop conditions, seeded sampling, and aborts free their blocks.

mod common;

use std::time::{Duration, Instant};

use candle_core::Device;
use ferrite_runtime::engine::core::{EngineHandle, Event, FinishReason, Request, spawn};
use ferrite_runtime::engine::sampler::SamplingParams;
use ferrite_runtime::engine::scheduler::SchedulerConfig;
use ferrite_runtime::engine::stats::NoStats;
use ferrite_runtime::kv::{KvCache, KvCacheConfig};
use ferrite_runtime::model::{self, LoadOptions, Tokenizer, WeightMode};
use tokio::sync::mpsc;

struct Output {
    tokens: Vec<u32>,
    text: String,
    reason: FinishReason,
    completion_tokens: usize,
}

/// Starts an engine on the default model with `blocks` device and `host` swap blocks.
/// Quantized weights keep every row's numerics independent of the batch, so "same output as
/// alone" is exact.
fn engine(blocks: usize, host: usize, max_num_seqs: usize) -> (EngineHandle, Tokenizer) {
    let opts = LoadOptions {
        weight_mode: WeightMode::Quantized,
        max_model_len: Some(256),
        ..Default::default()
    };
    let m = model::load(&common::default_model(), &opts).expect("load");
    let tok = m.tokenizer.clone();
    let kv = KvCacheConfig::for_model(m.model.config(), 16, blocks, host);
    let cache = KvCache::new(kv, &Device::Cpu).expect("cache");
    let cfg = SchedulerConfig {
        max_num_seqs,
        max_num_batched_tokens: 256,
        max_model_len: 256,
        block_size: 16,
        chunked_prefill: true,
        watermark_blocks: 1,
    };
    let (h, _join) = spawn(m, cache, cfg, Box::new(NoStats)).expect("spawn");
    (h, tok)
}

fn greedy() -> SamplingParams {
    SamplingParams {
        temperature: 0.0,
        ..Default::default()
    }
}

fn submit(
    h: &EngineHandle,
    prompt: Vec<u32>,
    sampling: SamplingParams,
    max_tokens: usize,
    stop: Vec<String>,
) -> mpsc::UnboundedReceiver<Event> {
    submit_with(h, prompt, sampling, max_tokens, stop, false)
}

fn submit_with(
    h: &EngineHandle,
    prompt: Vec<u32>,
    sampling: SamplingParams,
    max_tokens: usize,
    stop: Vec<String>,
    ignore_eos: bool,
) -> mpsc::UnboundedReceiver<Event> {
    let (tx, rx) = mpsc::unbounded_channel();
    h.submit(Request {
        prompt,
        sampling,
        max_tokens,
        stop,
        stop_token_ids: vec![],
        ignore_eos,
        events: tx,
        arrival: std::time::Instant::now(),
        group: None,
    })
    .expect("submit");
    rx
}

fn collect(mut rx: mpsc::UnboundedReceiver<Event>) -> Output {
    let mut out = Output {
        tokens: vec![],
        text: String::new(),
        reason: FinishReason::Abort,
        completion_tokens: 0,
    };
    while let Some(ev) = rx.blocking_recv() {
        match ev {
            Event::Token { token, text, .. } => {
                out.tokens.push(token);
                out.text.push_str(&text);
            }
            Event::Finished {
                reason,
                text,
                completion_tokens,
                ..
            } => {
                out.text.push_str(&text);
                out.reason = reason;
                out.completion_tokens = completion_tokens;
                return out;
            }
            Event::Failed(e) => panic!("request failed: {e}"),
        }
    }
    panic!("event stream ended without Finished");
}

fn wait_idle(h: &EngineHandle) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let s = h.stats();
        if s.num_running + s.num_waiting + s.num_swapped == 0
            && s.blocks_used == 0
            && s.host_blocks_used == 0
        {
            return;
        }
        assert!(Instant::now() < deadline, "engine not idle: {s:?}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn prompts(tok: &Tokenizer) -> Vec<Vec<u32>> {
    (0..12)
        .map(|i| {
            let q = format!(
                "Question {i}: {}",
                "why is the sky blue and the sea green? ".repeat(1 + i % 4)
            );
            tok.encode(
                &format!("<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"),
                false,
            )
            .expect("enc")
        })
        .collect()
}

#[test]
fn concurrent_requests_under_kv_pressure_match_their_solo_runs() {
    // 20 blocks (320 tokens) for 12 requests of ~25-60 prompt tokens and 24 new tokens each
    // (EOS ignored, so every request grows): they cannot all stay resident, so the engine must
    // preempt (swapping while 6 host blocks last, recomputing after).
    let (h, tok) = engine(20, 6, 12);
    let ps = prompts(&tok);
    let solo: Vec<Output> = ps
        .iter()
        .map(|p| collect(submit_with(&h, p.clone(), greedy(), 24, vec![], true)))
        .collect();
    wait_idle(&h);
    let before = h.stats().num_preemptions;
    let rxs: Vec<_> = ps
        .iter()
        .map(|p| submit_with(&h, p.clone(), greedy(), 24, vec![], true))
        .collect();
    let together: Vec<Output> = rxs.into_iter().map(collect).collect();
    let stats = h.stats();
    assert!(
        stats.num_preemptions > before,
        "the workload did not force preemption: {stats:?}"
    );
    for (i, (a, b)) in solo.iter().zip(&together).enumerate() {
        assert_eq!(a.tokens, b.tokens, "request {i} changed under load");
        assert_eq!(a.text, b.text);
        assert_eq!(a.reason, b.reason);
        assert_eq!(b.completion_tokens, 24);
    }
    wait_idle(&h);
    h.shutdown();
}

#[test]
fn stop_strings_max_tokens_and_seeds() {
    let (h, tok) = engine(64, 0, 8);
    let p = tok
        .encode(
            "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
            false,
        )
        .expect("enc");
    let full = collect(submit(&h, p.clone(), greedy(), 32, vec![]));
    assert_eq!(
        full.reason,
        FinishReason::Stop,
        "EOS ends it: {:?}",
        full.text
    );
    assert_eq!(full.text, "The capital of France is Paris.");

    let stopped = collect(submit(&h, p.clone(), greedy(), 32, vec![" Paris".into()]));
    assert_eq!(stopped.reason, FinishReason::Stop);
    assert_eq!(stopped.text, "The capital of France is");

    let short = collect(submit(&h, p.clone(), greedy(), 3, vec![]));
    assert_eq!(short.reason, FinishReason::Length);
    assert_eq!(short.completion_tokens, 3);

    let sampled = |seed| {
        let s = SamplingParams {
            temperature: 1.0,
            seed: Some(seed),
            ..Default::default()
        };
        collect(submit(&h, p.clone(), s, 16, vec![])).tokens
    };
    assert_eq!(sampled(11), sampled(11), "same seed, same tokens");
    let others: Vec<_> = (12..16).map(sampled).collect();
    assert!(
        others.iter().any(|o| *o != sampled(11)),
        "different seeds should diverge"
    );
    h.shutdown();
}

#[test]
fn dropped_receivers_abort_and_free_their_blocks() {
    let (h, tok) = engine(64, 0, 16);
    let ps = prompts(&tok);
    let mut rxs: Vec<_> = ps
        .iter()
        .map(|p| submit(&h, p.clone(), greedy(), 200, vec![]))
        .collect();
    // Wait until every request has produced a token, then drop them all.
    for rx in rxs.iter_mut() {
        match rx.blocking_recv() {
            Some(Event::Token { .. }) => {}
            other => panic!("expected a token, got {other:?}"),
        }
    }
    assert!(h.stats().blocks_used > 0);
    drop(rxs);
    wait_idle(&h);
    h.shutdown();
}

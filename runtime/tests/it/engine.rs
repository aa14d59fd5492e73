//! The engine thread with the default model: concurrent requests under KV pressure finish with
//! the output they have alone, prefix caching changes no output, stop conditions, seeded
//! sampling, and aborts free their blocks.

use crate::common;

use std::time::{Duration, Instant};

use ferrite_runtime::engine::request::SLOW_READER;
use ferrite_runtime::engine::stats::StatsSink;
use ferrite_runtime::engine::{
    self, Budget, EngineConfig, EngineHandle, EngineInfo, Event, EventReceiver, FinishReason,
    KvSizing, Pooling, PoolingKind, Request, SamplingParams, Scheduling, event_channel,
};
use ferrite_runtime::kv::CacheDtype;
use ferrite_runtime::model::{LoadOptions, Tokenizer, WeightMode};

struct Output {
    tokens: Vec<u32>,
    text: String,
    reason: FinishReason,
    completion_tokens: usize,
    cached_tokens: usize,
}

/// Starts an engine on the default model with `blocks` device and `host` swap blocks.
/// Packed weights (the CPU's default) keep every row's numerics independent of the batch
/// (`batch_invariance.rs`), so "same output as alone" is exact; they prefill several times
/// faster than candle's quantized kernels, which redo the unpacking for every row.
fn engine(blocks: usize, host: usize, max_num_seqs: usize) -> (EngineHandle, Tokenizer) {
    engine_with(blocks, host, max_num_seqs, true)
}

fn engine_with(
    blocks: usize,
    host: usize,
    max_num_seqs: usize,
    prefix_caching: bool,
) -> (EngineHandle, Tokenizer) {
    engine_budget(blocks, host, max_num_seqs, prefix_caching, 256)
}

/// [`engine_with`] with `budget` tokens per step (prompts longer than it are chunked).
fn engine_budget(
    blocks: usize,
    host: usize,
    max_num_seqs: usize,
    prefix_caching: bool,
    budget: usize,
) -> (EngineHandle, Tokenizer) {
    let config = EngineConfig {
        model: common::default_model(),
        load: LoadOptions {
            weight_mode: WeightMode::Packed,
            max_model_len: Some(256),
            ..Default::default()
        },
        kv: KvSizing {
            block_size: 16,
            device: Budget::Blocks(blocks),
            host: Budget::Blocks(host),
            dtype: CacheDtype::Auto,
        },
        scheduling: Scheduling {
            max_num_seqs,
            max_num_batched_tokens: budget,
            chunked_prefill: true,
            prefix_caching,
            max_loras: 1,
        },
        compute_nice: 0,
    };
    // No statistics: an empty list of sinks.
    let no_stats = |_: &EngineInfo| Ok(Box::new(Vec::<Box<dyn StatsSink>>::new()) as _);
    let started = engine::start(&config, no_stats).expect("the engine starts");
    (started.handle, started.tokenizer)
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
) -> EventReceiver {
    submit_with(h, prompt, sampling, max_tokens, stop, false)
}

fn submit_with(
    h: &EngineHandle,
    prompt: Vec<u32>,
    sampling: SamplingParams,
    max_tokens: usize,
    stop: Vec<String>,
    ignore_eos: bool,
) -> EventReceiver {
    let (tx, rx) = event_channel();
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
        adapter: None,
        guide: None,
        pooling: None,
    })
    .expect("submit");
    rx
}

fn collect(mut rx: EventReceiver) -> Output {
    let mut out = Output {
        tokens: vec![],
        text: String::new(),
        reason: FinishReason::Abort,
        completion_tokens: 0,
        cached_tokens: 0,
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
                cached_tokens,
                ..
            } => {
                out.text.push_str(&text);
                out.reason = reason;
                out.completion_tokens = completion_tokens;
                out.cached_tokens = cached_tokens;
                return out;
            }
            Event::Failed(e) | Event::Refused(e) => panic!("request failed: {e}"),
            Event::Embedding { .. } => panic!("a generation was pooled"),
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

/// Prompts sharing a ~70-token system prompt in the ways that matter to block-level caching:
/// prefixes ending mid-block and exactly at a block boundary (16 tokens), a prompt repeated
/// whole, and a prompt that extends an earlier one (a later chat turn).
fn shared_prefix_prompts(tok: &Tokenizer) -> Vec<Vec<u32>> {
    let system = tok
        .encode(
            "<|im_start|>system\nYou are a careful assistant for a small library in a quiet \
             town. Answer every question in one short sentence. Name the facts you rely on, \
             say so when you do not know, and never invent numbers, dates, people or places. \
             Keep a friendly tone, avoid jargon, and prefer plain words.<|im_end|>\n",
            false,
        )
        .expect("enc");
    assert!(
        system.len() > 50,
        "system prompt of {} tokens",
        system.len()
    );
    let ask = |q: &str| {
        tok.encode(
            &format!("<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"),
            false,
        )
        .expect("enc")
    };
    let join = |a: &[u32], b: &[u32]| [a, b].concat();
    let first = join(&system, &ask("What is the capital of France?"));
    let boundary = join(&system[..48], &ask("Why is the sky blue?"));
    let mid_block = join(&system[..50], &ask("Name a large ocean."));
    let mut next_turn = first.clone();
    next_turn.extend(
        tok.encode("The capital of France is Paris.<|im_end|>\n", false)
            .expect("enc"),
    );
    next_turn.extend(ask("And of Italy?"));
    vec![first.clone(), boundary, mid_block, first, next_turn]
}

#[test]
fn prefix_caching_changes_no_output() {
    let run = |caching: bool| {
        let (h, tok) = engine_with(64, 8, 8, caching);
        let ps = shared_prefix_prompts(&tok);
        // One at a time (each finds the earlier ones cached), then all at once.
        let mut outs: Vec<Output> = ps
            .iter()
            .map(|p| collect(submit_with(&h, p.clone(), greedy(), 16, vec![], true)))
            .collect();
        let rxs: Vec<_> = ps
            .iter()
            .map(|p| submit_with(&h, p.clone(), greedy(), 16, vec![], true))
            .collect();
        outs.extend(rxs.into_iter().map(collect));
        wait_idle(&h);
        h.shutdown();
        (ps, outs)
    };
    let (ps, cached) = run(true);
    let (_, plain) = run(false);
    for (i, (a, b)) in cached.iter().zip(&plain).enumerate() {
        assert_eq!(
            a.tokens, b.tokens,
            "output {i} differs with the prefix cache"
        );
        assert_eq!(a.text, b.text);
        assert_eq!(b.cached_tokens, 0, "nothing is cached with caching off");
    }
    // The first run of each prompt, in order: what the cache could supply, in whole blocks.
    let full_blocks = full_blocks_of;
    assert_eq!(cached[0].cached_tokens, 0);
    assert_eq!(
        cached[1].cached_tokens, 48,
        "prefix ending at a block boundary"
    );
    assert_eq!(
        cached[2].cached_tokens, 48,
        "prefix ending mid-block: whole blocks only"
    );
    assert_eq!(
        cached[3].cached_tokens,
        full_blocks(ps[3].len() - 1),
        "a repeated prompt recomputes at least its last token"
    );
    assert_eq!(
        cached[4].cached_tokens,
        full_blocks(ps[0].len()),
        "the earlier turn"
    );
    // The second pass finds every prompt's blocks cached.
    for (i, (o, p)) in cached[5..].iter().zip(&ps).enumerate() {
        assert_eq!(
            o.cached_tokens,
            full_blocks(p.len() - 1),
            "second pass, prompt {i}"
        );
    }
}

#[test]
fn an_evicted_prefix_gives_the_same_answer() {
    // 16 blocks (256 tokens, one max_model_len): the other prompts need every block, so the
    // first's are evicted.
    let (h, tok) = engine(16, 0, 4);
    let ps = shared_prefix_prompts(&tok);
    let first = collect(submit_with(&h, ps[0].clone(), greedy(), 16, vec![], true));
    let filler = prompts(&tok);
    for p in filler.iter().rev().take(4) {
        collect(submit_with(&h, p.clone(), greedy(), 60, vec![], true));
    }
    let again = collect(submit_with(&h, ps[0].clone(), greedy(), 16, vec![], true));
    assert!(
        again.cached_tokens < full_blocks_of(ps[0].len() - 1),
        "the prefix should have been evicted (cached {})",
        again.cached_tokens
    );
    assert_eq!(first.tokens, again.tokens);
    wait_idle(&h);
    h.shutdown();
}

fn full_blocks_of(n: usize) -> usize {
    n / 16 * 16
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

fn question(tok: &Tokenizer, q: &str) -> Vec<u32> {
    tok.encode(
        &format!("<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"),
        false,
    )
    .expect("enc")
}

/// Every event of a request, until the engine lets go of it.
fn drain(mut rx: EventReceiver) -> Vec<Event> {
    let mut out = Vec::new();
    while let Some(ev) = rx.blocking_recv() {
        out.push(ev);
    }
    out
}

#[test]
fn a_bad_prompt_fails_alone_and_the_batch_goes_on() {
    let (h, tok) = engine(64, 0, 8);
    let p = question(&tok, "What is the capital of France?");
    let mut bad = p.clone();
    bad.push(1_000_000); // beyond any vocabulary
    let good = submit(&h, p.clone(), greedy(), 32, vec![]);
    let refused = submit(&h, bad, greedy(), 32, vec![]);
    let out = collect(good);
    assert_eq!(out.text, "The capital of France is Paris.");
    match drain(refused).as_slice() {
        [Event::Failed(msg)] => assert!(msg.contains("vocabulary"), "{msg}"),
        other => panic!("expected one failure, got {other:?}"),
    }
    let empty = submit(&h, vec![], greedy(), 4, vec![]);
    assert!(matches!(drain(empty).as_slice(), [Event::Failed(_)]));
    h.shutdown();
}

#[test]
fn a_reader_that_falls_behind_is_ended_not_buffered() {
    // The engine's rule holds for a channel of any size: a small one keeps the test short
    // (the server's, from `event_channel`, holds EVENT_BACKLOG).
    let (h, tok) = engine(64, 0, 8);
    let p = question(&tok, "Write a long story about the sea.");
    let (tx, unread) = tokio::sync::mpsc::channel(16);
    h.submit(Request {
        prompt: p.clone(),
        sampling: greedy(),
        max_tokens: 100,
        stop: vec![],
        stop_token_ids: vec![],
        ignore_eos: true,
        events: tx,
        arrival: Instant::now(),
        group: None,
        adapter: None,
        guide: None,
        pooling: None,
    })
    .expect("submit");
    // A reader that keeps up is not affected.
    let read = collect(submit_with(&h, p, greedy(), 40, vec![], true));
    assert_eq!(read.completion_tokens, 40);
    wait_idle(&h);
    let events = drain(unread);
    assert!(events.len() <= 16, "{} events held", events.len());
    match events.last() {
        Some(Event::Failed(msg)) => assert_eq!(msg, SLOW_READER),
        other => panic!("expected the slow-reader failure last, got {other:?}"),
    }
    h.shutdown();
}

#[test]
fn bytes_that_never_form_a_character_are_released_in_bounded_windows() {
    // A lone UTF-8 lead byte, forced for every token: the text never becomes valid, so a
    // decoder that waits for a whole character would hold (and re-decode) the whole output.
    let (h, tok) = engine(64, 0, 8);
    let lead = tok.token_to_id("ð").expect("the byte 0xF0 is a token");
    let s = SamplingParams {
        temperature: 0.0,
        logit_bias: vec![(lead, 100.0)],
        ..Default::default()
    };
    let rx = submit_with(&h, question(&tok, "Say hi."), s, 64, vec![], true);
    let mut with_text = 0;
    let mut text = String::new();
    let mut rx = rx;
    while let Some(ev) = rx.blocking_recv() {
        match ev {
            Event::Token { text: t, token, .. } => {
                assert_eq!(token, lead);
                with_text += usize::from(!t.is_empty());
                text.push_str(&t);
            }
            Event::Finished { text: t, .. } => {
                text.push_str(&t);
                break;
            }
            Event::Failed(e) | Event::Refused(e) => panic!("{e}"),
            Event::Embedding { .. } => panic!("a generation was pooled"),
        }
    }
    assert!(with_text >= 64 / 8 - 1, "{with_text} tokens released text");
    assert!(
        text.chars().all(|c| c == '\u{FFFD}') && !text.is_empty(),
        "{text:?}"
    );
    h.shutdown();
}

/// Submits an embedding request.
fn embed(h: &EngineHandle, prompt: Vec<u32>, kind: PoolingKind) -> EventReceiver {
    let (tx, rx) = event_channel();
    h.submit(Request {
        prompt,
        sampling: SamplingParams::default(),
        max_tokens: 0,
        stop: vec![],
        stop_token_ids: vec![],
        ignore_eos: false,
        events: tx,
        arrival: Instant::now(),
        group: None,
        adapter: None,
        guide: None,
        pooling: Some(Pooling {
            kind,
            normalize: true,
        }),
    })
    .expect("submit");
    rx
}

/// An embedding request's one event: its vector (as bits) and cached prompt tokens.
fn vector(mut rx: EventReceiver, prompt_len: usize) -> (Vec<u32>, usize) {
    match rx.blocking_recv() {
        Some(Event::Embedding {
            values,
            prompt_tokens,
            cached_tokens,
        }) => {
            assert_eq!(prompt_tokens, prompt_len);
            let norm: f32 = values.iter().map(|v| v * v).sum::<f32>().sqrt();
            assert!((norm - 1.0).abs() < 1e-4, "norm {norm}");
            assert!(rx.blocking_recv().is_none(), "events after the embedding");
            (values.iter().map(|v| v.to_bits()).collect(), cached_tokens)
        }
        other => panic!("expected an embedding, got {other:?}"),
    }
}

/// A prompt of about `words` words.
fn long_prompt(tok: &Tokenizer, words: usize, topic: &str) -> Vec<u32> {
    let text: Vec<String> = (0..words).map(|i| format!("{topic}{}", i % 7)).collect();
    tok.encode(&text.join(" "), true).expect("tokenize")
}

#[test]
fn an_embedding_is_the_same_alone_and_among_generations_and_other_embeddings() {
    let (h, tok) = engine(64, 0, 8);
    let a = long_prompt(&tok, 40, "river");
    let b = long_prompt(&tok, 25, "mountain");
    for kind in [PoolingKind::Last, PoolingKind::Mean] {
        let (alone, _) = vector(embed(&h, a.clone(), kind), a.len());
        let (other, _) = vector(embed(&h, b.clone(), kind), b.len());
        assert_ne!(alone, other, "two texts, one vector ({kind:?})");
        // Now beside two generations and another embedding, submitted together.
        let gens: Vec<_> = (0..2)
            .map(|_| {
                submit_with(
                    &h,
                    question(&tok, "Tell me a story."),
                    greedy(),
                    24,
                    vec![],
                    true,
                )
            })
            .collect();
        let rx_b = embed(&h, b.clone(), kind);
        let rx_a = embed(&h, a.clone(), kind);
        assert_eq!(vector(rx_a, a.len()).0, alone, "{kind:?} in a batch");
        assert_eq!(vector(rx_b, b.len()).0, other, "{kind:?} in a batch");
        for g in gens {
            assert_eq!(collect(g).completion_tokens, 24);
        }
        wait_idle(&h);
    }
    h.shutdown();
}

#[test]
fn a_mean_is_the_same_whatever_the_chunks_and_never_reads_the_prefix_cache() {
    let (whole, tok) = engine_budget(64, 0, 8, true, 256);
    let p = long_prompt(&tok, 90, "cloud");
    assert!(p.len() > 100, "{} tokens", p.len());
    let (first, cached) = vector(embed(&whole, p.clone(), PoolingKind::Mean), p.len());
    assert_eq!(cached, 0);
    // Its blocks are now in the prefix cache; a mean still computes every token.
    let (again, cached) = vector(embed(&whole, p.clone(), PoolingKind::Mean), p.len());
    assert_eq!((again.as_slice(), cached), (first.as_slice(), 0));
    // The last token's state may start from the cached blocks, with the same result.
    let (last, _) = vector(embed(&whole, p.clone(), PoolingKind::Last), p.len());
    let (last_cached, cached) = vector(embed(&whole, p.clone(), PoolingKind::Last), p.len());
    assert!(
        cached > 0,
        "the second last-token pool found no cached blocks"
    );
    assert_eq!(last_cached, last);
    whole.shutdown();
    // Chunks of 32 tokens: the same bits.
    let (chunked, _) = engine_budget(64, 0, 8, false, 32);
    assert_eq!(
        vector(embed(&chunked, p.clone(), PoolingKind::Mean), p.len()).0,
        first
    );
    assert_eq!(
        vector(embed(&chunked, p.clone(), PoolingKind::Last), p.len()).0,
        last
    );
    chunked.shutdown();
}

//! `/metrics` after a known workload: 200 requests over 32 concurrent connections, with `n=2`,
//! chat, streaming and client aborts, checked counter by counter against what the clients saw.
//! Counters and latency histograms count engine sequences (a request with `n=2` is two, as in
//! vLLM V1); the request-parameter histograms count API requests.

use crate::common;

use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::thread;
use std::time::Duration;

use common::server::{Server, SseReader, start};
use serde_json::{Value, json};

const REQUESTS: usize = 200;
const CONNECTIONS: usize = 32;
/// Aborted requests ask for this many tokens, so they cannot finish before the disconnect.
const ABORT_MAX_TOKENS: usize = 200;

#[derive(Debug, Clone, Copy, PartialEq)]
enum Kind {
    /// Non-streaming completion with `n=2`.
    Pair,
    Chat,
    /// Streaming completion that the client drops after its first token.
    Abort,
    /// Streaming completion with `include_usage`.
    Stream,
    Plain,
}

fn kind(i: usize) -> Kind {
    match i % 10 {
        0 => Kind::Pair,
        1 | 2 => Kind::Chat,
        3 => Kind::Abort,
        4 | 5 => Kind::Stream,
        _ => Kind::Plain,
    }
}

/// What one client saw.
#[derive(Debug, Default)]
struct Outcome {
    kind: Option<Kind>,
    /// Prompt tokens of one sequence (usage, or `/tokenize` for aborts).
    prompt_tokens: u64,
    /// Finish reason of each choice.
    finishes: Vec<String>,
    /// Completion tokens of all choices (completed requests).
    completion_tokens: u64,
    /// Tokens an aborted request received before it hung up.
    received: u64,
}

fn prompt(i: usize) -> String {
    let topics = [
        "tides",
        "comets",
        "honey",
        "glaciers",
        "lighthouses",
        "maps",
    ];
    format!(
        "Request {i}. {}Write a sentence about {}.",
        "Keep it short. ".repeat(i % 5),
        topics[i % topics.len()]
    )
}

fn run_one(s: &Server, i: usize) -> Outcome {
    let max_tokens = 3 + i % 6;
    let mut out = Outcome {
        kind: Some(kind(i)),
        ..Outcome::default()
    };
    match kind(i) {
        Kind::Pair | Kind::Plain => {
            let n = if kind(i) == Kind::Pair { 2 } else { 1 };
            let r: Value = s
                .post(
                    "/v1/completions",
                    &json!({"model": "smol", "prompt": prompt(i), "max_tokens": max_tokens,
                            "n": n, "temperature": 0.8, "seed": i}),
                )
                .into_json()
                .expect("json");
            out.prompt_tokens = r["usage"]["prompt_tokens"].as_u64().expect("usage");
            out.completion_tokens = r["usage"]["completion_tokens"].as_u64().expect("usage");
            for c in r["choices"].as_array().expect("choices") {
                out.finishes
                    .push(c["finish_reason"].as_str().expect("finish").into());
            }
        }
        Kind::Chat => {
            let r: Value = s
                .post(
                    "/v1/chat/completions",
                    &json!({"model": "smol", "max_tokens": max_tokens,
                            "messages": [{"role": "user", "content": prompt(i)}]}),
                )
                .into_json()
                .expect("json");
            out.prompt_tokens = r["usage"]["prompt_tokens"].as_u64().expect("usage");
            out.completion_tokens = r["usage"]["completion_tokens"].as_u64().expect("usage");
            out.finishes.push(
                r["choices"][0]["finish_reason"]
                    .as_str()
                    .expect("finish")
                    .into(),
            );
        }
        Kind::Stream => {
            let mut sse = SseReader::new(s.post(
                "/v1/completions",
                &json!({"model": "smol", "prompt": prompt(i), "max_tokens": max_tokens,
                        "stream": true, "stream_options": {"include_usage": true}}),
            ));
            while let Some(c) = sse.next_chunk() {
                if let Some(f) = c["choices"][0]["finish_reason"].as_str() {
                    out.finishes.push(f.into());
                }
                if c["usage"].is_object() {
                    out.prompt_tokens = c["usage"]["prompt_tokens"].as_u64().expect("usage");
                    out.completion_tokens =
                        c["usage"]["completion_tokens"].as_u64().expect("usage");
                }
            }
        }
        Kind::Abort => {
            let t: Value = s
                .post("/tokenize", &json!({"model": "smol", "prompt": prompt(i)}))
                .into_json()
                .expect("json");
            out.prompt_tokens = t["count"].as_u64().expect("count");
            let mut sse = SseReader::new(s.post(
                "/v1/completions",
                &json!({"model": "smol", "prompt": prompt(i), "max_tokens": ABORT_MAX_TOKENS,
                        "ignore_eos": true, "stream": true}),
            ));
            while let Some(c) = sse.next_chunk() {
                if c["choices"][0]["text"]
                    .as_str()
                    .is_some_and(|t| !t.is_empty())
                {
                    out.received += 1;
                    break;
                }
            }
            assert_eq!(out.received, 1, "request {i} saw no token before its abort");
            // Dropping the reader closes the connection mid-stream.
        }
    }
    out
}

#[test]
fn counters_and_histogram_counts_equal_the_workload_exactly() {
    let s = start(&["--max-model-len", "512", "--max-num-seqs", "32"]);
    let mut s = s;
    s.wait_ready();
    let before = s.scrape();
    assert_eq!(before.get("vllm:generation_tokens_total", &[]), 0.0);

    let next = AtomicUsize::new(0);
    let outcomes = Mutex::new(Vec::new());
    thread::scope(|scope| {
        for _ in 0..CONNECTIONS {
            scope.spawn(|| {
                loop {
                    let i = next.fetch_add(1, Ordering::SeqCst);
                    if i >= REQUESTS {
                        break;
                    }
                    let o = run_one(&s, i);
                    outcomes.lock().expect("lock").push(o);
                }
            });
        }
    });
    let outcomes = outcomes.into_inner().expect("lock");
    assert_eq!(outcomes.len(), REQUESTS);

    // Aborts are noticed within an engine step; then everything is idle.
    for g in [
        "vllm:num_requests_running{",
        "vllm:num_requests_waiting{",
        "vllm:num_requests_swapped{",
        "vllm:kv_cache_usage_perc{",
        "vllm:gpu_cache_usage_perc{",
        "vllm:cpu_cache_usage_perc{",
    ] {
        s.wait_metric(g, 0.0, Duration::from_secs(30));
    }
    let m = s.scrape();

    let count = |k: Kind| outcomes.iter().filter(|o| o.kind == Some(k)).count() as f64;
    let n_of = |o: &Outcome| if o.kind == Some(Kind::Pair) { 2 } else { 1 };
    let sequences: f64 = outcomes.iter().map(|o| n_of(o) as f64).sum();
    let aborted = count(Kind::Abort);
    assert_eq!(aborted, 20.0);
    assert_eq!(sequences, 220.0);

    // Tokens.
    let prompt_tokens: u64 = outcomes.iter().map(|o| o.prompt_tokens * n_of(o)).sum();
    assert_eq!(m.get("vllm:prompt_tokens_total", &[]), prompt_tokens as f64);
    let completed_gen: u64 = outcomes.iter().map(|o| o.completion_tokens).sum();
    let received: u64 = outcomes.iter().map(|o| o.received).sum();
    let generated = m.get("vllm:generation_tokens_total", &[]);
    let aborted_gen = generated - completed_gen as f64;
    // The client cannot see how many tokens an aborted request made before the server noticed
    // the hang-up; it is at least what it received and less than its max_tokens each.
    assert!(
        aborted_gen >= received as f64 && aborted_gen < aborted * ABORT_MAX_TOKENS as f64,
        "aborted requests generated {aborted_gen} tokens, received {received}"
    );
    // Every sequence looks its whole prompt up in the prefix cache once (aborts and both
    // choices of n=2 included); what it finds depends on timing, but never more than it asked.
    let queries = m.get("vllm:prefix_cache_queries_total", &[]);
    assert_eq!(queries, prompt_tokens as f64);
    let hits = m.get("vllm:prefix_cache_hits_total", &[]);
    assert!(hits > 0.0 && hits < queries, "hits {hits} of {queries}");
    // The per-token counter and the per-request histogram are separate code paths.
    assert_eq!(m.get("vllm:request_generation_tokens_sum", &[]), generated);
    assert_eq!(
        m.get("vllm:request_prompt_tokens_sum", &[]),
        prompt_tokens as f64
    );

    // Finish reasons, one per sequence.
    for reason in ["stop", "length"] {
        let want = outcomes
            .iter()
            .flat_map(|o| &o.finishes)
            .filter(|f| f.as_str() == reason)
            .count() as f64;
        assert_eq!(
            m.get("vllm:request_success_total", &[("finished_reason", reason)]),
            want,
            "finished_reason={reason}"
        );
    }
    assert_eq!(
        m.get(
            "vllm:request_success_total",
            &[("finished_reason", "abort")]
        ),
        aborted
    );
    let finished: f64 = ["stop", "length", "abort"]
        .iter()
        .map(|r| m.get("vllm:request_success_total", &[("finished_reason", r)]))
        .sum();
    assert_eq!(finished, sequences);

    // Histogram counts: per sequence ...
    for h in [
        "vllm:time_to_first_token_seconds",
        "vllm:e2e_request_latency_seconds",
        "vllm:request_queue_time_seconds",
        "vllm:request_inference_time_seconds",
        "vllm:request_prefill_time_seconds",
        "vllm:request_decode_time_seconds",
        "vllm:request_prompt_tokens",
        "vllm:request_generation_tokens",
    ] {
        assert_eq!(m.get(&format!("{h}_count"), &[]), sequences, "{h}_count");
        assert_eq!(
            m.get(&format!("{h}_bucket"), &[("le", "+Inf")]),
            sequences,
            "{h} +Inf bucket"
        );
    }
    // ... one gap per token after a sequence's first ...
    for h in [
        "vllm:inter_token_latency_seconds",
        "vllm:time_per_output_token_seconds",
    ] {
        assert_eq!(
            m.get(&format!("{h}_count"), &[]),
            generated - sequences,
            "{h}"
        );
    }
    // ... and per API request.
    for h in [
        "vllm:request_params_n",
        "vllm:request_params_best_of",
        "vllm:request_params_max_tokens",
        "vllm:request_max_num_generation_tokens",
    ] {
        assert_eq!(m.get(&format!("{h}_count"), &[]), REQUESTS as f64, "{h}");
    }
    assert_eq!(
        m.get("vllm:request_params_n_sum", &[]),
        REQUESTS as f64 + count(Kind::Pair)
    );
    assert!(m.get("vllm:iteration_tokens_total_count", &[]) > 0.0);
    assert!(m.get("vllm:iteration_tokens_total_sum", &[]) >= generated);

    // HTTP metrics: every request answered 200 on its route.
    let completions = REQUESTS as f64 - count(Kind::Chat);
    assert_eq!(
        m.get(
            "http_requests_total",
            &[("handler", "/v1/completions"), ("status", "200")]
        ),
        completions
    );
    assert_eq!(
        m.get(
            "http_requests_total",
            &[("handler", "/v1/chat/completions"), ("status", "200")]
        ),
        count(Kind::Chat)
    );
}

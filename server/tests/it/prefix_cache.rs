//! Automatic prefix caching over HTTP: `usage.prompt_tokens_details.cached_tokens` on every
//! response shape, the vLLM prefix-cache counters equal to what the clients saw, the setting in
//! `vllm:cache_config_info`, and `--no-enable-prefix-caching`.

use crate::common;

use std::sync::Mutex;
use std::thread;

use common::server::{Server, SseReader, start};
use serde_json::{Value, json};

/// A system prompt long enough to fill several 16-token blocks.
const SYSTEM: &str = "You are the help desk of a small public library. Answer in one short \
    sentence. Name the rule you rely on. Opening hours are nine to five on weekdays and ten to \
    two on Saturdays. Books are lent for three weeks and can be renewed twice. Never invent a \
    rule that is not listed here.";

const QUESTIONS: [&str; 6] = [
    "When do you open on Saturday?",
    "How long can I keep a book?",
    "Can I renew a book?",
    "Are you open on Sunday?",
    "Can I borrow ten books?",
    "Do you have maps?",
];

/// Prompt and cached tokens as one client saw them.
#[derive(Debug, Default, Clone, Copy)]
struct Seen {
    prompt: u64,
    cached: u64,
}

fn usage_of(u: &Value) -> Seen {
    Seen {
        prompt: u["prompt_tokens"].as_u64().expect("prompt_tokens"),
        cached: u["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .expect("usage.prompt_tokens_details.cached_tokens"),
    }
}

/// One request of the mix: chat, completion, or a stream with usage; all n=1, none aborted,
/// so every lookup the server counts is one a client saw.
fn request(s: &Server, i: usize) -> Seen {
    let q = QUESTIONS[i % QUESTIONS.len()];
    match i % 3 {
        0 => {
            let r: Value = s
                .post(
                    "/v1/chat/completions",
                    &json!({"model": "smol", "max_tokens": 4, "temperature": 0,
                            "messages": [{"role": "system", "content": SYSTEM},
                                         {"role": "user", "content": q}]}),
                )
                .into_json()
                .expect("json");
            usage_of(&r["usage"])
        }
        1 => {
            let r: Value = s
                .post(
                    "/v1/completions",
                    &json!({"model": "smol", "max_tokens": 4, "temperature": 0,
                            "prompt": format!("{SYSTEM}\nQuestion: {q}\nAnswer:")}),
                )
                .into_json()
                .expect("json");
            usage_of(&r["usage"])
        }
        _ => {
            let mut sse = SseReader::new(s.post(
                "/v1/completions",
                &json!({"model": "smol", "max_tokens": 4, "stream": true,
                        "stream_options": {"include_usage": true},
                        "prompt": format!("{SYSTEM}\nQuestion: {q}\nAnswer:")}),
            ));
            let mut seen = None;
            while let Some(c) = sse.next_chunk() {
                if c["usage"].is_object() {
                    seen = Some(usage_of(&c["usage"]));
                }
            }
            seen.expect("the stream's usage chunk")
        }
    }
}

#[test]
fn cached_tokens_and_the_counters_match_what_clients_saw() {
    let mut s = start(&["--max-model-len", "512"]);
    s.wait_ready();
    let m = s.scrape();
    assert_eq!(
        m.get(
            "vllm:cache_config_info",
            &[("enable_prefix_caching", "True")]
        ),
        1.0,
        "prefix caching is on by default"
    );
    assert_eq!(m.get("vllm:prefix_cache_queries_total", &[]), 0.0);

    // The first request of each shape computes everything; a repeat finds all but its last
    // block's worth cached.
    let first = request(&s, 1);
    assert_eq!(first.cached, 0);
    let again = request(&s, 1);
    assert_eq!(again.prompt, first.prompt);
    assert_eq!(again.cached, (first.prompt - 1) / 16 * 16);

    // Then a concurrent mix of chat, completions and streams over the shared system prompt.
    let seen = Mutex::new(vec![first, again]);
    thread::scope(|scope| {
        for t in 0..4 {
            let (s, seen) = (&s, &seen);
            scope.spawn(move || {
                for i in 0..9 {
                    let r = request(s, t * 9 + i);
                    seen.lock().expect("lock").push(r);
                }
            });
        }
    });
    let seen = seen.into_inner().expect("lock");
    let prompt: u64 = seen.iter().map(|r| r.prompt).sum();
    let cached: u64 = seen.iter().map(|r| r.cached).sum();
    assert!(
        seen.iter()
            .all(|r| r.cached % 16 == 0 && r.cached < r.prompt),
        "whole blocks, never the whole prompt: {seen:?}"
    );

    let m = s.scrape();
    let queries = m.get("vllm:prefix_cache_queries_total", &[]);
    let hits = m.get("vllm:prefix_cache_hits_total", &[]);
    assert_eq!(queries, prompt as f64, "queries count every prompt token");
    assert_eq!(
        hits, cached as f64,
        "hits are the cached_tokens clients saw"
    );
    assert!(
        hits > 0.5 * queries,
        "a shared system prompt should mostly hit: {hits} of {queries}"
    );
    assert_eq!(m.get("vllm:gpu_prefix_cache_hit_rate", &[]), hits / queries);
    assert_eq!(m.get("vllm:prompt_tokens_total", &[]), queries);
}

#[test]
fn turned_off_nothing_is_cached_or_counted() {
    let mut s = start(&["--max-model-len", "512", "--no-enable-prefix-caching"]);
    s.wait_ready();
    let a = request(&s, 0);
    let b = request(&s, 0);
    assert_eq!((a.cached, b.cached), (0, 0));
    let m = s.scrape();
    assert_eq!(
        m.get(
            "vllm:cache_config_info",
            &[("enable_prefix_caching", "False")]
        ),
        1.0
    );
    assert_eq!(m.get("vllm:prefix_cache_queries_total", &[]), 0.0);
    assert_eq!(m.get("vllm:prefix_cache_hits_total", &[]), 0.0);
}

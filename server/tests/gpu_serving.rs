//! The real server binary on an NVIDIA GPU (`--device cuda`), over real HTTP on 127.0.0.1.
//! Runs wherever `nvidia-smi` works and the server was built with `--features cuda`
//! (docs/runtime.md, "GPU tests"); elsewhere it prints one `=== GPU TEST SKIPPED` line and
//! tests nothing.

#[path = "it/common/mod.rs"]
mod common;

use std::sync::{Arc, Barrier};
use std::thread;
use std::time::Duration;

use common::server::{SseReader, read_stream, start};
use ferrite_testkit::gpu::gpu_or_skip;
use serde_json::json;

fn max_tokens(i: usize) -> usize {
    8 + (i * 7) % 57
}

/// 32 concurrent streams of mixed prompt and output lengths all finish with their full length,
/// and afterwards the scheduler and cache gauges are back at zero: nothing is left running,
/// waiting or holding KV blocks on the GPU.
#[test]
fn gpu_thirty_two_concurrent_streams_then_the_gauges_are_back_at_zero() {
    if gpu_or_skip(
        "gpu_thirty_two_concurrent_streams_then_the_gauges_are_back_at_zero",
        cfg!(feature = "cuda"),
    )
    .is_none()
    {
        return;
    }
    let mut s = start(&["--device", "cuda"]);
    s.wait_ready();
    let s = Arc::new(s);
    let start_line = Arc::new(Barrier::new(32));
    let handles: Vec<_> = (0..32usize)
        .map(|i| {
            let (s, start_line) = (s.clone(), start_line.clone());
            thread::spawn(move || {
                let prompt = format!(
                    "Question {i}: {}Tell me three facts about the number {i}.",
                    "Be brief. ".repeat(i % 9)
                );
                start_line.wait();
                read_stream(SseReader::new(s.post(
                    "/v1/completions",
                    &json!({"model": "smol", "prompt": prompt, "max_tokens": max_tokens(i),
                            "temperature": 0, "ignore_eos": true, "stream": true}),
                )))
            })
        })
        .collect();
    for (i, h) in handles.into_iter().enumerate() {
        let (text, finish) = h.join().expect("client thread");
        assert_eq!(finish.as_deref(), Some("length"), "request {i}");
        assert!(!text.is_empty(), "request {i}: no text");
    }
    let m = s.scrape();
    let generated = m.sum("vllm:generation_tokens_total");
    let want: usize = (0..32).map(max_tokens).sum();
    assert_eq!(generated as usize, want, "generation tokens counted");
    for gauge in [
        "vllm:num_requests_running{",
        "vllm:num_requests_waiting{",
        "vllm:kv_cache_usage_perc{",
    ] {
        s.wait_metric(gauge, 0.0, Duration::from_secs(5));
    }
}

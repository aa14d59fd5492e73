//! The server under concurrent load, client disconnects and SIGTERM, over real HTTP on
//! 127.0.0.1 with the default model.

use crate::common;

use std::sync::{Arc, Barrier};
use std::thread;
use std::time::Duration;

use common::server::{SseReader, read_stream, start};
use serde_json::json;

const RUNNING: &str = "vllm:num_requests_running{";
const KV_USAGE: &str = "vllm:kv_cache_usage_perc{";

/// 64 prompts of mixed lengths (about 12 to 45 tokens) with mixed output lengths.
fn mixed_requests() -> Vec<serde_json::Value> {
    let topics = [
        "rivers",
        "planets",
        "bread",
        "chess",
        "violins",
        "volcanoes",
        "owls",
    ];
    (0..64)
        .map(|i| {
            let filler = "Be brief and precise. ".repeat(i % 7);
            let prompt = format!(
                "Question {i}: {filler}Tell me three facts about {}.",
                topics[i % topics.len()]
            );
            json!({
                "model": "smol", "prompt": prompt, "max_tokens": 2 + (i * 5) % 13,
                "temperature": 0, "ignore_eos": true, "stream": true,
            })
        })
        .collect()
}

#[test]
fn sixty_four_concurrent_streams_under_preemption_match_their_solo_runs() {
    // 16 blocks of 16 tokens hold any one of these sequences (at most 4 blocks) but not 64 at
    // once: the newest are preempted, some to the small host pool (swap) and the rest by
    // recompute. Packed weights (the CPU's default) are bitwise batch invariant, so "equal to
    // the solo run" is exact.
    let mut s = start(&[
        "--weights",
        "packed",
        "--num-gpu-blocks",
        "16",
        "--max-model-len",
        "128",
        "--swap-space",
        "0.01",
    ]);
    s.wait_ready();
    let reqs = mixed_requests();
    let solo: Vec<(String, Option<String>)> = reqs
        .iter()
        .map(|r| read_stream(SseReader::new(s.post("/v1/completions", r))))
        .collect();
    assert_eq!(s.metric("vllm:num_preemptions_total{"), 0.0);

    // Whether requests overlap enough to exhaust the pool depends on how the OS schedules 64
    // client threads; on a loaded CI machine they can trickle in. Every round checks every
    // output; rounds repeat (at most three) until one has preempted.
    let s = Arc::new(s);
    for round in 1..=3 {
        let start_line = Arc::new(Barrier::new(reqs.len()));
        let handles: Vec<_> = reqs
            .iter()
            .cloned()
            .map(|r| {
                let (s, start_line) = (s.clone(), start_line.clone());
                thread::spawn(move || {
                    start_line.wait();
                    read_stream(SseReader::new(s.post("/v1/completions", &r)))
                })
            })
            .collect();
        for (i, (h, want)) in handles.into_iter().zip(&solo).enumerate() {
            let got = h.join().expect("client thread");
            assert_eq!(
                &got, want,
                "round {round}: request {i} differs from its solo run"
            );
            assert_eq!(got.1.as_deref(), Some("length"));
        }
        if s.metric("vllm:num_preemptions_total{") > 0.0 {
            break;
        }
        eprintln!("round {round}: the requests never exhausted the pool; running them again");
    }
    assert!(
        s.metric("vllm:num_preemptions_total{") > 0.0,
        "three rounds of 64 concurrent requests never preempted"
    );
    s.wait_metric(RUNNING, 0.0, Duration::from_secs(5));
    s.wait_metric(KV_USAGE, 0.0, Duration::from_secs(5));
    assert_eq!(s.metric("vllm:cpu_cache_usage_perc{"), 0.0);
    assert_eq!(s.metric("vllm:num_requests_swapped{"), 0.0);
}

#[test]
fn clients_that_drop_mid_stream_free_everything_and_count_as_aborts() {
    let mut s = start(&["--weights", "quantized"]);
    s.wait_ready();
    let s = Arc::new(s);
    let handles: Vec<_> = (0..20)
        .map(|i| {
            let s = s.clone();
            thread::spawn(move || {
                let body = json!({
                    "prompt": format!("Story {i}: once upon a time"), "max_tokens": 400,
                    "temperature": 0, "ignore_eos": true, "stream": true,
                });
                let mut r = SseReader::new(s.post("/v1/completions", &body));
                for _ in 0..3 {
                    assert!(r.next_chunk().is_some(), "stream ended early");
                }
                // Dropping the reader closes the connection mid-stream.
            })
        })
        .collect();
    for h in handles {
        h.join().expect("client thread");
    }
    s.wait_metric(RUNNING, 0.0, Duration::from_secs(10));
    s.wait_metric(KV_USAGE, 0.0, Duration::from_secs(5));
    assert_eq!(s.metric("vllm:num_requests_waiting{"), 0.0);
    assert_eq!(
        s.metric("vllm:request_success_total{engine=\"0\",finished_reason=\"abort\""),
        20.0
    );
    assert_eq!(
        s.metric("vllm:request_success_total{engine=\"0\",finished_reason=\"length\""),
        0.0
    );
}

#[test]
fn sigterm_finishes_in_flight_requests_then_exits_zero() {
    let mut s = start(&["--weights", "quantized", "--shutdown-timeout", "120"]);
    s.wait_ready();
    let base = s.base.clone();
    let started = Arc::new(Barrier::new(9));
    let handles: Vec<_> = (0..8)
        .map(|i| {
            let (base, started) = (base.clone(), started.clone());
            thread::spawn(move || {
                let body = json!({
                    "prompt": format!("Item {i}:"), "max_tokens": 24, "temperature": 0,
                    "ignore_eos": true, "stream": true,
                    "stream_options": {"include_usage": true},
                });
                let resp = ureq::post(&format!("{base}/v1/completions"))
                    .send_json(body)
                    .expect("request accepted before SIGTERM");
                let mut r = SseReader::new(resp);
                let first = r.next_chunk().expect("first chunk");
                started.wait();
                let mut last = first;
                let mut finish = None;
                while let Some(c) = r.next_chunk() {
                    if let Some(f) = c["choices"][0]["finish_reason"].as_str() {
                        finish = Some(f.to_string());
                    }
                    last = c;
                }
                (finish, last["usage"]["completion_tokens"].as_u64())
            })
        })
        .collect();
    started.wait();
    s.sigterm();
    for h in handles {
        assert_eq!(
            h.join().expect("client thread"),
            (Some("length".to_string()), Some(24))
        );
    }
    let status = s.wait_exit(Duration::from_secs(60));
    assert!(status.success(), "exit status {status}");
    assert!(
        ureq::get(&format!("{base}/health")).call().is_err(),
        "nothing answers after exit"
    );
}

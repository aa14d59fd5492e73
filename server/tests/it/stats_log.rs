//! The periodic stats log line and its throughput gauges, from the real binary's log.

use crate::common;

use std::thread;
use std::time::Duration;

use common::server::start_logged;
use serde_json::{Value, json};

/// One parsed stats line.
#[derive(Debug, PartialEq)]
struct Line {
    prompt_tps: f64,
    gen_tps: f64,
    running: u64,
    swapped: u64,
    pending: u64,
    gpu: f64,
    cpu: f64,
    hit_rate: f64,
}

impl Line {
    fn idle(&self) -> bool {
        self.prompt_tps == 0.0 && self.gen_tps == 0.0 && self.running + self.pending == 0
    }
}

/// Parses the seed's wording; `None` for any other log line.
fn parse(line: &str) -> Option<Line> {
    let at = line.find("Avg prompt throughput: ")?;
    let rest = &line[at..];
    let num = |key: &str, end: &str| -> f64 {
        let from = rest.find(key).unwrap_or_else(|| panic!("{key} in {rest}")) + key.len();
        let to = rest[from..].find(end).expect("end") + from;
        rest[from..to]
            .parse()
            .unwrap_or_else(|_| panic!("number after {key} in {rest}"))
    };
    Some(Line {
        prompt_tps: num("Avg prompt throughput: ", " tokens/s"),
        gen_tps: num("Avg generation throughput: ", " tokens/s"),
        running: num("Running: ", " reqs") as u64,
        swapped: num("Swapped: ", " reqs") as u64,
        pending: num("Pending: ", " reqs") as u64,
        gpu: num("GPU KV cache usage: ", "%"),
        cpu: num("CPU KV cache usage: ", "%,"),
        hit_rate: num("Prefix cache hit rate: ", "%."),
    })
}

#[test]
fn stats_line_reports_each_interval_and_goes_quiet_when_idle() {
    let (mut s, log) = start_logged(&["--log-stats-interval", "1", "--max-num-seqs", "2"]);
    s.wait_ready();
    thread::sleep(Duration::from_millis(3500));
    let idle_before = log.lines().iter().filter_map(|l| parse(l)).count();
    assert_eq!(
        idle_before, 1,
        "an idle server logs one line, then stays quiet"
    );

    // Six requests on two slots: some wait, so Pending shows.
    let tokens: u64 = thread::scope(|scope| {
        let hs: Vec<_> = (0..6)
            .map(|i| {
                let s = &s;
                scope.spawn(move || {
                    let r: Value = s
                        .post(
                            "/v1/completions",
                            &json!({"model": "smol", "prompt": format!("Count to {i}:"),
                                    "max_tokens": 48, "ignore_eos": true}),
                        )
                        .into_json()
                        .expect("json");
                    r["usage"]["completion_tokens"].as_u64().expect("usage")
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("client")).sum()
    });
    thread::sleep(Duration::from_millis(4500));
    let lines: Vec<Line> = log.lines().iter().filter_map(|l| parse(l)).collect();
    let busy: Vec<&Line> = lines.iter().filter(|l| !l.idle()).collect();
    assert!(!busy.is_empty(), "no busy line in {lines:?}");
    assert!(
        busy.iter()
            .any(|l| l.gen_tps > 0.0 && l.running > 0 && l.gpu > 0.0)
    );
    assert!(
        busy.iter().any(|l| l.pending > 0),
        "queue never showed: {lines:?}"
    );
    assert!(lines.iter().all(|l| l.cpu == 0.0 && l.swapped == 0));
    // The prompts are shorter than one 16-token block, so nothing can be a prefix-cache hit.
    assert!(lines.iter().all(|l| l.hit_rate == 0.0), "{lines:?}");
    // Each line covers about one second, so the throughputs add up to the tokens generated.
    let total: f64 = lines.iter().map(|l| l.gen_tps).sum();
    assert!(
        (total - tokens as f64).abs() <= tokens as f64 * 0.1 + 1.0,
        "lines sum to {total} tokens/s·s, clients got {tokens}"
    );
    // After the work: exactly one idle line, then silence.
    let last_busy = lines.iter().rposition(|l| !l.idle()).expect("busy line");
    assert_eq!(lines.len() - last_busy - 1, 1, "{lines:?}");

    let m = s.scrape();
    assert!(m.has("vllm:avg_prompt_throughput_toks_per_s"));
    assert_eq!(m.get("vllm:avg_generation_throughput_toks_per_s", &[]), 0.0);
}

#[test]
fn disable_log_stats_turns_off_the_line_and_the_throughput_gauges() {
    let (mut s, log) = start_logged(&["--log-stats-interval", "1", "--disable-log-stats"]);
    s.wait_ready();
    let r = s.post(
        "/v1/completions",
        &json!({"model": "smol", "prompt": "Hi", "max_tokens": 8, "ignore_eos": true}),
    );
    assert_eq!(r.status(), 200);
    thread::sleep(Duration::from_millis(2500));
    let lines = log.lines();
    assert!(
        lines.iter().any(|l| l.contains("ready")),
        "log is captured: {lines:?}"
    );
    assert!(lines.iter().all(|l| parse(l).is_none()), "{lines:?}");
    let m = s.scrape();
    assert!(!m.has("vllm:avg_prompt_throughput_toks_per_s"));
    assert!(!m.has("vllm:avg_generation_throughput_toks_per_s"));
    assert_eq!(m.get("vllm:generation_tokens_total", &[]), 8.0);
}

//! A real Prometheus (Debian's `prometheus`) on 127.0.0.1 scrapes the real server every second
//! while a load backs up its queue; the protocol's PromQL queries must answer with the values the
//! clients saw. `promtool check metrics` lints the exposition.

use crate::common;

use std::io::Write;
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use common::server::{Server, SseReader, start};
use ferrite_testkit::prometheus::{Prometheus, tool, unix_now};
use serde_json::{Value, json};

/// TTFT buckets of the protocol, to compare the client's median with the server's.
const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];

/// Prometheus scraping `target` (host:port) every second as job `ferrite`.
fn scraping(target: &str) -> Prometheus {
    Prometheus::start(&format!(
        "  - job_name: ferrite\n    static_configs:\n      - targets: ['{target}']\n"
    ))
}

fn bucket_index(v: f64) -> usize {
    TTFT_BUCKETS
        .iter()
        .position(|&b| v <= b)
        .unwrap_or(TTFT_BUCKETS.len())
}

fn target(s: &Server) -> String {
    s.base.trim_start_matches("http://").to_string()
}

/// One streamed request; returns (client TTFT in seconds, completion tokens from usage).
fn stream_one(s: &Server, i: usize) -> (f64, u64) {
    let t0 = Instant::now();
    let mut sse = SseReader::new(s.post(
        "/v1/completions",
        &json!({"model": "smol", "prompt": format!("Story {i}: once upon a time"),
                "max_tokens": 24, "ignore_eos": true, "temperature": 0, "stream": true,
                "stream_options": {"include_usage": true}}),
    ));
    let mut ttft = None;
    let mut tokens = None;
    while let Some(c) = sse.next_chunk() {
        if ttft.is_none() && c["choices"][0]["text"].as_str().is_some() {
            ttft = Some(t0.elapsed().as_secs_f64());
        }
        if let Some(u) = c["usage"]["completion_tokens"].as_u64() {
            tokens = Some(u);
        }
    }
    (ttft.expect("a token"), tokens.expect("usage chunk"))
}

#[test]
fn prometheus_scrapes_the_server_under_load_and_promql_matches_the_clients() {
    let mut s = start(&["--max-num-seqs", "4", "--max-model-len", "256"]);
    s.wait_ready();
    let prom = scraping(&target(&s));
    prom.wait_for("up{job=\"ferrite\"}", Duration::from_secs(30), |v| v == 1.0);
    // Two scrapes before the load, so every rate() window starts from zeroed counters.
    thread::sleep(Duration::from_millis(2200));
    let load_start = unix_now();

    // 16 clients against 4 sequence slots: 12 requests wait at any moment.
    const CLIENTS: usize = 16;
    const REQUESTS: usize = 64;
    let next = AtomicUsize::new(0);
    let results = Mutex::new(Vec::new());
    let done = AtomicBool::new(false);
    let (saw_waiting, saw_kv) = thread::scope(|scope| {
        let watcher = scope.spawn(|| {
            let (mut waiting, mut kv) = (None, None);
            while !done.load(Ordering::SeqCst) && (waiting.is_none() || kv.is_none()) {
                if waiting.is_none() {
                    waiting = prom.value("vllm:num_requests_waiting > 0");
                    if waiting.is_some() {
                        check_adapter_rules(&prom);
                    }
                }
                if kv.is_none() {
                    kv = prom.value("vllm:kv_cache_usage_perc > 0");
                }
                thread::sleep(Duration::from_millis(250));
            }
            (waiting, kv)
        });
        let clients: Vec<_> = (0..CLIENTS)
            .map(|_| {
                scope.spawn(|| {
                    loop {
                        let i = next.fetch_add(1, Ordering::SeqCst);
                        if i >= REQUESTS {
                            break;
                        }
                        let r = stream_one(&s, i);
                        results.lock().expect("lock").push(r);
                    }
                })
            })
            .collect();
        for c in clients {
            c.join().expect("client");
        }
        done.store(true, Ordering::SeqCst);
        watcher.join().expect("watcher")
    });
    let load_end = unix_now();
    let results = results.into_inner().expect("lock");
    assert_eq!(results.len(), REQUESTS);
    let waiting = saw_waiting.expect("vllm:num_requests_waiting > 0 never returned data");
    assert!(waiting >= 1.0);
    let kv = saw_kv.expect("vllm:kv_cache_usage_perc > 0 never returned data");
    assert!(kv > 0.0 && kv <= 1.0, "kv usage {kv}");

    // Total generated tokens, as Prometheus stored them, equal the clients' count exactly.
    let client_tokens: u64 = results.iter().map(|r| r.1).sum();
    assert_eq!(client_tokens, (REQUESTS * 24) as u64);
    prom.wait_for(
        "vllm:generation_tokens_total",
        Duration::from_secs(15),
        |v| v == client_tokens as f64,
    );
    // The queue drains back to zero, and Prometheus sees it.
    prom.wait_for("vllm:num_requests_waiting", Duration::from_secs(15), |v| {
        v == 0.0
    });
    let eval_at = unix_now();
    let window = format!("{}s", (eval_at - load_start).ceil() as u64 + 2);

    let rate = prom
        .value_at(
            &format!("rate(vllm:generation_tokens_total[{window}])"),
            Some(eval_at),
        )
        .expect("rate(vllm:generation_tokens_total) is empty");
    let load_secs = load_end - load_start;
    let mean_rate = client_tokens as f64 / load_secs;
    assert!(
        rate > 0.0 && rate <= mean_rate * 1.5,
        "rate {rate} tok/s vs the clients' mean {mean_rate} tok/s"
    );

    let p90 = prom
        .value_at(
            &format!(
                "histogram_quantile(0.9, sum by (le) \
                 (rate(vllm:time_to_first_token_seconds_bucket[{window}])))"
            ),
            Some(eval_at),
        )
        .expect("TTFT p90 is empty");
    assert!(p90.is_finite() && p90 > 0.0, "TTFT p90 {p90}");

    // Fidelity: the client's TTFT median and the histogram's fall within one bucket.
    let server_p50 = prom
        .value_at(
            &format!(
                "histogram_quantile(0.5, sum by (le) \
                 (rate(vllm:time_to_first_token_seconds_bucket[{window}])))"
            ),
            Some(eval_at),
        )
        .expect("TTFT p50 is empty");
    let mut ttfts: Vec<f64> = results.iter().map(|r| r.0).collect();
    ttfts.sort_by(f64::total_cmp);
    let client_p50 = (ttfts[REQUESTS / 2 - 1] + ttfts[REQUESTS / 2]) / 2.0;
    let (ci, si) = (bucket_index(client_p50), bucket_index(server_p50));
    assert!(
        ci.abs_diff(si) <= 1,
        "client TTFT p50 {client_p50:.3}s (bucket {ci}) vs server {server_p50:.3}s (bucket {si})"
    );
    eprintln!(
        "load {load_secs:.1}s, {client_tokens} tokens; rate {rate:.1} tok/s; TTFT p50 client \
         {client_p50:.3}s server {server_p50:.3}s; p90 {p90:.3}s; max waiting seen {waiting}"
    );
}

/// The prometheus-adapter rules shipped in charts/: every metricsQuery, with the adapter's
/// template fields filled in as it would for an HPA selecting this scrape job, parses, returns
/// one series, and agrees with the raw metric it aggregates (one server: sum and avg are the
/// value itself).
fn check_adapter_rules(prom: &Prometheus) {
    let path = ferrite_testkit::paths::workspace_root()
        .join("charts/ferrite-operator/files/prometheus-adapter-rules.yaml");
    let text = std::fs::read_to_string(&path).expect("adapter rules");
    let rules: serde_yaml_ng::Value = serde_yaml_ng::from_str(&text).expect("rules are YAML");
    let external = rules["external"].as_sequence().expect("external rules");
    assert_eq!(external.len(), 3);
    for rule in external {
        let series_query = rule["seriesQuery"].as_str().expect("seriesQuery");
        let series = series_query.split('{').next().expect("series name");
        let as_name = rule["name"]["as"].as_str().expect("name.as");
        assert!(as_name.starts_with("ferrite_"), "{as_name}");
        let query = rule["metricsQuery"]
            .as_str()
            .expect("metricsQuery")
            .replace("<<.Series>>", series)
            .replace("<<.LabelMatchers>>", "job=\"ferrite\"")
            .replace("<<.GroupBy>>", "job");
        // Both at one instant, so a scrape in between cannot make them differ.
        let at = Some(unix_now());
        let got = prom
            .query_at(&query, at)
            .unwrap_or_else(|e| panic!("{query}: {e}"));
        assert_eq!(got.len(), 1, "{as_name}: {query} returned {got:?}");
        let raw = prom
            .query_at(&format!("{series}{{job=\"ferrite\"}}"), at)
            .expect("raw series");
        assert_eq!(raw.len(), 1, "{series}");
        let value = |v: &Value| v["value"][1].as_str().and_then(|s| s.parse::<f64>().ok());
        assert_eq!(value(&got[0]), value(&raw[0]), "{as_name}: {query}");
    }
}

/// Whether a `promtool check metrics` finding is one the vLLM protocol makes on purpose: its
/// names are `vllm:`-prefixed (a recording-rule style colon that promtool's linter flags), and
/// renaming them would break every dashboard, alert and autoscaler written for vLLM. The seed's
/// two average-throughput gauges also spell their unit `toks_per_s`, and vLLM's per-step token
/// histogram is named `iteration_tokens_total`.
fn expected_finding(f: &str) -> bool {
    f.split_once(' ').is_some_and(|(name, msg)| {
        (name.starts_with("vllm:") && msg == "metric names should not contain ':'")
            || (matches!(
                name,
                "vllm:avg_prompt_throughput_toks_per_s"
                    | "vllm:avg_generation_throughput_toks_per_s"
            ) && msg == "metric names should not contain abbreviated units")
            || (name == "vllm:iteration_tokens_total"
                && msg == "non-counter metrics should not have \"_total\" suffix")
    })
}

fn promtool_findings(exposition: &str) -> Vec<String> {
    let mut child = Command::new(tool("FERRITE_PROMTOOL", "promtool"))
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn promtool");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(exposition.as_bytes())
        .expect("write exposition");
    let out = child.wait_with_output().expect("promtool");
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(str::to_string)
        .collect()
}

#[test]
fn promtool_check_metrics_finds_only_what_the_protocol_requires() {
    let mut s = start(&["--max-model-len", "256"]);
    s.wait_ready();
    // Traffic first, so every histogram and labelled counter has series.
    for path in ["/v1/completions", "/v1/completions"] {
        let r = s.post(
            path,
            &json!({"model": "smol", "prompt": "Hello", "max_tokens": 3, "n": 2}),
        );
        assert_eq!(r.status(), 200);
    }
    let text = ureq::get(&format!("{}/metrics", s.base))
        .call()
        .expect("metrics")
        .into_string()
        .expect("text");
    let findings = promtool_findings(&text);
    for f in &findings {
        assert!(
            expected_finding(f),
            "unexplained promtool finding: {f}\nall findings: {findings:#?}"
        );
    }
    // Every vllm: family is flagged for its colon and for nothing else.
    assert!(findings.len() >= 25, "{findings:#?}");
    // A real lint problem (a counter without `_total`) is not excused, so the check can fail.
    let bad = promtool_findings("# HELP tokens Tokens.\n# TYPE tokens counter\ntokens 1\n");
    assert!(
        bad.iter().any(|f| !expected_finding(f)),
        "promtool passed a counter without _total: {bad:?}"
    );
}

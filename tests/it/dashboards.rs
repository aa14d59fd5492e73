//! The Grafana dashboards and alert rules of `dashboards/`, proven against real parts:
//! - conventions: template variables (datasource, namespace, model_name scoped through a ferrite
//!   series, pod), no hard-coded datasource, `$__rate_interval`, replica aggregation, layout;
//! - Grafana's own schema (npm `@grafana/schema` → JSON Schema → ajv);
//! - the alert rules with `promtool check rules` and `promtool test rules`;
//! - every panel's PromQL, with the variables substituted, parses (`promtool check rules`) and
//!   returns data from a real Prometheus on 127.0.0.1 that scrapes two real ferrite-server
//!   replicas under load and the real operator autoscaling them; every metric name the
//!   dashboards and alerts use is on the servers' or the operator's `/metrics`, or is a listed
//!   external one (DCGM: two stand-in exporters serve it, scraped with and without
//!   honor_labels, and the GPU panels must show the model's pods from both).
//!
//! With `FERRITE_DASHBOARD_PREVIEW_DIR` set, the live test also writes each dashboard with its
//! panels' query results there, for `scripts/dashboard-preview.sh`.

use std::collections::{BTreeMap, BTreeSet};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use ferrite_testkit::e2e::{Applier, Operator, install, isvc, pods_ready_at};
use ferrite_testkit::kube::{Cluster, workspace_root};
use ferrite_testkit::process::{Guard, TempDir, free_port};
use ferrite_testkit::prometheus::{Prometheus, tool, unix_now};
use ferrite_testkit::server::{Server, start_server_at};
use ferrite_testkit::tools::{node_modules, python};
use ferrite_testkit::validate::run_validator;
use serde_json::{Value, json};

const DASHBOARDS: [&str; 3] = ["overview", "realtime", "autoscaling"];
/// Metrics from exporters other than ferrite-server and the operator: NVIDIA's DCGM exporter.
/// The live test serves them from two stand-in exporters, one scraped the way the GPU
/// operator's ServiceMonitor does (its pod labels honored), one the way kube-prometheus-stack's
/// default does (renamed `exported_pod`).
const EXTERNAL: [&str; 2] = ["DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_FB_USED"];
/// Series Prometheus makes itself (used by the alerts).
const PROMETHEUS_SERIES: [&str; 1] = ["up"];
/// The datasource reference every panel, target and variable uses.
const DATASOURCE: &str = "${datasource}";

fn dashboards_dir() -> PathBuf {
    workspace_root().join("dashboards")
}

fn load(name: &str) -> Value {
    let path = dashboards_dir().join(format!("{name}.json"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Panels, with the panels of rows flattened in.
fn panels(d: &Value) -> Vec<&Value> {
    let mut out = Vec::new();
    for p in d["panels"].as_array().into_iter().flatten() {
        out.push(p);
        out.extend(p["panels"].as_array().into_iter().flatten());
    }
    out
}

/// What a DCGM exporter on a GPU node shows: utilization and frame-buffer use of each GPU,
/// labelled with the pod (namespace `ml`) that holds it.
fn dcgm_exposition(gpus: &[(&str, u32)]) -> String {
    let mut out = String::new();
    for (metric, value) in [("DCGM_FI_DEV_GPU_UTIL", 87), ("DCGM_FI_DEV_FB_USED", 30512)] {
        out.push_str(&format!("# TYPE {metric} gauge\n"));
        for (pod, gpu) in gpus {
            out.push_str(&format!(
                "{metric}{{gpu=\"{gpu}\",UUID=\"GPU-{pod}-{gpu}\",device=\"nvidia{gpu}\",modelName=\"NVIDIA H100 80GB HBM3\",container=\"server\",namespace=\"ml\",pod=\"{pod}\"}} {value}\n"
            ));
        }
    }
    out
}

/// A /metrics endpoint on 127.0.0.1 that always answers the same exposition.
struct StaticExporter {
    port: u16,
}

impl StaticExporter {
    fn start(body: &str) -> StaticExporter {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let body = body.to_string();
        thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { continue };
                let body = body.clone();
                thread::spawn(move || {
                    use std::io::{Read, Write};
                    let mut buf = [0u8; 4096];
                    let _ = stream.read(&mut buf);
                    let _ = write!(
                        stream,
                        "HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                        body.len()
                    );
                });
            }
        });
        StaticExporter { port }
    }
}

/// One PromQL expression of a panel.
#[derive(Debug, Clone)]
struct Query {
    dashboard: &'static str,
    panel: String,
    legend: String,
    expr: String,
}

impl Query {
    fn name(&self) -> String {
        format!("{} / {} / {}", self.dashboard, self.panel, self.legend)
    }

    fn external(&self) -> bool {
        EXTERNAL.iter().any(|m| self.expr.contains(m))
    }
}

fn queries(dashboard: &'static str, d: &Value) -> Vec<Query> {
    let mut out = Vec::new();
    for p in panels(d) {
        for t in p["targets"].as_array().into_iter().flatten() {
            let expr = t["expr"].as_str().unwrap_or_default();
            assert!(
                !expr.is_empty(),
                "{dashboard}: panel {} has a target without expr",
                p["title"]
            );
            out.push(Query {
                dashboard,
                panel: p["title"].as_str().unwrap_or_default().to_string(),
                legend: t["legendFormat"].as_str().unwrap_or_default().to_string(),
                expr: expr.to_string(),
            });
        }
    }
    out
}

fn all_queries() -> Vec<Query> {
    DASHBOARDS
        .iter()
        .flat_map(|name| queries(name, &load(name)))
        .collect()
}

fn variables(d: &Value) -> Vec<&Value> {
    d["templating"]["list"]
        .as_array()
        .map(|l| l.iter().collect())
        .unwrap_or_default()
}

fn variable<'a>(d: &'a Value, name: &str) -> Option<&'a Value> {
    variables(d).into_iter().find(|v| v["name"] == name)
}

/// Grafana's interpolation for the test: each `$name` / `${name}` by its value, longest names
/// first. Panics if a `$` is left.
fn substitute(expr: &str, values: &[(&str, &str)]) -> String {
    let mut values = values.to_vec();
    values.sort_by_key(|(k, _)| std::cmp::Reverse(k.len()));
    let mut out = expr.to_string();
    for (k, v) in values {
        out = out.replace(&format!("${{{k}}}"), v);
        out = out.replace(&format!("${k}"), v);
    }
    // `$1` is label_replace's capture reference: no Grafana variable is named by a digit.
    let left = out
        .match_indices('$')
        .any(|(i, _)| !out[i + 1..].starts_with(|c: char| c.is_ascii_digit()));
    assert!(!left, "an unknown variable is left in {out} (from {expr})");
    out
}

/// The values the live test gives the variables: one namespace, one model, all pods (Grafana's
/// custom all value), one InferenceService, and a rate interval of a few 1 s scrapes.
const VALUES: [(&str, &str); 6] = [
    ("namespace", "ml"),
    ("model_name", "smol"),
    ("pod", ".*"),
    ("inferenceservice", "chat"),
    ("__rate_interval", "5s"),
    ("__interval", "1s"),
];

// ---- a small PromQL scanner: metric names and enclosing aggregations ----

#[derive(Debug, Clone, PartialEq)]
enum Tok {
    Ident(String),
    Open,
    Close,
    Other,
}

/// Tokens of `expr` with string literals, label matchers (`{…}`) and ranges (`[…]`) dropped.
fn tokens(expr: &str) -> Vec<Tok> {
    let mut out = Vec::new();
    let mut chars = expr.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '"' | '\'' | '`' => {
                let mut escaped = false;
                for d in chars.by_ref() {
                    if !escaped && d == c {
                        break;
                    }
                    escaped = d == '\\' && !escaped;
                }
            }
            '{' | '[' => {
                let close = if c == '{' { '}' } else { ']' };
                let mut in_str = false;
                for d in chars.by_ref() {
                    if d == '"' {
                        in_str = !in_str;
                    }
                    if d == close && !in_str {
                        break;
                    }
                }
            }
            '(' => out.push(Tok::Open),
            ')' => out.push(Tok::Close),
            c if c.is_ascii_alphabetic() || c == '_' || c == ':' => {
                let mut s = c.to_string();
                while let Some(&d) = chars.peek() {
                    if d.is_ascii_alphanumeric() || d == '_' || d == ':' {
                        s.push(d);
                        chars.next();
                    } else {
                        break;
                    }
                }
                out.push(Tok::Ident(s));
            }
            c if c.is_ascii_digit() || c == '.' => {
                while chars
                    .peek()
                    .is_some_and(|d| d.is_ascii_alphanumeric() || *d == '.')
                {
                    chars.next();
                }
                out.push(Tok::Other);
            }
            c if c.is_whitespace() => {}
            _ => out.push(Tok::Other),
        }
    }
    out
}

const GROUPING: [&str; 6] = [
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
];
const KEYWORDS: [&str; 6] = ["and", "or", "unless", "bool", "offset", "le"];
const AGGREGATIONS: [&str; 12] = [
    "sum",
    "min",
    "max",
    "avg",
    "count",
    "stddev",
    "stdvar",
    "topk",
    "bottomk",
    "quantile",
    "count_values",
    "group",
];

/// The index of the parenthesis closing the one at `open`.
fn closing(toks: &[Tok], open: usize) -> usize {
    let mut depth = 0;
    for (i, t) in toks.iter().enumerate().skip(open) {
        match t {
            Tok::Open => depth += 1,
            Tok::Close => {
                depth -= 1;
                if depth == 0 {
                    return i;
                }
            }
            _ => {}
        }
    }
    toks.len()
}

/// Each metric name in `expr`, with the innermost function or aggregation it is an argument of.
fn metrics_in(expr: &str) -> Vec<(String, Option<String>)> {
    let toks = tokens(expr);
    let mut out = Vec::new();
    // For each open parenthesis: the function or aggregation it calls, if any.
    let mut stack: Vec<Option<String>> = Vec::new();
    let mut i = 0;
    while i < toks.len() {
        match &toks[i] {
            // A grouping clause's label list, `by (a, b)`, holds no metrics.
            Tok::Ident(s) if GROUPING.contains(&s.as_str()) => {
                if toks.get(i + 1) == Some(&Tok::Open) {
                    i = closing(&toks, i + 1);
                }
            }
            Tok::Ident(s) if toks.get(i + 1) == Some(&Tok::Open) => {
                stack.push(Some(s.clone()));
                i += 1;
            }
            Tok::Ident(s) if AGGREGATIONS.contains(&s.as_str()) => {
                // `sum by (le) (…)`: the call's parenthesis comes after the clause.
                let mut j = i + 1;
                if let Some(Tok::Ident(g)) = toks.get(j)
                    && GROUPING.contains(&g.as_str())
                    && toks.get(j + 1) == Some(&Tok::Open)
                {
                    j = closing(&toks, j + 1) + 1;
                }
                if toks.get(j) == Some(&Tok::Open) {
                    stack.push(Some(s.clone()));
                    i = j;
                }
            }
            Tok::Ident(s) if KEYWORDS.contains(&s.as_str()) => {}
            Tok::Ident(s) => out.push((s.clone(), stack.iter().rev().find_map(Clone::clone))),
            Tok::Open => stack.push(None),
            Tok::Close => {
                stack.pop();
            }
            Tok::Other => {}
        }
        i += 1;
    }
    out
}

fn metric_names(expr: &str) -> BTreeSet<String> {
    metrics_in(expr).into_iter().map(|(m, _)| m).collect()
}

/// The selector of a `label_values(selector, label)` variable query, and the label.
fn label_values_query(q: &str) -> Option<(String, String)> {
    let inner = q.trim().strip_prefix("label_values(")?.strip_suffix(')')?;
    let (selector, label) = inner.rsplit_once(',')?;
    Some((selector.trim().to_string(), label.trim().to_string()))
}

#[test]
fn the_scanner_finds_metric_names_and_their_aggregation() {
    let e = r#"histogram_quantile(0.9, sum by (le) (rate(vllm:x_bucket{a=~"$b", le!="1"}[$__rate_interval]))) / sum(up) or on (pod) group_left () max by (namespace, pod) (other_metric)"#;
    assert_eq!(
        metrics_in(e),
        vec![
            ("vllm:x_bucket".to_string(), Some("rate".to_string())),
            ("up".to_string(), Some("sum".to_string())),
            ("other_metric".to_string(), Some("max".to_string())),
        ]
    );
    assert_eq!(
        label_values_query(r#"label_values(vllm:a{namespace=~"$namespace"}, model_name)"#),
        Some((
            r#"vllm:a{namespace=~"$namespace"}"#.to_string(),
            "model_name".to_string()
        ))
    );
}

// ---- static checks ----

#[test]
fn the_dashboards_are_what_generate_py_writes() {
    let python = python();
    let (ok, out) = run_validator(
        Command::new(python)
            .arg(dashboards_dir().join("generate.py"))
            .arg("--check"),
    );
    assert!(ok, "{out}");
}

#[test]
fn the_dashboards_follow_the_conventions() {
    for name in DASHBOARDS {
        let d = load(name);
        assert!(d.get("__inputs").is_none() && d.get("__requires").is_none());
        assert!(d["title"].as_str().is_some_and(|t| !t.is_empty()));

        // Variables: a datasource variable, and namespace → model_name → pod looked up through a
        // ferrite series (never `label_values(model_name)`, which lists every exporter's).
        let ds = variable(&d, "datasource").expect("a datasource variable");
        assert_eq!(
            (&ds["type"], &ds["query"]),
            (&json!("datasource"), &json!("prometheus"))
        );
        let mut wanted = vec!["namespace", "model_name", "pod"];
        if name == "autoscaling" {
            wanted.push("inferenceservice");
        }
        for v in wanted {
            let var = variable(&d, v).unwrap_or_else(|| panic!("{name}: no variable {v}"));
            let q = var["query"].as_str().unwrap_or_default();
            let (selector, _) = label_values_query(q)
                .unwrap_or_else(|| panic!("{name}: {v} is not a label_values query: {q}"));
            assert!(
                selector.starts_with("vllm:"),
                "{name}: {v} is not scoped through a ferrite series: {q}"
            );
            if v != "namespace" {
                assert!(
                    selector.contains("namespace=~\"$namespace\""),
                    "{name}: {q}"
                );
            }
            if v == "pod" || v == "inferenceservice" {
                assert!(
                    selector.contains("model_name=~\"$model_name\""),
                    "{name}: {q}"
                );
            }
        }

        // No datasource but the variable, anywhere.
        fn datasources<'a>(v: &'a Value, out: &mut Vec<&'a Value>) {
            match v {
                Value::Object(m) => {
                    for (k, x) in m {
                        if k == "datasource" {
                            out.push(x);
                        }
                        datasources(x, out);
                    }
                }
                Value::Array(a) => a.iter().for_each(|x| datasources(x, out)),
                _ => {}
            }
        }
        let mut refs = Vec::new();
        datasources(&d, &mut refs);
        assert!(
            refs.len() > 10,
            "{name}: {} datasource references",
            refs.len()
        );
        for r in refs {
            assert_eq!(
                r,
                &json!({"type": "prometheus", "uid": DATASOURCE}),
                "{name}"
            );
        }

        // Default ranges from the monitoring guide.
        let from = match name {
            "overview" => "now-24h",
            "realtime" => "now-5m",
            _ => "now-3h",
        };
        assert_eq!(d["time"]["from"], from, "{name}");

        // Layout: unique ids, inside 24 columns, no overlaps.
        let mut ids = BTreeSet::new();
        let mut cells = BTreeSet::new();
        for p in panels(&d) {
            assert!(
                ids.insert(p["id"].as_i64().expect("id")),
                "{name}: duplicate id"
            );
            let g = &p["gridPos"];
            let (x, y, w, h) = (
                g["x"].as_i64().expect("x"),
                g["y"].as_i64().expect("y"),
                g["w"].as_i64().expect("w"),
                g["h"].as_i64().expect("h"),
            );
            assert!(x >= 0 && w > 0 && x + w <= 24 && h > 0, "{name}: {g}");
            for cx in x..x + w {
                for cy in y..y + h {
                    assert!(cells.insert((cx, cy)), "{name}: panels overlap at {g}");
                }
            }
            if p["type"] == "heatmap" {
                assert_eq!(p["targets"][0]["format"], "heatmap", "{name}");
            }
        }

        for q in queries(name, &d) {
            let e = &q.expr;
            // Ranges are Grafana's $__rate_interval.
            let mut rest = e.as_str();
            while let Some(i) = rest.find('[') {
                assert!(
                    rest[i..].starts_with("[$__rate_interval]"),
                    "{}: range other than $__rate_interval in {e}",
                    q.name()
                );
                rest = &rest[i + 1..];
            }
            // Scoped: every ferrite series filters on the variables.
            for (metric, within) in metrics_in(e) {
                let at = e.find(&format!("{metric}{{")).map(|i| &e[i..]);
                if metric.starts_with("vllm:") {
                    let sel = at.unwrap_or_else(|| panic!("{}: bare {metric}", q.name()));
                    let sel = &sel[..sel.find('}').unwrap_or(sel.len())];
                    assert!(
                        sel.contains("namespace=~\"$namespace\"")
                            && sel.contains("model_name=~\"$model_name\""),
                        "{}: {metric} is not filtered by namespace and model_name",
                        q.name()
                    );
                }
                if metric.starts_with("ferrite_operator_autoscaler_") {
                    let sel = at.unwrap_or_else(|| panic!("{}: bare {metric}", q.name()));
                    assert!(
                        sel.contains("inferenceservice=~\"$inferenceservice\""),
                        "{}: {metric} is not filtered by InferenceService",
                        q.name()
                    );
                }
                // The router's series: by model only, since their `namespace` is the router
                // pod's own; held and queued requests name their InferenceService's namespace
                // (honorLabels).
                if metric.starts_with("ferrite_router_") {
                    let sel = at.unwrap_or_else(|| panic!("{}: bare {metric}", q.name()));
                    let sel = &sel[..sel.find('}').unwrap_or(sel.len())];
                    assert!(
                        sel.contains("model_name=~\"$model_name\""),
                        "{}: {metric} is not filtered by model_name",
                        q.name()
                    );
                    let service_gauge = metric == "ferrite_router_held_requests"
                        || metric == "ferrite_router_queued_requests";
                    assert_eq!(
                        sel.contains("namespace=~\"$namespace\""),
                        service_gauge,
                        "{}: {metric}: only held and queued requests carry the model's namespace",
                        q.name()
                    );
                }
                // Aggregation over replicas: queue and running add up; KV usage averages; the
                // router's gauges add up over router replicas.
                let within = within.unwrap_or_default();
                if metric == "ferrite_router_held_requests"
                    || metric == "ferrite_router_queued_requests"
                    || metric == "ferrite_router_in_flight_requests"
                {
                    assert_eq!(within, "sum", "{}: {metric} aggregated with", q.name());
                }
                if metric.starts_with("vllm:num_requests_") {
                    assert!(
                        ["sum", "count", "max"].contains(&within.as_str()),
                        "{}: {metric} aggregated with {within:?}",
                        q.name()
                    );
                }
                if metric.ends_with("cache_usage_perc") {
                    assert!(
                        ["avg", "max"].contains(&within.as_str()),
                        "{}: {metric} aggregated with {within:?}",
                        q.name()
                    );
                }
                if metric.ends_with("_bucket") && e.contains("histogram_quantile") {
                    assert!(
                        e.contains("sum by (le) (rate(") || e.contains("sum by (le, "),
                        "{}: quantile not over sum by (le) of the rates: {e}",
                        q.name()
                    );
                }
            }
        }
    }
}

#[test]
fn each_dashboard_shows_what_the_monitoring_guide_lists() {
    let want: [(&str, &[&str]); 3] = [
        (
            "overview",
            &[
                "vllm:e2e_request_latency_seconds_bucket",
                "vllm:e2e_request_latency_seconds_sum",
                "vllm:prompt_tokens_total",
                "vllm:generation_tokens_total",
                "vllm:inter_token_latency_seconds_bucket",
                "vllm:num_requests_running",
                "vllm:num_requests_waiting",
                "vllm:num_requests_swapped",
                "vllm:time_to_first_token_seconds_bucket",
                "vllm:kv_cache_usage_perc",
                "vllm:cpu_cache_usage_perc",
                "vllm:request_success_total",
                "vllm:prefix_cache_hits_total",
                "vllm:prefix_cache_queries_total",
                "DCGM_FI_DEV_GPU_UTIL",
                "ferrite_router_requests_total",
                "ferrite_router_routing_decisions_total",
                "ferrite_router_upstream_headers_seconds_bucket",
                "ferrite_router_upstream_duration_seconds_bucket",
                "ferrite_router_held_requests",
                "ferrite_router_cold_start_seconds_bucket",
                "ferrite_router_retries_total",
                "ferrite_router_in_flight_requests",
                "ferrite_router_tenant_requests_total",
                "ferrite_router_tenant_tokens_total",
                "ferrite_router_queued_requests",
                "ferrite_router_queue_duration_seconds_bucket",
            ],
        ),
        (
            "realtime",
            &[
                "vllm:avg_prompt_throughput_toks_per_s",
                "vllm:avg_generation_throughput_toks_per_s",
                "vllm:prompt_tokens_total",
                "vllm:generation_tokens_total",
                "vllm:num_requests_running",
                "vllm:num_requests_swapped",
                "vllm:num_requests_waiting",
                "vllm:request_inference_time_seconds_bucket",
                "vllm:request_queue_time_seconds_bucket",
                "vllm:request_prompt_tokens_bucket",
                "vllm:request_generation_tokens_bucket",
                "vllm:num_preemptions_total",
                "vllm:prefix_cache_hits_total",
                "vllm:prefix_cache_queries_total",
                "vllm:iteration_tokens_total_bucket",
                "process_cpu_seconds_total",
                "DCGM_FI_DEV_GPU_UTIL",
            ],
        ),
        (
            "autoscaling",
            &[
                "ferrite_operator_autoscaler_desired_replicas",
                "ferrite_operator_autoscaler_signal",
                "ferrite_operator_autoscaler_target",
                "ferrite_operator_autoscaler_scale_actions_total",
                "ferrite_operator_reconciliations_total",
                "ferrite_operator_reconcile_errors_total",
                "ferrite_operator_reconcile_duration_seconds_bucket",
            ],
        ),
    ];
    for (name, metrics) in want {
        let used: BTreeSet<String> = queries(name, &load(name))
            .iter()
            .flat_map(|q| metric_names(&q.expr))
            .collect();
        for m in metrics {
            assert!(used.contains(*m), "{name} does not show {m}");
        }
    }
    // The router's panels sit in the overview's collapsed "Router" row, and only there: they
    // are empty where no router runs.
    for name in DASHBOARDS {
        let d = load(name);
        for p in d["panels"].as_array().into_iter().flatten() {
            let router = |p: &Value| {
                p["targets"].as_array().into_iter().flatten().any(|t| {
                    t["expr"]
                        .as_str()
                        .is_some_and(|e| e.contains("ferrite_router_"))
                })
            };
            let inside: Vec<&Value> = p["panels"].as_array().into_iter().flatten().collect();
            if p["type"] == "row" && p["title"] == "Router" {
                assert_eq!(name, "overview");
                assert_eq!(p["collapsed"], true);
                assert!(inside.len() >= 7 && inside.iter().all(|i| router(i)), "{p}");
            } else {
                assert!(!router(p), "{name}: {} outside the Router row", p["title"]);
                assert!(inside.iter().all(|i| !router(i)), "{name}");
            }
        }
    }
    // Heatmaps in the real-time dashboard.
    let heatmaps = panels(&load("realtime"))
        .iter()
        .filter(|p| p["type"] == "heatmap")
        .count();
    assert!(heatmaps >= 4, "{heatmaps} heatmaps");
}

#[test]
fn the_operators_copy_presets_the_model_name_variable() {
    for name in DASHBOARDS {
        let d = load(name);
        let copy = ferrite_operator::build::dashboards::personalise(&d, name, "ml", "chat", "smol")
            .expect("personalised");
        let var = variable(&copy, "model_name").expect("model_name");
        assert_eq!(var["current"]["value"], "smol", "{name}");
        assert!(copy["uid"].as_str().is_some_and(|u| u.len() <= 40));
    }
}

#[test]
fn the_dashboards_validate_against_grafanas_schema() {
    let modules = node_modules();
    let files: Vec<PathBuf> = DASHBOARDS
        .iter()
        .map(|n| dashboards_dir().join(format!("{n}.json")))
        .collect();
    let (ok, out) = run_validator(
        Command::new("node")
            .arg(workspace_root().join("tests/node/validate-grafana-dashboard.mjs"))
            .arg(&modules)
            .args(&files),
    );
    assert!(ok, "{out}");
    assert_eq!(
        out.lines().filter(|l| l.starts_with("ok ")).count(),
        3,
        "{out}"
    );

    // The validator does reject what Grafana's schema forbids.
    let dir = ferrite_testkit::validate::temp_dir("dashboards");
    let mut bad = load("overview");
    bad["panels"][1]["gridPos"]["w"] = json!("wide");
    bad["templating"]["list"][1]["hide"] = json!(7);
    let bad_file = dir.join("bad.json");
    std::fs::write(&bad_file, bad.to_string()).expect("write");
    let (ok, out) = run_validator(
        Command::new("node")
            .arg(workspace_root().join("tests/node/validate-grafana-dashboard.mjs"))
            .arg(&modules)
            .arg(&bad_file),
    );
    assert!(!ok && out.contains("invalid"), "{out}");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn the_alert_rules_pass_promtool_check_and_their_unit_tests() {
    let promtool = tool("FERRITE_PROMTOOL", "promtool");
    let (ok, out) = run_validator(
        Command::new(&promtool)
            .args(["check", "rules"])
            .arg(dashboards_dir().join("alerts.yaml")),
    );
    assert!(ok && out.contains("SUCCESS: 6 rules found"), "{out}");
    let (ok, out) = run_validator(Command::new(&promtool).current_dir(dashboards_dir()).args([
        "test",
        "rules",
        "alerts.test.yaml",
    ]));
    assert!(ok && out.contains("SUCCESS"), "{out}");

    // Every alert has a severity and a summary and description, and a unit test.
    let rules: Value = serde_yaml_ng::from_str(
        &std::fs::read_to_string(dashboards_dir().join("alerts.yaml")).expect("alerts.yaml"),
    )
    .expect("yaml");
    let tests = std::fs::read_to_string(dashboards_dir().join("alerts.test.yaml")).expect("tests");
    for r in alert_rules(&rules) {
        let name = r["alert"].as_str().expect("alert");
        assert!(
            ["warning", "critical"].contains(&r["labels"]["severity"].as_str().unwrap_or("")),
            "{name}: severity"
        );
        for a in ["summary", "description"] {
            assert!(r["annotations"][a].is_string(), "{name}: {a}");
        }
        assert!(
            tests.contains(&format!("alertname: {name}")),
            "{name} has no unit test"
        );
    }
}

fn alert_rules(rules: &Value) -> Vec<&Value> {
    rules["groups"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|g| g["rules"].as_array().into_iter().flatten())
        .collect()
}

// ---- the live test ----

/// A port free on both 127.0.0.1 and 127.0.0.2, so two "pods" share the container port as
/// they would in a Deployment.
fn shared_port() -> u16 {
    for _ in 0..50 {
        let p = free_port();
        if TcpListener::bind(("127.0.0.2", p)).is_ok() {
            return p;
        }
    }
    panic!("no port free on both 127.0.0.1 and 127.0.0.2");
}

fn start_replica(host: &str, port: u16) -> Server {
    // A tiny KV cache and swap pool, so that swapping and preemption happen and their panels
    // have data.
    start_server_at(
        host,
        port,
        &[
            "--max-model-len",
            "96",
            "--log-stats-interval",
            "1",
            "--num-gpu-blocks",
            "6",
            "--swap-space",
            "0.01",
        ],
    )
}

fn wait_ready(servers: &mut [Server]) {
    for s in servers {
        s.wait_ready();
    }
}

/// One completion, streamed or not; its status (0 when the connection failed, or a stream did
/// not end with `data: [DONE]`). The whole body is read: a client that leaves aborts the request.
fn complete(base: &str, i: usize, stream: bool) -> u16 {
    // Prompts of different lengths, for the length distributions, each starting with its own
    // number. Every third asks for two choices of a prompt at least two blocks long: the second
    // choice finds the first's prompt blocks cached, for the prefix-cache hit rate, however
    // quickly the tiny KV cache evicts (the swap panels need that pressure).
    let story = "Write a long story about a lighthouse. ".repeat(1 + i % 6);
    let (prompt, n) = if i.is_multiple_of(3) {
        (
            format!("Request {i}: {}", "Tell a tale of the sea. ".repeat(6)),
            2,
        )
    } else {
        (format!("Request {i}: {story}"), 1)
    };
    let body = json!({"model": "smol", "prompt": prompt, "max_tokens": 8 + (i % 3) * 4, "n": n,
                      "ignore_eos": true, "temperature": 0.0, "stream": stream});
    // The router's tenant key (the servers have no key, and ignore it).
    let request = ureq::post(&format!("{base}/v1/completions"))
        .set("Authorization", &format!("Bearer {TENANT_KEY}"));
    match request.send_json(body) {
        Ok(r) => {
            let status = r.status();
            match r.into_string() {
                Ok(text) if !stream || text.trim_end().ends_with("data: [DONE]") => status,
                _ => 0,
            }
        }
        Err(ureq::Error::Status(code, _)) => code,
        Err(_) => 0,
    }
}

/// The API key of the router's one tenant in the live test.
const TENANT_KEY: &str = "sk-dashboards";

/// InferenceTenant `dashboards`, allowed every model of `ns`, its key in a Secret there.
async fn tenant(client: &kube::Client, ns: &str) {
    use ferrite_api::tenant::{InferenceTenant, InferenceTenantSpec, TENANT_LABEL};
    // Its namespace before the rest of the test applies it, for the Secret.
    let namespace: k8s_openapi::api::core::v1::Namespace =
        serde_json::from_value(json!({"metadata": {"name": ns}})).expect("a Namespace");
    kube::Api::<k8s_openapi::api::core::v1::Namespace>::all(client.clone())
        .create(&Default::default(), &namespace)
        .await
        .expect("creating the namespace");
    let spec = InferenceTenantSpec {
        namespaces: vec![ns.to_string()],
        ..Default::default()
    };
    kube::Api::<InferenceTenant>::all(client.clone())
        .create(
            &Default::default(),
            &InferenceTenant::new("dashboards", spec),
        )
        .await
        .expect("creating the tenant");
    let secret: k8s_openapi::api::core::v1::Secret = serde_json::from_value(json!({
        "metadata": {"name": "dashboards-keys", "labels": {TENANT_LABEL: "dashboards"}},
        "stringData": {"key": TENANT_KEY}}))
    .expect("a Secret");
    kube::Api::<k8s_openapi::api::core::v1::Secret>::namespaced(client.clone(), ns)
        .create(&Default::default(), &secret)
        .await
        .expect("creating the key Secret");
}

fn exposition_names(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .filter_map(|l| l.split(['{', ' ']).next().map(String::from))
        .collect()
}

/// Whether a range result has at least one finite sample.
fn has_data(result: &[Value]) -> bool {
    result.iter().any(|s| {
        s["values"].as_array().into_iter().flatten().any(|v| {
            v[1].as_str()
                .and_then(|x| x.parse::<f64>().ok())
                .is_some_and(f64::is_finite)
        })
    })
}

/// Whether a range result has a sample above zero.
fn has_positive(result: &[Value]) -> bool {
    result.iter().any(|s| {
        s["values"].as_array().into_iter().flatten().any(|v| {
            v[1].as_str()
                .and_then(|x| x.parse::<f64>().ok())
                .is_some_and(|x| x > 0.0)
        })
    })
}

fn get_text(url: &str) -> String {
    ureq::get(url)
        .call()
        .unwrap_or_else(|e| panic!("GET {url}: {e}"))
        .into_string()
        .expect("body")
}

/// The real ferrite-router binary (built beside this test: `cargo build -p ferrite-router`),
/// with the cluster's admin kubeconfig, watching `ns` and serving on 127.0.0.1:`port`; it
/// scrapes the replicas' load every 500 ms and queues at one request waiting per replica. Its log goes to `log`. Returns once `/readyz`
/// answers (its watch caches have listed).
fn start_router(cluster: &Cluster, ns: &str, port: u16, log: &Path) -> Guard {
    let file = std::fs::File::create(log).expect("router log");
    let mut cmd = Command::new(ferrite_testkit::e2e::router_binary());
    cmd.args([
        format!("--addr=127.0.0.1:{port}"),
        format!("--namespace={ns}"),
        // The stand-in pods sit at loopback addresses, which EndpointSlices refuse.
        "--endpoints-from=pods".to_string(),
        "--scrape-interval-ms=500".to_string(),
        // The unreachable pod sits out 1 s after each refusal (default 10 s), so retries
        // keep coming within the short load window.
        "--set-aside-ms=1000".to_string(),
        // A replica is saturated once one request waits in its own queue (default 5), so the
        // router holds requests while the direct load keeps both servers busy: the queue
        // panels have data.
        "--saturation-queue-depth=1".to_string(),
        // Tenants: the load carries [`TENANT_KEY`], for the tenants' panels.
        "--tenants".to_string(),
        format!("--tenant-secrets-namespace={ns}"),
    ])
    .env("KUBECONFIG", cluster.admin_kubeconfig())
    .env_remove("KUBERNETES_SERVICE_HOST")
    .stdin(Stdio::null())
    .stdout(file.try_clone().expect("log"))
    .stderr(file);
    let mut router = Guard::spawn("ferrite-router", cmd).expect("ferrite-router starts");
    let deadline = Instant::now() + Duration::from_secs(30);
    let url = format!("http://127.0.0.1:{port}/readyz");
    while ureq::get(&url).call().is_err() {
        let log = || std::fs::read_to_string(log).unwrap_or_default();
        if let Some(status) = router.exited() {
            panic!("ferrite-router exited with {status}:\n{}", log());
        }
        assert!(
            Instant::now() < deadline,
            "ferrite-router not ready in 30 s:\n{}",
            log()
        );
        thread::sleep(Duration::from_millis(100));
    }
    router
}

/// The expression of the alert `name` in alerts.yaml.
fn alert_expr(rules: &Value, name: &str) -> String {
    alert_rules(rules)
        .into_iter()
        .find(|r| r["alert"] == name)
        .and_then(|r| r["expr"].as_str())
        .unwrap_or_else(|| panic!("no alert {name}"))
        .to_string()
}

#[test]
fn every_panel_query_returns_data_from_prometheus_scraping_two_loaded_servers_and_the_operator() {
    let started = Instant::now();
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let Some(cluster) = rt.block_on(Cluster::start()) else {
        return;
    };
    let client = rt.block_on(cluster.client());
    let release = rt.block_on(install(&cluster, &json!({}), "dashboards"));

    // Two replicas of one model, as two pods of a Deployment (same port, two IPs).
    let port = shared_port();
    let mut servers = vec![
        start_replica("127.0.0.1", port),
        start_replica("127.0.0.2", port),
    ];
    wait_ready(&mut servers);

    // The operator autoscales "chat" on the two pods (and a third, ready but unreachable, so
    // its scrapes fail), ships the dashboards, and keeps failing to reconcile "broken", whose
    // namespace's quota forbids its Service: each panel of the operator has something to show.
    let op = rt.block_on(Operator::launch(
        &cluster,
        &release,
        "ferrite-operator-0",
        &[],
    ));
    // The router in front of them: part of the load goes through it. Its endpoints are chat's
    // Ready pods, the unreachable third one included, whose connect errors it retries.
    let router_dir = TempDir::new("ferrite-dashboards-router");
    let router_log = router_dir.path().join("router.log");
    let router_port = free_port();
    rt.block_on(tenant(&client, "ml"));
    let router = start_router(&cluster, "ml", router_port, &router_log);
    let router_base = format!("http://127.0.0.1:{router_port}");
    let router_log = move || std::fs::read_to_string(&router_log).unwrap_or_default();

    let dcgm_honored = StaticExporter::start(&dcgm_exposition(&[("chat-0", 0), ("other-0", 1)]));
    let dcgm_exported = StaticExporter::start(&dcgm_exposition(&[("chat-1", 0)]));

    // Prometheus scrapes the pods with the target labels a Prometheus Operator ServiceMonitor
    // gives them (namespace, pod, service), the operator and the router with honor_labels
    // (their series carry the InferenceServices' namespace, the router's in-flight gauge the
    // replica's pod; their own target labels are ferrite-system's), and itself as a foreign
    // exporter that happens to use `model_name` and `pod` labels: the dashboards must not list
    // or show it. It starts before chat has ready pods, to see the router's cold start.
    let target = |host: &str, pod: &str| {
        format!(
            "      - targets: ['{host}:{port}']\n        labels: {{namespace: ml, service: chat, pod: {pod}}}\n"
        )
    };
    let config = [
        "  - job_name: chat\n    static_configs:\n".to_string(),
        target("127.0.0.1", "chat-0"),
        target("127.0.0.2", "chat-1"),
        "  - job_name: ferrite-operator\n    honor_labels: true\n    static_configs:\n".to_string(),
        format!("      - targets: ['127.0.0.1:{}']\n", op.http_port),
        "        labels: {namespace: ferrite-system, pod: ferrite-operator-0}\n".to_string(),
        "  - job_name: ferrite-router\n    honor_labels: true\n    static_configs:\n".to_string(),
        format!("      - targets: ['127.0.0.1:{router_port}']\n"),
        "        labels: {namespace: ferrite-system, pod: ferrite-router-0}\n".to_string(),
        "  - job_name: foreign\n    static_configs:\n      - targets: ['$PROMETHEUS']\n"
            .to_string(),
        "        labels: {namespace: ml, pod: other-0, model_name: foreign}\n".to_string(),
        // DCGM exporters (one per GPU node) report the GPUs of chat-0 and of chat-1, and of a
        // pod of another model that the panels must leave out.
        "  - job_name: dcgm-honored\n    honor_labels: true\n    static_configs:\n".to_string(),
        format!("      - targets: ['127.0.0.1:{}']\n", dcgm_honored.port),
        "        labels: {namespace: gpu-operator, pod: nvidia-dcgm-exporter-a}\n".to_string(),
        "  - job_name: dcgm-exported\n    static_configs:\n".to_string(),
        format!("      - targets: ['127.0.0.1:{}']\n", dcgm_exported.port),
        "        labels: {namespace: gpu-operator, pod: nvidia-dcgm-exporter-b}\n".to_string(),
    ]
    .concat();
    let prom = Prometheus::start_with_rules(&config, &[dashboards_dir().join("alerts.yaml")]);
    prom.wait_for("count(up == 1)", Duration::from_secs(30), |v| v == 7.0);
    let from = unix_now() - 1.0;
    let rules: Value = serde_yaml_ng::from_str(
        &std::fs::read_to_string(dashboards_dir().join("alerts.yaml")).expect("alerts.yaml"),
    )
    .expect("yaml");

    let chat = isvc(
        "ml",
        "chat",
        json!({"model": {"source": "/models/smol.gguf", "servedName": "smol"},
               "runtime": {"port": port}, "replicas": 3,
               "autoscaling": {"minReplicas": 1, "maxReplicas": 4,
                   "targets": {"queuePerReplica": 1.0, "kvCacheUsage": 0.8},
                   "scrapeIntervalSeconds": 1, "panicThreshold": 1.5}}),
    );
    rt.block_on(async {
        let mut applier = Applier::new(client.clone()).await;
        for ns in ["ml", "broken"] {
            applier
                .apply(&json!({"apiVersion": "v1", "kind": "Namespace",
                               "metadata": {"name": ns}}))
                .await;
        }
        ferrite_testkit::e2e::quota(&client, "broken", json!({"services": "0"})).await;
        applier.apply(&chat).await;
        applier
            .apply(&isvc(
                "broken",
                "broken",
                json!({"model": {"source": "/models/smol.gguf"}}),
            ))
            .await;
    });

    // A cold start of "smol": chat wants 3 replicas but none is Ready yet, so the router holds
    // a request (nothing to wake) until the first pod turns Ready. Prometheus sees it held,
    // and FerriteRouterHoldingRequests' expression names the InferenceService in its own
    // namespace.
    let cold_start = Instant::now();
    let deadline = Instant::now() + Duration::from_secs(30);
    while !ureq::get(&format!("{router_base}/v1/models"))
        .set("Authorization", &format!("Bearer {TENANT_KEY}"))
        .call()
        .ok()
        .and_then(|r| r.into_json::<Value>().ok())
        .is_some_and(|v| v["data"][0]["id"] == "smol")
    {
        assert!(
            Instant::now() < deadline,
            "the router never listed smol:\n{}",
            router_log()
        );
        thread::sleep(Duration::from_millis(100));
    }
    let held = {
        let base = router_base.clone();
        thread::spawn(move || complete(&base, 0, false))
    };
    prom.wait_for(
        r#"sum(ferrite_router_held_requests{namespace="ml", model_name="smol"})"#,
        Duration::from_secs(30),
        |v| v >= 1.0,
    );
    let held_seen_secs = cold_start.elapsed().as_secs_f64();
    // Stay held for two more scrapes: the panels' range queries (1 s steps) must find a held
    // sample, and one lone sample was missed once on a loaded CI machine.
    thread::sleep(Duration::from_millis(2500));
    let holding = prom
        .query(&alert_expr(&rules, "FerriteRouterHoldingRequests"))
        .expect("query");
    assert_eq!(holding.len(), 1, "{holding:?}");
    assert_eq!(
        holding[0]["metric"],
        json!({"namespace": "ml", "inferenceservice": "chat", "model_name": "smol"})
    );
    assert!(!held.is_finished(), "the request is held, not refused");
    // KEDA mode's activity trigger sees the held request: what wakes a service KEDA scaled to
    // zero.
    let keda = ferrite_operator::build::keda::queries("ml", "chat");
    let activity = prom.value(&keda.activity);
    assert!(
        activity.is_some_and(|v| v >= 1.0),
        "{activity:?}: {}",
        keda.activity
    );
    let chat_pods: BTreeSet<String> = rt.block_on(async {
        let deadline = Instant::now() + Duration::from_secs(60);
        while pods_ready_at(
            &client,
            "ml",
            "chat",
            &["127.0.0.1", "127.0.0.2", "127.0.0.3"],
        )
        .await
            < 3
        {
            assert!(Instant::now() < deadline, "chat's 3 pods");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        // The router's `pod` labels are these pods' names (Prometheus knows the two live ones
        // as chat-0 and chat-1: static targets).
        let pods: kube::Api<k8s_openapi::api::core::v1::Pod> =
            kube::Api::namespaced(client.clone(), "ml");
        let list = pods
            .list(&kube::api::ListParams::default().labels("ferrite.dev/inferenceservice=chat"))
            .await
            .expect("chat's pods");
        list.items
            .into_iter()
            .filter_map(|p| p.metadata.name)
            .collect()
    });
    let status = held.join().expect("held request");
    assert_eq!(status, 200, "the held request\n{}", router_log());
    let cold_start_secs = cold_start.elapsed().as_secs_f64();
    prom.wait_for(
        "sum(ferrite_operator_autoscaler_desired_replicas)",
        Duration::from_secs(30),
        |v| v >= 1.0,
    );
    let setup_secs = started.elapsed().as_secs_f64();

    // The servers' KV caches are 6 blocks of 16 tokens (--num-gpu-blocks 6), so two sequences
    // of these prompts outgrow them: sequences are preempted and swapped to the small host pool.
    // Load until Prometheus has seen a queue and a swapped sequence, the autoscaler has scaled
    // on the queue in panic mode (its threshold is 1.5 × the target here), the operator's error
    // counters have moved, the router has retried a request on the unreachable pod and
    // answered a few, and 12 requests have started (90 s at most). Half the requests go
    // through the router, half of those streamed.
    let next = AtomicUsize::new(0);
    let done = AtomicBool::new(false);
    let statuses = std::sync::Mutex::new(Vec::new());
    let saw_queue = thread::scope(|scope| {
        for _ in 0..8 {
            scope.spawn(|| {
                while !done.load(Ordering::SeqCst) {
                    let i = next.fetch_add(1, Ordering::SeqCst);
                    // Every fourth streams through the router, as most clients do.
                    let base = match i % 4 {
                        0 | 1 => &servers[i % 2].base,
                        _ => &router_base,
                    };
                    let status = complete(base, i, i % 4 == 3);
                    statuses.lock().expect("lock").push(status);
                }
            });
        }
        let deadline = Instant::now() + Duration::from_secs(90);
        let (mut saw_queue, mut saw_swapped) = (0.0f64, 0.0f64);
        let mut saw_keda_queue = 0.0f64;
        let mut conditions = [false; 6];
        // When the conditions but the router's first held, and when the router's did: what
        // the router adds to the load.
        let load_started = Instant::now();
        let (mut others_met, mut router_met) = (None, None);
        // "broken" is retried with a growing backoff, so its failures thin out; an annotation
        // changed every 2 s makes it fail again at once, so the errors panel has data within
        // the load window however long setup took.
        let broken = ferrite_testkit::e2e::isvc_api(&client, "broken");
        let mut poked = Instant::now();
        let mut pokes = 0u32;
        while Instant::now() < deadline && !conditions.iter().all(|c| *c) {
            thread::sleep(Duration::from_millis(250));
            if poked.elapsed() >= Duration::from_secs(2) {
                poked = Instant::now();
                pokes += 1;
                let poke = json!({"metadata": {"annotations": {"test.ferrite.dev/poke": pokes.to_string()}}});
                rt.block_on(broken.patch(
                    "broken",
                    &kube::api::PatchParams::default(),
                    &kube::api::Patch::Merge(&poke),
                ))
                .expect("annotate broken");
            }
            saw_queue = saw_queue.max(
                prom.value(r#"sum(vllm:num_requests_waiting{namespace="ml"})"#)
                    .unwrap_or(0.0),
            );
            // KEDA mode's queue trigger: the pods' queue and the router's, one number.
            saw_keda_queue = saw_keda_queue.max(prom.value(&keda.queue).unwrap_or(0.0));
            saw_swapped = saw_swapped.max(
                prom.value(r#"sum(vllm:num_requests_swapped{namespace="ml"})"#)
                    .unwrap_or(0.0),
            );
            conditions = [
                saw_queue >= 1.0,
                saw_swapped >= 1.0,
                prom.value("sum(ferrite_operator_autoscaler_scale_actions_total)")
                    .is_some_and(|v| v >= 1.0)
                    && prom
                        .value("max(max_over_time(ferrite_operator_autoscaler_panic_mode[1m]))")
                        .is_some_and(|v| v >= 1.0),
                prom.value("sum(increase(ferrite_operator_reconcile_errors_total[10s]))")
                    .is_some_and(|v| v > 0.0)
                    && prom
                        .value("sum(ferrite_operator_autoscaler_scrape_errors_total)")
                        .is_some_and(|v| v >= 1.0),
                next.load(Ordering::SeqCst) >= 12,
                // An increase Prometheus saw: a counter's series starts at its first value,
                // which rate() cannot see, so the retries panel needs a later one.
                prom.value(r#"sum(increase(ferrite_router_retries_total{model_name="smol"}[1m]))"#)
                    .is_some_and(|v| v > 0.0)
                    && prom
                        .value(r#"sum(ferrite_router_requests_total{model_name="smol", outcome="success"})"#)
                        .is_some_and(|v| v >= 4.0)
                    && prom
                        .value(r#"sum(ferrite_router_upstream_duration_seconds_count{model_name="smol"})"#)
                        .is_some_and(|v| v >= 1.0)
                    // Flow control held a request while both servers were saturated.
                    && prom
                        .value(r#"max_over_time(sum(ferrite_router_queued_requests{model_name="smol"})[2m:])"#)
                        .is_some_and(|v| v >= 1.0),
            ];
            let secs = Some(load_started.elapsed().as_secs_f64());
            if others_met.is_none() && conditions[..5].iter().all(|c| *c) {
                others_met = secs;
            }
            if router_met.is_none() && conditions[5] {
                router_met = secs;
            }
        }
        done.store(true, Ordering::SeqCst);
        assert!(
            conditions.iter().all(|c| *c),
            "after 90 s of load: queue seen {}, swapped seen {}, scaled in panic mode {}, \
             operator errors {} (reconcile {:?}, scrape {:?}), 12 requests {}, router retried \
             and answered {}\n{}\nrouter:\n{}",
            conditions[0],
            conditions[1],
            conditions[2],
            conditions[3],
            prom.value("sum(ferrite_operator_reconcile_errors_total)"),
            prom.value("sum(ferrite_operator_autoscaler_scrape_errors_total)"),
            conditions[4],
            conditions[5],
            op.log(),
            router_log()
        );
        eprintln!(
            "load conditions met after {:.1} s without the router's, {:.1} s for the router's",
            others_met.unwrap_or_default(),
            router_met.unwrap_or_default()
        );
        // The queue KEDA would scale on counts at least what the pods queued.
        assert!(
            saw_keda_queue >= 1.0,
            "{saw_keda_queue} (pods: {saw_queue}): {}",
            keda.queue
        );
        let kv = prom.value(&keda.kv_cache);
        assert!(
            kv.is_some_and(|v| (0.0..=1.0).contains(&v)),
            "{kv:?}: {}",
            keda.kv_cache
        );
        saw_queue
    });
    let statuses = statuses.into_inner().expect("lock");
    assert!(
        statuses.iter().all(|s| *s == 200),
        "statuses: {statuses:?}\nrouter:\n{}",
        router_log()
    );
    let load_secs = started.elapsed().as_secs_f64();
    // Two more scrapes of the final state.
    thread::sleep(Duration::from_millis(2500));
    let to = unix_now();
    let router_sum = |series: &str| prom.value(&format!("sum({series})")).unwrap_or(0.0);
    eprintln!(
        "setup {setup_secs:.1} s (router cold start {cold_start_secs:.1} s, seen held after \
         {held_seen_secs:.1} s); load: {} requests, \
         peak queue {saw_queue} (Prometheus), {:.1} s; router: {} answered, affinity {} kept \
         and {} overflowed, {} retried, {} timed to headers and {} to the end",
        statuses.len(),
        load_secs - setup_secs,
        router_sum(r#"ferrite_router_requests_total{model_name="smol"}"#),
        router_sum(r#"ferrite_router_routing_decisions_total{model_name="smol", affinity="kept"}"#),
        router_sum(
            r#"ferrite_router_routing_decisions_total{model_name="smol", affinity="overflowed"}"#
        ),
        router_sum(r#"ferrite_router_retries_total{model_name="smol"}"#),
        router_sum(r#"ferrite_router_upstream_headers_seconds_count{model_name="smol"}"#),
        router_sum(r#"ferrite_router_upstream_duration_seconds_count{model_name="smol"}"#),
    );

    // Every metric name the dashboards and alerts use is exposed by a server, the operator or the
    // router, or is listed as external.
    let mut exposed = BTreeSet::new();
    for s in &servers {
        exposed.extend(exposition_names(&get_text(&format!("{}/metrics", s.base))));
    }
    let (_, operator_metrics) = op.get("/metrics").expect("operator /metrics");
    exposed.extend(exposition_names(&operator_metrics));
    exposed.extend(exposition_names(&get_text(&format!(
        "{router_base}/metrics"
    ))));
    let mut used: BTreeMap<String, String> = BTreeMap::new();
    for q in all_queries() {
        for m in metric_names(&q.expr) {
            used.entry(m).or_insert_with(|| q.name());
        }
    }
    for name in DASHBOARDS {
        for v in variables(&load(name)) {
            if let Some((selector, _)) = v["query"].as_str().and_then(label_values_query) {
                for m in metric_names(&selector) {
                    used.entry(m)
                        .or_insert_with(|| format!("{name} / variable {}", v["name"]));
                }
            }
        }
    }
    for r in alert_rules(&rules) {
        for m in metric_names(r["expr"].as_str().unwrap_or_default()) {
            used.entry(m)
                .or_insert_with(|| format!("alert {}", r["alert"].as_str().unwrap_or("")));
        }
    }
    let missing: Vec<String> = used
        .iter()
        .filter(|(m, _)| {
            !exposed.contains(*m)
                && !EXTERNAL.contains(&m.as_str())
                && !PROMETHEUS_SERIES.contains(&m.as_str())
        })
        .map(|(m, at)| format!("{m} ({at})"))
        .collect();
    assert!(
        missing.is_empty(),
        "metrics neither exposed nor listed as external: {missing:?}"
    );
    eprintln!("{} metric names checked against /metrics", used.len());

    // The variables list this model, its namespace, pods and InferenceService, and nothing of the
    // foreign exporter, though it has the same labels.
    let leak = prom.label_values("up", "model_name").expect("series");
    assert_eq!(
        leak,
        ["foreign"],
        "the foreign exporter's label is there to leak"
    );
    let expected: [(&str, &[&str]); 4] = [
        ("namespace", &["ml"]),
        ("model_name", &["smol"]),
        ("pod", &["chat-0", "chat-1"]),
        ("inferenceservice", &["chat"]),
    ];
    for name in DASHBOARDS {
        let d = load(name);
        for (var, want) in expected {
            let Some(v) = variable(&d, var) else {
                assert_eq!(var, "inferenceservice", "{name} lacks {var}");
                continue;
            };
            let (selector, label) =
                label_values_query(v["query"].as_str().unwrap_or_default()).expect("query");
            let got = prom
                .label_values(&substitute(&selector, &VALUES), &label)
                .unwrap_or_else(|e| panic!("{name} / {var}: {e}"));
            assert_eq!(got, want, "{name}: variable {var}");
        }
    }

    // Every expression parses (promtool, as recording rules) ...
    let queries = all_queries();
    let dir = ferrite_testkit::validate::temp_dir("dashboard-queries");
    let mut recording = String::from("groups:\n  - name: dashboards\n    rules:\n");
    for (i, q) in queries.iter().enumerate() {
        let expr = serde_json::to_string(&substitute(&q.expr, &VALUES)).expect("json");
        recording.push_str(&format!(
            "      - record: dashboard:query_{i}\n        expr: {expr}\n"
        ));
    }
    let rules_file = dir.join("queries.yaml");
    std::fs::write(&rules_file, recording).expect("write");
    let (ok, out) = run_validator(
        Command::new(tool("FERRITE_PROMTOOL", "promtool"))
            .args(["check", "rules"])
            .arg(&rules_file),
    );
    assert!(
        ok && out.contains(&format!("SUCCESS: {} rules found", queries.len())),
        "{out}"
    );
    let _ = std::fs::remove_dir_all(&dir);

    // ... and returns data over the run, only for this model's pods; GPU panels from the stand-in exporters too.
    let mut failures = Vec::new();
    let mut gpu = Vec::new();
    let mut with_data = 0;
    let mut results: BTreeMap<String, Vec<Value>> = BTreeMap::new();
    for q in &queries {
        let expr = substitute(&q.expr, &VALUES);
        let result = match prom.query_range(&expr, from, to, 1.0) {
            Ok(r) => r,
            Err(e) => {
                failures.push(format!("{}: {e}", q.name()));
                continue;
            }
        };
        if q.external() {
            // Both of the model's pods, whichever way their exporter was scraped, and only
            // them.
            let pods: BTreeSet<&str> = result
                .iter()
                .filter_map(|r| r["metric"]["pod"].as_str())
                .collect();
            if pods != BTreeSet::from(["chat-0", "chat-1"]) || !has_positive(&result) {
                failures.push(format!("{}: GPU series for {pods:?} in {expr}", q.name()));
            }
            gpu.push(q.name());
            continue;
        }
        if has_data(&result) {
            with_data += 1;
        } else {
            failures.push(format!("{}: no data for {expr}", q.name()));
        }
        if !has_positive(&result) {
            failures.push(format!("{}: only zeros for {expr}", q.name()));
        }
        for s in &result {
            let m = &s["metric"];
            let pod_ok = m["pod"]
                .as_str()
                .is_none_or(|p| p == "chat-0" || p == "chat-1" || chat_pods.contains(p));
            let model_ok = m["model_name"].as_str().is_none_or(|n| n == "smol");
            if !pod_ok || !model_ok {
                failures.push(format!("{}: foreign series {m}", q.name()));
            }
        }
        results.insert(format!("{}\u{0}{}", q.dashboard, q.expr), result);
    }
    eprintln!(
        "{} queries: {} returned data, {} of them GPU panels on stand-in DCGM exporters, {} failed",
        queries.len(),
        with_data + gpu.len(),
        gpu.len(),
        failures.len()
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert!(!gpu.is_empty() && gpu.iter().all(|s| s.contains("GPU")));

    // The alert rules evaluate on the real series without errors; the two "down" alerts are
    // quiet while every server is scraped, and nothing is held any more. Then a replica dies:
    // FerriteServerDown's expression picks exactly its target (the alert itself waits 2
    // minutes).
    let alerts = prom.rules();
    assert_eq!(alerts.len(), 6, "{alerts:?}");
    for r in &alerts {
        assert_eq!(r["health"], "ok", "{r}");
        if [
            "FerriteServerDown",
            "FerriteServerNotScraped",
            "FerriteRouterHoldingRequests",
        ]
        .contains(&r["name"].as_str().unwrap_or_default())
        {
            assert_eq!(r["state"], "inactive", "{r}");
        }
    }
    let down = alert_expr(&rules, "FerriteServerDown");
    assert_eq!(prom.query(&down).map(|r| r.len()), Ok(0));
    let _ = servers[1].child.kill();
    let _ = servers[1].child.wait();
    prom.wait_for(r#"up{pod="chat-1"}"#, Duration::from_secs(15), |v| v == 0.0);
    let fired = prom.query(&down).expect("query");
    assert_eq!(fired.len(), 1, "{fired:?}");
    assert_eq!(fired[0]["metric"]["pod"], "chat-1", "{fired:?}");

    // The operator shipped each model dashboard the chart gives it (not the cluster-wide
    // autoscaling one) for "chat", its model variable preset to "smol".
    let config_maps: kube::Api<k8s_openapi::api::core::v1::ConfigMap> =
        kube::Api::namespaced(client.clone(), "ml");
    for name in ["overview", "realtime"] {
        let cm = rt
            .block_on(config_maps.get_opt(&format!("chat-dashboard-{name}")))
            .expect("read")
            .unwrap_or_else(|| panic!("no ConfigMap for {name}"));
        let data = cm.data.unwrap_or_default();
        let json: Value =
            serde_json::from_str(data.get(&format!("chat-{name}.json")).expect("data"))
                .expect("dashboard JSON");
        assert_eq!(
            variable(&json, "model_name").expect("var")["current"]["value"],
            "smol"
        );
    }

    if let Ok(dir) = std::env::var("FERRITE_DASHBOARD_PREVIEW_DIR") {
        write_preview(Path::new(&dir), &results, from, to);
    }
    eprintln!("live test took {:.1} s", started.elapsed().as_secs_f64());
    drop(router);
    drop(op);
    drop(servers);
}

/// Each dashboard with every target's result under `preview` (the range and the series).
fn write_preview(dir: &Path, results: &BTreeMap<String, Vec<Value>>, from: f64, to: f64) {
    std::fs::create_dir_all(dir).expect("preview dir");
    for name in DASHBOARDS {
        let mut d = load(name);
        let fill = |p: &mut Value| {
            for t in p
                .get_mut("targets")
                .and_then(Value::as_array_mut)
                .into_iter()
                .flatten()
            {
                let key = format!("{name}\u{0}{}", t["expr"].as_str().unwrap_or_default());
                t["preview"] = json!({"from": from, "to": to,
                    "result": results.get(&key).cloned().unwrap_or_default()});
            }
        };
        for p in d["panels"].as_array_mut().into_iter().flatten() {
            fill(p);
            for inner in p
                .get_mut("panels")
                .and_then(Value::as_array_mut)
                .into_iter()
                .flatten()
            {
                fill(inner);
            }
        }
        std::fs::write(dir.join(format!("{name}.json")), d.to_string()).expect("write preview");
    }
}

//! bench-serve: a streaming load generator for any OpenAI-compatible server.
//!
//! Each target gets the same closed-loop load at each concurrency: unique prompts of about
//! `--prompt-tokens` tokens (unique from the first token, so no server can reuse a cached
//! prefix), `max_tokens` with `ignore_eos`, temperature 0, streamed from `/v1/completions`.
//! Every request opens its own connection (llama.cpp's server closes it after a stream anyway).
//! The first target is the baseline; the others are printed as ratios against it.
//!
//! `--save FILE` writes a run's raw figures and `--pool FILE...` pools saved runs, so a script
//! can restart the servers between runs (and alternate which starts first) and still compare
//! pooled figures (bench/metrics-overhead.sh).

use ferrite_bench::stats::{alternating, mean_ci95, percentile};
use ferrite_bench::text::WORDS;
use std::io::{Read as _, Write as _};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use clap::Parser;
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::header::{CONTENT_TYPE, HOST};
use hyper_util::rt::TokioIo;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

#[derive(Debug, Parser)]
#[command(about = "Streaming load generator for OpenAI-compatible servers")]
struct Args {
    /// `name=http://host:port` (repeatable); the first is the baseline.
    #[arg(long = "target", required_unless_present = "pool")]
    targets: Vec<String>,
    /// The `model` field to send.
    #[arg(long, default_value = "default")]
    model: String,
    /// `name=m1,m2,...` (repeatable): target `name`'s requests name these models in turn
    /// instead of `--model` (request `i` sends model `i mod n`), e.g. one LoRA adapter each.
    #[arg(long = "target-models")]
    target_models: Vec<String>,
    /// `name=FILE` (repeatable): a JSON object whose fields are added to every request body
    /// of target `name`, e.g. a `response_format` (two targets at one server then compare
    /// constrained and free generation in one run).
    #[arg(long = "target-body")]
    target_bodies: Vec<String>,
    /// Sampling temperature of every request (0: greedy).
    #[arg(long, default_value_t = 0.0)]
    temperature: f64,
    #[arg(long, value_delimiter = ',', default_value = "1,8,32")]
    concurrency: Vec<usize>,
    /// Requests per concurrency level, as a multiple of the concurrency (at least 4 requests).
    #[arg(long, default_value_t = 2)]
    rounds: usize,
    #[arg(long, default_value_t = 128)]
    prompt_tokens: usize,
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    /// Per-request timeout in seconds.
    #[arg(long, default_value_t = 600)]
    timeout: u64,
    /// Scrape `/metrics` of the `--scrape` targets every this many milliseconds during each
    /// level, as Prometheus would (0: never), and report scrape latency.
    #[arg(long, default_value_t = 0)]
    scrape_ms: u64,
    /// Names of targets to scrape (repeatable).
    #[arg(long = "scrape")]
    scrape: Vec<String>,
    /// `name=PID` (repeatable): sample that process's resident memory (VmRSS) while its target
    /// is under load and report the peak per level. Both servers stay up for the whole run, so
    /// each peak includes whatever earlier levels left resident.
    #[arg(long = "pid")]
    pids: Vec<String>,
    /// Run every target this many times, alternating their order (A B, B A, …), and report the
    /// pooled figures; spreads drift (thermal, page cache, noisy neighbours) over all targets.
    #[arg(long, default_value_t = 1)]
    repeat: usize,
    /// Run the targets in reverse order (the first repetition; later ones alternate).
    #[arg(long)]
    reverse: bool,
    /// Write this run's raw figures (every sample) as JSON, for `--pool`.
    #[arg(long)]
    save: Option<std::path::PathBuf>,
    /// Load no servers: pool the runs saved with `--save` (repeatable) and print the pooled
    /// figures and ratios.
    #[arg(long, num_args = 1..)]
    pool: Vec<std::path::PathBuf>,
}

/// What one request saw.
#[derive(Debug, Clone, Default)]
struct Sample {
    ttft: f64,
    itls: Vec<f64>,
    e2e: f64,
    output_tokens: usize,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct LevelResult {
    concurrency: usize,
    requests: usize,
    wall: f64,
    output_tokens: usize,
    ttft: Vec<f64>,
    itl: Vec<f64>,
    e2e: Vec<f64>,
    /// Latencies of `/metrics` scrapes taken during the level.
    scrapes: Vec<f64>,
    scrape_bytes: usize,
    /// Peak resident memory of the target's process during the level (`--pid`), KiB.
    #[serde(default)]
    peak_rss_kib: u64,
}

impl LevelResult {
    /// Pools another run of the same level into this one.
    fn merge(&mut self, o: LevelResult) {
        self.requests += o.requests;
        self.wall += o.wall;
        self.output_tokens += o.output_tokens;
        self.ttft.extend(o.ttft);
        self.itl.extend(o.itl);
        self.e2e.extend(o.e2e);
        self.scrapes.extend(o.scrapes);
        self.scrape_bytes = self.scrape_bytes.max(o.scrape_bytes);
        self.peak_rss_kib = self.peak_rss_kib.max(o.peak_rss_kib);
    }
    fn tok_per_s(&self) -> f64 {
        self.output_tokens as f64 / self.wall
    }
    fn req_per_s(&self) -> f64 {
        self.requests as f64 / self.wall
    }
}

/// A prompt of roughly `tokens` tokens whose first token differs per request.
fn prompt(i: usize, tokens: usize) -> String {
    let mut s = format!("{i} ");
    // English words are about one token each with a leading space.
    for k in 0..tokens.saturating_sub(2) {
        s.push_str(WORDS[(i * 7 + k * 5 + k / 3) % WORDS.len()]);
        s.push(' ');
    }
    s
}

struct Target {
    name: String,
    host: String,
    addr: String,
    /// The `model` of each request, in turn.
    models: Vec<String>,
    /// Fields added to every request body (`--target-body`).
    body: serde_json::Map<String, Value>,
}

fn parse_target(s: &str) -> Result<Target> {
    let (name, url) = s
        .split_once('=')
        .ok_or_else(|| anyhow!("--target wants name=url, got {s}"))?;
    let rest = url
        .strip_prefix("http://")
        .ok_or_else(|| anyhow!("only http:// targets are supported: {url}"))?;
    let host = rest.trim_end_matches('/').to_string();
    Ok(Target {
        name: name.to_string(),
        addr: host.clone(),
        host,
        models: Vec::new(),
        body: serde_json::Map::new(),
    })
}

/// The target a per-target option `flag name=VALUE` names, and its value.
fn target_option<'a>(
    targets: &'a mut [Target],
    flag: &str,
    what: &str,
    spec: &'a str,
) -> Result<(&'a mut Target, &'a str)> {
    let (name, value) = spec
        .split_once('=')
        .ok_or_else(|| anyhow!("{flag} wants name={what}, got {spec}"))?;
    let t = targets
        .iter_mut()
        .find(|t| t.name == name)
        .ok_or_else(|| anyhow!("{flag} names no --target: {name}"))?;
    Ok((t, value))
}

/// Reads each `--target-body name=FILE` into its target.
fn assign_bodies(targets: &mut [Target], args: &Args) -> Result<()> {
    for spec in &args.target_bodies {
        let (t, file) = target_option(targets, "--target-body", "FILE", spec)?;
        let text = std::fs::read_to_string(file).with_context(|| format!("reading {file}"))?;
        match serde_json::from_str(&text).with_context(|| format!("parsing {file}"))? {
            Value::Object(fields) => t.body = fields,
            _ => bail!("--target-body {file}: not a JSON object"),
        }
    }
    Ok(())
}

/// Sets each target's models: its `--target-models` list, else `--model`.
fn assign_models(targets: &mut [Target], args: &Args) -> Result<()> {
    for t in targets.iter_mut() {
        t.models = vec![args.model.clone()];
    }
    for spec in &args.target_models {
        let (t, list) = target_option(targets, "--target-models", "m1,m2,...", spec)?;
        t.models = list
            .split(',')
            .filter(|m| !m.is_empty())
            .map(String::from)
            .collect();
        anyhow::ensure!(!t.models.is_empty(), "--target-models {spec}: no model");
    }
    Ok(())
}

async fn one_request(t: &Target, body: &Value) -> Result<Sample> {
    let started = Instant::now();
    let stream = tokio::net::TcpStream::connect(&t.addr)
        .await
        .with_context(|| format!("connecting to {}", t.addr))?;
    stream.set_nodelay(true)?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    let req = hyper::Request::post("/v1/completions")
        .header(HOST, &t.host)
        .header(CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(body.to_string())))?;
    let resp = sender.send_request(req).await?;
    if !resp.status().is_success() {
        let status = resp.status();
        let text = resp.into_body().collect().await?.to_bytes();
        bail!("HTTP {status}: {}", String::from_utf8_lossy(&text));
    }
    let mut body = resp.into_body();
    let mut buf = Vec::new();
    let mut sample = Sample::default();
    let mut last: Option<Instant> = None;
    let mut chunks_with_text = 0usize;
    let mut usage_tokens = None;
    while let Some(frame) = body.frame().await {
        let frame = frame?;
        let Some(data) = frame.data_ref() else {
            continue;
        };
        buf.extend_from_slice(data);
        while let Some(end) = find_event_end(&buf) {
            let event: Vec<u8> = buf.drain(..end).collect();
            let now = Instant::now();
            for line in String::from_utf8_lossy(&event).lines() {
                let Some(payload) = line.strip_prefix("data: ") else {
                    continue;
                };
                if payload.trim() == "[DONE]" {
                    continue;
                }
                let v: Value = serde_json::from_str(payload)
                    .with_context(|| format!("bad chunk: {payload}"))?;
                if let Some(n) = v["usage"]["completion_tokens"].as_u64() {
                    usage_tokens = Some(n as usize);
                }
                let text = v["choices"][0]["text"].as_str().unwrap_or("");
                if text.is_empty() {
                    continue;
                }
                chunks_with_text += 1;
                match last {
                    None => sample.ttft = (now - started).as_secs_f64(),
                    Some(prev) => sample.itls.push((now - prev).as_secs_f64()),
                }
                last = Some(now);
            }
        }
    }
    sample.e2e = started.elapsed().as_secs_f64();
    sample.output_tokens = usage_tokens.unwrap_or(chunks_with_text);
    Ok(sample)
}

/// One `GET /metrics` over a fresh connection, as Prometheus does by default; returns
/// (seconds, body bytes). Blocking: it runs on the scraper's own thread.
fn scrape(addr: &str, host: &str) -> Result<(f64, usize)> {
    let started = Instant::now();
    let mut stream = std::net::TcpStream::connect(addr)?;
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(
        stream,
        "GET /metrics HTTP/1.1\r\nHost: {host}\r\nAccept: text/plain\r\nConnection: close\r\n\r\n"
    )?;
    let mut response = Vec::with_capacity(64 * 1024);
    stream.read_to_end(&mut response)?;
    let secs = started.elapsed().as_secs_f64();
    let head_end = response
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| anyhow!("/metrics: no HTTP header end"))?;
    let status = String::from_utf8_lossy(&response[..head_end.min(64)]).into_owned();
    if !status.starts_with("HTTP/1.1 200") {
        bail!("/metrics answered {}", status.lines().next().unwrap_or(""));
    }
    Ok((secs, response.len() - head_end - 4))
}

/// Scrapes every `every` until `stop` is set, on a thread of its own: the load generator's
/// runtime is busy with the streams, and a scraper waiting behind them (rather than behind the
/// server) would inflate the latency it reports. Prometheus is a separate process too.
fn scrape_loop(
    t: Arc<Target>,
    every: Duration,
    stop: Arc<AtomicBool>,
) -> std::thread::JoinHandle<Result<(Vec<f64>, usize)>> {
    std::thread::spawn(move || {
        let (mut lat, mut bytes) = (Vec::new(), 0);
        let mut next = Instant::now();
        while !stop.load(Ordering::SeqCst) {
            let (secs, n) = scrape(&t.addr, &t.host)?;
            lat.push(secs);
            bytes = n;
            next += every;
            match next.checked_duration_since(Instant::now()) {
                Some(wait) => std::thread::sleep(wait),
                None => next = Instant::now(),
            }
        }
        Ok((lat, bytes))
    })
}

/// `VmRSS` of a process, KiB, from `/proc/PID/status`.
fn rss_kib(pid: u32) -> Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .with_context(|| format!("reading /proc/{pid}/status"))?;
    parse_vm_rss(&status).ok_or_else(|| anyhow!("no VmRSS line in /proc/{pid}/status"))
}

fn parse_vm_rss(status: &str) -> Option<u64> {
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

/// Samples `pid`'s resident memory every 100 ms until `stop` is set and returns the peak, on a
/// thread of its own for the same reason as [`scrape_loop`].
fn rss_loop(pid: u32, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<Result<u64>> {
    std::thread::spawn(move || {
        let mut peak = rss_kib(pid)?;
        while !stop.load(Ordering::SeqCst) {
            std::thread::sleep(Duration::from_millis(100));
            peak = peak.max(rss_kib(pid)?);
        }
        Ok(peak)
    })
}

/// End (exclusive) of the first complete SSE event in `buf`, if any.
fn find_event_end(buf: &[u8]) -> Option<usize> {
    buf.windows(2)
        .position(|w| w == b"\n\n")
        .map(|p| p + 2)
        .or_else(|| buf.windows(4).position(|w| w == b"\r\n\r\n").map(|p| p + 4))
}

async fn run_level(
    t: Arc<Target>,
    args: &Args,
    pid: Option<u32>,
    concurrency: usize,
    seed: usize,
) -> Result<LevelResult> {
    let total = (concurrency * args.rounds).max(4);
    let next = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let scraper = (args.scrape_ms > 0 && args.scrape.contains(&t.name)).then(|| {
        scrape_loop(
            t.clone(),
            Duration::from_millis(args.scrape_ms),
            stop.clone(),
        )
    });
    let rss = pid.map(|p| rss_loop(p, stop.clone()));
    let started = Instant::now();
    let mut workers = Vec::new();
    for _ in 0..concurrency {
        let (t, next) = (t.clone(), next.clone());
        let (prompt_tokens, max_tokens) = (args.prompt_tokens, args.max_tokens);
        let temperature = args.temperature;
        let timeout = Duration::from_secs(args.timeout);
        workers.push(tokio::spawn(async move {
            let mut out = Vec::new();
            loop {
                let i = next.fetch_add(1, Ordering::SeqCst);
                if i >= total {
                    break;
                }
                let mut body = json!({
                    "model": t.models[i % t.models.len()],
                    "prompt": prompt(seed + i, prompt_tokens),
                    "max_tokens": max_tokens,
                    "temperature": temperature,
                    "seed": seed + i,
                    "ignore_eos": true,
                    "stream": true,
                    "stream_options": {"include_usage": true},
                });
                if let Value::Object(fields) = &mut body {
                    fields.extend(t.body.clone());
                }
                let s = tokio::time::timeout(timeout, one_request(&t, &body))
                    .await
                    .map_err(|_| anyhow!("request timed out"))??;
                out.push(s);
            }
            Ok::<_, anyhow::Error>(out)
        }));
    }
    let mut r = LevelResult {
        concurrency,
        requests: total,
        ..Default::default()
    };
    for w in workers {
        for s in w.await?? {
            r.output_tokens += s.output_tokens;
            r.ttft.push(s.ttft);
            r.e2e.push(s.e2e);
            r.itl.extend(s.itls);
        }
    }
    r.wall = started.elapsed().as_secs_f64();
    stop.store(true, Ordering::SeqCst);
    if let Some(s) = scraper {
        (r.scrapes, r.scrape_bytes) = tokio::task::spawn_blocking(move || s.join())
            .await?
            .map_err(|_| anyhow!("the scraper thread panicked"))??;
    }
    if let Some(s) = rss {
        r.peak_rss_kib = tokio::task::spawn_blocking(move || s.join())
            .await?
            .map_err(|_| anyhow!("the RSS sampler thread panicked"))??;
    }
    Ok(r)
}

fn print_level(name: &str, r: &LevelResult) {
    println!(
        "{name:>10} c={:<3} reqs={:<4} out tok/s={:>8.1} req/s={:>6.3} TTFT p50={:>7.3}s p99={:>7.3}s ITL p50={:>6.1}ms p99={:>7.1}ms e2e p50={:>7.2}s p99={:>7.2}s",
        r.concurrency,
        r.requests,
        r.tok_per_s(),
        r.req_per_s(),
        percentile(&r.ttft, 50.0),
        percentile(&r.ttft, 99.0),
        percentile(&r.itl, 50.0) * 1e3,
        percentile(&r.itl, 99.0) * 1e3,
        percentile(&r.e2e, 50.0),
        percentile(&r.e2e, 99.0),
    );
    if !r.scrapes.is_empty() {
        println!(
            "{name:>10} c={:<3} /metrics scrapes={} p50={:.2}ms p99={:.2}ms max={:.2}ms size={} B",
            r.concurrency,
            r.scrapes.len(),
            percentile(&r.scrapes, 50.0) * 1e3,
            percentile(&r.scrapes, 99.0) * 1e3,
            percentile(&r.scrapes, 100.0) * 1e3,
            r.scrape_bytes,
        );
    }
    if r.peak_rss_kib > 0 {
        println!(
            "{name:>10} c={:<3} peak RSS {:.0} MiB",
            r.concurrency,
            r.peak_rss_kib as f64 / 1024.0
        );
    }
}

/// One run's raw figures, per target in `--target` order, as `--save` writes them.
#[derive(Debug, Serialize, Deserialize)]
struct Saved {
    targets: Vec<String>,
    results: Vec<Vec<LevelResult>>,
}

/// Pools `from` into `into`, level by level.
fn pool_into(into: &mut [Vec<LevelResult>], from: Vec<Vec<LevelResult>>) {
    for (per, more) in into.iter_mut().zip(from) {
        for (k, r) in more.into_iter().enumerate() {
            match per.get_mut(k) {
                Some(pooled) => pooled.merge(r),
                None => per.push(r),
            }
        }
    }
}

fn print_pooled(over: &str, names: &[String], results: &[Vec<LevelResult>]) {
    println!("\npooled over {over}:");
    for (n, per) in names.iter().zip(results) {
        for r in per {
            print_level(n, r);
        }
    }
}

fn print_ratios(names: &[String], results: &[Vec<LevelResult>]) {
    let base = &names[0];
    println!("\nratios against {base} (higher is better for throughput, lower for latency):");
    for (name, per) in names.iter().zip(results).skip(1) {
        for (r, b) in per.iter().zip(&results[0]) {
            println!(
                "{:>10} c={:<3} out tok/s {:>5.3}x  req/s {:>5.3}x  TTFT p50 {:>5.2}x  p99 {:>5.2}x  ITL p50 {:>5.2}x  p99 {:>5.2}x  e2e p50 {:>5.2}x  p99 {:>5.2}x",
                name,
                r.concurrency,
                r.tok_per_s() / b.tok_per_s(),
                r.req_per_s() / b.req_per_s(),
                percentile(&r.ttft, 50.0) / percentile(&b.ttft, 50.0),
                percentile(&r.ttft, 99.0) / percentile(&b.ttft, 99.0),
                percentile(&r.itl, 50.0) / percentile(&b.itl, 50.0),
                percentile(&r.itl, 99.0) / percentile(&b.itl, 99.0),
                percentile(&r.e2e, 50.0) / percentile(&b.e2e, 50.0),
                percentile(&r.e2e, 99.0) / percentile(&b.e2e, 99.0),
            );
            if r.peak_rss_kib > 0 && b.peak_rss_kib > 0 {
                println!(
                    "{:>10} c={:<3} peak RSS {:>5.3}x ({:.0} MiB against {:.0} MiB)",
                    name,
                    r.concurrency,
                    r.peak_rss_kib as f64 / b.peak_rss_kib as f64,
                    r.peak_rss_kib as f64 / 1024.0,
                    b.peak_rss_kib as f64 / 1024.0
                );
            }
        }
    }
}

/// `name=PID` for a target named in `--target`.
fn parse_pid(s: &str, targets: &[Arc<Target>]) -> Result<(String, u32)> {
    let (name, pid) = s
        .split_once('=')
        .ok_or_else(|| anyhow!("--pid wants name=PID, got {s}"))?;
    if !targets.iter().any(|t| t.name == name) {
        bail!("--pid {s}: no --target is named {name}");
    }
    let pid = pid
        .parse()
        .with_context(|| format!("--pid {s}: {pid} is not a process id"))?;
    Ok((name.to_string(), pid))
}

/// `--pool`: the saved runs' figures pooled, then the ratios.
fn pool_saved(paths: &[std::path::PathBuf]) -> Result<()> {
    let mut names: Option<Vec<String>> = None;
    let mut results: Vec<Vec<LevelResult>> = Vec::new();
    let mut run_ratios: std::collections::BTreeMap<(usize, usize), Vec<f64>> =
        std::collections::BTreeMap::new();
    for p in paths {
        let text =
            std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
        let saved: Saved =
            serde_json::from_str(&text).with_context(|| format!("parsing {}", p.display()))?;
        match &names {
            None => {
                results = vec![Vec::new(); saved.targets.len()];
                names = Some(saved.targets.clone());
            }
            Some(n) if *n != saved.targets => {
                bail!("{} has targets {:?}, not {n:?}", p.display(), saved.targets)
            }
            Some(_) => {}
        }
        // Per-run throughput, to show the spread the pooled figure averages over.
        let per_run: Vec<String> = saved
            .targets
            .iter()
            .zip(&saved.results)
            .flat_map(|(n, per)| {
                per.iter()
                    .map(move |r| format!("{n} c={} {:.1} tok/s", r.concurrency, r.tok_per_s()))
            })
            .collect();
        println!("{}: {}", p.display(), per_run.join(", "));
        // Each run's throughput ratio against the baseline, per target and level.
        for (ti, per) in saved.results.iter().enumerate().skip(1) {
            for (k, (r, b)) in per.iter().zip(&saved.results[0]).enumerate() {
                run_ratios
                    .entry((ti, k))
                    .or_default()
                    .push(r.tok_per_s() / b.tok_per_s());
            }
        }
        pool_into(&mut results, saved.results);
    }
    let names = names.ok_or_else(|| anyhow!("--pool needs at least one file"))?;
    print_pooled(&format!("{} runs", paths.len()), &names, &results);
    print_ratios(&names, &results);
    // Runs differ more than samples within a run (the servers restart), so the honest
    // uncertainty of a ratio is the spread of the per-run ratios.
    println!(
        "\nper-run out tok/s ratios against {} (mean, 95% interval over runs):",
        names[0]
    );
    for ((ti, k), ratios) in &run_ratios {
        let c = results[*ti].get(*k).map_or(0, |r| r.concurrency);
        let list: Vec<String> = ratios.iter().map(|r| format!("{r:.3}")).collect();
        match mean_ci95(ratios) {
            Some((mean, half)) => println!(
                "{:>10} c={c:<3} {mean:.3}x  [{:.3}, {:.3}]  over {} runs: {}",
                names[*ti],
                mean - half,
                mean + half,
                ratios.len(),
                list.join(" ")
            ),
            None => println!("{:>10} c={c:<3} one run: {}", names[*ti], list.join(" ")),
        }
    }
    Ok(())
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    if !args.pool.is_empty() {
        return pool_saved(&args.pool);
    }
    let mut targets: Vec<Target> = args
        .targets
        .iter()
        .map(|s| parse_target(s))
        .collect::<Result<_>>()?;
    assign_models(&mut targets, &args)?;
    assign_bodies(&mut targets, &args)?;
    let targets: Vec<Arc<Target>> = targets.into_iter().map(Arc::new).collect();
    let pids = args
        .pids
        .iter()
        .map(|s| parse_pid(s, &targets))
        .collect::<Result<std::collections::HashMap<_, _>>>()?;
    let mut results: Vec<Vec<LevelResult>> = vec![Vec::new(); targets.len()];
    for rep in 0..args.repeat.max(1) {
        for ti in alternating(targets.len(), rep + usize::from(args.reverse)) {
            let t = &targets[ti];
            // One short warm-up request so lazy initialisation is not measured.
            let warm = json!({"model": t.models[0], "prompt": "warm up", "max_tokens": 4,
                              "temperature": 0, "stream": true});
            one_request(t, &warm)
                .await
                .with_context(|| format!("warm-up request to {}", t.name))?;
            let mut run = Vec::new();
            for (k, &c) in args.concurrency.iter().enumerate() {
                let seed = 100_000 * (k + 1) + 10_000_000 * rep;
                let pid = pids.get(&t.name).copied();
                let r = run_level(t.clone(), &args, pid, c, seed).await?;
                print_level(&t.name, &r);
                run.push(r);
            }
            let mut one = vec![Vec::new(); targets.len()];
            one[ti] = run;
            pool_into(&mut results, one);
        }
    }
    let names: Vec<String> = targets.iter().map(|t| t.name.clone()).collect();
    if let Some(path) = &args.save {
        let saved = Saved {
            targets: names.clone(),
            results: results.clone(),
        };
        std::fs::write(path, serde_json::to_string(&saved)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    if args.repeat > 1 {
        print_pooled(
            &format!("{} alternating runs", args.repeat),
            &names,
            &results,
        );
    }
    print_ratios(&names, &results);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sse_events_split_on_blank_lines() {
        assert_eq!(find_event_end(b"data: 1\n\ndata: 2"), Some(9));
        assert_eq!(find_event_end(b"data: 1\r\n\r\n"), Some(11));
        assert_eq!(find_event_end(b"data: partial"), None);
    }

    #[test]
    fn percentiles_and_prompts() {
        let v = [4.0, 1.0, 3.0, 2.0, 5.0];
        assert_eq!(percentile(&v, 50.0), 3.0);
        assert_eq!(percentile(&v, 99.0), 5.0);
        assert!(percentile(&[], 50.0).is_nan());
        assert_ne!(prompt(1, 128)[..4], prompt(2, 128)[..4]);
        assert_eq!(prompt(1, 128).split_whitespace().count(), 127);
    }

    #[test]
    fn vm_rss_is_read_from_proc_status() {
        let status = "Name:\tx\nVmPeak:\t  9000 kB\nVmRSS:\t  123456 kB\nRssAnon:\t 1 kB\n";
        assert_eq!(parse_vm_rss(status), Some(123_456));
        assert_eq!(parse_vm_rss("Name:\tkthreadd\n"), None);
        let own = rss_kib(std::process::id()).expect("this process has a VmRSS");
        assert!(own > 0);
    }
}

//! bench-serve: a streaming load generator for any OpenAI-compatible server.
//!
//! Each target gets the same closed-loop load at each concurrency: unique prompts of about
//! `--prompt-tokens` tokens (unique from the first token, so no server can reuse a cached
//! prefix), `max_tokens` with `ignore_eos`, temperature 0, streamed from `/v1/completions`.
//! Every request opens its own connection (llama.cpp's server closes it after a stream anyway).
//! The first target is the baseline; the others are printed as ratios against it.

mod stats;

use stats::percentile;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use clap::Parser;
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::header::{CONTENT_TYPE, HOST};
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};

#[derive(Debug, Parser)]
#[command(about = "Streaming load generator for OpenAI-compatible servers")]
struct Args {
    /// `name=http://host:port` (repeatable); the first is the baseline.
    #[arg(long = "target", required = true)]
    targets: Vec<String>,
    /// The `model` field to send.
    #[arg(long, default_value = "default")]
    model: String,
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
    /// Run every target this many times, alternating their order (A B, B A, …), and report the
    /// pooled figures; spreads drift (thermal, page cache, noisy neighbours) over all targets.
    #[arg(long, default_value_t = 1)]
    repeat: usize,
}

/// What one request saw.
#[derive(Debug, Clone, Default)]
struct Sample {
    ttft: f64,
    itls: Vec<f64>,
    e2e: f64,
    output_tokens: usize,
}

#[derive(Debug, Clone, Default)]
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
    const WORDS: &[&str] = &[
        "river", "mountain", "library", "engine", "garden", "harbor", "signal", "lantern",
        "meadow", "compass", "orchard", "glacier", "market", "violin", "canyon", "beacon",
    ];
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
    })
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

/// One `GET /metrics`; returns (seconds, body bytes).
async fn scrape(t: &Target) -> Result<(f64, usize)> {
    let started = Instant::now();
    let stream = tokio::net::TcpStream::connect(&t.addr).await?;
    stream.set_nodelay(true)?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    let req = hyper::Request::get("/metrics")
        .header(HOST, &t.host)
        .body(Full::new(Bytes::new()))?;
    let resp = sender.send_request(req).await?;
    if !resp.status().is_success() {
        bail!("/metrics answered {}", resp.status());
    }
    let body = resp.into_body().collect().await?.to_bytes();
    Ok((started.elapsed().as_secs_f64(), body.len()))
}

/// Scrapes every `every` until `stop` is set.
async fn scrape_loop(
    t: Arc<Target>,
    every: Duration,
    stop: Arc<std::sync::atomic::AtomicBool>,
) -> Result<(Vec<f64>, usize)> {
    let mut ticks = tokio::time::interval(every);
    let (mut lat, mut bytes) = (Vec::new(), 0);
    while !stop.load(Ordering::SeqCst) {
        ticks.tick().await;
        let (secs, n) = scrape(&t).await?;
        lat.push(secs);
        bytes = n;
    }
    Ok((lat, bytes))
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
    concurrency: usize,
    seed: usize,
) -> Result<LevelResult> {
    let total = (concurrency * args.rounds).max(4);
    let next = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let scraper = (args.scrape_ms > 0 && args.scrape.contains(&t.name)).then(|| {
        let every = Duration::from_millis(args.scrape_ms);
        tokio::spawn(scrape_loop(t.clone(), every, stop.clone()))
    });
    let started = Instant::now();
    let mut workers = Vec::new();
    for _ in 0..concurrency {
        let (t, next) = (t.clone(), next.clone());
        let (model, prompt_tokens, max_tokens) =
            (args.model.clone(), args.prompt_tokens, args.max_tokens);
        let timeout = Duration::from_secs(args.timeout);
        workers.push(tokio::spawn(async move {
            let mut out = Vec::new();
            loop {
                let i = next.fetch_add(1, Ordering::SeqCst);
                if i >= total {
                    break;
                }
                let body = json!({
                    "model": model,
                    "prompt": prompt(seed + i, prompt_tokens),
                    "max_tokens": max_tokens,
                    "temperature": 0,
                    "ignore_eos": true,
                    "stream": true,
                    "stream_options": {"include_usage": true},
                });
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
        (r.scrapes, r.scrape_bytes) = s.await??;
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
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    let targets: Vec<Arc<Target>> = args
        .targets
        .iter()
        .map(|s| parse_target(s).map(Arc::new))
        .collect::<Result<_>>()?;
    let mut results: Vec<Vec<LevelResult>> = vec![Vec::new(); targets.len()];
    for rep in 0..args.repeat.max(1) {
        let mut order: Vec<usize> = (0..targets.len()).collect();
        if rep % 2 == 1 {
            order.reverse();
        }
        for ti in order {
            let t = &targets[ti];
            // One short warm-up request so lazy initialisation is not measured.
            let warm = json!({"model": args.model, "prompt": "warm up", "max_tokens": 4,
                              "temperature": 0, "stream": true});
            one_request(t, &warm)
                .await
                .with_context(|| format!("warm-up request to {}", t.name))?;
            for (k, &c) in args.concurrency.iter().enumerate() {
                let seed = 100_000 * (k + 1) + 10_000_000 * rep;
                let r = run_level(t.clone(), &args, c, seed).await?;
                print_level(&t.name, &r);
                match results[ti].get_mut(k) {
                    Some(pooled) => pooled.merge(r),
                    None => results[ti].push(r),
                }
            }
        }
    }
    if args.repeat > 1 {
        println!("\npooled over {} alternating runs:", args.repeat);
        for (t, per) in targets.iter().zip(&results) {
            for r in per {
                print_level(&t.name, r);
            }
        }
    }
    let base = &targets[0].name;
    println!("\nratios against {base} (higher is better for throughput, lower for latency):");
    for (t, per) in targets.iter().zip(&results).skip(1) {
        for (r, b) in per.iter().zip(&results[0]) {
            println!(
                "{:>10} c={:<3} out tok/s {:>5.2}x  req/s {:>5.2}x  TTFT p50 {:>5.2}x  p99 {:>5.2}x  ITL p50 {:>5.2}x  p99 {:>5.2}x  e2e p50 {:>5.2}x  p99 {:>5.2}x",
                t.name,
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
        }
    }
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
}

//! bench-router: ferrite-router against a random pick of replica (what kube-proxy does behind
//! a ClusterIP Service), on a real API server with real ferrite-servers behind stand-in pods.
//!
//! Three ferrite-servers (`--replicas`) listen at 127.0.0.1, .2 and .3; an InferenceService's
//! pods are made Ready at those addresses, and the release `ferrite-router` binary routes to
//! them. On one machine the replicas share its CPUs, unlike pods on separate nodes: a request
//! sent to an idle replica gets no more hardware than one queued at a busy one. `--pin` gives
//! each replica a CPU of its own (`taskset`), which is closer to separate nodes. Arms:
//! `random` (the client picks a replica at random for each request and talks to it directly),
//! `router` (the InferenceService's default policy, prefix affinity with bounded load) and
//! `router-least-load`. Scenarios:
//! - `skewed`: open-loop Poisson arrivals, a quarter long requests (~1,000-token prompt, 128
//!   tokens out) among short ones; TTFT p50/p99 and output tok/s;
//! - `tenants`: six tenants, each with its own ~1,000-token system prompt, multi-turn chats;
//!   prefix-cache hit rate (the servers' `cached_tokens`) and TTFT;
//! - `overhead`: one short cached request at a time, straight to a replica and through the
//!   router, alternating; the router's added latency p50;
//! - `cold`: requests for a service scaled to zero: the router holds them and scales it up,
//!   the stand-in pod starts a server and turns Ready; failures, and the latency beyond the
//!   pod's own start.
//!
//! Every run uses fresh prompts (a nonce at their head), so no arm finds another's prefixes
//! cached; arms alternate their order across `--repeat` runs, and every figure is printed
//! with its ratio against `random` from the same run.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use clap::Parser;
use ferrite_bench::chat::{Turn, stream_chat};
use ferrite_bench::stats::{alternating, percentile, ratio_summary};
use ferrite_bench::text::WORDS;
use ferrite_testkit::kube::Cluster;
use ferrite_testkit::kube::standin::{create_isvc, install_crd, isvc_api, ready_pod};
use ferrite_testkit::process::{Guard, free_port};
use ferrite_testkit::server::Metrics;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, Patch, PatchParams};
use serde_json::{Value, json};

#[derive(Debug, Parser)]
#[command(about = "ferrite-router against a random pick of replica")]
struct Args {
    /// Scenarios to run (skewed, tenants, overhead, cold).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "skewed,tenants,overhead,cold"
    )]
    scenarios: Vec<String>,
    /// Runs per arm, alternating the order of the arms.
    #[arg(long, default_value_t = 2)]
    repeat: usize,
    /// The model (default: FERRITE_MODEL).
    #[arg(long, env = "FERRITE_MODEL")]
    model: PathBuf,
    /// ferrite-server and ferrite-router binaries (default: beside this one).
    #[arg(long)]
    server_bin: Option<PathBuf>,
    #[arg(long)]
    router_bin: Option<PathBuf>,
    /// Each replica's KV cache: smaller than the six tenants' prompts together, larger than
    /// two tenants' (the regime where where a prefix lands decides whether it is cached).
    #[arg(long, default_value = "80MiB")]
    kv_cache_memory: String,
    /// Replicas (up to 3: 127.0.0.1-3).
    #[arg(long, default_value_t = 3)]
    replicas: usize,
    /// Pin replica i to CPU i (taskset), so replicas do not share cores as they would on
    /// separate nodes; needs as many CPUs as replicas.
    #[arg(long)]
    pin: bool,
    /// Each replica's longest sequence (the small KV cache must hold one).
    #[arg(long, default_value_t = 2048)]
    max_model_len: usize,
    /// Skewed: requests per run, arrivals per second, and the share of long ones.
    #[arg(long, default_value_t = 60)]
    skewed_requests: usize,
    #[arg(long, default_value_t = 0.8)]
    skewed_rate: f64,
    #[arg(long, default_value_t = 0.25)]
    long_share: f64,
    /// Tenants: how many, conversations each, turns each, system-prompt tokens, workers.
    #[arg(long, default_value_t = 6)]
    tenants: usize,
    #[arg(long, default_value_t = 3)]
    conversations: usize,
    #[arg(long, default_value_t = 3)]
    turns: usize,
    #[arg(long, default_value_t = 1000)]
    system_tokens: usize,
    #[arg(long, default_value_t = 6)]
    tenant_workers: usize,
    /// Overhead: request pairs (direct, routed).
    #[arg(long, default_value_t = 200)]
    overhead_pairs: usize,
    /// Cold: scale-from-zero trials, and requests held in each.
    #[arg(long, default_value_t = 3)]
    cold_trials: usize,
    #[arg(long, default_value_t = 8)]
    cold_requests: usize,
}

const HOSTS: [&str; 3] = ["127.0.0.1", "127.0.0.2", "127.0.0.3"];
const NS: &str = "bench";
const MODEL: &str = "chat";

/// Where a request goes.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Arm {
    Random,
    Router,
    LeastLoad,
}

impl Arm {
    fn name(self) -> &'static str {
        match self {
            Arm::Random => "random",
            Arm::Router => "router",
            Arm::LeastLoad => "router-least-load",
        }
    }
}

/// The replicas' and the router's base URLs.
struct Bases {
    replicas: Vec<String>,
    router: String,
    /// A second router with `--tenants` (the overhead scenario's third arm), and its key.
    tenant_router: Option<(String, String)>,
}

impl Bases {
    /// The base URL request `i` of a run goes to under `arm`; `random` draws from `rng`.
    fn pick(&self, arm: Arm, rng: &Mutex<u64>) -> String {
        match arm {
            Arm::Random => {
                let mut s = rng.lock().unwrap_or_else(|e| e.into_inner());
                self.replicas[(next_random(&mut s) % self.replicas.len() as u64) as usize].clone()
            }
            Arm::Router | Arm::LeastLoad => self.router.clone(),
        }
    }
}

/// splitmix64: a seeded stream, so every arm sees the same arrivals and kinds.
fn next_random(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn uniform(state: &mut u64) -> f64 {
    (next_random(state) >> 11) as f64 / (1u64 << 53) as f64
}

/// About `tokens` tokens of text headed by `head` (English words are about a token each).
fn text(head: &str, tokens: usize, salt: usize) -> String {
    let mut s = head.to_string();
    for k in 0..tokens.saturating_sub(12) {
        s.push(' ');
        s.push_str(WORDS[(k * 5 + k / 7 + salt) % WORDS.len()]);
    }
    s
}

fn agent() -> ureq::Agent {
    ureq::AgentBuilder::new()
        .timeout(Duration::from_secs(600))
        .build()
}

/// One run's requests: what each saw, whether it was long, and the run's wall time.
#[derive(Debug, Default, Clone)]
struct RunResult {
    turns: Vec<(Turn, bool)>,
    failures: usize,
    wall: f64,
}

impl RunResult {
    fn ttfts(&self, only_short: bool) -> Vec<f64> {
        self.turns
            .iter()
            .filter(|(_, long)| !(only_short && *long))
            .map(|(t, _)| t.ttft)
            .collect()
    }
    fn tok_per_s(&self) -> f64 {
        self.turns
            .iter()
            .map(|(t, _)| t.output_tokens)
            .sum::<usize>() as f64
            / self.wall
    }
    fn hit_rate(&self) -> f64 {
        let prompt: usize = self.turns.iter().map(|(t, _)| t.prompt_tokens).sum();
        let cached: usize = self.turns.iter().map(|(t, _)| t.cached_tokens).sum();
        cached as f64 / prompt.max(1) as f64
    }
}

/// Skewed traffic: Poisson arrivals at `skewed_rate`, each long with probability
/// `long_share`; every request is sent at its time on its own thread (open loop).
fn skewed(bases: &Bases, arm: Arm, args: &Args, nonce: usize) -> RunResult {
    let mut state = 42u64;
    let mut at = 0.0;
    let plan: Vec<(f64, bool)> = (0..args.skewed_requests)
        .map(|_| {
            at += -(1.0 - uniform(&mut state)).ln() / args.skewed_rate;
            (at, uniform(&mut state) < args.long_share)
        })
        .collect();
    let rng = Mutex::new(7u64);
    let results = Mutex::new(RunResult::default());
    let agent = agent();
    let started = Instant::now();
    std::thread::scope(|scope| {
        for (i, &(at, long)) in plan.iter().enumerate() {
            let base = bases.pick(arm, &rng);
            let (agent, results) = (&agent, &results);
            scope.spawn(move || {
                let wait = Duration::from_secs_f64(at).saturating_sub(started.elapsed());
                std::thread::sleep(wait);
                let (prompt_tokens, max_tokens) = if long { (1000, 128) } else { (48, 32) };
                let head = format!("Run {nonce}, request {i}. Summarise:");
                let body = json!({"model": MODEL, "max_tokens": max_tokens, "temperature": 0,
                    "ignore_eos": true,
                    "messages": [{"role": "user", "content": text(&head, prompt_tokens, i)}]});
                let r = stream_chat(agent, &base, body);
                let mut out = results.lock().unwrap_or_else(|e| e.into_inner());
                match r {
                    Ok((turn, _)) => out.turns.push((turn, long)),
                    Err(e) => {
                        eprintln!("{}: request {i}: {e:#}", arm.name());
                        out.failures += 1;
                    }
                }
            });
        }
    });
    let mut r = results.into_inner().unwrap_or_else(|e| e.into_inner());
    r.wall = started.elapsed().as_secs_f64();
    r
}

/// Tenants: conversations interleaved across tenants, each played turn by turn by one of
/// `tenant_workers` workers; every turn resends the tenant's system prompt and the history.
fn tenants(bases: &Bases, arm: Arm, args: &Args, nonce: usize) -> RunResult {
    let systems: Vec<String> = (0..args.tenants)
        .map(|t| {
            text(
                &format!("Run {nonce}. You are the assistant of tenant {t}. Rules:"),
                args.system_tokens,
                t * 3,
            )
        })
        .collect();
    let total = args.tenants * args.conversations;
    let next = AtomicUsize::new(0);
    let rng = Mutex::new(11u64);
    let results = Mutex::new(RunResult::default());
    let agent = agent();
    let started = Instant::now();
    std::thread::scope(|scope| {
        for _ in 0..args.tenant_workers {
            scope.spawn(|| {
                loop {
                    let c = next.fetch_add(1, Ordering::SeqCst);
                    if c >= total {
                        return;
                    }
                    let tenant = c % args.tenants;
                    let mut messages = vec![json!({"role": "system", "content": systems[tenant]})];
                    for turn in 0..args.turns {
                        let q = format!(
                            "Conversation {c}, question {turn}: what does rule {} say?",
                            1 + (c * 7 + turn * 3) % 40
                        );
                        messages.push(json!({"role": "user", "content": q}));
                        let body = json!({"model": MODEL, "max_tokens": 32, "temperature": 0,
                            "ignore_eos": true, "messages": messages});
                        let base = bases.pick(arm, &rng);
                        match stream_chat(&agent, &base, body) {
                            Ok((t, answer)) => {
                                messages.push(json!({"role": "assistant", "content": answer}));
                                results
                                    .lock()
                                    .unwrap_or_else(|e| e.into_inner())
                                    .turns
                                    .push((t, false));
                            }
                            Err(e) => {
                                eprintln!("{}: conversation {c}: {e:#}", arm.name());
                                results.lock().unwrap_or_else(|e| e.into_inner()).failures += 1;
                                break;
                            }
                        }
                    }
                }
            });
        }
    });
    let mut r = results.into_inner().unwrap_or_else(|e| e.into_inner());
    r.wall = started.elapsed().as_secs_f64();
    r
}

/// Seconds one short non-streamed completion takes at `url`.
fn timed(agent: &ureq::Agent, url: &str, body: &Value) -> Result<f64> {
    timed_as(agent, url, body, None)
}

/// [`timed`] with a bearer `key`.
fn timed_as(agent: &ureq::Agent, url: &str, body: &Value, key: Option<&str>) -> Result<f64> {
    let started = Instant::now();
    let mut req = agent.post(url);
    if let Some(k) = key {
        req = req.set("Authorization", &format!("Bearer {k}"));
    }
    req.send_json(body.clone())
        .map_err(|e| anyhow!("{url}: {e}"))?
        .into_string()?;
    Ok(started.elapsed().as_secs_f64())
}

/// The router's added latency: the same cached one-token request straight to replica 0 and
/// through the router (whose prefix affinity sends it to one replica, warmed first), in
/// alternating order; p50 of each and of the paired differences.
fn overhead(bases: &Bases, args: &Args) -> Result<()> {
    let agent = agent();
    let body = json!({"model": MODEL, "prompt": "The capital of France is", "max_tokens": 1,
                      "temperature": 0});
    // Warm every replica's prefix cache and connection.
    for b in bases.replicas.iter().chain([&bases.router]) {
        for _ in 0..3 {
            timed(&agent, &format!("{b}/v1/completions"), &body)?;
        }
    }
    // The replica the router picks for this prompt: the one whose count moves.
    let before: Vec<f64> = bases.replicas.iter().map(|b| finished(b)).collect();
    timed(&agent, &format!("{}/v1/completions", bases.router), &body)?;
    let target = bases
        .replicas
        .iter()
        .zip(&before)
        .find(|(b, n)| finished(b) > **n)
        .map(|(b, _)| b.clone())
        .ok_or_else(|| anyhow!("no replica served the routed request"))?;
    let (mut direct, mut routed, mut diffs) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..args.overhead_pairs {
        let d_url = format!("{target}/v1/completions");
        let r_url = format!("{}/v1/completions", bases.router);
        let (d, r) = if i % 2 == 0 {
            let d = timed(&agent, &d_url, &body)?;
            (d, timed(&agent, &r_url, &body)?)
        } else {
            let r = timed(&agent, &r_url, &body)?;
            (timed(&agent, &d_url, &body)?, r)
        };
        direct.push(d);
        routed.push(r);
        diffs.push(r - d);
    }
    let ms = |v: &[f64], p: f64| percentile(v, p) * 1000.0;
    println!(
        "overhead: {} pairs of a cached 1-token completion: direct p50 {:.2} ms p99 {:.2} ms; \
         through the router p50 {:.2} ms p99 {:.2} ms; router - direct, paired: p50 {:.3} ms \
         (ratio of p50s {:.3}x)",
        args.overhead_pairs,
        ms(&direct, 50.0),
        ms(&direct, 99.0),
        ms(&routed, 50.0),
        ms(&routed, 99.0),
        ms(&diffs, 50.0),
        percentile(&routed, 50.0) / percentile(&direct, 50.0)
    );
    if let Some((tenant_router, key)) = &bases.tenant_router {
        tenants_overhead(&agent, &bases.router, tenant_router, key, &body, args)?;
    }
    Ok(())
}

/// What authentication and quotas add: the same cached request through the plain router and
/// through one with `--tenants` (a key to check, buckets to charge and settle, the headers),
/// in alternating order; p50 of the paired differences.
fn tenants_overhead(
    agent: &ureq::Agent,
    plain: &str,
    tenant_router: &str,
    key: &str,
    body: &Value,
    args: &Args,
) -> Result<()> {
    let (p_url, t_url) = (
        format!("{plain}/v1/completions"),
        format!("{tenant_router}/v1/completions"),
    );
    for _ in 0..3 {
        timed_as(agent, &t_url, body, Some(key))?;
    }
    let (mut plain_t, mut tenant_t, mut diffs) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..args.overhead_pairs {
        let (p, t) = if i % 2 == 0 {
            let p = timed(agent, &p_url, body)?;
            (p, timed_as(agent, &t_url, body, Some(key))?)
        } else {
            let t = timed_as(agent, &t_url, body, Some(key))?;
            (timed(agent, &p_url, body)?, t)
        };
        plain_t.push(p);
        tenant_t.push(t);
        diffs.push(t - p);
    }
    let ms = |v: &[f64], p: f64| percentile(v, p) * 1000.0;
    println!(
        "tenants: {} pairs: router p50 {:.2} ms; router with --tenants (key, limits, headers) \
         p50 {:.2} ms; with - without, paired: p50 {:.3} ms (ratio of p50s {:.3}x)",
        args.overhead_pairs,
        ms(&plain_t, 50.0),
        ms(&tenant_t, 50.0),
        ms(&diffs, 50.0),
        percentile(&tenant_t, 50.0) / percentile(&plain_t, 50.0)
    );
    Ok(())
}

/// A tenant allowed the bench's model with limits no run reaches, its key in a Secret, and a
/// second router with `--tenants`; returns the router's guard, base URL and the key.
async fn start_tenant_router(
    client: &kube::Client,
    cluster: &Cluster,
    router_bin: &std::path::Path,
) -> Result<(Guard, String, String)> {
    use ferrite_api::tenant::{InferenceTenant, InferenceTenantSpec, TENANT_LABEL, TenantLimits};
    ferrite_testkit::kube::standin::install_tenant_crd(client).await;
    let spec = InferenceTenantSpec {
        models: vec![MODEL.into()],
        limits: TenantLimits {
            requests_per_minute: Some(1_000_000),
            tokens_per_minute: Some(1_000_000_000),
            concurrent_requests: Some(10_000),
        },
        ..Default::default()
    };
    Api::<InferenceTenant>::all(client.clone())
        .create(&Default::default(), &InferenceTenant::new("bench", spec))
        .await
        .context("creating the tenant")?;
    let key = "sk-bench-tenant";
    let secret: k8s_openapi::api::core::v1::Secret = serde_json::from_value(json!({
        "metadata": {"name": "bench-keys", "labels": {TENANT_LABEL: "bench"}},
        "stringData": {"key": key}}))?;
    Api::<k8s_openapi::api::core::v1::Secret>::namespaced(client.clone(), NS)
        .create(&Default::default(), &secret)
        .await
        .context("creating the key Secret")?;
    let port = free_port();
    let mut cmd = Command::new(router_bin);
    cmd.args(["--addr", &format!("127.0.0.1:{port}")])
        .args(["--namespace", NS, "--endpoints-from", "pods"])
        .args(["--tenants", "--tenant-secrets-namespace", NS])
        .env("KUBECONFIG", cluster.admin_kubeconfig())
        .env_remove("KUBERNETES_SERVICE_HOST")
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null());
    let guard = Guard::spawn("ferrite-router --tenants", cmd).context("starting the router")?;
    let base = format!("http://127.0.0.1:{port}");
    wait_ok(&format!("{base}/readyz")).context("the tenant router did not start")?;
    Ok((guard, base, key.to_string()))
}

/// Requests a server finished (its `vllm:request_success_total`).
fn finished(base: &str) -> f64 {
    ureq::get(&format!("{base}/metrics"))
        .call()
        .ok()
        .and_then(|r| r.into_string().ok())
        .map_or(0.0, |t| Metrics::parse(t).sum("vllm:request_success_total"))
}

/// A ferrite-server for the benchmark's model at `host:port`, served as `name`.
fn spawn_server(
    args: &Args,
    bin: &PathBuf,
    host: &str,
    port: u16,
    name: &str,
    cpu: Option<usize>,
) -> Result<Guard> {
    let mut cmd = match cpu {
        Some(c) => {
            let mut t = Command::new("taskset");
            t.args(["-c", &c.to_string()]).arg(bin);
            t
        }
        None => Command::new(bin),
    };
    cmd.arg("--model")
        .arg(&args.model)
        .args(["--host", host, "--port", &port.to_string()])
        .args(["--served-model-name", name])
        .args(["--kv-cache-memory", &args.kv_cache_memory])
        .args(["--max-model-len", &args.max_model_len.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    Guard::spawn(name, cmd).context("starting ferrite-server")
}

/// Waits until `url` answers 200.
fn wait_ok(url: &str) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(120);
    while Instant::now() < deadline {
        if ureq::get(url).call().is_ok() {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    bail!("{url} did not answer")
}

fn wait_health(base: &str) -> Result<()> {
    wait_ok(&format!("{base}/health"))
}

/// Scale from zero, `cold_trials` times: `cold_requests` requests arrive for a service at
/// zero replicas; when the router has scaled it to 1, the stand-in pod starts a server and
/// turns Ready once it is healthy. Reports failures, the wake-up (request to scale), the pod's
/// own start (scale to Ready), and what the requests waited beyond it (Ready to first token),
/// against the same request's TTFT on the warm replica.
async fn cold(client: &kube::Client, bases: &Bases, args: &Args, server_bin: &PathBuf) {
    let port = free_port();
    create_isvc(
        client,
        NS,
        "cold",
        json!({"model": {"source": "/models/smol.gguf"}, "replicas": 0,
               "runtime": {"port": port}}),
    )
    .await;
    let isvcs = isvc_api(client, NS);
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let (mut failures, mut wakes, mut starts, mut beyond, mut warm) =
        (0, Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for trial in 0..args.cold_trials {
        let sent = Instant::now();
        let router = bases.router.clone();
        let n = args.cold_requests;
        let held = tokio::task::spawn_blocking(move || {
            let agent = agent();
            std::thread::scope(|scope| {
                let handles: Vec<_> = (0..n)
                    .map(|i| {
                        let (agent, router) = (&agent, &router);
                        scope.spawn(move || {
                            let body = json!({"model": "cold", "max_tokens": 8,
                                "temperature": 0, "ignore_eos": true, "messages": [
                                {"role": "user", "content": format!("Trial {trial}, request {i}: hello")}]});
                            stream_chat(agent, router, body).map(|(t, _)| sent + Duration::from_secs_f64(t.ttft))
                        })
                    })
                    .collect();
                handles
                    .into_iter()
                    .map(|h| h.join().unwrap_or_else(|_| Err(anyhow!("panicked"))))
                    .collect::<Vec<_>>()
            })
        });
        // The stand-in kubelet: start the pod once spec.replicas is 1.
        loop {
            let replicas = isvcs
                .get("cold")
                .await
                .ok()
                .and_then(|o| o.data["spec"]["replicas"].as_u64());
            if replicas == Some(1) {
                break;
            }
            if sent.elapsed() > Duration::from_secs(60) {
                eprintln!("cold: the router did not scale the service up");
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let scaled = Instant::now();
        let server = spawn_server(args, server_bin, HOSTS[0], port, "cold", None);
        let base = format!("http://{}:{port}", HOSTS[0]);
        let healthy = {
            let base = base.clone();
            tokio::task::spawn_blocking(move || wait_health(&base)).await
        };
        if !matches!(healthy, Ok(Ok(()))) || server.is_err() {
            eprintln!("cold: the stand-in server did not start");
        }
        ready_pod(client, NS, "cold", "cold-0", HOSTS[0]).await;
        let ready = Instant::now();
        let firsts = held.await.unwrap_or_default();
        for f in &firsts {
            match f {
                Ok(first) => beyond.push(first.saturating_duration_since(ready).as_secs_f64()),
                Err(e) => {
                    eprintln!("cold: {e:#}");
                    failures += 1;
                }
            }
        }
        wakes.push(scaled.duration_since(sent).as_secs_f64());
        starts.push(ready.duration_since(scaled).as_secs_f64());
        // The same requests on the now warm replica, straight to it.
        let w = tokio::task::spawn_blocking(move || {
            let agent = agent();
            let body = json!({"model": "cold", "max_tokens": 8, "temperature": 0,
                "ignore_eos": true, "messages": [{"role": "user", "content": "warm: hello"}]});
            stream_chat(&agent, &base, body).map(|(t, _)| t.ttft)
        })
        .await;
        if let Ok(Ok(t)) = w {
            warm.push(t);
        }
        // Back to zero: the pod goes, and the service is scaled down.
        drop(server);
        let _ = pods.delete("cold-0", &DeleteParams::default()).await;
        let _ = isvcs
            .patch_scale(
                "cold",
                &PatchParams::default(),
                &Patch::Merge(json!({"spec": {"replicas": 0}})),
            )
            .await;
        loop {
            let gone = pods.get_opt("cold-0").await.ok().flatten().is_none();
            let zero = isvcs
                .get("cold")
                .await
                .ok()
                .and_then(|o| o.data["spec"]["replicas"].as_u64())
                == Some(0);
            if gone && zero {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let ms = |v: &[f64], p: f64| percentile(v, p) * 1000.0;
    println!(
        "cold: {} trials x {} held requests: {failures} failed; wake-up (request to scale) p50 \
         {:.0} ms; the pod's own start (scale to Ready) p50 {:.0} ms; Ready to first token p50 \
         {:.0} ms p99 {:.0} ms, against a warm replica's TTFT p50 {:.0} ms",
        args.cold_trials,
        args.cold_requests,
        ms(&wakes, 50.0),
        ms(&starts, 50.0),
        ms(&beyond, 50.0),
        ms(&beyond, 99.0),
        ms(&warm, 50.0),
    );
}

/// Prints one run of one arm.
fn print_run(scenario: &str, arm: Arm, r: &RunResult) {
    let all = r.ttfts(false);
    let short = r.ttfts(true);
    println!(
        "{scenario:>8} {:>18}: {} requests ({} failed) in {:.1} s, TTFT p50 {:.3} s p99 {:.3} \
         s (short requests p99 {:.3} s), output {:.1} tok/s, prompt tokens cached {:.1}%",
        arm.name(),
        r.turns.len(),
        r.failures,
        r.wall,
        percentile(&all, 50.0),
        percentile(&all, 99.0),
        percentile(&short, 99.0),
        r.tok_per_s(),
        r.hit_rate() * 100.0
    );
}

/// Ratios of each arm against `random`, per run and as a mean with its 95% interval.
fn print_ratios(
    scenario: &str,
    arms: &[Arm],
    results: &[Vec<RunResult>],
    what: &str,
    f: fn(&RunResult) -> f64,
) {
    for (ai, arm) in arms.iter().enumerate().skip(1) {
        let ratios: Vec<f64> = results[ai]
            .iter()
            .zip(&results[0])
            .map(|(r, base)| f(r) / f(base))
            .collect();
        println!(
            "{scenario:>8} {:>18}: {what} against random {}",
            arm.name(),
            ratio_summary(&ratios)
        );
    }
}

async fn set_policy(client: &kube::Client, policy: &str) -> Result<()> {
    isvc_api(client, NS)
        .patch(
            MODEL,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"routing": {"policy": policy}}})),
        )
        .await
        .context("setting the routing policy")?;
    // The router's watch sees it well within this.
    tokio::time::sleep(Duration::from_secs(1)).await;
    Ok(())
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<()> {
    let args = Args::parse();
    let here = std::env::current_exe()?
        .parent()
        .context("the bench binary's directory")?
        .to_path_buf();
    let server_bin = args
        .server_bin
        .clone()
        .unwrap_or_else(|| here.join("ferrite-server"));
    let router_bin = args
        .router_bin
        .clone()
        .unwrap_or_else(|| here.join("ferrite-router"));
    let Some(cluster) = Cluster::start().await else {
        bail!("no Kubernetes control plane binaries (see ferrite-testkit)");
    };
    let client = cluster.client().await;
    install_crd(&client).await;
    let namespaces: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(client.clone());
    namespaces
        .create(
            &Default::default(),
            &serde_json::from_value(json!({"metadata": {"name": NS}}))?,
        )
        .await?;

    let port = free_port();
    create_isvc(
        &client,
        NS,
        MODEL,
        json!({"model": {"source": "/models/smol.gguf"}, "replicas": args.replicas,
               "runtime": {"port": port}}),
    )
    .await;
    let mut servers = Vec::new();
    let mut replicas = Vec::new();
    let hosts = &HOSTS[..args.replicas.clamp(1, HOSTS.len())];
    for (i, host) in hosts.iter().enumerate() {
        let cpu = args.pin.then_some(i);
        servers.push(spawn_server(&args, &server_bin, host, port, MODEL, cpu)?);
        replicas.push(format!("http://{host}:{port}"));
    }
    for (i, (host, base)) in hosts.iter().zip(&replicas).enumerate() {
        wait_health(base)?;
        ready_pod(&client, NS, MODEL, &format!("chat-{i}"), host).await;
    }
    let router_port = free_port();
    let mut cmd = Command::new(&router_bin);
    cmd.args(["--addr", &format!("127.0.0.1:{router_port}")])
        // The stand-in pods sit at loopback addresses, which EndpointSlices refuse.
        .args(["--namespace", NS, "--endpoints-from", "pods"])
        .env("KUBECONFIG", cluster.admin_kubeconfig())
        .env_remove("KUBERNETES_SERVICE_HOST")
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null());
    let _router = Guard::spawn("ferrite-router", cmd).context("starting ferrite-router")?;
    let overhead_wanted = args.scenarios.iter().any(|s| s == "overhead");
    let tenant_router = match overhead_wanted {
        true => Some(start_tenant_router(&client, &cluster, &router_bin).await?),
        false => None,
    };
    let bases = Bases {
        replicas,
        router: format!("http://127.0.0.1:{router_port}"),
        tenant_router: tenant_router
            .as_ref()
            .map(|(_, base, key)| (base.clone(), key.clone())),
    };
    wait_ok(&format!("{}/readyz", bases.router)).context("the router did not start")?;
    println!(
        "{} replicas (KV cache {} each{}) behind stand-in pods; ferrite-router release binary; \
         {} runs per arm, alternating",
        hosts.len(),
        args.kv_cache_memory,
        if args.pin {
            ", each pinned to its own CPU"
        } else {
            ", sharing the CPUs"
        },
        args.repeat
    );

    let arms = [Arm::Random, Arm::Router, Arm::LeastLoad];
    for scenario in ["skewed", "tenants"] {
        if !args.scenarios.iter().any(|s| s == scenario) {
            continue;
        }
        let mut results: Vec<Vec<RunResult>> = vec![Vec::new(); arms.len()];
        for rep in 0..args.repeat.max(1) {
            for ai in alternating(arms.len(), rep) {
                let arm = arms[ai];
                match arm {
                    Arm::LeastLoad => set_policy(&client, "least-load").await?,
                    _ => set_policy(&client, "prefix-affinity").await?,
                }
                let nonce = 1000 * (rep + 1) + ai;
                let r = tokio::task::block_in_place(|| {
                    if scenario == "skewed" {
                        skewed(&bases, arm, &args, nonce)
                    } else {
                        tenants(&bases, arm, &args, nonce)
                    }
                });
                print_run(scenario, arm, &r);
                results[ai].push(r);
            }
        }
        if scenario == "skewed" {
            print_ratios(scenario, &arms, &results, "TTFT p99", |r| {
                percentile(&r.ttfts(false), 99.0)
            });
            print_ratios(scenario, &arms, &results, "TTFT p50", |r| {
                percentile(&r.ttfts(false), 50.0)
            });
            print_ratios(
                scenario,
                &arms,
                &results,
                "output tok/s",
                RunResult::tok_per_s,
            );
        } else {
            print_ratios(scenario, &arms, &results, "hit rate", RunResult::hit_rate);
            print_ratios(scenario, &arms, &results, "TTFT p50", |r| {
                percentile(&r.ttfts(false), 50.0)
            });
        }
    }
    set_policy(&client, "prefix-affinity").await?;
    if args.scenarios.iter().any(|s| s == "overhead") {
        tokio::task::block_in_place(|| overhead(&bases, &args))?;
    }
    if args.scenarios.iter().any(|s| s == "cold") {
        cold(&client, &bases, &args, &server_bin).await;
    }
    drop(servers);
    Ok(())
}

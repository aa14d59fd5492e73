//! bench-operator: the real `ferrite-operator` binary against the in-memory API server
//! (`ferrite_operator::fake_api`, real HTTP on 127.0.0.1) with N InferenceServices of varied
//! specs. Reports the operator's RSS idle (the baseline) and after every resource is `Ready`, and
//! the reconcile duration p50/p99 from the operator's own histogram, next to the round trip of a
//! plain GET to the same API server (the baseline for time: a reconcile makes several).
//!
//!   cargo build --release -p ferrite-operator -p ferrite-bench
//!   target/release/bench-operator --count 100

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};
use clap::Parser;
use ferrite_bench::stats::percentile;
use ferrite_operator::fake_api::FakeApi;
use serde_json::{Value, json};

#[derive(Debug, Parser)]
struct Args {
    /// InferenceServices to create.
    #[arg(long, default_value_t = 100)]
    count: usize,
    /// The operator binary (default: beside this one).
    #[arg(long)]
    operator: Option<PathBuf>,
    /// Directory of dashboards the operator ships per resource (default: none).
    #[arg(long)]
    dashboards_dir: Option<PathBuf>,
}

const ISVCS: &str = "/apis/ferrite.dev/v1alpha1/namespaces/bench/inferenceservices";

/// A spread of specs: runtimes, replicas, GPUs, engine settings, monitoring on and off.
fn isvc(i: usize) -> Value {
    let mut spec = json!({"model": {"source": format!("/models/m{i}.gguf")}});
    match i % 4 {
        0 => {}
        1 => {
            spec["replicas"] = json!(2);
            spec["resources"] = json!({"cpu": "2", "memory": "4Gi"});
            spec["runtime"] = json!({"engine": {"maxNumSeqs": 64, "kvCacheMemory": "2Gi"}});
        }
        2 => {
            spec["runtime"] = json!({"kind": "vllm", "args": ["--enable-prefix-caching"]});
            spec["resources"] = json!({"gpus": 1});
            spec["model"]["source"] = json!(format!("hf://org/model-{i}"));
        }
        _ => {
            spec["replicas"] = json!(3);
            spec["monitoring"] = json!({"serviceMonitor": {"enabled": true, "interval": "15s"},
                                        "dashboards": {"enabled": true, "folder": "LLM"}});
        }
    }
    json!({"apiVersion": "ferrite.dev/v1alpha1", "kind": "InferenceService",
           "metadata": {"name": format!("svc-{i:03}"), "namespace": "bench"}, "spec": spec})
}

/// VmRSS and VmHWM of `pid`, in KiB.
fn rss_kib(pid: u32) -> Result<(u64, u64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .with_context(|| format!("{name} in /proc/{pid}/status"))
    };
    Ok((field("VmRSS:")?, field("VmHWM:")?))
}

fn get(url: &str) -> Result<String> {
    Ok(ureq::get(url)
        .timeout(Duration::from_secs(5))
        .call()?
        .into_string()?)
}

/// `histogram_quantile` over a cumulative histogram's buckets: linear within the bucket.
fn quantile(q: f64, buckets: &[(f64, f64)]) -> Option<f64> {
    let total = buckets.last()?.1;
    if total <= 0.0 {
        return None;
    }
    let rank = q * total;
    let mut prev = (0.0, 0.0);
    for &(le, count) in buckets {
        if count >= rank {
            if le.is_infinite() {
                return Some(prev.0);
            }
            let within = (rank - prev.1) / (count - prev.1).max(f64::MIN_POSITIVE);
            return Some(prev.0 + (le - prev.0) * within);
        }
        prev = (le, count);
    }
    None
}

/// The reconcile-duration buckets and the reconcile count from an exposition.
fn reconcile_histogram(text: &str) -> (Vec<(f64, f64)>, f64) {
    let mut buckets = Vec::new();
    let mut count = 0.0;
    for line in text.lines() {
        let mut parts = line.split_whitespace();
        let (Some(name), Some(value)) = (parts.next(), parts.next()) else {
            continue;
        };
        let value: f64 = value.parse().unwrap_or(0.0);
        if let Some(rest) =
            name.strip_prefix("ferrite_operator_reconcile_duration_seconds_bucket{le=\"")
        {
            let le = rest.trim_end_matches("\"}");
            let le = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().unwrap_or(f64::NAN)
            };
            buckets.push((le, value));
        } else if name == "ferrite_operator_reconcile_duration_seconds_count" {
            count = value;
        }
    }
    (buckets, count)
}

struct Killed(Child);
impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<()> {
    let args = Args::parse();
    let operator = match args.operator {
        Some(p) => p,
        None => std::env::current_exe()?
            .parent()
            .context("the bench binary's directory")?
            .join("ferrite-operator"),
    };
    let api = FakeApi::start().await?;
    api.set_simulate_rollouts(true);
    api.set_service_monitor_crd(true);
    let dir = std::env::temp_dir().join(format!("bench-operator-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let kubeconfig = dir.join("kubeconfig");
    std::fs::write(&kubeconfig, api.kubeconfig("bench"))?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let mut cmd = Command::new(&operator);
    cmd.args([
        "--http-addr",
        &format!("127.0.0.1:{port}"),
        "--no-leader-election",
        "--external-metrics-addr",
        "off",
    ])
    .env("KUBECONFIG", &kubeconfig)
    .env("RUST_LOG", "warn")
    .stdout(Stdio::null())
    .stderr(Stdio::inherit());
    if let Some(d) = &args.dashboards_dir {
        cmd.arg("--dashboards-dir").arg(d);
    }
    let child = Killed(
        cmd.spawn()
            .with_context(|| format!("starting {}", operator.display()))?,
    );
    let pid = child.0.id();
    let base = format!("http://127.0.0.1:{port}");

    let started = Instant::now();
    loop {
        let b = base.clone();
        if tokio::task::spawn_blocking(move || get(&format!("{b}/readyz")))
            .await?
            .is_ok()
        {
            break;
        }
        if started.elapsed() > Duration::from_secs(30) {
            bail!("the operator never became ready");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (idle_rss, _) = rss_kib(pid)?;

    let created = Instant::now();
    for i in 0..args.count {
        api.put(ISVCS, isvc(i)).map_err(anyhow::Error::msg)?;
    }
    let ready = |v: &Value| {
        v["status"]["observedGeneration"] == v["metadata"]["generation"]
            && v["status"]["conditions"].as_array().is_some_and(|c| {
                c.iter()
                    .any(|c| c["type"] == "Ready" && c["status"] == "True")
            })
    };
    loop {
        let n = api.list(ISVCS).iter().filter(|v| ready(v)).count();
        if n == args.count {
            break;
        }
        if created.elapsed() > Duration::from_secs(120) {
            bail!("only {n} of {} InferenceServices became Ready", args.count);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let converged = created.elapsed();
    // Let the echoes of the last status writes settle, then measure.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (rss, hwm) = rss_kib(pid)?;
    let (requests, writes) = api.request_counts();
    let b = base.clone();
    let text = tokio::task::spawn_blocking(move || get(&format!("{b}/metrics"))).await??;
    let (burst, reconciles) = reconcile_histogram(&text);
    let p50 = quantile(0.5, &burst).context("no reconciles recorded")?;
    let p99 = quantile(0.99, &burst).context("no reconciles recorded")?;

    // Phase 2, one at a time: a spec change per InferenceService (the Deployment is updated and
    // the status written), waiting for its observedGeneration before the next. The histogram's
    // change over this phase is the reconcile time without other reconciles competing.
    let one_by_one = Instant::now();
    for i in 0..args.count {
        let mut changed = isvc(i);
        changed["spec"]["runtime"]["args"] = json!([format!("--seed={i}")]);
        let path = format!("{ISVCS}/svc-{i:03}");
        let generation =
            api.put(ISVCS, changed).map_err(anyhow::Error::msg)?["metadata"]["generation"].clone();
        loop {
            let v = api.get(&path).context("the InferenceService vanished")?;
            if v["status"]["observedGeneration"] == generation {
                break;
            }
            if one_by_one.elapsed() > Duration::from_secs(120) {
                bail!("svc-{i:03} never observed generation {generation}");
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let b = base.clone();
    let text = tokio::task::spawn_blocking(move || get(&format!("{b}/metrics"))).await??;
    let (after, reconciles_after) = reconcile_histogram(&text);
    let single: Vec<(f64, f64)> = after
        .iter()
        .zip(&burst)
        .map(|(&(le, a), &(_, b))| (le, a - b))
        .collect();
    let s50 = quantile(0.5, &single).context("no reconciles in phase 2")?;
    let s99 = quantile(0.99, &single).context("no reconciles in phase 2")?;

    // Baseline for time: a GET of one Deployment from the same API server, 200 times.
    let url = format!(
        "{}/apis/apps/v1/namespaces/bench/deployments/svc-000",
        api.url
    );
    let rtt = tokio::task::spawn_blocking(move || -> Result<Vec<f64>> {
        let agent = ureq::AgentBuilder::new().build();
        (0..200)
            .map(|_| {
                let t = Instant::now();
                agent.get(&url).call()?.into_string()?;
                Ok(t.elapsed().as_secs_f64())
            })
            .collect()
    })
    .await??;
    let get_p50 = percentile(&rtt, 50.0);
    let objects: usize = [
        "/apis/apps/v1/deployments",
        "/api/v1/services",
        "/apis/policy/v1/poddisruptionbudgets",
        "/apis/monitoring.coreos.com/v1/servicemonitors",
        "/api/v1/configmaps",
    ]
    .iter()
    .map(|p| api.list(p).len())
    .sum();
    drop(child);
    let _ = std::fs::remove_dir_all(&dir);

    let mib = |k: u64| k as f64 / 1024.0;
    println!("operator: {}", operator.display());
    println!(
        "{} InferenceServices Ready in {:.2} s; {objects} child objects; {reconciles} reconciles; \
         {requests} API requests ({writes} writes)",
        args.count,
        converged.as_secs_f64()
    );
    println!(
        "RSS idle (baseline) {:.1} MiB -> after {} Ready {:.1} MiB (peak {:.1} MiB): {:.2}x",
        mib(idle_rss),
        args.count,
        mib(rss),
        mib(hwm),
        rss as f64 / idle_rss.max(1) as f64
    );
    println!(
        "API GET round trip p50 {:.3} ms (baseline for times)",
        get_p50 * 1e3
    );
    println!(
        "burst ({} created at once, {reconciles} reconciles): reconcile p50 {:.2} ms ({:.0}x), \
         p99 {:.2} ms ({:.0}x): mostly waiting for the other reconciles on 2 cores",
        args.count,
        p50 * 1e3,
        p50 / get_p50,
        p99 * 1e3,
        p99 / get_p50
    );
    println!(
        "one at a time ({} spec changes, {} reconciles): reconcile p50 {:.2} ms ({:.0}x), \
         p99 {:.2} ms ({:.0}x), localhost API calls included",
        args.count,
        reconciles_after - reconciles,
        s50 * 1e3,
        s50 / get_p50,
        s99 * 1e3,
        s99 / get_p50
    );
    println!(
        "API requests per reconcile: {:.1}",
        requests as f64 / reconciles.max(1.0)
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantile_interpolates_like_prometheus() {
        let b = [
            (0.001, 0.0),
            (0.002, 50.0),
            (0.005, 100.0),
            (f64::INFINITY, 100.0),
        ];
        assert!((quantile(0.5, &b).expect("q") - 0.002).abs() < 1e-12);
        assert!((quantile(0.25, &b).expect("q") - 0.0015).abs() < 1e-12);
        assert!((quantile(0.99, &b).expect("q") - 0.00494).abs() < 1e-9);
    }
}

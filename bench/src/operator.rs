//! bench-operator: the real `ferrite-operator` release binary against a real control plane
//! (ferrite-testkit's etcd, kube-apiserver and kube-controller-manager on 127.0.0.1, with an
//! audit log) holding N InferenceServices of four kinds. Reports, each against a baseline from
//! the same run:
//! - RSS after all are reconciled and settled, against its RSS idle;
//! - reconcile duration p50/p99 from the operator's own histogram, in a burst (all created at
//!   once) and one at a time (a spec change each), against a plain GET's round trip;
//! - the requests the operator sends in steady state, from the API server's audit log, against
//!   its Lease renewals in the same window.
//!
//!   cargo build --release -p ferrite-operator -p ferrite-bench
//!   target/release/bench-operator --count 100

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};
use clap::Parser;
use ferrite_bench::stats::percentile;
use ferrite_testkit::kube::{Cluster, KubeUser, Options, kubeconfig, workspace_root};
use ferrite_testkit::process::{Guard, TempDir, free_port};
use ferrite_testkit::server::Metrics;
use kube::api::{Api, DynamicObject, ListParams, Patch, PatchParams};
use kube::core::GroupVersionKind;
use kube::discovery::ApiResource;
use serde_json::{Value, json};

#[derive(Debug, Parser)]
struct Args {
    /// InferenceServices to create.
    #[arg(long, default_value_t = 100)]
    count: usize,
    /// The operator binary (default: beside this one).
    #[arg(long)]
    operator: Option<PathBuf>,
    /// Seconds of steady state over which requests are counted.
    #[arg(long, default_value_t = 300)]
    window: u64,
}

/// The operator's user name, as the API server (and its audit log) knows it.
const OPERATOR_USER: &str = "ferrite-operator-bench";

/// A spread of specs: runtimes, replicas, GPUs, engine settings, claims, monitoring on and off,
/// autoscaling through an HPA.
fn isvc(i: usize, seed: Option<usize>) -> Value {
    let mut spec = json!({"model": {"source": "pvc://models/m.gguf"}});
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
            spec["autoscaling"] = json!({"mode": "HPA", "minReplicas": 1, "maxReplicas": 6,
                                         "targets": {"queuePerReplica": 4.0}});
            spec["monitoring"] = json!({"serviceMonitor": {"enabled": true, "interval": "15s"},
                                        "dashboards": {"enabled": true, "folder": "LLM"}});
        }
    }
    if let Some(seed) = seed {
        spec["runtime"]["args"] = json!([format!("--seed={seed}")]);
    }
    json!({"apiVersion": "ferrite.dev/v1alpha1", "kind": "InferenceService",
           "metadata": {"name": format!("svc-{i:04}"), "namespace": "bench"}, "spec": spec})
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

/// The operator's requests in the audit log: (verb, resource[/subresource]) per request.
fn operator_requests(cluster: &Cluster) -> Vec<(String, String)> {
    let mut ids = std::collections::BTreeSet::new();
    cluster
        .audit_events()
        .into_iter()
        .filter(|e| e["user"]["username"] == OPERATOR_USER)
        .filter(|e| ids.insert(e["auditID"].to_string()))
        .map(|e| {
            let resource = e["objectRef"]["resource"].as_str().unwrap_or_default();
            let resource = match e["objectRef"]["subresource"].as_str() {
                Some(sub) => format!("{resource}/{sub}"),
                None => resource.to_string(),
            };
            (e["verb"].as_str().unwrap_or_default().to_string(), resource)
        })
        .collect()
}

fn is_write(verb: &str) -> bool {
    matches!(verb, "create" | "update" | "patch" | "delete")
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
    let Some(cluster) = Cluster::start_with(Options {
        audit: true,
        ..Options::default()
    })
    .await
    else {
        bail!("no Kubernetes control plane binaries (see ferrite-testkit)");
    };
    let admin = cluster.client().await;
    let dir = TempDir::new("bench-operator");
    let root = workspace_root();

    // The CRDs, the namespace and the claim the InferenceServices mount.
    let crd = std::fs::read_to_string(root.join("crds/inferenceservice.yaml"))?;
    let sm_crd = json!({
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": "servicemonitors.monitoring.coreos.com"},
        "spec": {"group": "monitoring.coreos.com", "scope": "Namespaced",
            "names": {"kind": "ServiceMonitor", "listKind": "ServiceMonitorList",
                      "plural": "servicemonitors", "singular": "servicemonitor"},
            "versions": [{"name": "v1", "served": true, "storage": true,
                "schema": {"openAPIV3Schema": {"type": "object",
                    "properties": {"spec": {"type": "object",
                        "x-kubernetes-preserve-unknown-fields": true}}}}}]}});
    let crd: Value = serde_yaml_ng::from_str(&crd)?;
    apply(
        &admin,
        &crd,
        "CustomResourceDefinition",
        "customresourcedefinitions",
        "apiextensions.k8s.io/v1",
        false,
    )
    .await?;
    apply(
        &admin,
        &sm_crd,
        "CustomResourceDefinition",
        "customresourcedefinitions",
        "apiextensions.k8s.io/v1",
        false,
    )
    .await?;
    apply(
        &admin,
        &json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "bench"}}),
        "Namespace",
        "namespaces",
        "v1",
        false,
    )
    .await?;
    apply(
        &admin,
        &json!({"apiVersion": "v1", "kind": "PersistentVolumeClaim",
        "metadata": {"name": "models", "namespace": "bench"},
        "spec": {"accessModes": ["ReadOnlyMany"], "resources": {"requests": {"storage": "1Gi"}}}}),
        "PersistentVolumeClaim",
        "persistentvolumeclaims",
        "v1",
        true,
    )
    .await?;
    tokio::time::sleep(Duration::from_secs(2)).await;

    // The operator, as its own user, with the dashboards the chart gives it.
    let dashboards = dir.path().join("dashboards");
    std::fs::create_dir_all(&dashboards)?;
    for d in ["overview.json", "realtime.json"] {
        std::fs::copy(root.join("dashboards").join(d), dashboards.join(d))?;
    }
    let identity = cluster.ca().client(OPERATOR_USER, &["system:masters"]);
    std::fs::write(dir.path().join("op.crt"), &identity.cert)?;
    std::fs::write(dir.path().join("op.key"), &identity.key)?;
    let kc = dir.path().join("kubeconfig");
    std::fs::write(
        &kc,
        kubeconfig(
            &cluster.url(),
            &cluster.ca_file(),
            &KubeUser::Certificate {
                cert: dir.path().join("op.crt"),
                key: dir.path().join("op.key"),
            },
        ),
    )?;
    let port = free_port();
    let mut cmd = Command::new(&operator);
    cmd.args(["--http-addr", &format!("127.0.0.1:{port}")])
        .args(["--lease-namespace", "bench", "--identity", "bench-0"])
        .args(["--external-metrics-addr", "off"])
        .arg("--dashboards-dir")
        .arg(&dashboards)
        .env("KUBECONFIG", &kc)
        .env("RUST_LOG", "warn")
        .env_remove("KUBERNETES_SERVICE_HOST")
        .stdout(Stdio::null())
        .stderr(Stdio::inherit());
    let child = Guard::spawn("ferrite-operator", cmd)
        .with_context(|| format!("starting {}", operator.display()))?;
    let pid = child.id();
    let base = format!("http://127.0.0.1:{port}");
    let metrics = |base: String| async move {
        tokio::task::spawn_blocking(move || get(&format!("{base}/metrics"))).await?
    };
    let started = Instant::now();
    while metrics(base.clone())
        .await
        .map(|t| !t.contains("ferrite_operator_leader 1"))
        .unwrap_or(true)
    {
        if started.elapsed() > Duration::from_secs(60) {
            bail!("the operator never led");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (idle_rss, _) = rss_kib(pid)?;

    // Burst: all at once.
    let isvcs = isvc_api(&admin);
    let created = Instant::now();
    for i in 0..args.count {
        isvcs
            .patch(
                &format!("svc-{i:04}"),
                &PatchParams::apply("bench").force(),
                &Patch::Apply(isvc(i, None)),
            )
            .await?;
    }
    let created_in = created.elapsed();
    let observed = |v: &DynamicObject| {
        v.data["status"]["observedGeneration"].as_i64() == v.metadata.generation
    };
    // Polled from the API server's watch cache, once a second: a quorum list of N objects
    // every few hundred milliseconds would load the API server (and so the figure) itself.
    let from_cache = ListParams::default().match_any();
    let mut progress = Instant::now();
    loop {
        let n = isvcs
            .list(&from_cache)
            .await?
            .items
            .iter()
            .filter(|v| observed(v))
            .count();
        if n == args.count {
            break;
        }
        if progress.elapsed() >= Duration::from_secs(30) {
            progress = Instant::now();
            let m = Metrics::parse(metrics(base.clone()).await.unwrap_or_default());
            eprintln!(
                "{:>4.0} s: {n} of {} observed; operator: {} reconciles, {} failed",
                created.elapsed().as_secs_f64(),
                args.count,
                m.sum("ferrite_operator_reconciliations_total"),
                m.sum("ferrite_operator_reconcile_errors_total"),
            );
        }
        if created.elapsed() > Duration::from_secs(600) {
            bail!(
                "only {n} of {} InferenceServices were reconciled",
                args.count
            );
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let converged = created.elapsed();

    // Settled: 5 s without a write from the operator. The Deployment controller creates the
    // ReplicaSets and pods at its client's 20 requests/s, and every Deployment status it
    // writes meanwhile is followed, so allow it time in proportion.
    let settle = Instant::now();
    let settle_limit = Duration::from_secs(180).max(Duration::from_millis(600 * args.count as u64));
    let writes = |cluster: &Cluster| -> Vec<(String, String)> {
        operator_requests(cluster)
            .into_iter()
            .filter(|(v, r)| is_write(v) && r != "leases")
            .collect()
    };
    loop {
        let before = writes(&cluster).len();
        tokio::time::sleep(Duration::from_secs(5)).await;
        let window = writes(&cluster).split_off(before);
        if window.is_empty() {
            break;
        }
        if settle.elapsed() > settle_limit {
            let mut kinds = std::collections::BTreeMap::<String, usize>::new();
            for (v, r) in &window {
                *kinds.entry(format!("{v} {r}")).or_default() += 1;
            }
            bail!(
                "the operator kept writing ({} writes in 5 s: {kinds:?})",
                window.len()
            );
        }
    }
    let settled = settle.elapsed();
    let text = metrics(base.clone()).await?;
    let (burst, reconciles) = reconcile_histogram(&text);
    let p50 = quantile(0.5, &burst).context("no reconciles recorded")?;
    let p99 = quantile(0.99, &burst).context("no reconciles recorded")?;

    // Steady state: what it sends in the window, from the audit log.
    let before = operator_requests(&cluster).len();
    tokio::time::sleep(Duration::from_secs(args.window)).await;
    let window: Vec<(String, String)> = operator_requests(&cluster)[before..].to_vec();
    let (rss, hwm) = rss_kib(pid)?;
    let per_min = |n: usize| n as f64 * 60.0 / args.window as f64;
    let lease = window.iter().filter(|(_, r)| r == "leases").count();
    let others: Vec<&(String, String)> = window.iter().filter(|(_, r)| r != "leases").collect();
    let writes = others.iter().filter(|(v, _)| is_write(v)).count();
    let watches = others.iter().filter(|(v, _)| v == "watch").count();
    let reads = others.len() - writes - watches;

    // One at a time: a spec change each, waiting for its observedGeneration. The histogram is
    // read again first, so that the phase counts only its own reconciles.
    let (before_changes, reconciles_before_changes) =
        reconcile_histogram(&metrics(base.clone()).await?);
    let changes = args.count.min(200);
    let one_by_one = Instant::now();
    for i in 0..changes {
        let name = format!("svc-{i:04}");
        let applied = isvcs
            .patch(
                &name,
                &PatchParams::apply("bench").force(),
                &Patch::Apply(isvc(i, Some(i))),
            )
            .await?;
        let generation = applied.metadata.generation;
        loop {
            let v = isvcs.get(&name).await?;
            if v.data["status"]["observedGeneration"].as_i64() == generation {
                break;
            }
            if one_by_one.elapsed() > Duration::from_secs(600) {
                bail!("{name} never observed generation {generation:?}");
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let text = metrics(base.clone()).await?;
    let (after, reconciles_after) = reconcile_histogram(&text);
    let single: Vec<(f64, f64)> = after
        .iter()
        .zip(&before_changes)
        .map(|(&(le, a), &(_, b))| (le, a - b))
        .collect();
    let s50 = quantile(0.5, &single).context("no reconciles in phase 2")?;
    let s99 = quantile(0.99, &single).context("no reconciles in phase 2")?;

    // Baseline for time: a GET of one Deployment from the same API server, 200 times.
    let deployments: Api<k8s_openapi::api::apps::v1::Deployment> =
        Api::namespaced(admin.clone(), "bench");
    let mut rtt = Vec::new();
    for _ in 0..200 {
        let t = Instant::now();
        deployments.get("svc-0000").await?;
        rtt.push(t.elapsed().as_secs_f64());
    }
    let get_p50 = percentile(&rtt, 50.0);
    drop(child);

    let mib = |k: u64| k as f64 / 1024.0;
    println!("operator: {}", operator.display());
    println!(
        "{} InferenceServices created in {:.1} s, reconciled (observedGeneration) {:.1} s after \
         the first create, settled {:.1} s later; {reconciles} reconciles",
        args.count,
        created_in.as_secs_f64(),
        converged.as_secs_f64(),
        settled.as_secs_f64()
    );
    println!(
        "RSS idle (baseline) {:.1} MiB -> with {} settled {:.1} MiB (peak {:.1} MiB): {:.2}x",
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
        "burst ({} created at once): reconcile p50 {:.2} ms ({:.0}x), p99 {:.2} ms ({:.0}x)",
        args.count,
        p50 * 1e3,
        p50 / get_p50,
        p99 * 1e3,
        p99 / get_p50
    );
    println!(
        "one at a time ({changes} spec changes, {} reconciles): reconcile p50 {:.2} ms ({:.0}x), \
         p99 {:.2} ms ({:.0}x), API writes included",
        reconciles_after - reconciles_before_changes,
        s50 * 1e3,
        s50 / get_p50,
        s99 * 1e3,
        s99 / get_p50
    );
    println!(
        "steady state ({} s, from the audit log): {:.1} requests/min beyond the Lease \
         ({:.1} reads, {:.1} writes, {:.1} watch restarts); Lease renewals (baseline) \
         {:.1} requests/min: {:.2}x",
        args.window,
        per_min(others.len()),
        per_min(reads),
        per_min(writes),
        per_min(watches),
        per_min(lease),
        others.len() as f64 / lease.max(1) as f64
    );
    Ok(())
}

fn isvc_api(client: &kube::Client) -> Api<DynamicObject> {
    let ar = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("ferrite.dev", "v1alpha1", "InferenceService"),
        "inferenceservices",
    );
    Api::namespaced_with(client.clone(), "bench", &ar)
}

/// Server-side applies `obj` as the bench.
async fn apply(
    client: &kube::Client,
    obj: &Value,
    kind: &str,
    plural: &str,
    api_version: &str,
    namespaced: bool,
) -> Result<()> {
    let (group, version) = api_version.split_once('/').unwrap_or(("", api_version));
    let ar =
        ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(group, version, kind), plural);
    let api: Api<DynamicObject> = if namespaced {
        Api::namespaced_with(
            client.clone(),
            obj["metadata"]["namespace"].as_str().unwrap_or("default"),
            &ar,
        )
    } else {
        Api::all_with(client.clone(), &ar)
    };
    let name = obj["metadata"]["name"].as_str().context("name")?;
    api.patch(
        name,
        &PatchParams::apply("bench").force(),
        &Patch::Apply(obj),
    )
    .await
    .with_context(|| format!("applying {kind} {name}"))?;
    Ok(())
}

//! Flow control on a real API server with a real ferrite-server behind the router: a heavy
//! tenant that keeps more requests open than the server's batch holds saturates it; the
//! router queues the excess (exported per service), and a light tenant sending one request at
//! a time still starts about as fast as alone (its median within 2× of its median alone, and
//! its p90 under the median of the same requests through a router without flow control).
//! Timings are read in a suite that runs other tests beside this one, so the test asserts
//! medians; the p99 ratio it prints is for a quiet machine (docs/router.md, "Flow control"). Through a router without
//! flow control, the same light request waits behind the heavy tenant's queue in the server.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::common::*;
use ferrite_api::tenant::{InferenceTenant, InferenceTenantSpec, TENANT_LABEL};
use ferrite_testkit::process::eventually;
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use kube::Api;
use kube::api::PostParams;
use serde_json::json;

/// The server runs this many sequences at once.
const BATCH: usize = 4;
/// The heavy tenant's requests open at once: three times the batch.
const HEAVY: usize = 12;

async fn tenant_with_key(client: &kube::Client, ns: &str, name: &str) {
    let spec = InferenceTenantSpec {
        namespaces: vec![ns.to_string()],
        ..Default::default()
    };
    Api::<InferenceTenant>::all(client.clone())
        .create(&PostParams::default(), &InferenceTenant::new(name, spec))
        .await
        .expect("tenant");
    let mut s = Secret::default();
    s.metadata.name = Some(format!("{name}-keys"));
    s.metadata.labels = Some([(TENANT_LABEL.to_string(), name.to_string())].into());
    s.data = Some(
        [(
            "key".to_string(),
            ByteString(format!("sk-{name}").into_bytes()),
        )]
        .into(),
    );
    Api::<Secret>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &s)
        .await
        .expect("key Secret");
}

/// A prompt of about 150 tokens that no other request shares a prefix with (no cache hit).
fn prompt(i: usize) -> String {
    format!(
        "Note {i}. {}",
        "The river bends past the old mill, where the miller keeps his accounts in a \
         ledger bound in green cloth and the children count boats. "
            .repeat(5)
    )
}

/// Time from sending a streamed completion as `key` to its first token event.
async fn ttft(url: String, key: String, i: usize) -> Duration {
    tokio::task::spawn_blocking(move || {
        use std::io::BufRead;
        let body = json!({"model": "chat", "prompt": prompt(i), "max_tokens": 2,
                          "temperature": 0, "stream": true});
        let started = Instant::now();
        let r = ureq::post(&url)
            .set("Authorization", &format!("Bearer {key}"))
            .timeout(Duration::from_secs(120))
            .send_json(body)
            .unwrap_or_else(|e| panic!("{url}: {e}"));
        let mut first = None;
        for line in std::io::BufReader::new(r.into_reader()).lines() {
            let line = line.expect("stream line");
            if first.is_none() && line.starts_with("data: {") && line.contains("\"text\"") {
                first = Some(started.elapsed());
            }
        }
        first.expect("a token event")
    })
    .await
    .expect("request thread")
}

/// `n` light requests one after another (`gap` apart), each time to first token, sorted.
async fn light_ttfts(url: &str, n: usize, from: usize, gap: Duration) -> Vec<Duration> {
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        out.push(ttft(url.to_string(), "sk-light".into(), from + i).await);
        tokio::time::sleep(gap).await;
    }
    out.sort();
    out
}

/// The 99th percentile of sorted samples (the largest, for fewer than 100).
fn p99(sorted: &[Duration]) -> Duration {
    sorted[(sorted.len() * 99).div_ceil(100).saturating_sub(1)]
}

/// The heavy tenant: `HEAVY` threads each sending completions back to back to `url` (which
/// may change) until `stop`; counts what finished.
fn heavy_load(url: Arc<Mutex<String>>, stop: Arc<AtomicBool>, done: Arc<AtomicUsize>) {
    for t in 0..HEAVY {
        let (url, stop, done) = (url.clone(), stop.clone(), done.clone());
        std::thread::spawn(move || {
            let mut i = 0;
            while !stop.load(Ordering::Relaxed) {
                let url = url.lock().expect("url").clone();
                let body = json!({"model": "chat", "prompt": format!("Batch job {t}-{i}: list"),
                                  "max_tokens": 32, "temperature": 0, "ignore_eos": true});
                let r = ureq::post(&url)
                    .set("Authorization", "Bearer sk-heavy")
                    .timeout(Duration::from_secs(300))
                    .send_json(body);
                if r.is_ok() {
                    done.fetch_add(1, Ordering::Relaxed);
                }
                i += 1;
            }
        });
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_light_tenant_keeps_its_time_to_first_token_while_a_heavy_one_saturates() {
    let Some((_cluster, client, ns, port)) = tenant_chat_service("fair").await else {
        return;
    };
    let batch = BATCH.to_string();
    let _server = server_with("127.0.0.1", port, "chat", &["--max-num-seqs", &batch]);
    ready_pod(&client, &ns, "chat", "chat-0", "127.0.0.1").await;
    tenant_with_key(&client, &ns, "heavy").await;
    tenant_with_key(&client, &ns, "light").await;
    let mut config = config();
    config.tenants = Some(ns.clone());
    let base = router_with(&client, &ns, config.clone(), false).await;
    config.flow = None;
    let plain = router_with(&client, &ns, config, false).await;
    for b in [&base, &plain] {
        eventually(WAIT, "the tenants' keys and the replica", async || {
            let (status, _, _) = post_with(
                &format!("{b}/v1/completions"),
                &[("Authorization", "Bearer sk-light".into())],
                json!({"model": "chat", "prompt": "hi", "max_tokens": 1}),
            )
            .await;
            (status == 200).then_some(())
        })
        .await;
    }
    let url = format!("{base}/v1/completions");
    let gap = Duration::from_millis(50);

    // Unloaded.
    let alone = light_ttfts(&url, 20, 0, gap).await;
    let alone_p50 = alone[alone.len() / 2];

    // The heavy tenant keeps three batches' worth open.
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicUsize::new(0));
    let heavy_url = Arc::new(Mutex::new(url.clone()));
    heavy_load(heavy_url.clone(), stop.clone(), done.clone());
    // The router learns the server's batch from its queue, and holds the excess itself.
    let metrics = format!("{base}/metrics");
    let labels = [("inferenceservice", "chat"), ("model_name", "chat")];
    eventually(WAIT, "heavy requests queued in the router", async || {
        let text = get_text(metrics.clone()).await;
        (metric_sum(&text, "ferrite_router_queued_requests", &labels) >= 1.0).then_some(())
    })
    .await;
    // The light tenant starts; its first requests find the heavy one's backlog in the
    // server's own queue, and the router then keeps a slot for it.
    light_ttfts(&url, 10, 100, gap).await;
    let loaded = light_ttfts(&url, 40, 200, gap).await;
    let loaded_p99 = p99(&loaded);
    let text = get_text(metrics.clone()).await;
    // Seconds the heavy tenant's requests spent in the router's queue, all together.
    let heavy_waited = metric_sum(
        &text,
        "ferrite_router_queue_duration_seconds_sum",
        &[("tenant", "heavy")],
    );

    // Both tenants through a router without flow control: the light request queues in the
    // server behind the heavy one's backlog.
    let plain_url = format!("{plain}/v1/completions");
    *heavy_url.lock().expect("url") = plain_url.clone();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let unfair = light_ttfts(&plain_url, 5, 300, gap).await;
    stop.store(true, Ordering::Relaxed);

    let ms = |d: &[Duration]| d.iter().map(|d| d.as_millis()).collect::<Vec<_>>();
    eprintln!(
        "light TTFT ms: alone {:?}; heavy saturating, flow control {:?}; without {:?}; \
         heavy finished {}",
        ms(&alone),
        ms(&loaded),
        ms(&unfair),
        done.load(Ordering::Relaxed)
    );
    let loaded_p50 = loaded[loaded.len() / 2];
    let loaded_p90 = loaded[loaded.len() * 9 / 10];
    let unfair_p50 = unfair[unfair.len() / 2];
    eprintln!(
        "light TTFT p99 under load ÷ p50 alone: {:.2}",
        loaded_p99.as_secs_f64() / alone_p50.as_secs_f64()
    );
    assert!(
        loaded_p50 <= alone_p50 * 2,
        "light TTFT p50 {loaded_p50:?} under load vs {alone_p50:?} alone"
    );
    assert!(
        loaded_p90 < unfair_p50,
        "flow control: p90 {loaded_p90:?}; without: p50 {unfair_p50:?}"
    );
    assert!(
        done.load(Ordering::Relaxed) >= HEAVY,
        "the heavy tenant was served too"
    );
    assert!(heavy_waited > 1.0, "{text}");
    // The comparison can fail: without the router's queue the light tenant waits.
    assert!(
        unfair_p50 > alone_p50 * 2,
        "without flow control: {:?}",
        ms(&unfair)
    );
}

//! Clients and tenants written to hurt the router, on a real API server: bodies past the
//! limits, more held requests than it will keep, a service that will never start, and a
//! tenant in another namespace copying a served name. Each is refused at once with an
//! OpenAI-style error, and what the router keeps stays bounded.

use std::time::Duration;

use super::common::*;
use bytes::Bytes;
use ferrite_router::LimitConfig;
use ferrite_testkit::process::{eventually, free_port, memory_kib};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client as HttpClient;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use kube::api::{Patch, PatchParams};
use serde_json::{Value, json};

type Http = HttpClient<HttpConnector, Full<Bytes>>;

fn http() -> Http {
    HttpClient::builder(TokioExecutor::new())
        .pool_max_idle_per_host(0)
        .build_http()
}

/// Status, JSON body and Retry-After of a POST of raw bytes.
async fn send(client: &Http, url: &str, body: Bytes) -> (u16, Value, Option<String>) {
    try_send(client, url, body).await.expect("response")
}

/// [`send`], or the client's error: a request the router refuses from its head (before its
/// body is read) may see its body write fail before the refusal arrives.
async fn try_send(
    client: &Http,
    url: &str,
    body: Bytes,
) -> Result<(u16, Value, Option<String>), hyper_util::client::legacy::Error> {
    let req = hyper::Request::post(url)
        .header("content-type", "application/json")
        .body(Full::new(body))
        .expect("request");
    let resp = client.request(req).await?;
    let status = resp.status().as_u16();
    let retry = resp
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let bytes = resp
        .into_body()
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    Ok((
        status,
        serde_json::from_slice(&bytes).unwrap_or(Value::Null),
        retry,
    ))
}

/// The router's answer to a completions request head announcing `length` bytes of body, none
/// of which is sent.
async fn head_only(base: &str, length: usize) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let addr = base.trim_start_matches("http://");
    let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
         content-length: {length}\r\n\r\n"
    );
    s.write_all(head.as_bytes()).await.expect("write");
    let mut out = vec![0u8; 4096];
    let n = tokio::time::timeout(Duration::from_secs(10), s.read(&mut out))
        .await
        .expect("an answer before the body")
        .expect("read");
    String::from_utf8_lossy(&out[..n]).into_owned()
}

fn body(v: Value) -> Bytes {
    Bytes::from(v.to_string())
}

/// A completion for `model` padded with a prompt of `bytes` characters.
fn padded(model: &str, bytes: usize) -> Bytes {
    body(json!({"model": model, "prompt": "a".repeat(bytes), "max_tokens": 1}))
}

/// Bodies past the limit get 413 before they are read; bodies within it, only as many as the
/// byte budget holds (the others 503 with Retry-After); held requests are capped per service;
/// however many are held, the service is woken with one write; a degraded service is not
/// waited for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limits_hold_and_wake_once() {
    let Some((_cluster, client, ns)) = cluster_with_crd("hostile").await else {
        return;
    };
    let spec = json!({"model": {"source": "/models/smol.gguf"}, "replicas": 0,
                      "runtime": {"port": free_port()}});
    create_isvc(&client, &ns, "cold", spec).await;
    let mut config = config();
    config.limits = LimitConfig {
        max_body: 1 << 20,
        max_upload: 25 << 20,
        // Eight 1 MiB bodies and half a MiB for small ones.
        max_buffered_bytes: (8 << 20) + (512 << 10),
        max_in_flight: 1000,
        max_held: 1000,
        max_held_per_service: 100,
    };
    let base = router_with(&client, &ns, config, true).await;
    let url = format!("{base}/v1/completions");
    let h = http();

    // Over the body limit: 413 with an OpenAI error, before the body is read (the head alone
    // is sent: a client still writing its body would see its write fail first).
    let reply = head_only(&base, 2 << 20).await;
    assert!(reply.starts_with("HTTP/1.1 413"), "{reply}");
    assert!(reply.contains("invalid_request_error"), "{reply}");
    // (A chunked body over the limit is cut while it is read: `ferrite-net`'s unit tests. Here
    // the client would see its write fail before the 413 arrives.)
    // Bad bodies: 400, the same way the server refuses them.
    for bad in [
        &b"{\"model\": \"cold\"} trailing"[..],
        b"{\"model\": \"a\", \"model\": \"b\"}",
        b"[1]",
    ] {
        let (status, err, _) = send(&h, &url, Bytes::from_static(bad)).await;
        assert_eq!(status, 400, "{err}");
    }

    // 20 held requests of 1 MiB: the budget keeps 8 of them, the rest are refused at once,
    // from the request's head; the router takes and drops the rest of a refused body, so that
    // a client still writing it reads the 503 rather than a broken pipe.
    let big: Vec<_> = (0..20)
        .map(|_| {
            let (h, url) = (h.clone(), url.clone());
            tokio::spawn(async move { try_send(&h, &url, padded("cold", (1 << 20) - 100)).await })
        })
        .collect();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let (mut held, mut answered) = (0, 0);
    for r in big {
        // The held ones are still waiting when the deadline passes.
        match tokio::time::timeout_at(deadline, r).await {
            Err(_) => held += 1,
            Ok(Ok(Ok((status, err, retry)))) => {
                assert_eq!(status, 503, "{err}");
                assert!(retry.is_some(), "Retry-After");
                answered += 1;
            }
            Ok(Ok(Err(e))) => panic!("a refused client saw no refusal: {e:?}"),
            Ok(Err(e)) => panic!("client task: {e}"),
        }
    }
    assert_eq!(
        (held, answered),
        (8, 12),
        "8 of 20 held, 12 refused with 503"
    );

    // 300 small held requests: 100 per service are held, the 8 above among them.
    let small: Vec<_> = (0..300)
        .map(|_| {
            let (h, url) = (h.clone(), url.clone());
            tokio::spawn(async move {
                send(&h, &url, body(json!({"model": "cold", "prompt": "hi"}))).await
            })
        })
        .collect();
    // 8 + 92 held, and 12 + 208 refused in all.
    eventually(
        WAIT,
        "the held gauge at its cap, the rest refused",
        async || {
            let m = get_text(format!("{base}/metrics")).await;
            let held = metric_sum(&m, "ferrite_router_held_requests", &[]);
            let refused = metric_sum(&m, "ferrite_router_refused_requests_total", &[]);
            (held == 100.0 && refused == 220.0).then_some(())
        },
    )
    .await;
    // However many are held, one write woke the service.
    eventually(WAIT, "the router to scale cold from zero", async || {
        let o = isvc_api(&client, &ns).get("cold").await.ok()?;
        (o.data["spec"]["replicas"] == 1).then_some(())
    })
    .await;
    let m = get_text(format!("{base}/metrics")).await;
    assert_eq!(
        metric_sum(&m, "ferrite_router_wakes_total", &[]),
        1.0,
        "{m}"
    );

    // The service turns Degraded (its pods crash-loop): everyone held is answered at once,
    // with the condition's reason and not its pod-level message, and so is the next request.
    let status = json!({"status": {"conditions": [{
        "type": "Degraded", "status": "True", "reason": "CrashLoopBackOff",
        "message": "pod cold-abc, container server: back-off restarting",
        "lastTransitionTime": k8s_openapi::jiff::Timestamp::now().to_string()}]}});
    isvc_api(&client, &ns)
        .patch_status("cold", &PatchParams::default(), &Patch::Merge(&status))
        .await
        .expect("status");
    for r in small {
        let Ok(Ok((status, err, _))) = tokio::time::timeout(WAIT, r).await else {
            panic!("a held request was not answered");
        };
        assert_eq!(status, 503, "{err}");
    }
    let (status, err, retry) = send(&h, &url, body(json!({"model": "cold", "prompt": "hi"}))).await;
    assert_eq!(status, 503, "{err}");
    assert!(retry.is_some());
    let msg = err["error"]["message"].as_str().unwrap_or_default();
    assert!(msg.contains("CrashLoopBackOff"), "{msg}");
    assert!(
        !msg.contains("cold-abc"),
        "pod names stay in the status: {msg}"
    );
}

/// A tenant in another namespace copies a served name: the oldest claimant keeps its traffic
/// (before, the first namespace in alphabetical order took it, with its clients' keys), the
/// copy is listed under its `namespace/name`, and that id reaches the copy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_served_name_cannot_be_captured_from_another_namespace() {
    let Some((cluster, client, first)) = cluster_with_crd("zzz-owner").await else {
        return;
    };
    let (owner_port, copy_port) = (free_port(), free_port());
    create_isvc(
        &client,
        &first,
        "llm",
        json!({"model": {"source": "/models/smol.gguf", "servedName": "shared"},
               "runtime": {"port": owner_port}}),
    )
    .await;
    // Creation times are in whole seconds: make the copy clearly younger.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let second = cluster.namespace("aaa-tenant").await;
    create_isvc(
        &client,
        &second,
        "copy",
        json!({"model": {"source": "/models/smol.gguf", "servedName": "shared"},
               "runtime": {"port": copy_port}}),
    )
    .await;
    // Each server answers with its own first name, so responses tell them apart; the
    // operator gives every server its `namespace/name` as a second name.
    let _owner = server_with(
        "127.0.0.1",
        owner_port,
        "shared",
        &["--served-model-name", &format!("{first}/llm")],
    );
    let copy_id = format!("{second}/copy");
    let _copy = server_with(
        "127.0.0.2",
        copy_port,
        "shared-copy",
        &["--served-model-name", &copy_id],
    );
    ready_pod(&client, &first, "llm", "llm-0", "127.0.0.1").await;
    ready_pod(&client, &second, "copy", "copy-0", "127.0.0.2").await;
    let base = router_in(&client, None, config(), false).await;
    eventually(WAIT, "both ready", async || {
        let v = get(format!("{base}/v1/models")).await;
        (v["data"]
            .as_array()?
            .iter()
            .filter(|m| m["ready_replicas"] == 1)
            .count()
            == 2)
            .then_some(())
    })
    .await;
    let h = http();
    let url = format!("{base}/v1/completions");
    for _ in 0..10 {
        let (status, r, _) = send(
            &h,
            &url,
            body(json!({"model": "shared", "prompt": "Hi", "max_tokens": 1})),
        )
        .await;
        assert_eq!(status, 200, "{r}");
        assert_eq!(r["model"], "shared", "the owner answered: {r}");
    }
    let (status, r, _) = send(
        &h,
        &url,
        body(json!({"model": copy_id, "prompt": "Hi", "max_tokens": 1})),
    )
    .await;
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["model"], "shared-copy", "{r}");
    let listed = get(format!("{base}/v1/models")).await;
    let ids: Vec<&str> = listed["data"]
        .as_array()
        .expect("data")
        .iter()
        .filter_map(|m| m["id"].as_str())
        .collect();
    assert!(
        ids.contains(&"shared") && ids.contains(&copy_id.as_str()),
        "{listed}"
    );
}

/// Raises this process's open-file limit to its hard limit; returns the soft limit now.
fn raise_fd_limit() -> u64 {
    let mut l = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit and setrlimit only read and write the struct passed by pointer, which
    // lives on this stack frame for the calls.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut l) == 0 {
            l.rlim_cur = l.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &l);
            libc::getrlimit(libc::RLIMIT_NOFILE, &mut l);
        }
    }
    l.rlim_cur
}

/// The router binary with its default limits (`--max-held-per-service` raised to 1,000 for the
/// wake figure) in front of a service at zero that never starts: its memory while 64 clients
/// each send the largest body it accepts, and while 10,000 requests arrive (the excess refused
/// with 503); and its `/scale` writes while 1,000 are held and the service keeps being scaled
/// back to zero (as an autoscaler would). Prints the figures the issue asks for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_router_binary_stays_small_under_load_it_refuses() {
    let Some((cluster, client, ns)) = cluster_with_crd("rss").await else {
        return;
    };
    let spec = json!({"model": {"source": "/models/smol.gguf"}, "replicas": 0,
                      "runtime": {"port": free_port()}});
    create_isvc(&client, &ns, "cold", spec).await;
    // Held requests keep their sockets open (a descriptor each here, and one in the router,
    // which inherits the raised limit): as many as the limit allows, up to 1,000.
    let cap: usize = if raise_fd_limit() >= 2_000 {
        1_000
    } else {
        200
    };
    let port = free_port();
    let mut cmd =
        std::process::Command::new(ferrite_testkit::server::workspace_binary("ferrite-router"));
    cmd.env("KUBECONFIG", cluster.admin_kubeconfig())
        .args(["--addr", &format!("127.0.0.1:{port}")])
        .args([
            "--namespace",
            &ns,
            "--endpoints-from",
            "pods",
            "--max-held-per-service",
            &cap.to_string(),
        ])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    let router = ferrite_testkit::process::Guard::spawn("ferrite-router", cmd).expect("spawn");
    let pid = router.id();
    let base = format!("http://127.0.0.1:{port}");
    eventually(WAIT, "the router ready", async || {
        let b = base.clone();
        tokio::task::spawn_blocking(move || ureq::get(&format!("{b}/readyz")).call().ok())
            .await
            .ok()
            .flatten()
    })
    .await;
    let url = format!("{base}/v1/completions");
    let held = |n: f64| {
        let base = base.clone();
        async move {
            let m = get_text(format!("{base}/metrics")).await;
            (metric_sum(&m, "ferrite_router_held_requests", &[]) == n).then_some(())
        }
    };
    let (_, baseline) = memory_kib(pid);

    let h = http();
    // 10,000 small requests, `cap` + 200 open at once from here: `cap` held, the rest 503.
    let gate = std::sync::Arc::new(tokio::sync::Semaphore::new(cap + 200));
    let small = body_of(json!({"model": "cold", "prompt": "hi"}));
    let mut tasks = Vec::new();
    for _ in 0..10_000 {
        let permit = gate.clone().acquire_owned().await.expect("gate");
        let (h, url, body) = (h.clone(), url.clone(), small.clone());
        tasks.push(tokio::spawn(async move {
            let _permit = permit;
            send(&h, &url, body).await.0
        }));
    }
    eventually(WAIT, "1,000 held, the rest answered", async || {
        let m = get_text(format!("{base}/metrics")).await;
        let held = metric_sum(&m, "ferrite_router_held_requests", &[]);
        let refused = metric_sum(&m, "ferrite_router_refused_requests_total", &[]);
        (held == cap as f64 && refused >= (10_000 - cap) as f64).then_some(())
    })
    .await;
    let (peak_held, _) = memory_kib(pid);

    // With them held, the service keeps going back to zero: the wakes are counted.
    let wakes = |m: &str| metric_sum(m, "ferrite_router_wakes_total", &[]);
    let wakes_before = wakes(&get_text(format!("{base}/metrics")).await);
    let started = std::time::Instant::now();
    let zero = Patch::Merge(json!({"spec": {"replicas": 0}}));
    while started.elapsed() < Duration::from_secs(20) {
        let _ = isvc_api(&client, &ns)
            .patch("cold", &PatchParams::default(), &zero)
            .await;
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    let wakes = wakes(&get_text(format!("{base}/metrics")).await) - wakes_before;
    tasks.iter().for_each(|t| t.abort());
    drop(tasks);
    eventually(WAIT, "the held requests gone", async || held(0.0).await).await;

    // 64 clients, each with a body just under the 2 MiB limit: all held (128 MiB budget).
    let body = padded("cold", (2 << 20) - 100);
    let big: Vec<_> = (0..64)
        .map(|_| {
            let (h, url, body) = (h.clone(), url.clone(), body.clone());
            tokio::spawn(async move { send(&h, &url, body).await })
        })
        .collect();
    eventually(WAIT, "64 large requests held", async || held(64.0).await).await;
    let (peak_bodies, _) = memory_kib(pid);
    big.iter().for_each(|t| t.abort());

    let mib = |kib: u64| kib as f64 / 1024.0;
    println!(
        "ferrite-router (debug build) RSS: {:.0} MiB idle; peak {:.0} MiB over 10,000 \
         requests ({cap} held, the rest 503); peak {:.0} MiB with 64 x 2 MiB bodies held; \
         {wakes} /scale writes in 20 s (after the first) with {cap} held and the service reset \
         to 0 every 2 s",
        mib(baseline),
        mib(peak_held),
        mib(peak_bodies)
    );
    assert!(mib(peak_bodies) < 384.0, "{} MiB", mib(peak_bodies));
    assert!(mib(peak_held) < 384.0, "{} MiB", mib(peak_held));
    assert!(wakes <= 1.0, "{wakes} writes in 20 s");
}

fn body_of(v: Value) -> Bytes {
    body(v)
}

//! Tenants on the router (`--tenants`), on a real API server with real ferrite-servers behind
//! stand-in pods: InferenceTenants and their key Secrets as a platform team writes them, 401
//! for no key or a bad one, 403 for a model outside the tenant's list, 429 with Retry-After and
//! the `x-ratelimit-*` headers over requests or tokens per minute, tokens settled to the
//! replicas' usage, and a tenant's key never passed on to a pod.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use super::common::*;
use ferrite_api::tenant::{InferenceTenant, InferenceTenantSpec, TENANT_LABEL, TenantLimits};
use ferrite_testkit::kube::standin::install_tenant_crd;
use ferrite_testkit::process::eventually;
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use kube::Api;
use kube::api::{DeleteParams, PostParams};
use serde_json::{Value, json};

/// POSTs `body` with bearer `key`: status, JSON body and headers.
async fn call(
    url: String,
    key: Option<&str>,
    body: Value,
) -> (u16, Value, HashMap<String, String>) {
    let auth: Vec<(&str, String)> = key
        .map(|k| ("Authorization", format!("Bearer {k}")))
        .into_iter()
        .collect();
    post_with(&url, &auth, body).await
}

/// `GET /v1/models` with bearer `key`: status and JSON.
async fn models(base: &str, key: Option<&str>) -> (u16, Value) {
    let (url, key) = (format!("{base}/v1/models"), key.map(str::to_string));
    tokio::task::spawn_blocking(move || {
        let mut req = ureq::get(&url);
        if let Some(k) = key {
            req = req.set("Authorization", &format!("Bearer {k}"));
        }
        match req.call() {
            Ok(r) | Err(ureq::Error::Status(_, r)) => {
                (r.status(), r.into_json().unwrap_or(Value::Null))
            }
            Err(e) => panic!("{url}: {e}"),
        }
    })
    .await
    .expect("request thread")
}

/// The ids `/v1/models` lists for `key`, once `model` has a ready replica.
async fn listed_once_ready(base: &str, key: &str, model: &str) -> Vec<String> {
    eventually(WAIT, "the model ready in /v1/models", async || {
        let (status, v) = models(base, Some(key)).await;
        assert_eq!(status, 200, "{v}");
        let data = v["data"].as_array()?;
        data.iter()
            .any(|m| m["id"] == model && m["ready_replicas"] == 1)
            .then(|| {
                data.iter()
                    .filter_map(|m| m["id"].as_str().map(String::from))
                    .collect()
            })
    })
    .await
}

/// POSTs `body` with bearer `key` from a blocking thread until the router admits it (a
/// tenant with one request open at once: the last request's slot is given back as its
/// response ends on the router's side, which may be just after its client read it).
fn post_when_admitted(url: &str, key: &str, body: &Value) -> ureq::Response {
    (0..50)
        .find_map(|_| {
            let req = ureq::post(url).set("Authorization", &format!("Bearer {key}"));
            match req.send_json(body.clone()) {
                Ok(r) => Some(r),
                Err(ureq::Error::Status(429, _)) => {
                    std::thread::sleep(Duration::from_millis(100));
                    None
                }
                Err(e) => panic!("{url}: {e}"),
            }
        })
        .expect("admitted within 5 s")
}

async fn tenant(client: &kube::Client, name: &str, spec: InferenceTenantSpec) {
    Api::<InferenceTenant>::all(client.clone())
        .create(&PostParams::default(), &InferenceTenant::new(name, spec))
        .await
        .unwrap_or_else(|e| panic!("creating tenant {name}: {e}"));
}

async fn keys(client: &kube::Client, ns: &str, name: &str, tenant: &str, key: &str) {
    let mut s = Secret::default();
    s.metadata.name = Some(name.into());
    s.metadata.labels = Some(BTreeMap::from([(TENANT_LABEL.into(), tenant.into())]));
    // Written with a trailing newline, as `echo > file` makes one.
    s.data = Some(BTreeMap::from([(
        "key".into(),
        ByteString(format!("{key}\n").into_bytes()),
    )]));
    Api::<Secret>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &s)
        .await
        .unwrap_or_else(|e| panic!("creating Secret {name}: {e}"));
}

fn completion(model: &str, max_tokens: u32) -> Value {
    json!({"model": model, "prompt": "The capital of France is", "max_tokens": max_tokens,
           "temperature": 0, "ignore_eos": true})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_are_authenticated_kept_to_their_models_and_held_to_their_limits() {
    let Some((_cluster, client, ns)) = cluster_with_crd("tenants").await else {
        return;
    };
    install_tenant_crd(&client).await;
    let ports = services(&client, &ns, &["chat", "code", "secure"]).await;
    let (chat_port, code_port, secure_port) = (ports[0], ports[1], ports[2]);
    let _chat = server("127.0.0.1", chat_port, "chat");
    let _code = server("127.0.0.1", code_port, "code");
    // A server whose own key is team B's: if the router passed tenants' keys on, it would
    // accept team B's requests.
    let _secure = server_with(
        "127.0.0.1",
        secure_port,
        "secure",
        &["--api-key", "sk-team-b"],
    );
    for name in ["chat", "code", "secure"] {
        ready_pod(&client, &ns, name, &format!("{name}-0"), "127.0.0.1").await;
    }
    tenant(
        &client,
        "team-a",
        InferenceTenantSpec {
            models: vec!["chat".into()],
            limits: TenantLimits {
                requests_per_minute: Some(5),
                ..Default::default()
            },
            ..Default::default()
        },
    )
    .await;
    tenant(
        &client,
        "team-b",
        InferenceTenantSpec {
            namespaces: vec![ns.clone()],
            limits: TenantLimits {
                tokens_per_minute: Some(300),
                ..Default::default()
            },
            ..Default::default()
        },
    )
    .await;
    tenant(
        &client,
        "team-d",
        InferenceTenantSpec {
            models: vec!["chat".into()],
            limits: TenantLimits {
                concurrent_requests: Some(1),
                tokens_per_minute: Some(100_000),
                ..Default::default()
            },
            ..Default::default()
        },
    )
    .await;
    keys(&client, &ns, "team-d-keys", "team-d", "sk-team-d").await;
    keys(&client, &ns, "team-a-keys", "team-a", "sk-team-a").await;
    keys(&client, &ns, "team-b-keys", "team-b", "sk-team-b").await;
    let mut config = config();
    config.tenants = Some(ns.clone());
    let base = router_with(&client, &ns, config, false).await;
    // Each tenant sees only its own models; without a key, nothing.
    assert_eq!(
        listed_once_ready(&base, "sk-team-a", "chat").await,
        ["chat"]
    );
    let all = listed_once_ready(&base, "sk-team-b", "chat").await;
    assert_eq!(all, ["chat", "code", "secure"]);
    assert_eq!(models(&base, None).await.0, 401);
    let url = format!("{base}/v1/completions");

    // No key, a wrong key: 401 in OpenAI's shape.
    for key in [None, Some("sk-wrong"), Some("sk-team")] {
        let (status, body, _) = call(url.clone(), key, completion("chat", 2)).await;
        assert_eq!(status, 401, "{key:?}: {body}");
        assert_eq!(body["error"]["type"], "authentication_error", "{body}");
    }
    // Team A may use `chat` only.
    let (status, body, _) = call(url.clone(), Some("sk-team-a"), completion("code", 2)).await;
    assert_eq!(
        (status, &body["error"]["param"]),
        (403, &json!("model")),
        "{body}"
    );
    // Five requests a minute: the sixth is refused, with when to retry.
    for i in 0..5 {
        let (status, body, h) = call(url.clone(), Some("sk-team-a"), completion("chat", 2)).await;
        assert_eq!(status, 200, "request {i}: {body}");
        assert_eq!(h["x-ratelimit-limit-requests"], "5");
        assert_eq!(h["x-ratelimit-remaining-requests"], (4 - i).to_string());
    }
    let (status, body, h) = call(url.clone(), Some("sk-team-a"), completion("chat", 2)).await;
    assert_eq!(status, 429, "{body}");
    assert_eq!(body["error"]["type"], "rate_limit_error", "{body}");
    let retry: u64 = h["retry-after"].parse().expect("Retry-After");
    assert!((1..=12).contains(&retry), "Retry-After {retry}");
    assert_eq!(h["x-ratelimit-remaining-requests"], "0");

    // Team B: 300 tokens a minute. A request that may take more than that is never admitted.
    let (status, body, h) = call(url.clone(), Some("sk-team-b"), completion("code", 400)).await;
    assert_eq!(status, 429, "{body}");
    assert!(!h.contains_key("retry-after"), "{h:?}");
    // Requests of up to 6 + 40 tokens until refused: what they used, as the servers report it,
    // stays within the minute's 300 plus what refilled meanwhile, and the router charged
    // exactly that.
    let started = Instant::now();
    let mut used = 0.0;
    let mut admitted = 0;
    loop {
        let (status, body, _) = call(url.clone(), Some("sk-team-b"), completion("code", 40)).await;
        if status == 429 {
            break;
        }
        assert_eq!(status, 200, "{body}");
        used += body["usage"]["total_tokens"].as_f64().expect("usage");
        admitted += 1;
        assert!(admitted < 40, "never throttled");
    }
    let refilled = started.elapsed().as_secs_f64() * 300.0 / 60.0;
    assert!(admitted >= 5, "only {admitted} admitted");
    assert!(
        used <= 300.0 + refilled,
        "{used} tokens used in {:?}",
        started.elapsed()
    );
    // The 400-token refusal charged nothing; each admitted request its usage (settled as its
    // response ends on the router's side, which may be just after the client read it).
    let text = eventually(WAIT, "every request settled to its usage", async || {
        let text = get_text(format!("{base}/metrics")).await;
        let charged = metric_sum(
            &text,
            "ferrite_router_tenant_tokens_total",
            &[("tenant", "team-b")],
        );
        (charged == used).then_some(text)
    })
    .await;
    assert_eq!(
        metric_sum(
            &text,
            "ferrite_router_tenant_requests_total",
            &[("tenant", "team-a"), ("outcome", "throttled_requests")]
        ),
        1.0
    );
    assert_eq!(
        metric_sum(&text, "ferrite_router_unauthorized_requests_total", &[]),
        4.0
    );

    // The tenant's key stays at the router: the pod that would accept it never sees it.
    // (Team B's minute is spent just above: its bucket refills first.)
    let (status, body) = eventually(WAIT, "team B admitted again", async || {
        let (status, body, _) = call(url.clone(), Some("sk-team-b"), completion("secure", 1)).await;
        (status != 429).then_some((status, body))
    })
    .await;
    assert_eq!(status, 401, "{body}");

    // Team D: one request open at once, and a stream settled to the usage it reports.
    let long = json!({"model": "chat", "prompt": "Count:", "max_tokens": 120, "temperature": 0,
                      "ignore_eos": true, "stream": true,
                      "stream_options": {"include_usage": true}});
    let stream_url = url.clone();
    let streaming = tokio::task::spawn_blocking(move || {
        let r = post_when_admitted(&stream_url, "sk-team-d", &long);
        r.into_string().expect("the stream's text")
    });
    let tokens_d = || async {
        let text = get_text(format!("{base}/metrics")).await;
        metric_sum(
            &text,
            "ferrite_router_tenant_tokens_total",
            &[("tenant", "team-d")],
        )
    };
    eventually(
        WAIT,
        "a second request refused while the stream runs",
        async || {
            let (status, body, _) =
                call(url.clone(), Some("sk-team-d"), completion("chat", 1)).await;
            match status {
                429 => {
                    assert_eq!(body["error"]["type"], "rate_limit_error", "{body}");
                    Some(())
                }
                // The stream had not started yet.
                _ => None,
            }
        },
    )
    .await;
    let text = streaming.await.expect("the stream thread");
    let usage: Value = text
        .lines()
        .rev()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .find_map(|v| v.get("usage").filter(|u| !u.is_null()).cloned())
        .expect("the usage chunk");
    let streamed = usage["total_tokens"].as_f64().expect("total_tokens");
    // Charged what the stream used (and the single-token requests that passed meanwhile).
    // The router settles a response as it ends on its side, which may be just after the
    // client has read it.
    let before = eventually(WAIT, "the stream settled", async || {
        let t = tokens_d().await;
        (t >= streamed).then_some(t)
    })
    .await;
    let body = eventually(WAIT, "the stream's slot given back", async || {
        let (status, body, _) = call(url.clone(), Some("sk-team-d"), completion("chat", 1)).await;
        (status == 200).then_some(body)
    })
    .await;
    let one = body["usage"]["total_tokens"].as_f64().expect("usage");
    eventually(WAIT, "the request charged its usage", async || {
        (tokens_d().await == before + one).then_some(())
    })
    .await;
    let text = get_text(format!("{base}/metrics")).await;
    assert!(
        metric_sum(
            &text,
            "ferrite_router_tenant_requests_total",
            &[("tenant", "team-d"), ("outcome", "throttled_concurrent")]
        ) >= 1.0
    );

    // A client that leaves a stream early is charged what it was sent, not the estimate
    // (6 + 400 tokens).
    let before = tokens_d().await;
    let leave_url = url.clone();
    tokio::task::spawn_blocking(move || {
        use std::io::BufRead;
        let body = json!({"model": "chat", "prompt": "Count:", "max_tokens": 400,
                          "temperature": 0, "ignore_eos": true, "stream": true});
        let r = post_when_admitted(&leave_url, "sk-team-d", &body);
        let mut lines = std::io::BufReader::new(r.into_reader()).lines();
        let mut events = 0;
        while events < 3 {
            let line = lines.next().expect("a line").expect("readable");
            events += usize::from(line.starts_with("data:"));
        }
        // Dropped here: the connection closes.
    })
    .await
    .expect("the stream thread");
    let charged = eventually(WAIT, "the left stream settled", async || {
        let now = tokens_d().await;
        (now > before).then_some(now - before)
    })
    .await;
    assert!(
        charged < 200.0,
        "charged {charged} for a stream left after 3 events"
    );

    // A deleted key Secret takes the key away at once.
    Api::<Secret>::namespaced(client.clone(), &ns)
        .delete("team-a-keys", &DeleteParams::default())
        .await
        .expect("deleting the Secret");
    eventually(WAIT, "the deleted key refused", async || {
        let (status, _, _) = call(url.clone(), Some("sk-team-a"), completion("chat", 1)).await;
        (status == 401).then_some(())
    })
    .await;
}

/// Two router replicas, as the chart runs them: stand-in pods `router-0` and `router-1` at
/// 127.0.0.3 and .4, each replica listening there (the others read its tenants' rates at
/// that address) and knowing its pod name. Returns their base URLs.
async fn two_routers(client: &kube::Client, ns: &str) -> [String; 2] {
    let labels = json!({"app.kubernetes.io/name": "ferrite-router"});
    let port = ferrite_testkit::process::free_port();
    let mut bases = Vec::new();
    for (pod, ip) in [("router-0", "127.0.0.3"), ("router-1", "127.0.0.4")] {
        ferrite_testkit::kube::standin::ready_pod_labelled(client, ns, pod, ip, labels.clone())
            .await;
        let mut config = config();
        config.tenants = Some(ns.to_string());
        config.peers = Some(ferrite_router::PeerConfig {
            selector: "app.kubernetes.io/name=ferrite-router".into(),
            pod_name: Some(pod.into()),
            port,
        });
        bases.push(router_bound(client, Some(ns), config, false, &format!("{ip}:{port}")).await);
    }
    // Until a replica's pod watch shows the other, it splits the limits with no one (on a
    // loaded machine, for seconds): the tests start from the state the chart runs in.
    for base in &bases {
        eventually(WAIT, "each router replica counting both", async || {
            let text = get_text(format!("{base}/metrics")).await;
            let counts = |state: &str| {
                metric_sum(&text, "ferrite_router_peer_replicas", &[("state", state)])
            };
            (counts("ready") == 2.0 && counts("heard") == 1.0).then_some(())
        })
        .await;
    }
    [bases[0].clone(), bases[1].clone()]
}

/// A tenant with `requests_per_minute` on the chat model, and its key `key`.
async fn limited_tenant(client: &kube::Client, ns: &str, name: &str, key: &str, rpm: i64) {
    tenant(
        client,
        name,
        InferenceTenantSpec {
            models: vec!["chat".into()],
            limits: TenantLimits {
                requests_per_minute: Some(rpm),
                ..Default::default()
            },
            ..Default::default()
        },
    )
    .await;
    keys(client, ns, &format!("{name}-keys"), name, key).await;
}

/// Two router replicas share a tenant's limits with no store between them: each enforces a
/// share (half, while the tenant's requests alternate between them), so together they admit
/// the tenant's minute, within the refill while the test runs and the rounding of shares
/// that move as the replicas read each other's rates.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_router_replicas_together_admit_one_minute_of_a_tenant() {
    let Some((_cluster, client, ns, port)) = tenant_chat_service("tenants-two").await else {
        return;
    };
    let _chat = server("127.0.0.1", port, "chat");
    ready_pod(&client, &ns, "chat", "chat-0", "127.0.0.1").await;
    limited_tenant(&client, &ns, "team-c", "sk-team-c", 10).await;
    let [a, b] = two_routers(&client, &ns).await;
    for base in [&a, &b] {
        listed_once_ready(base, "sk-team-c", "chat").await;
    }
    let started = Instant::now();
    let mut admitted = [0u32; 2];
    for i in 0..30 {
        let base = if i % 2 == 0 { &a } else { &b };
        let (status, body, h) = call(
            format!("{base}/v1/completions"),
            Some("sk-team-c"),
            completion("chat", 1),
        )
        .await;
        match status {
            200 => {
                admitted[i % 2] += 1;
                // Each replica's own share of the minute, about half.
                let limit: u32 = h["x-ratelimit-limit-requests"].parse().expect("a number");
                assert!((4..=6).contains(&limit), "{h:?}");
            }
            429 => {}
            other => panic!("{other}: {body}"),
        }
    }
    // 10 a minute: what refilled while the test ran may add one per replica.
    let refill = (started.elapsed().as_secs_f64() * 10.0 / 60.0).ceil() as u32;
    let total = admitted[0] + admitted[1];
    eprintln!("admitted {admitted:?} in {:?}", started.elapsed());
    assert!(
        (9..=10 + refill).contains(&total),
        "admitted {admitted:?} in {:?}",
        started.elapsed()
    );
    assert!(admitted.iter().all(|&n| n >= 4), "{admitted:?}");
    // Then the tenant's traffic moves, all to one replica for 4 s, then all to the other: the
    // shares follow it, and together the replicas still admit no more than the minute and its
    // refill.
    for base in [&a, &b] {
        for _ in 0..40 {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let (status, body, _) = call(
                format!("{base}/v1/completions"),
                Some("sk-team-c"),
                completion("chat", 1),
            )
            .await;
            match status {
                200 => admitted[usize::from(base == &b)] += 1,
                429 => {}
                other => panic!("{other}: {body}"),
            }
        }
    }
    let refill = (started.elapsed().as_secs_f64() * 10.0 / 60.0).ceil() as u32;
    let total = admitted[0] + admitted[1];
    eprintln!(
        "with the traffic moved: admitted {admitted:?} in {:?}",
        started.elapsed()
    );
    assert!(
        total <= 10 + refill,
        "admitted {admitted:?} in {:?}",
        started.elapsed()
    );
}

/// A tenant whose requests all reach one replica (one keep-alive connection through a
/// Service) gets most of its limits there, not half: each replica's share follows the
/// tenant's traffic it sees, read from the other every second. When the tenant moves to the
/// other replica, its share moves with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_share_follows_its_traffic_between_router_replicas() {
    let Some((_cluster, client, ns, port)) = tenant_chat_service("tenants-follow").await else {
        return;
    };
    let _chat = server("127.0.0.1", port, "chat");
    ready_pod(&client, &ns, "chat", "chat-0", "127.0.0.1").await;
    limited_tenant(&client, &ns, "team-d", "sk-team-d", 600).await;
    let [a, b] = two_routers(&client, &ns).await;
    for base in [&a, &b] {
        listed_once_ready(base, "sk-team-d", "chat").await;
    }
    // The replica's share of 600 a minute, as its response says.
    let limit_at = async |base: &str| -> u32 {
        let (status, body, h) = call(
            format!("{base}/v1/completions"),
            Some("sk-team-d"),
            completion("chat", 1),
        )
        .await;
        assert!(status == 200 || status == 429, "{status}: {body}");
        h["x-ratelimit-limit-requests"].parse().expect("a number")
    };
    let first = limit_at(&a).await;
    assert_eq!(first, 300, "no rates yet: the even split");
    for (name, base) in [("the first", &a), ("the second", &b)] {
        let started = Instant::now();
        let limit = eventually(Duration::from_secs(30), "the share to follow", async || {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let limit = limit_at(base).await;
            (limit >= 510).then_some(limit)
        })
        .await;
        eprintln!(
            "{name} replica's share of 600/min: {limit} after {:?}",
            started.elapsed()
        );
    }
    // The replica left behind keeps its floor, and a share that fell with its traffic.
    let left = limit_at(&a).await;
    assert!((30..300).contains(&left), "{left}");
}

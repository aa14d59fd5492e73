//! ferrite-router on a real API server: routing by model, scale from zero, and retries (the
//! harness is in `common.rs`).

use std::time::{Duration, Instant};

use super::common::*;
use ferrite_testkit::process::{eventually, free_port};
use serde_json::{Value, json};

fn completion(model: &str) -> Value {
    json!({"model": model, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0})
}

/// Service `chat`'s pods `chat-0` at 127.0.0.1 and `chat-1` at 127.0.0.2 marked Ready, and a
/// router that lists both; returns the router's base URL.
async fn router_over_two_replicas(client: &kube::Client, ns: &str) -> String {
    ready_pod(client, ns, "chat", "chat-0", "127.0.0.1").await;
    ready_pod(client, ns, "chat", "chat-1", "127.0.0.2").await;
    let base = router(client, ns).await;
    wait_ready_replicas(&base, "chat", 2).await;
    base
}

/// Two InferenceServices behind one endpoint: each model reaches its own server (completions,
/// chat, embeddings, the tokenizer and other paths), unknown models get OpenAI's 404, adapter
/// management is refused, and `/v1/models` lists both with their ready replicas.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routes_by_model_across_two_inference_services() {
    let Some((_cluster, client, ns)) = cluster_with_crd("router").await else {
        return;
    };
    let (chat_port, code_port) = (free_port(), free_port());
    create_isvc(
        &client,
        &ns,
        "chat",
        json!({"model": {"source": "/models/smol.gguf", "servedName": "chat-model",
                         "aliases": ["assistant"]},
        "runtime": {"port": chat_port}}),
    )
    .await;
    create_isvc(
        &client,
        &ns,
        "code",
        json!({"model": {"source": "/models/smol.gguf"},
        "runtime": {"port": code_port}, "routing": {"policy": "least-load"}}),
    )
    .await;
    let _chat = server("127.0.0.1", chat_port, "chat-model");
    let _code = server("127.0.0.1", code_port, "code");
    ready_pod(&client, &ns, "chat", "chat-0", "127.0.0.1").await;
    ready_pod(&client, &ns, "code", "code-0", "127.0.0.1").await;
    let base = router(&client, &ns).await;

    let listed = eventually(WAIT, "both models ready in /v1/models", async || {
        let v = get(format!("{base}/v1/models")).await;
        let ready = v["data"]
            .as_array()?
            .iter()
            .filter(|m| m["ready_replicas"] == 1)
            .count();
        (ready == 2).then_some(v)
    })
    .await;
    let ids: Vec<&str> = listed["data"]
        .as_array()
        .expect("data")
        .iter()
        .filter_map(|m| m["id"].as_str())
        .collect();
    assert_eq!(ids, ["chat-model", "code", "assistant"], "{listed}");
    assert_eq!(listed["data"][0]["state"], "ready");

    for model in ["chat-model", "code"] {
        let (status, body, _) = post(format!("{base}/v1/completions"), completion(model)).await;
        assert_eq!(status, 200, "{model}: {body}");
        // Each server names the model it serves: the answer came from the right one.
        assert_eq!(body["model"], model, "{body}");
        assert!(body["choices"][0]["text"].is_string(), "{body}");
    }
    let chat = json!({"model": "chat-model", "max_tokens": 4, "temperature": 0,
        "messages": [{"role": "user", "content": "Say hi"}]});
    let (status, body, _) = post(format!("{base}/v1/chat/completions"), chat).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["object"], "chat.completion");

    // An alias reaches its service, under the served name the server knows.
    let (status, body, _) = post(format!("{base}/v1/completions"), completion("assistant")).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["model"], "chat-model", "{body}");
    let aliases: Vec<Value> = listed["data"]
        .as_array()
        .expect("data")
        .iter()
        .filter(|m| m["id"] == "assistant")
        .cloned()
        .collect();
    assert_eq!(aliases.len(), 1, "{listed}");
    assert_eq!(aliases[0]["root"], "chat-model");

    // Embeddings, the tokenizer and any other POST that names a model reach its server.
    let embed = json!({"model": "chat-model", "input": ["a cat", "a dog"],
        "encoding_format": "float"});
    let (status, body, _) = post(format!("{base}/v1/embeddings"), embed).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["model"], "chat-model", "{body}");
    assert_eq!(body["data"].as_array().map(Vec::len), Some(2), "{body}");
    assert_eq!(
        body["data"][1]["embedding"].as_array().map(Vec::len),
        Some(576)
    );
    let tokenize = json!({"model": "code", "prompt": "Hello world"});
    let (status, body, _) = post(format!("{base}/tokenize"), tokenize).await;
    assert_eq!(status, 200, "{body}");
    assert!(body["count"].as_u64().is_some_and(|n| n > 0), "{body}");
    // A path ferrite-server does not serve: the router forwards it (without a model it is the
    // router's 400) and the server's 404 comes back.
    let rerank = json!({"model": "code", "query": "q", "documents": ["d"]});
    let (status, body, _) = post(format!("{base}/v1/rerank"), rerank).await;
    assert_eq!(status, 404, "{body}");
    let (status, body, _) = post(format!("{base}/v1/rerank"), json!({"query": "q"})).await;
    assert_eq!(
        (status, &body["error"]["param"]),
        (400, &json!("model")),
        "{body}"
    );
    // A replica's adapter management is not the clients'.
    let load = json!({"model": "code", "lora_name": "x", "lora_path": "/etc"});
    let (status, body, _) = post(format!("{base}/v1/load_lora_adapter"), load).await;
    assert_eq!(status, 403, "{body}");

    let (status, body, _) = post(format!("{base}/v1/completions"), completion("nope")).await;
    assert_eq!(status, 404);
    assert_eq!(body["error"]["type"], "invalid_request_error", "{body}");
    assert_eq!(body["error"]["param"], "model");
    let (status, body, _) = post(format!("{base}/v1/completions"), json!({"prompt": "x"})).await;
    assert_eq!(status, 400, "{body}");
}

/// LoRA adapters behind the router: an adapter's requests reach the service that declares
/// it (only that service's server has it loaded, so a 200 shows where it went), `/v1/models`
/// lists each with its parent model, and a name two services declare belongs to the older
/// (then the first by name), as served names do.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adapters_route_to_the_service_that_declares_them() {
    let Some((_cluster, client, ns)) = cluster_with_crd("router-lora").await else {
        return;
    };
    let (a_port, b_port) = (free_port(), free_port());
    let dirs: Vec<String> = [1, 2]
        .map(|seed| {
            ferrite_testkit::model::lora_adapter_dir(seed)
                .display()
                .to_string()
        })
        .to_vec();
    let (sql, legal) = (
        format!("{}/peft", dirs[0]),
        format!("{}/adapter.gguf", dirs[1]),
    );
    create_isvc(
        &client,
        &ns,
        "base-a",
        json!({"model": {"source": "/models/smol.gguf", "servedName": "model-a",
            "adapters": [{"name": "sql", "source": sql}, {"name": "shared", "source": sql}]},
        "runtime": {"port": a_port}}),
    )
    .await;
    create_isvc(
        &client,
        &ns,
        "base-b",
        json!({"model": {"source": "/models/smol.gguf", "servedName": "model-b",
            "adapters": [{"name": "legal", "source": legal}, {"name": "shared", "source": legal},
                         // Another tenant's served name: it stays that service's.
                         {"name": "model-a", "source": legal}]},
        "runtime": {"port": b_port}}),
    )
    .await;
    let modules = |a: &str, path: &str| [format!("{a}={path}"), format!("shared={path}")];
    let (ma, mb) = (modules("sql", &sql), modules("legal", &legal));
    let _a = server_with(
        "127.0.0.1",
        a_port,
        "model-a",
        &["--lora-modules", &ma[0], &ma[1]],
    );
    let _b = server_with(
        "127.0.0.1",
        b_port,
        "model-b",
        &["--lora-modules", &mb[0], &mb[1]],
    );
    ready_pod(&client, &ns, "base-a", "base-a-0", "127.0.0.1").await;
    ready_pod(&client, &ns, "base-b", "base-b-0", "127.0.0.1").await;
    let base = router(&client, &ns).await;

    let listed = eventually(WAIT, "the models and adapters in /v1/models", async || {
        let v = get(format!("{base}/v1/models")).await;
        let entries: Vec<(String, String, String)> = v["data"]
            .as_array()?
            .iter()
            .map(|m| {
                let s = |k: &str| m[k].as_str().unwrap_or_default().to_string();
                (s("id"), s("parent"), s("owned_by"))
            })
            .collect();
        (entries.len() == 5).then_some(entries)
    })
    .await;
    let (a, b) = (format!("{ns}/base-a"), format!("{ns}/base-b"));
    let e = |id: &str, parent: &str, owner: &str| {
        (id.to_string(), parent.to_string(), owner.to_string())
    };
    assert_eq!(
        listed,
        [
            e("model-a", "", &a),
            e("model-b", "", &b),
            e("sql", "model-a", &a),
            e("shared", "model-a", &a),
            e("legal", "model-b", &b),
        ]
    );
    // model-a reaches base-a's server (base-b's has no adapter of that name, so it would
    // refuse the request).
    for adapter in ["sql", "legal", "shared", "model-a"] {
        let (status, body, _) = post(format!("{base}/v1/completions"), completion(adapter)).await;
        assert_eq!(status, 200, "{adapter}: {body}");
        assert_eq!(body["model"], adapter, "{body}");
    }
    let (status, body, _) =
        post(format!("{base}/v1/completions"), completion("unknown-lora")).await;
    assert_eq!(status, 404, "{body}");
}

/// A request for a service scaled to zero is held, the router scales it up through the scale
/// subresource, and once a pod turns Ready the request succeeds; with a short cold-start
/// timeout and nothing starting, the client gets 503 with Retry-After.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn holds_requests_while_scaling_from_zero() {
    let Some((_cluster, client, ns, port)) = chat_service("cold", json!({"replicas": 0})).await
    else {
        return;
    };
    create_isvc(
        &client,
        &ns,
        "idle",
        json!({"model": {"source": "/models/smol.gguf"},
        "replicas": 0, "routing": {"coldStartTimeoutSeconds": 2}}),
    )
    .await;
    let base = router(&client, &ns).await;

    let held = tokio::spawn(post(format!("{base}/v1/completions"), completion("chat")));
    // The router wakes the service: spec.replicas goes 0 -> 1 through /scale.
    eventually(WAIT, "the router to scale chat from zero", async || {
        let o = isvc_api(&client, &ns).get("chat").await.ok()?;
        (o.data["spec"]["replicas"] == 1).then_some(())
    })
    .await;
    let metrics = get_text(format!("{base}/metrics")).await;
    assert!(
        metrics.contains("ferrite_router_held_requests{inferenceservice=\"chat\""),
        "{metrics}"
    );
    assert!(!held.is_finished(), "the request is held, not refused");
    // The pod starts (here: the server, then the pod's Ready condition).
    let _server = server("127.0.0.1", port, "chat");
    ready_pod(&client, &ns, "chat", "chat-0", "127.0.0.1").await;
    let (status, body, _) = held.await.expect("held request");
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["model"], "chat");

    let started = Instant::now();
    let (status, body, retry) = post(format!("{base}/v1/completions"), completion("idle")).await;
    assert_eq!(status, 503, "{body}");
    assert!(
        started.elapsed() >= Duration::from_secs(2),
        "held for the timeout first"
    );
    assert!(retry.is_some(), "Retry-After is set");
    assert_eq!(body["error"]["type"], "service_unavailable", "{body}");
}

/// A replica that refuses connections (its pod still listed Ready, as in the seconds before
/// the kubelet notices a crash) costs one retry on the other replica, not a failed request,
/// and then sits out instead of drawing every other first attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_replica_is_retried_on_another() {
    let Some((_cluster, client, ns, port)) = chat_service(
        "retry",
        json!({"replicas": 2, "routing": {"policy": "round-robin"}}),
    )
    .await
    else {
        return;
    };
    let _server = server("127.0.0.1", port, "chat");
    // Nothing listens on 127.0.0.2 at this port.
    let base = router_over_two_replicas(&client, &ns).await;
    for _ in 0..4 {
        let (status, body, _) = post(format!("{base}/v1/completions"), completion("chat")).await;
        assert_eq!(status, 200, "{body}");
    }
    // Round robin sends the second request to the dead replica; once refused, it sits out
    // (load::SET_ASIDE, until a scrape reaches it), so the others go straight to the live one.
    let metrics = get_text(format!("{base}/metrics")).await;
    let retries = metric_sum(
        &metrics,
        "ferrite_router_retries_total",
        &[("reason", "connect")],
    );
    assert_eq!(
        retries, 1.0,
        "one retry, then the dead replica sat out: {metrics}"
    );
}

/// A replica that does not have an adapter yet (it started before the adapter was declared,
/// and the operator's adapter sync has not reached it) refuses the adapter's requests: the
/// router tries another replica instead of passing the refusal on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adapter_missing_on_one_replica_is_served_by_another() {
    let peft = format!(
        "{}/peft",
        ferrite_testkit::model::lora_adapter_dir(1).display()
    );
    let Some((_cluster, client, ns, port)) = chat_service(
        "lora-retry",
        json!({"replicas": 2, "routing": {"policy": "round-robin"},
               "model": {"source": "/models/smol.gguf",
                         "adapters": [{"name": "sql", "source": peft}]}}),
    )
    .await
    else {
        return;
    };
    let module = format!("sql={peft}");
    let _with = server_with("127.0.0.1", port, "chat", &["--lora-modules", &module]);
    let _without = server("127.0.0.2", port, "chat");
    let base = router_over_two_replicas(&client, &ns).await;
    let adapter_retries = async || {
        let metrics = get_text(format!("{base}/metrics")).await;
        let labels = [("reason", "adapter_not_loaded")];
        metric_sum(&metrics, "ferrite_router_retries_total", &labels)
    };
    // A client's bad request for the adapter gets the refusal of the replica that has it
    // (400 for its parameter), never the other's refusal of the model: that one is retried.
    for _ in 0..2 {
        let mut bad = completion("sql");
        bad["temperature"] = json!(3);
        let (status, body, _) = post(format!("{base}/v1/completions"), bad).await;
        assert_eq!(status, 400, "{body}");
        assert_eq!(body["error"]["param"], "temperature", "{body}");
    }
    for _ in 0..4 {
        let (status, body, _) = post(format!("{base}/v1/completions"), completion("sql")).await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(body["model"], "sql", "{body}");
    }
    // The replica without the adapter refused it once, on whichever request reached it first
    // (round robin sends it one of the first two); once refused, it sits out that adapter's
    // requests (--set-aside-ms), and the other replica's refusals of a parameter set nothing
    // aside and are not retried.
    assert_eq!(
        adapter_retries().await,
        1.0,
        "one refusal retried, then it sat out"
    );
    // It sits out only that adapter: the base model's requests still reach it.
    let without = format!("http://127.0.0.2:{port}");
    let before = finished(&without).await;
    for _ in 0..2 {
        let (status, body, _) = post(format!("{base}/v1/completions"), completion("chat")).await;
        assert_eq!(status, 200, "{body}");
    }
    let after = finished(&without).await;
    assert_eq!(after - before, 1.0, "round robin gave it one of two");
    // A model no service declares is the router's own 404.
    let (status, body, _) =
        post(format!("{base}/v1/completions"), completion("unknown-lora")).await;
    assert_eq!(status, 404, "{body}");
}

//! A model name two InferenceServices of one namespace share by weight (`spec.routing.weight`):
//! a 20% canary gets its share of 500 requests within 8 percentage points, each prompt
//! prefix always reaches one service, `x-ferrite-service` pins a request, a pin outside the
//! split is refused, and a weight edited live takes effect.

use super::common::*;
use ferrite_testkit::process::{eventually, free_port};
use futures::StreamExt;
use kube::api::{Patch, PatchParams};
use serde_json::{Value, json};

fn completion(prompt: &str) -> Value {
    json!({"model": "chat", "prompt": prompt, "max_tokens": 1, "temperature": 0})
}

/// POSTs a completion through the router with `headers`: the status.
async fn send(url: &str, prompt: &str, headers: &[(&str, String)]) -> u16 {
    post_with(url, headers, completion(prompt)).await.0
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_canary_takes_its_weight_sticky_by_prefix_pinned_by_header_and_edited_live() {
    let Some((_cluster, client, ns)) = cluster_with_crd("splits").await else {
        return;
    };
    let (stable_port, canary_port) = (free_port(), free_port());
    for (name, port, weight) in [("stable", stable_port, 80), ("canary", canary_port, 20)] {
        create_isvc(
            &client,
            &ns,
            name,
            json!({"model": {"source": "/models/smol.gguf", "servedName": "chat"},
                   "runtime": {"port": port}, "routing": {"weight": weight}}),
        )
        .await;
        // The canary is the younger claimant.
        tokio::time::sleep(std::time::Duration::from_millis(1100)).await;
    }
    let _stable = server("127.0.0.1", stable_port, "chat");
    let _canary = server("127.0.0.1", canary_port, "chat");
    ready_pod(&client, &ns, "stable", "stable-0", "127.0.0.1").await;
    ready_pod(&client, &ns, "canary", "canary-0", "127.0.0.1").await;
    let base = router(&client, &ns).await;
    wait_ready_replicas(&base, "chat", 1).await;
    let url = format!("{base}/v1/completions");
    let stable_base = format!("http://127.0.0.1:{stable_port}");
    let canary_base = format!("http://127.0.0.1:{canary_port}");
    let counts = async || (finished(&stable_base).await, finished(&canary_base).await);

    // 500 different prompts: the canary's share within 8 points of 20% (about 100 ± 9 of them,
    // so ±4 standard deviations of a fair draw: as strict as 5% of 2,000 within 2 points, at a
    // quarter of the requests). Eight at a time (which service a prompt draws does not depend
    // on what else is open).
    const N: usize = 500;
    let before = counts().await;
    let statuses: Vec<(usize, u16)> = futures::stream::iter(0..N)
        .map(|i| {
            let url = &url;
            async move {
                let prompt = format!("Request {i}: the capital of France is");
                (i, send(url, &prompt, &[]).await)
            }
        })
        .buffer_unordered(8)
        .collect()
        .await;
    for (i, status) in statuses {
        assert_eq!(status, 200, "request {i}");
    }
    let after = counts().await;
    let (stable, canary) = (after.0 - before.0, after.1 - before.1);
    assert_eq!(stable + canary, N as f64);
    let share = canary / N as f64;
    println!("the canary (weight 20 of 100) took {canary} of {N} requests: {share}");
    assert!((share - 0.2).abs() <= 0.08, "the canary took {share}");
    let text = get_text(format!("{base}/metrics")).await;
    let split = |svc: &str| {
        metric_sum(
            &text,
            "ferrite_router_split_requests_total",
            &[("inferenceservice", svc)],
        )
    };
    assert_eq!(split(&format!("{ns}/canary")), canary, "{text}");
    assert_eq!(split(&format!("{ns}/stable")), stable, "{text}");

    // One prompt prefix, one service, every time.
    let before = counts().await;
    for _ in 0..20 {
        assert_eq!(
            send(&url, "Request 7: the capital of France is", &[]).await,
            200
        );
    }
    let after = counts().await;
    let moved = (after.0 - before.0, after.1 - before.1);
    assert!(moved == (20.0, 0.0) || moved == (0.0, 20.0), "{moved:?}");

    // Pinned to the canary; a pin outside the split is refused.
    let pin = [("x-ferrite-service", format!("{ns}/canary"))];
    let before = counts().await;
    for i in 0..10 {
        assert_eq!(send(&url, &format!("Pinned {i}"), &pin).await, 200);
    }
    assert_eq!(counts().await.1 - before.1, 10.0);
    let stranger = [("x-ferrite-service", "other/svc".to_string())];
    assert_eq!(send(&url, "Pinned", &stranger).await, 400);

    // The canary's weight set to 0 live: it takes nothing more.
    isvc_api(&client, &ns)
        .patch(
            "canary",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"routing": {"weight": 0}}})),
        )
        .await
        .expect("patching the weight");
    eventually(WAIT, "the router to see the new weight", async || {
        let before = counts().await;
        for i in 0..40 {
            assert_eq!(send(&url, &format!("After {i}"), &[]).await, 200);
        }
        (counts().await.1 == before.1).then_some(())
    })
    .await;
}

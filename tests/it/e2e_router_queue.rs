//! The router's queue as an autoscaling signal, on a real API server: the chart installed, the
//! real `ferrite-router` and `ferrite-operator` binaries run as the chart renders them (the
//! operator with `--router-pods`), a stand-in router pod Ready where the router listens, and a
//! real ferrite-server (2 sequences at once) behind the InferenceService's stand-in pod.
//!
//! Under load the router's flow control keeps the server's own queue at its threshold (5) and
//! holds the rest; the server's queue alone is under the service's target (8 per replica), so
//! only counting the router's queue scales the service: the operator does, and its status shows
//! the waiting requests the routers hold.

use std::time::Duration;

use ferrite_testkit::chart::{NAMESPACE, router_deployment};
use ferrite_testkit::e2e::{Operator, Router, get_isvc, install, isvc, pods_ready};
use ferrite_testkit::kube::Cluster;
use ferrite_testkit::kube::standin::ready_pod_labelled;
use ferrite_testkit::process::eventually;
use ferrite_testkit::server::{Load, ready_server};
use serde_json::json;

const WAIT: Duration = Duration::from_secs(90);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_operator_scales_on_the_requests_the_router_holds() {
    let Some(cluster) = Cluster::start().await else {
        return;
    };
    let client = cluster.client().await;
    let ns = cluster.namespace("rq").await;
    let values =
        json!({"router": {"endpointsFrom": "pods", "extraArgs": ["--scrape-interval-ms=200"]}});
    let release = install(&cluster, &values, "rq").await;
    let mut router = Router::launch(&cluster, &release).await;
    let port = router.base.rsplit(':').next().expect("a port").to_string();
    // The router's pod, as its Deployment labels it, Ready where the router listens.
    let labels = router_deployment(&release.docs)["spec"]["selector"]["matchLabels"].clone();
    ready_pod_labelled(&client, NAMESPACE, "router-0", "127.0.0.1", labels).await;
    let _operator = Operator::launch(
        &cluster,
        &release,
        "op-0",
        &[&format!("--router-port={port}")],
    )
    .await;
    let (server, server_port) = ready_server().await;
    ferrite_testkit::e2e::create(
        &client,
        &isvc(
            &ns,
            "smol",
            json!({"model": {"source": "/models/smol.gguf"}, "runtime": {"port": server_port},
                   "autoscaling": {"minReplicas": 1, "maxReplicas": 3,
                                   "targets": {"queuePerReplica": 8.0},
                                   "scrapeIntervalSeconds": 1}}),
        ),
    )
    .await;
    eventually(WAIT, "the server's pod Ready", async || {
        (pods_ready(&client, &ns, "smol", "127.0.0.1").await >= 1).then_some(())
    })
    .await;
    let base = router.base.clone();
    eventually(WAIT, "the router to route smol", async || {
        let (status, _, _) = ferrite_testkit::server::post_json(
            format!("{base}/v1/completions"),
            json!({"model": "smol", "prompt": "hi", "max_tokens": 1}),
        )
        .await;
        (status == 200).then_some(())
    })
    .await;

    // Three clients: the server runs two and queues one, and the router learns its batch.
    let first = Load::start(&base, 3, 64);
    tokio::time::sleep(Duration::from_secs(3)).await;
    // Twenty more: the router sends the server up to its threshold and holds the rest.
    let more = Load::start(&base, 20, 64);
    let router_metrics = format!("{base}/metrics");
    eventually(WAIT, "requests held in the router", async || {
        let url = router_metrics.clone();
        let text =
            tokio::task::spawn_blocking(move || ureq::get(&url).call().ok()?.into_string().ok())
                .await
                .ok()??;
        let m = ferrite_testkit::server::Metrics::parse(text);
        (m.sum_where(
            "ferrite_router_queued_requests",
            &[("inferenceservice", "smol")],
        ) >= 10.0)
            .then_some(())
    })
    .await;
    let server_waiting = server.metric("vllm:num_requests_waiting");
    assert!(
        server_waiting <= 5.0,
        "the server's own queue stays at the router's threshold: {server_waiting}"
    );
    // The status published with the decision shows the signals it was made on.
    let scaled = eventually(WAIT, "a scale-up, in spec and status", async || {
        let i = get_isvc(&client, &ns, "smol").await?;
        (i["spec"]["replicas"].as_i64()? >= 2 && i["status"]["desiredReplicas"].as_i64()? >= 2)
            .then_some(i)
    })
    .await;
    let statuses = tokio::task::spawn_blocking(move || {
        let mut s = first.finish();
        s.extend(more.finish());
        s
    })
    .await
    .expect("clients");
    assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");
    eprintln!("status after the scale: {}", scaled["status"]);
    let waiting = scaled["status"]["currentMetrics"]["requestsWaiting"]
        .as_f64()
        .unwrap_or_default();
    assert!(
        waiting > 8.0,
        "status counts the router's queue as waiting: {}",
        scaled["status"]
    );
    router.terminate();
}

//! The real `ferrite-operator` binary against the in-memory API server (`fake_api`) over HTTP:
//! it reconciles InferenceServices to `Ready`, shows a missing claim as `Degraded`, recreates a
//! deleted Deployment through its watch, goes quiet in steady state, serves its own probes and
//! metrics, hands the leader Lease over on SIGTERM, and exits 0.

use std::time::{Duration, Instant};

mod common;

use common::operator::{ISVCS, Operator, blocking, condition, eventually, isvc};
use common::servers::{Server, load, start_server, wait_healthy};
use ferrite_operator::fake_api::FakeApi;
use serde_json::{Value, json};

const DEPLOYMENTS: &str = "/apis/apps/v1/namespaces/ml/deployments";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_reconciles_heals_settles_and_exits_cleanly() {
    let api = FakeApi::start().await.expect("fake API server");
    api.set_simulate_rollouts(true);
    api.put(ISVCS, isvc("chat", "/models/smol.gguf"))
        .expect("created");
    api.put(ISVCS, isvc("broken", "pvc://missing/smol.gguf"))
        .expect("created");
    let mut op = Operator::start(&api, "solo", &["--no-leader-election"]);

    eventually(30, "chat to be Ready", || {
        condition(&api, "chat", "Ready").filter(|(s, _)| s == "True")
    })
    .await;
    let (status, reason) = eventually(30, "broken to be Degraded", || {
        condition(&api, "broken", "Degraded").filter(|(s, _)| s == "True")
    })
    .await;
    assert_eq!(
        (status.as_str(), reason.as_str()),
        ("True", "PersistentVolumeClaimNotFound")
    );
    assert!(
        api.get(&format!("{DEPLOYMENTS}/broken")).is_none(),
        "nothing is applied for a spec that points at a missing claim"
    );
    let chat = api.get(&format!("{ISVCS}/chat")).expect("chat");
    assert_eq!(
        chat["status"]["observedGeneration"],
        chat["metadata"]["generation"]
    );
    assert_eq!(chat["status"]["readyReplicas"], 1);

    // The Deployment's owner reference ties it to the InferenceService, so deleting it wakes
    // the owner's reconcile through the Deployment watch.
    let before = api.get(&format!("{DEPLOYMENTS}/chat")).expect("deployment");
    assert_eq!(before["metadata"]["ownerReferences"][0]["name"], "chat");
    assert!(api.delete(&format!("{DEPLOYMENTS}/chat")));
    let after = eventually(20, "the Deployment to be recreated", || {
        api.get(&format!("{DEPLOYMENTS}/chat"))
    })
    .await;
    assert_ne!(after["metadata"]["uid"], before["metadata"]["uid"]);

    // A spec change reaches the Deployment and moves observedGeneration.
    let mut changed = isvc("chat", "/models/smol.gguf");
    changed["spec"]["replicas"] = json!(2);
    api.put(ISVCS, changed).expect("updated");
    eventually(20, "replicas 2 and observedGeneration 2", || {
        let d = api.get(&format!("{DEPLOYMENTS}/chat"))?;
        let i = api.get(&format!("{ISVCS}/chat"))?;
        (d["spec"]["replicas"] == 2 && i["status"]["observedGeneration"] == 2).then_some(())
    })
    .await;
    assert!(
        api.get("/apis/policy/v1/namespaces/ml/poddisruptionbudgets/chat")
            .is_some(),
        "two replicas get a PodDisruptionBudget"
    );

    // Settled: within 20 s comes a 2 s window in which the operator writes nothing (a hot loop
    // never goes quiet; a loaded machine may need a moment for the last echoes).
    let settle = Instant::now();
    loop {
        let (_, before) = api.request_counts();
        tokio::time::sleep(Duration::from_secs(2)).await;
        let (_, after) = api.request_counts();
        if before == after {
            break;
        }
        assert!(
            settle.elapsed() < Duration::from_secs(20),
            "the operator kept writing in steady state ({} writes in the last 2 s)",
            after - before
        );
    }

    let (op_ref, metrics) = blocking(move || {
        let m = (
            op.get("/healthz"),
            op.get("/readyz"),
            op.metric("ferrite_operator_reconciliations_total"),
            op.metric("ferrite_operator_leader"),
            op.metric("ferrite_operator_reconcile_duration_seconds_count"),
        );
        (op, m)
    })
    .await;
    op = op_ref;
    let (healthz, readyz, reconciles, leader, observed) = metrics;
    assert_eq!(healthz.expect("healthz").0, 200);
    assert_eq!(readyz.expect("readyz").0, 200);
    let reconciles = reconciles.expect("reconcile counter");
    assert!(reconciles >= 4.0, "reconciles: {reconciles}");
    assert_eq!(observed, Some(reconciles), "every reconcile is timed");
    assert_eq!(leader, Some(1.0));

    let status = blocking(move || op.terminate()).await;
    assert!(status.success(), "exit status after SIGTERM: {status}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn of_two_replicas_one_leads_and_the_other_takes_over_after_sigterm() {
    let api = FakeApi::start().await.expect("fake API server");
    api.set_simulate_rollouts(true);
    let lease_args = ["--lease-seconds", "3"];
    let a = Operator::start(&api, "a", &lease_args);
    let holder = eventually(20, "a Lease holder", || {
        api.get("/apis/coordination.k8s.io/v1/namespaces/ml/leases/ferrite-operator-leader")
            .and_then(|l| l["spec"]["holderIdentity"].as_str().map(String::from))
    })
    .await;
    assert_eq!(holder, "a");
    let b = Operator::start(&api, "b", &lease_args);

    // b stands by: ready, not leading, reconciling nothing.
    let (a, b, (a_leads, b_leads, b_ready)) = blocking(move || {
        let deadline = Instant::now() + Duration::from_secs(20);
        while b.get("/readyz").map(|r| r.0) != Ok(200) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(100));
        }
        let m = (
            a.metric("ferrite_operator_leader"),
            b.metric("ferrite_operator_leader"),
            b.get("/readyz").map(|r| r.0),
        );
        (a, b, m)
    })
    .await;
    assert_eq!((a_leads, b_leads, b_ready), (Some(1.0), Some(0.0), Ok(200)));

    api.put(ISVCS, isvc("first", "/models/smol.gguf"))
        .expect("created");
    eventually(30, "first to be Ready (reconciled by a)", || {
        condition(&api, "first", "Ready").filter(|(s, _)| s == "True")
    })
    .await;

    // a leaves and hands the Lease back; b takes over well before the Lease would expire.
    let (mut a, b) = (a, b);
    let left = Instant::now();
    let (status, b) = blocking(move || (a.terminate(), b)).await;
    assert!(status.success(), "a's exit status: {status}");
    eventually(10, "b to hold the Lease", || {
        api.get("/apis/coordination.k8s.io/v1/namespaces/ml/leases/ferrite-operator-leader")
            .filter(|l| l["spec"]["holderIdentity"] == "b")
    })
    .await;
    assert!(
        left.elapsed() < Duration::from_secs(3),
        "took over in {:?}",
        left.elapsed()
    );
    api.put(ISVCS, isvc("second", "/models/smol.gguf"))
        .expect("created");
    eventually(30, "second to be Ready (reconciled by b)", || {
        condition(&api, "second", "Ready").filter(|(s, _)| s == "True")
    })
    .await;
    let lease = api
        .get("/apis/coordination.k8s.io/v1/namespaces/ml/leases/ferrite-operator-leader")
        .expect("lease");
    assert_eq!(lease["spec"]["leaseTransitions"], 1, "{lease}");
    let mut b = b;
    let status = blocking(move || b.terminate()).await;
    assert!(status.success());
}

/// Polls an External Metrics API `url` for the items of InferenceService `chat`: `Some` once
/// there are any.
fn external_items(agent: ureq::Agent, url: String) -> impl Fn() -> Option<Vec<Value>> {
    move || {
        let body: Value = agent
            .get(&url)
            .query("labelSelector", "ferrite.dev/inferenceservice=chat")
            .call()
            .ok()?
            .into_json()
            .ok()?;
        let items = body["items"].as_array()?.clone();
        (!items.is_empty()).then_some(items)
    }
}

/// A real ferrite-server, and a fake API server holding an InferenceService `chat` with
/// `autoscaling` whose one ready pod is that server (at 127.0.0.1).
async fn autoscaled_server(autoscaling: Value) -> (Server, FakeApi) {
    let server = blocking(|| {
        let mut s = start_server();
        wait_healthy(&mut s);
        s
    })
    .await;
    let port: i64 = server
        .base
        .rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .expect("port");
    let api = FakeApi::start().await.expect("fake API server");
    api.set_simulate_rollouts(true);
    let mut scaled = isvc("chat", "/models/smol.gguf");
    scaled["spec"]["runtime"] = json!({"port": port});
    scaled["spec"]["autoscaling"] = autoscaling;
    api.put(ISVCS, scaled).expect("created");
    api.put(
        "/api/v1/namespaces/ml/pods",
        json!({"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "chat-0", "namespace": "ml", "labels": {
                "app.kubernetes.io/component": "server", "ferrite.dev/inferenceservice": "chat"}},
            "spec": {"containers": [{"name": "server", "image": "x"}]},
            "status": {"phase": "Running", "podIP": "127.0.0.1",
                "conditions": [{"type": "Ready", "status": "True"}]}}),
    )
    .expect("pod");
    (server, api)
}

/// Builtin autoscaling end to end: the operator lists the InferenceService's pods, scrapes a
/// real ferrite-server (the pod at 127.0.0.1), and when its queue backs up writes spec.replicas
/// through the scale subresource; the Deployment follows, status shows the decision and the
/// signals, an event records the scale, and the operator's metrics count it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_builtin_autoscaler_scales_on_a_real_servers_queue() {
    let (mut server, api) = autoscaled_server(json!({"minReplicas": 1, "maxReplicas": 4,
        "targets": {"queuePerReplica": 1.0}, "scrapeIntervalSeconds": 1}))
    .await;
    let op = Operator::start(&api, "scaler", &["--no-leader-election"]);

    // Idle: the signals are read and nothing changes.
    let idle = eventually(30, "ScalingActive with metrics", || {
        let i = api.get(&format!("{ISVCS}/chat"))?;
        (condition(&api, "chat", "ScalingActive")?.0 == "True"
            && i["status"]["currentMetrics"]["reportingReplicas"] == 1)
            .then_some(i)
    })
    .await;
    assert_eq!(idle["status"]["desiredReplicas"], 1);
    assert_eq!(idle["status"]["currentMetrics"]["requestsWaiting"], 0.0);
    // An empty queue asks for 0 replicas; minReplicas holds it at 1, as HPA reports it.
    assert_eq!(
        condition(&api, "chat", "ScalingLimited"),
        Some(("True".into(), "TooFewReplicas".into()))
    );

    // 8 requests on a server that runs 2 at once: 6 wait, 6 × the target of 1 is past the
    // default panic threshold (3×), so it goes straight to maxReplicas.
    let base = server.base.clone();
    let clients = blocking(move || load(&base, 8, 48)).await;
    let scaled = eventually(60, "spec.replicas 4", || {
        let i = api.get(&format!("{ISVCS}/chat"))?;
        (i["spec"]["replicas"] == 4).then_some(i)
    })
    .await;
    assert_eq!(
        scaled["metadata"]["generation"], 2,
        "one write of spec.replicas"
    );
    eventually(
        20,
        "the Deployment at 4 and status showing the scale",
        || {
            let d = api.get(&format!("{DEPLOYMENTS}/chat"))?;
            let i = api.get(&format!("{ISVCS}/chat"))?;
            (d["spec"]["replicas"] == 4
                && i["status"]["desiredReplicas"] == 4
                && i["status"]["lastScaleTime"].is_string())
            .then_some(())
        },
    )
    .await;
    // The stored status equals what the operator computes, so nothing is rewritten: a status
    // that never compares equal (a lastScaleTime finer than the API's seconds) would patch on
    // every reconcile and reconcile on every patch.
    let (_, writes_before) = api.request_counts();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (_, writes_after) = api.request_counts();
    assert!(
        writes_after - writes_before <= 4,
        "{} writes in 3 s after the scale: a status hot loop",
        writes_after - writes_before
    );
    let events = api.list("/apis/events.k8s.io/v1/namespaces/ml/events");
    let scale_event = events
        .iter()
        .find(|e| e["reason"] == "ScaledUp")
        .unwrap_or_else(|| panic!("no ScaledUp event in {events:#?}"));
    let note = scale_event["note"].as_str().unwrap_or_default();
    assert!(note.starts_with("1 → 4 replicas (panic mode"), "{note}");

    let (op, body) = blocking(move || {
        let b = op.get("/metrics").map(|(_, b)| b).unwrap_or_default();
        (op, b)
    })
    .await;
    let line = |prefix: &str| {
        body.lines()
            .find(|l| l.starts_with(prefix))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse::<f64>().ok())
    };
    assert_eq!(
        line(
            r#"ferrite_operator_autoscaler_scale_actions_total{direction="up",inferenceservice="chat",namespace="ml"}"#
        ),
        Some(1.0),
        "{body}"
    );
    assert_eq!(
        line(
            r#"ferrite_operator_autoscaler_desired_replicas{inferenceservice="chat",namespace="ml"}"#
        ),
        Some(4.0)
    );
    // Born at 0, so increase() over it sees the first scale of each direction.
    assert_eq!(
        line(
            r#"ferrite_operator_autoscaler_scale_actions_total{direction="down",inferenceservice="chat",namespace="ml"}"#
        ),
        Some(0.0),
        "{body}"
    );
    // The spec's targets, beside the signals: queue 1.0 is set, the KV target is not.
    assert_eq!(
        line(
            r#"ferrite_operator_autoscaler_target{inferenceservice="chat",namespace="ml",signal="queue_per_replica"}"#
        ),
        Some(1.0),
        "{body}"
    );
    assert!(
        !body.contains(r#"ferrite_operator_autoscaler_target{inferenceservice="chat",namespace="ml",signal="kv_cache_usage"}"#),
        "{body}"
    );
    for c in blocking(move || clients.into_iter().map(|c| c.join()).collect::<Vec<_>>()).await {
        assert_eq!(c.expect("client"), 200);
    }

    // Switched to HPA mode: the operator creates the HPA and serves the signals over HTTPS on
    // the External Metrics API for it; it no longer writes spec.replicas itself.
    let mut hpa_mode = api.get(&format!("{ISVCS}/chat")).expect("chat");
    hpa_mode["spec"]["autoscaling"]["mode"] = json!("HPA");
    api.put(ISVCS, hpa_mode).expect("updated");
    let hpa = eventually(20, "the HPA", || {
        api.get("/apis/autoscaling/v2/namespaces/ml/horizontalpodautoscalers/chat")
    })
    .await;
    assert_eq!(hpa["spec"]["scaleTargetRef"]["kind"], "InferenceService");
    assert_eq!(
        hpa["spec"]["metrics"][0]["external"]["metric"]["name"],
        "ferrite_requests_waiting"
    );
    let url = format!(
        "https://localhost:{}/apis/external.metrics.k8s.io/v1beta1/namespaces/ml/ferrite_requests_running",
        op.external_port
    );
    let agent = common::tls::agent(&op.cert_pem);
    let items = eventually(
        20,
        "an External metric value for chat",
        external_items(agent.clone(), url.clone()),
    )
    .await;
    assert_eq!(items.len(), 1, "{items:?}");
    assert_eq!(items[0]["metricName"], "ferrite_requests_running");
    assert_eq!(items[0]["value"], "0", "the load is over");
    let none: Value = agent
        .get(&url)
        .query("labelSelector", "ferrite.dev/inferenceservice=other")
        .call()
        .expect("a selector matching nothing is not an error")
        .into_json()
        .expect("JSON");
    assert_eq!(none["items"], json!([]));
    drop(op);
    drop(server.child.kill());
}

/// Behind one Service, every operator replica answers the External Metrics API: a standby
/// scrapes too, serves the same signals as the leader, and exports no per-InferenceService
/// autoscaler series (so dashboards summing over operator pods count once) until it leads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_serves_the_same_external_metrics_as_the_leader() {
    let (server, api) = autoscaled_server(json!({"mode": "HPA", "minReplicas": 1,
        "maxReplicas": 4, "targets": {"queuePerReplica": 2.0}, "scrapeIntervalSeconds": 1}))
    .await;
    let lease_args = ["--lease-seconds", "3"];
    let a = Operator::start(&api, "a", &lease_args);
    eventually(20, "a to lead", || {
        api.get("/apis/coordination.k8s.io/v1/namespaces/ml/leases/ferrite-operator-leader")
            .filter(|l| l["spec"]["holderIdentity"] == "a")
    })
    .await;
    let b = Operator::start(&api, "b", &lease_args);
    let running = |op: &Operator| {
        let url = format!(
            "https://localhost:{}/apis/external.metrics.k8s.io/v1beta1/namespaces/ml/ferrite_requests_running",
            op.external_port
        );
        external_items(common::tls::agent(&op.cert_pem), url)
    };
    let (from_a, from_b) = (running(&a), running(&b));
    let leader_items = eventually(30, "the leader's External metric", from_a).await;
    let standby_items = eventually(30, "the standby's External metric", from_b).await;
    assert_eq!(leader_items.len(), 1);
    assert_eq!(standby_items.len(), 1);
    assert_eq!(standby_items[0]["metricName"], "ferrite_requests_running");
    assert_eq!(standby_items[0]["value"], leader_items[0]["value"]);

    let signal = r#"ferrite_operator_autoscaler_signal{inferenceservice="chat""#;
    // The leader's first evaluation may come before it won the Lease (observing only), so its
    // series can follow the API's items by one scrape interval.
    eventually(20, "the leader to export the signals", || {
        let body = a.get("/metrics").map(|(_, b)| b).unwrap_or_default();
        body.contains(signal).then_some(())
    })
    .await;
    let (a, b, b_body) = blocking(move || {
        let b_body = b.get("/metrics").map(|(_, b)| b).unwrap_or_default();
        (a, b, b_body)
    })
    .await;
    assert!(
        !b_body.contains(signal),
        "a standby exports signals:\n{b_body}"
    );
    assert!(b_body.contains("ferrite_operator_leader 0"), "{b_body}");

    // The leader goes; the standby leads, keeps serving, and now exports the signals.
    let (mut a, b) = (a, b);
    let status = blocking(move || a.terminate()).await;
    assert!(status.success());
    let from_b = running(&b);
    eventually(20, "b to lead and still serve", || {
        let leads = api
            .get("/apis/coordination.k8s.io/v1/namespaces/ml/leases/ferrite-operator-leader")
            .is_some_and(|l| l["spec"]["holderIdentity"] == "b");
        (leads && from_b().is_some()).then_some(())
    })
    .await;
    eventually(20, "b to export the signals", || {
        let body = b.get("/metrics").map(|(_, b)| b).unwrap_or_default();
        body.contains(signal).then_some(())
    })
    .await;
    drop(server);
}

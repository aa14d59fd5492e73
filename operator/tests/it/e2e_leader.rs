//! Leader election on a real API server, with the chart's Lease Role: a standby takes over
//! within the Lease duration plus one retry after the leader is SIGKILLed, at once after a
//! SIGTERM; an API server outage longer than the renew deadline ends the leader (non-zero
//! exit, /healthz failing first) instead of leaving it idle; and a standby serves the same
//! External Metrics API as the leader.

use std::time::{Duration, Instant};

use ferrite_testkit::e2e::{Applier, Operator, Release, condition, install, isvc};
use ferrite_testkit::kube::Cluster;
use ferrite_testkit::process::eventually;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::coordination::v1::Lease;
use kube::api::Api;
use serde_json::json;

const WAIT: Duration = Duration::from_secs(60);
/// The chart's default Lease duration, which these tests keep.
const LEASE: Duration = Duration::from_secs(15);
/// The operator retries (and renews) every 2 s, as client-go does.
const RETRY: Duration = Duration::from_secs(2);

fn lease_name(release: &Release) -> String {
    let args = ferrite_testkit::chart::operator_args(&release.docs);
    args.iter()
        .find_map(|a| a.strip_prefix("--lease-name="))
        .expect("--lease-name")
        .to_string()
}

async fn holder(client: &kube::Client, name: &str) -> Option<(String, i32)> {
    let lease = Api::<Lease>::namespaced(client.clone(), "ferrite-system")
        .get_opt(name)
        .await
        .ok()??;
    let spec = lease.spec?;
    Some((spec.holder_identity?, spec.lease_transitions.unwrap_or(0)))
}

async fn deployment_exists(client: &kube::Client, ns: &str, name: &str) -> Option<()> {
    Api::<Deployment>::namespaced(client.clone(), ns)
        .get_opt(name)
        .await
        .ok()?
        .map(|_| ())
}

/// One leads, one stands by (ready, not leading, exporting no leader gauge); SIGKILL of the
/// leader hands over within Lease duration + one retry, SIGTERM at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_takes_over_after_sigkill_within_the_lease_and_at_once_after_sigterm() {
    let Some(cluster) = Cluster::start().await else {
        return;
    };
    let client = cluster.client().await;
    let release = install(&cluster, &json!({"replicaCount": 2}), "leader").await;
    let lease = lease_name(&release);
    let mut a = Operator::launch(&cluster, &release, "op-a", &[]).await;
    eventually(WAIT, "op-a to hold the Lease", async || {
        holder(&client, &lease).await.filter(|h| h.0 == "op-a")
    })
    .await;
    let b = Operator::launch(&cluster, &release, "op-b", &[]).await;
    eventually(WAIT, "op-b to stand by, ready", async || {
        (b.get("/readyz")?.0 == 200).then_some(())
    })
    .await;
    assert_eq!(a.metric("ferrite_operator_leader"), Some(1.0));
    assert_eq!(b.metric("ferrite_operator_leader"), Some(0.0));
    let ns = cluster.namespace("leader").await;
    let mut applier = Applier::new(client.clone()).await;
    let model = json!({"model": {"source": "/models/smol.gguf"}});
    applier.apply(&isvc(&ns, "first", model.clone())).await;
    eventually(WAIT, "first reconciled (by op-a)", async || {
        deployment_exists(&client, &ns, "first").await
    })
    .await;

    // SIGKILL: no release; op-b waits for the Lease to expire, by its own clock.
    a.guard.kill();
    let killed = Instant::now();
    applier.apply(&isvc(&ns, "second", model.clone())).await;
    eventually(LEASE + RETRY * 3, "second reconciled by op-b", async || {
        deployment_exists(&client, &ns, "second").await
    })
    .await;
    let takeover = killed.elapsed();
    eprintln!(
        "takeover after SIGKILL of the leader: {:.1} s",
        takeover.as_secs_f64()
    );
    assert!(
        takeover <= LEASE + RETRY + Duration::from_secs(2),
        "took {takeover:?}, more than the Lease duration plus one retry"
    );
    let (h, transitions) = holder(&client, &lease).await.expect("Lease");
    assert_eq!((h.as_str(), transitions), ("op-b", 1));

    // SIGTERM: op-b releases the Lease on the way out; op-c takes it at its next retry.
    let c = Operator::launch(&cluster, &release, "op-c", &[]).await;
    eventually(WAIT, "op-c to stand by, ready", async || {
        (c.get("/readyz")?.0 == 200).then_some(())
    })
    .await;
    let mut b = b;
    let left = Instant::now();
    let status = tokio::task::spawn_blocking(move || (b.terminate(), b))
        .await
        .expect("terminate");
    assert!(
        status.0.success(),
        "op-b's exit after SIGTERM: {}",
        status.0
    );
    applier.apply(&isvc(&ns, "third", model)).await;
    eventually(RETRY * 3, "third reconciled by op-c", async || {
        deployment_exists(&client, &ns, "third").await
    })
    .await;
    let handover = left.elapsed();
    eprintln!(
        "takeover after SIGTERM of the leader: {:.1} s",
        handover.as_secs_f64()
    );
    assert!(
        handover <= RETRY + Duration::from_secs(2),
        "took {handover:?}"
    );
    assert_eq!(holder(&client, &lease).await.expect("Lease").0, "op-c");
}

/// The API server goes away for longer than the renew deadline: the leader cannot renew, its
/// /healthz fails, and it exits non-zero (the kubelet then restarts it as a candidate); it
/// never goes on as a leader that does not lead. Restarted once the API server is back, it
/// leads and reconciles again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_api_server_outage_ends_the_leader_instead_of_idling_it() {
    let Some(mut cluster) = Cluster::start().await else {
        return;
    };
    let client = cluster.client().await;
    let release = install(&cluster, &json!({}), "outage").await;
    let lease = lease_name(&release);
    let op = Operator::launch(&cluster, &release, "op-0", &[]).await;
    eventually(WAIT, "op-0 to lead", async || {
        holder(&client, &lease).await.filter(|h| h.0 == "op-0")
    })
    .await;

    cluster.stop_apiserver();
    let down = Instant::now();
    // Poll /healthz until the process is gone.
    let (mut op, codes) = tokio::task::spawn_blocking(move || {
        let mut op = op;
        let mut codes = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(40);
        while op.guard.exited().is_none() && Instant::now() < deadline {
            codes.push((down.elapsed(), op.get("/healthz").map(|r| r.0)));
            std::thread::sleep(Duration::from_millis(100));
        }
        (op, codes)
    })
    .await
    .expect("poller");
    let exited = down.elapsed();
    let status = op.guard.exited();
    tokio::time::sleep(Duration::from_secs(15).saturating_sub(down.elapsed())).await;
    cluster.start_apiserver().await;

    let status =
        status.unwrap_or_else(|| panic!("still running 40 s into the outage:\n{}", op.log()));
    assert!(!status.success(), "exit status {status}");
    eprintln!(
        "outage: the leader exited {:.1} s after the API server went away ({status})",
        exited.as_secs_f64()
    );
    // Renew deadline (2/3 of the Lease) + one retry + the shutdown grace, at most.
    assert!(
        exited <= Duration::from_secs(10) + RETRY + Duration::from_secs(5 + 2),
        "exited after {exited:?}"
    );
    let log = op.log();
    assert!(log.contains("could not renew the leader Lease"), "{log}");
    // Once it failed, /healthz never said ok again.
    let first_failure = codes.iter().position(|(_, c)| *c == Some(503));
    if let Some(i) = first_failure {
        assert!(
            codes[i..].iter().all(|(_, c)| *c != Some(200)),
            "/healthz recovered after failing: {codes:?}"
        );
    }
    assert!(
        codes
            .iter()
            .all(|(t, c)| *c != Some(200) || *t < Duration::from_secs(10)),
        "/healthz said ok after the renew deadline: {codes:?}"
    );

    // As the kubelet would: start it again; it leads once the Lease it held expires.
    let _again = Operator::launch(&cluster, &release, "op-0-restarted", &[]).await;
    let ns = cluster.namespace("outage").await;
    Applier::new(client.clone())
        .await
        .apply(&isvc(
            &ns,
            "after",
            json!({"model": {"source": "/models/smol.gguf"}}),
        ))
        .await;
    eventually(WAIT, "a reconcile after the outage", async || {
        condition(&client, &ns, "after", "Progressing").await
    })
    .await;
}

/// Behind one Service, every operator replica answers the External Metrics API: a standby
/// scrapes too, serves the same signals as the leader, and exports no per-InferenceService
/// autoscaler series (so dashboards summing over operator pods count once) until it leads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_serves_the_same_external_metrics_as_the_leader() {
    use ferrite_testkit::e2e::{external_client, pods_ready};
    use ferrite_testkit::process::free_port;
    use ferrite_testkit::server::ready_server;
    let Some(cluster) = Cluster::start().await else {
        return;
    };
    let client = cluster.client().await;
    let release = install(
        &cluster,
        &json!({"replicaCount": 2, "externalMetrics": {"enabled": true}}),
        "standby",
    )
    .await;
    let lease = lease_name(&release);
    let mut a = Operator::launch(&cluster, &release, "op-a", &[]).await;
    eventually(WAIT, "op-a to lead", async || {
        holder(&client, &lease).await.filter(|h| h.0 == "op-a")
    })
    .await;
    let b_port = free_port();
    let b = Operator::launch_on(&cluster, &release, "op-b", &[], b_port).await;
    let (server, port) = ready_server().await;
    let ns = cluster.namespace("standby").await;
    Applier::new(client.clone())
        .await
        .apply(&isvc(
            &ns,
            "chat",
            json!({"model": {"source": "/models/smol.gguf"}, "runtime": {"port": port},
                   "autoscaling": {"mode": "HPA", "minReplicas": 1, "maxReplicas": 4,
                                   "targets": {"queuePerReplica": 2.0},
                                   "scrapeIntervalSeconds": 1}}),
        ))
        .await;
    eventually(WAIT, "the stand-in pod", async || {
        (pods_ready(&client, &ns, "chat", "127.0.0.1").await > 0).then_some(())
    })
    .await;
    // Both replicas serve the one certificate in the shared Secret, which the bundle trusts.
    let agents = [
        external_client(&cluster, &release, release.external_port, None).await,
        external_client(&cluster, &release, b_port, None).await,
    ];
    let items = |i: usize| {
        let (agent, base) = agents[i].clone();
        let url = format!(
            "{base}/apis/external.metrics.k8s.io/v1beta1/namespaces/{ns}/ferrite_requests_running"
        );
        move || -> Option<Vec<serde_json::Value>> {
            let body: serde_json::Value = agent
                .get(&url)
                .query("labelSelector", "ferrite.dev/inferenceservice=chat")
                .call()
                .ok()?
                .into_json()
                .ok()?;
            let items = body["items"].as_array()?.clone();
            (!items.is_empty()).then_some(items)
        }
    };
    let (from_a, from_b) = (items(0), items(1));
    let leader_items = eventually(WAIT, "the leader's External metric", async || from_a()).await;
    let standby_items = eventually(WAIT, "the standby's External metric", async || from_b()).await;
    assert_eq!(standby_items[0]["metricName"], "ferrite_requests_running");
    assert_eq!(standby_items[0]["value"], leader_items[0]["value"]);

    let signal = r#"ferrite_operator_autoscaler_signal{inferenceservice="chat""#;
    eventually(WAIT, "the leader to export the signals", async || {
        a.get("/metrics")?.1.contains(signal).then_some(())
    })
    .await;
    let b_body = b.get("/metrics").map(|(_, body)| body).unwrap_or_default();
    assert!(
        !b_body.contains(signal),
        "a standby exports signals:\n{b_body}"
    );
    assert!(b_body.contains("ferrite_operator_leader 0"), "{b_body}");

    // The leader goes; the standby leads, keeps serving, and now exports the signals.
    let status = tokio::task::spawn_blocking(move || (a.terminate(), a))
        .await
        .expect("terminate");
    assert!(status.0.success());
    a = status.1;
    drop(a);
    eventually(WAIT, "op-b to lead, still serving", async || {
        let leads = holder(&client, &lease).await.is_some_and(|h| h.0 == "op-b");
        (leads && from_b().is_some()).then_some(())
    })
    .await;
    eventually(WAIT, "op-b to export the signals", async || {
        b.get("/metrics")?.1.contains(signal).then_some(())
    })
    .await;
    drop(server);
}

/// Without the CRD the leader stops at once, non-zero, saying so: the API server answers the
/// InferenceService list with 404. (An unreachable API server is not that: the leader retries
/// the list and the Lease decides, as the outage test shows.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_crd_stops_the_leader_with_the_reason() {
    let Some(cluster) = Cluster::start().await else {
        return;
    };
    let client = cluster.client().await;
    let release = install(&cluster, &json!({}), "nocrd").await;
    let crds: Api<k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition> =
        Api::all(client.clone());
    crds.delete("inferenceservices.ferrite.dev", &Default::default())
        .await
        .expect("delete the CRD");
    eventually(WAIT, "the CRD to be gone", async || {
        crds.get_opt("inferenceservices.ferrite.dev")
            .await
            .ok()
            .and_then(|c| c.is_none().then_some(()))
    })
    .await;
    let mut op = Operator::launch(&cluster, &release, "op-0", &[]).await;
    let status = eventually(WAIT, "the operator to exit", async || op.guard.exited()).await;
    let log = op.log();
    assert!(!status.success(), "exit status {status}:\n{log}");
    assert!(log.contains("the CRD is not installed"), "{log}");
    let _ = op.terminate();
}

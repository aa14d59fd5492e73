//! ferrite-router's RBAC on a real API server, read back from the API server's audit log: the
//! chart installed, the real `ferrite-router` binary run as the chart's router ServiceAccount
//! with the rendered Deployment's arguments, and the operator beside it, a request for a model
//! scaled to zero is held, the service woken through `/scale` (or, read-only, by someone else),
//! and answered once its pod turns Ready. The router is never refused and uses every verb the
//! chart grants it: the rules are exactly enough, cluster-wide and in one namespace, reading
//! EndpointSlices (the default) or pods.
//!
//! EndpointSlices refuse loopback addresses, so where the router reads them the pod turns
//! Ready at a TEST-NET-2 address (198.51.100.0/24, where no model server listens), bound to a
//! Node so that Kubernetes' EndpointSlice controller lists it: the router counts it ready and
//! routes the held request there (whatever answers: nothing, or a sandbox's egress proxy).
//! With pods, it turns Ready at 127.0.0.1 where a real ferrite-server listens and the request
//! succeeds.
//!
//! The binaries are the workspace's (`cargo build -p ferrite-router -p ferrite-operator
//! -p ferrite-server`, or `FERRITE_ROUTER_BIN`, `FERRITE_OPERATOR_BIN`); `cargo nextest run
//! --workspace` builds them.

use std::time::Duration;

use ferrite_testkit::chart::router_args;
use ferrite_testkit::e2e::{
    Operator, Router, assert_exact_rbac, assert_exact_rbac_with, audited, bind_pods, get_isvc,
    install, isvc, isvc_api, pods_ready,
};
use ferrite_testkit::kube::Cluster;
use ferrite_testkit::process::eventually;
use ferrite_testkit::server::{post_json, ready_server, ready_server_with};
use kube::api::{Patch, PatchParams};
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(60);

/// Where a pod reads as Ready when the router reads EndpointSlices: not loopback (which
/// EndpointSlices refuse), and no model server there.
const UNREACHABLE_POD_IP: &str = "198.51.100.7";

/// GET `url` from a blocking thread: (status, body), or `None` when nothing answers.
async fn get(url: String) -> Option<(u16, String)> {
    tokio::task::spawn_blocking(move || {
        match ureq::get(&url).timeout(Duration::from_secs(5)).call() {
            Ok(r) => Some((r.status(), r.into_string().unwrap_or_default())),
            Err(ureq::Error::Status(code, r)) => Some((code, r.into_string().unwrap_or_default())),
            Err(_) => None,
        }
    })
    .await
    .expect("request thread")
}

/// A completion for `model` through the router: (status, JSON).
async fn complete(base: String, model: &str) -> (u16, Value) {
    let body = json!({"model": model, "prompt": "The capital of France is", "max_tokens": 4,
                      "temperature": 0});
    let (status, answer, _) = post_json(format!("{base}/v1/completions"), body).await;
    (status, answer)
}

/// The sum of `name`'s series labelled `label="value"` in the router's `/metrics`.
async fn series_sum(base: &str, name: &str, label: &str, value: &str) -> f64 {
    let (_, text) = get(format!("{base}/metrics")).await.unwrap_or_default();
    let (head, pair) = (format!("{name}{{"), format!("{label}=\"{value}\""));
    text.lines()
        .filter(|l| l.starts_with(&head) && l.contains(&pair))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// The held-requests gauge of `inferenceservice` in the router's `/metrics`.
async fn held(base: &str, inferenceservice: &str) -> f64 {
    series_sum(
        base,
        "ferrite_router_held_requests",
        "inferenceservice",
        inferenceservice,
    )
    .await
}

/// `model`'s entry in the router's `/v1/models`, once it answers 200.
async fn model_entry(base: &str, model: &str) -> Option<Value> {
    let (status, body) = get(format!("{base}/v1/models")).await?;
    let models: Value = serde_json::from_str(&body).ok()?;
    let entry = models["data"]
        .as_array()?
        .iter()
        .find(|m| m["id"] == model)?;
    (status == 200).then(|| entry.clone())
}

/// Installs the chart with `router` values (in a namespace made first, so they can name it),
/// runs the operator and the router as the chart would, and sends a completion for a service
/// scaled to zero: the router holds it; with `wake` it scales the service 0 -> 1 itself,
/// without it the test does, as another client would. The operator makes the pod, which turns
/// Ready (see the module's doc for where) and the router sends the held request to it.
/// Then the router's audited requests are checked against the chart's rules.
async fn cold_start_through_the_router(
    router_values: impl Fn(&str) -> Value,
    tag: &str,
    wake: bool,
) {
    let Some(cluster) = Cluster::start_with(audited()).await else {
        return;
    };
    let client = cluster.client().await;
    let ns = cluster.namespace(tag).await;
    let release = install(&cluster, &json!({"router": router_values(&ns)}), tag).await;
    let args = router_args(&release.docs);
    assert_eq!(args.iter().any(|a| a == "--no-wake"), !wake, "{args:?}");
    let _operator = Operator::launch(&cluster, &release, "op-0", &[]).await;
    let (_server, port) = ready_server().await;
    ferrite_testkit::e2e::create(
        &client,
        &isvc(
            &ns,
            "smol",
            json!({"model": {"source": "/models/smol.gguf"}, "replicas": 0,
                   "runtime": {"port": port}}),
        ),
    )
    .await;
    let mut router = Router::launch(&cluster, &release).await;
    let base = router.base.clone();
    // Ready once both watch caches are listed; then it knows the model, scaled to zero.
    eventually(
        WAIT,
        "the router to list smol as scaled to zero",
        async || (model_entry(&base, "smol").await?["state"] == "scaled-to-zero").then_some(()),
    )
    .await;
    assert_eq!(get(format!("{base}/readyz")).await.map(|r| r.0), Some(200));

    let request = tokio::spawn(complete(base.clone(), "smol"));
    eventually(WAIT, "the request to be held", async || {
        (held(&base, "smol").await >= 1.0).then_some(())
    })
    .await;
    if wake {
        eventually(WAIT, "the router to scale smol from zero", async || {
            let i = get_isvc(&client, &ns, "smol").await?;
            (i["spec"]["replicas"] == 1).then_some(())
        })
        .await;
    } else {
        // --no-wake: the router only waits; someone else scales the service.
        tokio::time::sleep(Duration::from_secs(2)).await;
        let i = get_isvc(&client, &ns, "smol").await.expect("smol");
        assert_eq!(i["spec"]["replicas"], 0, "a read-only router scaled: {i}");
        isvc_api(&client, &ns)
            .patch(
                "smol",
                &PatchParams::default(),
                &Patch::Merge(json!({"spec": {"replicas": 1}})),
            )
            .await
            .expect("scaling smol to 1");
    }
    assert!(!request.is_finished(), "the request is held, not refused");
    // The operator scales its Deployment, kube-controller-manager makes the pod; it turns
    // Ready where the router will look for it.
    let slices = args.iter().any(|a| a == "--endpoints-from=endpoint-slices");
    let ip = if slices {
        UNREACHABLE_POD_IP
    } else {
        "127.0.0.1"
    };
    eventually(WAIT, "smol's pod", async || {
        if slices {
            bind_pods(&client, &ns, "smol", &format!("{tag}-node")).await;
        }
        (pods_ready(&client, &ns, "smol", ip).await > 0).then_some(())
    })
    .await;
    eventually(WAIT, "the router to count smol's pod ready", async || {
        (model_entry(&base, "smol").await?["ready_replicas"] == 1).then_some(())
    })
    .await;
    let (status, body) = request.await.expect("held request");
    if slices {
        // Routed to the one endpoint the EndpointSlice controller listed, where no model
        // server listens: a routing decision, and no success.
        assert_ne!(status, 200, "{body}\n{}", router.log());
        let decisions = series_sum(
            &base,
            "ferrite_router_routing_decisions_total",
            "model_name",
            "smol",
        )
        .await;
        assert_eq!(decisions, 1.0, "{}", router.log());
    } else {
        assert_eq!(status, 200, "{body}\n{}", router.log());
        assert_eq!(body["model"], "smol", "{body}");
        assert!(body["choices"][0]["text"].is_string(), "{body}");
    }

    let (status, router) = tokio::task::spawn_blocking(move || (router.terminate(), router))
        .await
        .expect("terminate");
    assert!(status.success(), "{}", router.log());
    let used = assert_exact_rbac(
        &cluster,
        &release.docs,
        &release.router_service_account(),
        &router.log(),
    );
    eprintln!(
        "{tag}: {used} distinct (verb, group, resource) uses by the router, all granted, every grant used"
    );
}

/// The default install: a ClusterRole with list and watch on InferenceServices and
/// EndpointSlices (none on pods), and patch on `inferenceservices/scale`, all of it used by one
/// cold start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_router_uses_exactly_the_rbac_the_chart_grants() {
    cold_start_through_the_router(|_| json!({}), "router-rbac", true).await;
}

/// `watchNamespace`, `scaleFromZero: false` and `endpointsFrom: pods`: a Role in that
/// namespace with list and watch on InferenceServices and pods only, and the router's
/// `--namespace`, `--no-wake` and `--endpoints-from=pods` keep it within them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_namespaced_read_only_router_needs_no_more_than_its_role() {
    cold_start_through_the_router(
        |ns| json!({"watchNamespace": ns, "scaleFromZero": false, "endpointsFrom": "pods"}),
        "router-ro",
        false,
    )
    .await;
}

/// A key as a client sends it.
fn bearer(key: &str) -> String {
    format!("Bearer {key}")
}

/// POST a completion for `model` to `base` with `key`: (status, body).
async fn complete_with_key(base: String, model: &str, key: &str) -> (u16, String) {
    let key = bearer(key);
    let body = json!({"model": model, "prompt": "The capital of France is", "max_tokens": 4,
                      "temperature": 0});
    tokio::task::spawn_blocking(move || {
        match ureq::post(&format!("{base}/v1/completions"))
            .set("Authorization", &key)
            .timeout(Duration::from_secs(30))
            .send_json(body)
        {
            Ok(r) => (r.status(), r.into_string().unwrap_or_default()),
            Err(ureq::Error::Status(code, r)) => (code, r.into_string().unwrap_or_default()),
            Err(e) => (0, e.to_string()),
        }
    })
    .await
    .expect("request thread")
}

/// The chart with tenants on, the operator and router run as its ServiceAccounts: a service
/// whose server wants its own key (`spec.auth`) is reached through the router with a tenant's
/// key, the router sending the service's key in its place. The router reads that Secret
/// through the Role the operator made for the service (get, that one name), no rule of the
/// chart's: the audit log shows the router never refused and using exactly the chart's rules
/// plus that get. The tenant's key alone is refused by the server, so the answer shows the
/// swap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_with_tenants_sends_a_guarded_service_its_own_key() {
    const SERVICE_KEY: &str = "service-key-0123456789";
    const TENANT_KEY: &str = "tenant-key-abcdefghij";
    let Some(cluster) = Cluster::start_with(audited()).await else {
        return;
    };
    let client = cluster.client().await;
    let tag = "router-keys";
    let ns = cluster.namespace(tag).await;
    // A service that is up: nothing to wake (the wake's grant is the first test's).
    let values = json!({"router": {"tenants": {"enabled": true}, "endpointsFrom": "pods",
                                   "scaleFromZero": false}});
    let release = install(&cluster, &values, tag).await;
    let _operator = Operator::launch(&cluster, &release, "op-0", &[]).await;
    let (_server, port) = ready_server_with(&["--api-key", SERVICE_KEY]).await;
    let mut applier = ferrite_testkit::e2e::Applier::new(client.clone()).await;
    applier
        .apply(&json!({"apiVersion": "v1", "kind": "Secret",
                       "metadata": {"name": "smol-key", "namespace": ns},
                       "stringData": {"api-key": SERVICE_KEY}}))
        .await;
    applier
        .apply(&json!({"apiVersion": "v1", "kind": "Secret",
                       "metadata": {"name": "team-a-key", "namespace": "ferrite-system",
                                    "labels": {"ferrite.dev/tenant": "team-a"}},
                       "stringData": {"key": TENANT_KEY}}))
        .await;
    applier
        .apply(
            &json!({"apiVersion": "ferrite.dev/v1alpha1", "kind": "InferenceTenant",
                       "metadata": {"name": "team-a"}, "spec": {"models": ["smol"]}}),
        )
        .await;
    ferrite_testkit::e2e::create(
        &client,
        &isvc(
            &ns,
            "smol",
            json!({"model": {"source": "/models/smol.gguf"}, "replicas": 1,
                   "runtime": {"port": port},
                   "auth": {"apiKeySecretRef": {"name": "smol-key"}}}),
        ),
    )
    .await;
    eventually(WAIT, "smol's pod", async || {
        (pods_ready(&client, &ns, "smol", "127.0.0.1").await > 0).then_some(())
    })
    .await;
    // The operator's grant: get on that one Secret, for the router's account.
    let roles: kube::Api<k8s_openapi::api::rbac::v1::Role> =
        kube::Api::namespaced(client.clone(), &ns);
    let role = eventually(WAIT, "the router's grant", async || {
        roles.get_opt("smol-router-key").await.ok().flatten()
    })
    .await;
    let rule = &role.rules.expect("rules")[0];
    assert_eq!(rule.resource_names, Some(vec!["smol-key".to_string()]));
    assert_eq!(rule.verbs, ["get"]);

    let mut router = Router::launch(&cluster, &release).await;
    let base = router.base.clone();
    let server = format!("http://127.0.0.1:{port}");
    let (status, body) = complete_with_key(server, "smol", TENANT_KEY).await;
    assert_eq!(status, 401, "the server refuses the tenant's key: {body}");
    let answered = eventually(WAIT, "a completion through the router", async || {
        let (status, body) = complete_with_key(base.clone(), "smol", TENANT_KEY).await;
        (status == 200).then_some(body)
    })
    .await;
    let answer: Value = serde_json::from_str(&answered).expect("JSON");
    assert!(answer["choices"][0]["text"].is_string(), "{answer}");
    let (status, body) = complete_with_key(base.clone(), "smol", "not-a-tenant-key").await;
    assert_eq!(status, 401, "{body}");

    let (status, router) = tokio::task::spawn_blocking(move || (router.terminate(), router))
        .await
        .expect("terminate");
    assert!(status.success(), "{}", router.log());
    let used = assert_exact_rbac_with(
        &cluster,
        &release.docs,
        &release.router_service_account(),
        &router.log(),
        &[("get", "", "secrets")],
    );
    eprintln!("{tag}: {used} distinct (verb, group, resource) uses by the router, all granted");
}

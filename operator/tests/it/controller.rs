//! The reconciler against a scripted API server (kube-rs `tower-test`) and hand-filled watch
//! caches: the exact request sequence for creation, steady state, spec changes, drift,
//! pruning, deletion, the ServiceMonitor CRD absent and present, API errors and bad input.
//! Reads come from the caches, so a script holds only discovery and writes.

use std::sync::Arc;
use std::time::Duration;

use crate::apiserver::{
    self, Reply, Step, Transcript, deleted, echo, not_found, ok, status_reply, step,
};
use ferrite_api::crd::InferenceService;
use ferrite_operator::autoscale::runner::Views;
use ferrite_operator::cache::{Caches, Writers};
use ferrite_operator::config::{Dashboard, OperatorConfig};
use ferrite_operator::controller::{Context, Error, Timing, error_policy, reconcile};
use ferrite_operator::telemetry::Metrics;
use http::{Method, StatusCode};
use kube::api::PartialObjectMeta;
use kube::runtime::controller::Action;
use kube::runtime::watcher::Event;
use serde_json::{Value, json};

const NS: &str = "ml";
const DISCOVERY: &str = "/apis/monitoring.coreos.com/v1";
/// KEDA's group, looked up after the monitoring group's (absent in these tests).
const KEDA_DISCOVERY: &str = "/apis/keda.sh/v1alpha1";
const DEPLOYMENT: &str = "/apis/apps/v1/namespaces/ml/deployments/chat";
const SERVICE: &str = "/api/v1/namespaces/ml/services/chat";
const PDB: &str = "/apis/policy/v1/namespaces/ml/poddisruptionbudgets/chat";
const MONITOR: &str = "/apis/monitoring.coreos.com/v1/namespaces/ml/servicemonitors/chat";
const DASHBOARD: &str = "/api/v1/namespaces/ml/configmaps/chat-dashboard-overview";
const EVENTS: &str = "/apis/events.k8s.io/v1/namespaces/ml/events";
const STATUS: &str = "/apis/ferrite.dev/v1alpha1/namespaces/ml/inferenceservices/chat/status";

fn timing() -> Timing {
    Timing {
        discovery_ttl: Duration::ZERO,
        ..Timing::default()
    }
}

fn isvc_json(generation: i64, spec: Value, status: Option<&Value>) -> Value {
    let mut v = json!({
        "apiVersion": "ferrite.dev/v1alpha1", "kind": "InferenceService",
        "metadata": {"name": "chat", "namespace": NS, "uid": "isvc-uid",
                     "generation": generation, "resourceVersion": "7"},
        "spec": spec,
    });
    if let Some(s) = status {
        v["status"] = s.clone();
    }
    v
}

fn isvc(generation: i64, spec: Value, status: Option<&Value>) -> InferenceService {
    serde_json::from_value(isvc_json(generation, spec, status)).expect("valid InferenceService")
}

fn spec() -> Value {
    json!({"model": {"source": "/models/smol.gguf"}})
}

fn config() -> OperatorConfig {
    OperatorConfig {
        dashboards: vec![Dashboard {
            name: "overview".into(),
            json: json!({"title": "Ferrite", "templating": {"list": []}}),
        }],
        ..OperatorConfig::default()
    }
}

/// The status write answers with the resource carrying the status it was sent.
fn status_echo(isvc: &InferenceService) -> Reply {
    let mut full = serde_json::to_value(isvc).expect("serializes");
    Box::new(move |body| {
        full["status"] = body["status"].clone();
        (StatusCode::OK, full)
    })
}

fn event_steps(n: usize) -> Vec<Step> {
    (0..n).map(|_| step(Method::POST, EVENTS, echo())).collect()
}

struct Outcome {
    result: Result<Action, Error>,
    t: Transcript,
    metrics: Arc<Metrics>,
}

fn from<T: serde::de::DeserializeOwned>(v: &Value) -> T {
    serde_json::from_value(v.clone()).expect("a valid object")
}

fn meta<K>(v: &Value) -> PartialObjectMeta<K> {
    PartialObjectMeta {
        types: None,
        metadata: from(&v["metadata"]),
        _phantom: std::marker::PhantomData,
    }
}

/// Puts each object of `world` in the cache of its kind.
fn fill(w: &mut Writers, world: &[Value]) {
    w.all_listed();
    for o in world {
        match o["kind"].as_str() {
            Some("Deployment") => w.deployments.apply_watcher_event(&Event::Apply(from(o))),
            Some("Pod") => w.pods.apply_watcher_event(&Event::Apply(from(o))),
            Some("Service") => w.services.apply_watcher_event(&Event::Apply(meta(o))),
            Some("PodDisruptionBudget") => w.pdbs.apply_watcher_event(&Event::Apply(meta(o))),
            Some("HorizontalPodAutoscaler") => w.hpas.apply_watcher_event(&Event::Apply(meta(o))),
            Some("ConfigMap") => w.config_maps.apply_watcher_event(&Event::Apply(meta(o))),
            Some("ServiceMonitor") => w.monitors.apply_watcher_event(&Event::Apply(meta(o))),
            Some("PersistentVolumeClaim") => w.claims.apply_watcher_event(&Event::Apply(meta(o))),
            k => panic!("no cache for {k:?}"),
        }
    }
}

fn context(client: kube::Client, world: &[Value], metrics: Arc<Metrics>) -> Arc<Context> {
    context_and_writers(client, world, metrics).0
}

/// A context whose caches hold `world`, and the writers to change them later.
fn context_and_writers(
    client: kube::Client,
    world: &[Value],
    metrics: Arc<Metrics>,
) -> (Arc<Context>, Writers) {
    let (caches, mut writers) = Caches::manual();
    fill(&mut writers, world);
    let ctx = Context::new(
        client,
        config(),
        metrics,
        timing(),
        caches,
        Views::default(),
        Default::default(),
    );
    (Arc::new(ctx), writers)
}

/// One reconcile of `isvc` with the caches holding `world`, against `script`.
async fn run(isvc: &InferenceService, world: &[Value], script: Vec<Step>) -> Outcome {
    let (client, verifier) = apiserver::start(script);
    let metrics = Arc::new(Metrics::new().expect("metrics"));
    let ctx = context(client, world, metrics.clone());
    let result = tokio::time::timeout(
        Duration::from_secs(10),
        reconcile(Arc::new(isvc.clone()), ctx),
    )
    .await
    .expect("reconcile finished (a hang means a request was left unanswered)");
    let t = verifier.await.expect("verifier");
    Outcome { result, t, metrics }
}

/// A live object as the API server holds it after our apply, with `status` added.
fn live(applied: &Value, status: Value) -> Value {
    let mut v = applied.clone();
    v["metadata"]["uid"] = json!("child-uid");
    v["metadata"]["generation"] = json!(1);
    v["status"] = status;
    v
}

fn rolled_out(replicas: i32) -> Value {
    json!({"observedGeneration": 1, "replicas": replicas, "updatedReplicas": replicas,
           "readyReplicas": replicas, "availableReplicas": replicas})
}

fn condition<'a>(status: &'a Value, type_: &str) -> &'a Value {
    status["conditions"]
        .as_array()
        .and_then(|c| c.iter().find(|c| c["type"] == type_))
        .unwrap_or_else(|| panic!("no {type_} condition in {status}"))
}

/// The script of a first reconcile with the ServiceMonitor CRD absent.
fn create_script(isvc: &InferenceService) -> Vec<Step> {
    create_script_with(isvc, None)
}

/// The script of a first reconcile; `discovery` is the monitoring group's resource list when
/// the ServiceMonitor CRD is installed.
fn create_script_with(isvc: &InferenceService, discovery: Option<Value>) -> Vec<Step> {
    let monitor = discovery.is_some();
    let mut s = vec![
        step(Method::GET, DISCOVERY, discovery.map_or_else(not_found, ok)),
        step(Method::GET, KEDA_DISCOVERY, not_found()),
    ];
    s.extend(created(DEPLOYMENT));
    s.extend(created(SERVICE));
    if monitor {
        s.extend(created(MONITOR));
    }
    s.extend(created(DASHBOARD));
    s.extend(event_steps(if monitor { 4 } else { 3 }));
    s.push(step(Method::PATCH, STATUS, status_echo(isvc)));
    s
}

/// A child the caches do not hold: looked up first (the adoption rule: nothing someone else
/// made is applied over), then applied.
fn created(path: &str) -> Vec<Step> {
    vec![
        step(Method::GET, path, not_found()),
        step(Method::PATCH, path, echo()),
    ]
}

/// The discovery of a reconcile that finds the ServiceMonitor CRD absent.
fn discovery_absent() -> Vec<Step> {
    vec![
        step(Method::GET, DISCOVERY, not_found()),
        step(Method::GET, KEDA_DISCOVERY, not_found()),
    ]
}

/// Creation, then the rollout finishing, then a steady state with no requests but discovery.
#[tokio::test]
async fn create_then_ready_then_steady_state_without_writes() {
    let first = isvc(1, spec(), None);
    let o = run(&first, &[], create_script(&first)).await;
    o.t.assert_clean();
    assert_eq!(
        o.result.expect("reconciles"),
        Action::requeue(timing().progressing)
    );
    let patch =
        &o.t.seen
            .iter()
            .find(|s| s.method == Method::PATCH)
            .expect("a patch")
            .uri;
    assert!(
        patch.contains("fieldManager=ferrite-operator") && patch.contains("force=true"),
        "server-side apply with our field manager: {patch}"
    );
    let reasons: Vec<_> =
        o.t.bodies(Method::POST, "/events")
            .iter()
            .map(|e| e["reason"].clone())
            .collect();
    assert_eq!(reasons, vec![json!("Created"); 3]);
    let status = &o.t.bodies(Method::PATCH, "/status")[0]["status"];
    assert_eq!(status["observedGeneration"], 1);
    assert_eq!(condition(status, "Ready")["status"], "False");
    assert_eq!(condition(status, "Progressing")["status"], "True");
    assert_eq!(condition(status, "Degraded")["status"], "False");
    let monitoring = condition(status, "MonitoringReady");
    assert_eq!(monitoring["status"], "False");
    assert_eq!(monitoring["reason"], "ServiceMonitorCRDNotInstalled");
    assert_eq!(
        status["selector"],
        "app.kubernetes.io/component=server,ferrite.dev/inferenceservice=chat"
    );
    assert_eq!(o.metrics.reconciles.get(), 1);

    // The Deployment becomes available: Ready turns true, with one event and one status write.
    let deployment = live(o.t.bodies(Method::PATCH, DEPLOYMENT)[0], rolled_out(1));
    let service = live(o.t.bodies(Method::PATCH, SERVICE)[0], json!({}));
    let dashboard = live(o.t.bodies(Method::PATCH, DASHBOARD)[0], Value::Null);
    let world = [deployment, service, dashboard];
    let second = isvc(1, spec(), Some(status));
    let mut script = discovery_absent();
    script.push(step(Method::POST, EVENTS, echo()));
    script.push(step(Method::PATCH, STATUS, status_echo(&second)));
    let o = run(&second, &world, script).await;
    o.t.assert_clean();
    assert_eq!(
        o.result.expect("reconciles"),
        Action::requeue(timing().settled)
    );
    assert_eq!(o.t.bodies(Method::POST, "/events")[0]["reason"], "Ready");
    let ready_status = o.t.bodies(Method::PATCH, "/status")[0]["status"].clone();
    let ready = condition(&ready_status, "Ready");
    assert_eq!(ready["status"], "True");
    assert_eq!(ready["reason"], "Available");
    assert_eq!(ready_status["readyReplicas"], 1);
    assert_eq!(
        condition(&ready_status, "Degraded")["lastTransitionTime"],
        condition(status, "Degraded")["lastTransitionTime"],
        "an unchanged condition keeps its transition time"
    );

    // Nothing changed: the caches answer everything, and nothing is written.
    let third = isvc(1, spec(), Some(&ready_status));
    let o = run(&third, &world, discovery_absent()).await;
    o.t.assert_clean();
    assert!(o.result.is_ok());
    assert!(
        !o.t.seen.iter().any(|s| s.is_write()),
        "steady state wrote:\n{}",
        o.t.summary()
    );
}

/// A deleted Deployment (its watch fires) is recreated; the rest is left alone.
#[tokio::test]
async fn a_deleted_deployment_is_recreated() {
    let first = isvc(1, spec(), None);
    let o = run(&first, &[], create_script(&first)).await;
    o.t.assert_clean();
    let status = o.t.bodies(Method::PATCH, "/status")[0]["status"].clone();
    let service = live(o.t.bodies(Method::PATCH, SERVICE)[0], json!({}));
    let dashboard = live(o.t.bodies(Method::PATCH, DASHBOARD)[0], Value::Null);
    let again = isvc(1, spec(), Some(&status));
    let mut script = discovery_absent();
    script.extend(created(DEPLOYMENT));
    script.extend(event_steps(1));
    let o = run(&again, &[service, dashboard], script).await;
    o.t.assert_clean();
    assert!(o.result.is_ok());
    assert_eq!(
        o.t.bodies(Method::POST, "/events")[0]["note"],
        "created Deployment chat"
    );
}

/// A hand edit of the Deployment (its generation moves, its stamp stays) is put back within
/// one reconcile, and recorded as such; a second look finds nothing to do.
#[tokio::test]
async fn a_hand_edited_deployment_is_restored() {
    let first = isvc(1, spec(), None);
    let o = run(&first, &[], create_script(&first)).await;
    let status = o.t.bodies(Method::PATCH, "/status")[0]["status"].clone();
    // Still rolling out, so the status stays as it is and only the Deployment matters.
    let deployment = live(o.t.bodies(Method::PATCH, DEPLOYMENT)[0], json!({}));
    let service = live(o.t.bodies(Method::PATCH, SERVICE)[0], json!({}));
    let dashboard = live(o.t.bodies(Method::PATCH, DASHBOARD)[0], Value::Null);
    let settled = Arc::new(isvc(1, spec(), Some(&status)));

    // One context across three reconciles: the first takes the live objects as its own.
    // The server moves the generation again when the restoring write changes the spec.
    let restored: Reply = Box::new(|body| {
        let mut b = body.clone();
        b["metadata"]["uid"] = json!("child-uid");
        b["metadata"]["generation"] = json!(3);
        (StatusCode::OK, b)
    });
    let mut script = discovery_absent();
    script.extend(discovery_absent());
    script.push(step(Method::PATCH, DEPLOYMENT, restored));
    script.extend(event_steps(1));
    script.extend(discovery_absent());
    let (client, verifier) = apiserver::start(script);
    let metrics = Arc::new(Metrics::new().expect("metrics"));
    let (ctx, mut writers) =
        context_and_writers(client, &[deployment.clone(), service, dashboard], metrics);
    reconcile(settled.clone(), ctx.clone())
        .await
        .expect("baseline");

    let mut edited = deployment.clone();
    edited["metadata"]["generation"] = json!(2);
    edited["spec"]["template"]["spec"]["containers"][0]["image"] = json!("mine:1");
    writers
        .deployments
        .apply_watcher_event(&Event::Apply(from(&edited)));
    reconcile(settled.clone(), ctx.clone())
        .await
        .expect("restores");
    // The cache now shows the object as the (scripted) server answered the write.
    let mut restored = deployment;
    restored["metadata"]["generation"] = json!(3);
    writers
        .deployments
        .apply_watcher_event(&Event::Apply(from(&restored)));
    reconcile(settled, ctx.clone()).await.expect("settled");
    drop(ctx);
    let t = verifier.await.expect("verifier");
    t.assert_clean();
    let applied = t.bodies(Method::PATCH, DEPLOYMENT)[0];
    assert_ne!(
        applied["spec"]["template"]["spec"]["containers"][0]["image"],
        "mine:1"
    );
    assert_eq!(
        t.bodies(Method::POST, "/events")[0]["note"],
        "restored Deployment chat, which was changed outside the operator"
    );
}

/// A spec change updates what it touches, adds a PDB for replicas > 1, and moves
/// observedGeneration (status and every condition) to the new generation.
#[tokio::test]
async fn a_spec_change_updates_the_deployment_adds_a_pdb_and_moves_observed_generation() {
    let first = isvc(1, spec(), None);
    let o = run(&first, &[], create_script(&first)).await;
    o.t.assert_clean();
    let status = o.t.bodies(Method::PATCH, "/status")[0]["status"].clone();
    let deployment = live(o.t.bodies(Method::PATCH, DEPLOYMENT)[0], rolled_out(1));
    let service = live(o.t.bodies(Method::PATCH, SERVICE)[0], json!({}));
    let dashboard = live(o.t.bodies(Method::PATCH, DASHBOARD)[0], Value::Null);

    let mut changed_spec = spec();
    changed_spec["replicas"] = json!(3);
    let changed = isvc(2, changed_spec, Some(&status));
    let mut script = discovery_absent();
    script.push(step(Method::PATCH, DEPLOYMENT, echo()));
    script.extend(created(PDB));
    script.extend(event_steps(2));
    script.push(step(Method::PATCH, STATUS, status_echo(&changed)));
    let o = run(&changed, &[deployment, service, dashboard], script).await;
    o.t.assert_clean();
    assert!(o.result.is_ok());
    assert_eq!(
        o.t.bodies(Method::PATCH, DEPLOYMENT)[0]["spec"]["replicas"],
        3
    );
    let notes: Vec<_> =
        o.t.bodies(Method::POST, "/events")
            .iter()
            .map(|e| e["note"].clone())
            .collect();
    assert_eq!(
        notes,
        [
            json!("updated Deployment chat"),
            json!("created PodDisruptionBudget chat")
        ]
    );
    let status = &o.t.bodies(Method::PATCH, "/status")[0]["status"];
    assert_eq!(status["observedGeneration"], 2);
    for c in status["conditions"].as_array().expect("conditions") {
        assert_eq!(c["observedGeneration"], 2, "{c}");
    }
}

/// A metadata-only generation bump changes no child, yet the status follows the generation.
#[tokio::test]
async fn observed_generation_follows_generation_even_when_no_child_changes() {
    let first = isvc(1, spec(), None);
    let o = run(&first, &[], create_script(&first)).await;
    let status = o.t.bodies(Method::PATCH, "/status")[0]["status"].clone();
    let deployment = live(o.t.bodies(Method::PATCH, DEPLOYMENT)[0], json!({}));
    let service = live(o.t.bodies(Method::PATCH, SERVICE)[0], json!({}));
    let dashboard = live(o.t.bodies(Method::PATCH, DASHBOARD)[0], Value::Null);
    let bumped = isvc(5, spec(), Some(&status));
    let mut script = discovery_absent();
    script.push(step(Method::PATCH, STATUS, status_echo(&bumped)));
    let o = run(&bumped, &[deployment, service, dashboard], script).await;
    o.t.assert_clean();
    assert!(o.result.is_ok());
    assert_eq!(
        o.t.bodies(Method::PATCH, "/status")[0]["status"]["observedGeneration"],
        5
    );
}

/// The ServiceMonitor API's resource list, as discovery answers with the CRD installed.
fn monitor_resources() -> Value {
    json!({"kind": "APIResourceList", "apiVersion": "v1",
        "groupVersion": "monitoring.coreos.com/v1",
        "resources": [{"name": "servicemonitors", "singularName": "servicemonitor",
                       "namespaced": true, "kind": "ServiceMonitor", "verbs": ["get", "list"]}]})
}

/// Switching monitoring off and dropping to one replica deletes the ServiceMonitor, the PDB
/// and the dashboard ConfigMaps the operator made, and nothing it does not control.
#[tokio::test]
async fn objects_no_longer_wanted_are_deleted() {
    let owned = |kind: &str, name: &str, api: &str| {
        json!({"apiVersion": api, "kind": kind,
               "metadata": {"name": name, "namespace": NS, "uid": "u",
                            "labels": {"app.kubernetes.io/component": "dashboard",
                                       "ferrite.dev/inferenceservice": "chat"},
                            "ownerReferences": [{"apiVersion": "ferrite.dev/v1alpha1",
                                "kind": "InferenceService", "name": "chat", "uid": "isvc-uid",
                                "controller": true}]}})
    };
    let mut foreign_cm = owned("ConfigMap", "chat-dashboard-old", "v1");
    foreign_cm["metadata"]["ownerReferences"][0]["uid"] = json!("someone-else");
    let s = json!({"model": {"source": "/models/smol.gguf"},
                   "monitoring": {"serviceMonitor": {"enabled": false},
                                  "dashboards": {"enabled": false}}});
    let i = isvc(2, s, None);
    let world = [
        owned("PodDisruptionBudget", "chat", "policy/v1"),
        owned("ServiceMonitor", "chat", "monitoring.coreos.com/v1"),
        owned("ConfigMap", "chat-dashboard-overview", "v1"),
        foreign_cm,
    ];
    let mut script = vec![
        step(Method::GET, DISCOVERY, ok(monitor_resources())),
        step(Method::GET, KEDA_DISCOVERY, not_found()),
    ];
    script.extend(created(DEPLOYMENT));
    script.extend(created(SERVICE));
    script.extend([
        step(Method::DELETE, PDB, deleted()),
        step(Method::DELETE, MONITOR, deleted()),
        step(Method::DELETE, DASHBOARD, deleted()),
    ]);
    script.extend(event_steps(5));
    script.push(step(Method::PATCH, STATUS, status_echo(&i)));
    let o = run(&i, &world, script).await;
    // The script holds no DELETE of chat-dashboard-old: assert_clean fails on any.
    o.t.assert_clean();
    assert!(o.result.is_ok());
    let status = &o.t.bodies(Method::PATCH, "/status")[0]["status"];
    assert_eq!(
        condition(status, "MonitoringReady")["reason"],
        "ServiceMonitorDisabled"
    );
}

/// An InferenceService being deleted is left to garbage collection: no requests at all.
#[tokio::test]
async fn an_inferenceservice_being_deleted_is_left_to_garbage_collection() {
    let mut v = isvc_json(1, spec(), None);
    v["metadata"]["deletionTimestamp"] = json!("2026-11-22T10:00:00Z");
    let i: InferenceService = serde_json::from_value(v).expect("valid");
    let o = run(&i, &[], vec![]).await;
    o.t.assert_clean();
    assert_eq!(o.result.expect("reconciles"), Action::await_change());
    assert!(o.t.seen.is_empty());
}

/// With the ServiceMonitor CRD installed the monitor is applied and the condition says so.
#[tokio::test]
async fn with_the_service_monitor_crd_present_a_monitor_is_applied() {
    let i = isvc(1, spec(), None);
    let script = create_script_with(&i, Some(monitor_resources()));
    let o = run(&i, &[], script).await;
    o.t.assert_clean();
    assert!(o.result.is_ok());
    let sm = o.t.bodies(Method::PATCH, MONITOR)[0];
    assert_eq!(sm["kind"], "ServiceMonitor");
    assert_eq!(sm["metadata"]["ownerReferences"][0]["uid"], "isvc-uid");
    let status = &o.t.bodies(Method::PATCH, "/status")[0]["status"];
    let m = condition(status, "MonitoringReady");
    assert_eq!(
        (m["status"].clone(), m["reason"].clone()),
        (json!("True"), json!("ServiceMonitorApplied"))
    );
}

/// A conflict (or any API error) fails the reconcile, is counted, and is retried with a
/// backoff that grows per consecutive failure and resets after a success.
#[tokio::test]
async fn api_conflicts_and_errors_are_retried_with_growing_backoff() {
    let i = isvc(1, spec(), None);
    let (client, verifier) = apiserver::start(vec![
        step(Method::GET, DISCOVERY, not_found()),
        step(Method::GET, KEDA_DISCOVERY, not_found()),
        step(Method::GET, DEPLOYMENT, not_found()),
        step(
            Method::PATCH,
            DEPLOYMENT,
            status_reply(StatusCode::CONFLICT, "Conflict"),
        ),
        step(Method::GET, DISCOVERY, not_found()),
        step(Method::GET, KEDA_DISCOVERY, not_found()),
        step(Method::GET, DEPLOYMENT, not_found()),
        step(
            Method::PATCH,
            DEPLOYMENT,
            status_reply(StatusCode::INTERNAL_SERVER_ERROR, "InternalError"),
        ),
        // A failure on the server's side is shown in status (Degraded, a Warning event)
        // before the reconcile fails.
        step(Method::POST, EVENTS, echo()),
        step(Method::PATCH, STATUS, status_echo(&i)),
    ]);
    let metrics = Arc::new(Metrics::new().expect("metrics"));
    let ctx = context(client, &[], metrics.clone());
    let obj = Arc::new(i);
    let t = timing();

    let err = reconcile(obj.clone(), ctx.clone())
        .await
        .expect_err("409 fails the reconcile");
    assert!(err.to_string().contains("Deployment chat"), "{err}");
    assert_eq!(
        error_policy(obj.clone(), &err, ctx.clone()),
        Action::requeue(t.min_backoff)
    );
    let err = reconcile(obj.clone(), ctx.clone())
        .await
        .expect_err("500 fails the reconcile");
    assert_eq!(
        error_policy(obj.clone(), &err, ctx.clone()),
        Action::requeue(t.min_backoff * 2)
    );
    assert_eq!(metrics.errors.with_label_values(&["conflict"]).get(), 1);
    assert_eq!(metrics.errors.with_label_values(&["api"]).get(), 1);
    drop(ctx);
    verifier.await.expect("verifier").assert_clean();

    // A success in between resets the backoff.
    let first = isvc(1, spec(), None);
    let (client, verifier) = apiserver::start(create_script(&first));
    let ctx = context(client, &[], metrics.clone());
    let obj = Arc::new(first);
    let _ = error_policy(obj.clone(), &err, ctx.clone());
    let _ = error_policy(obj.clone(), &err, ctx.clone());
    reconcile(obj.clone(), ctx.clone())
        .await
        .expect("reconciles");
    assert_eq!(
        error_policy(obj.clone(), &err, ctx.clone()),
        Action::requeue(t.min_backoff)
    );
    drop(ctx);
    verifier.await.expect("verifier").assert_clean();
}

/// A claim that does not exist: nothing is applied, Degraded says which claim, one warning
/// event; the retry is slow (no hot loop) and a repeat is quiet.
#[tokio::test]
async fn a_missing_claim_shows_as_degraded_without_applying_anything() {
    let s = json!({"model": {"source": "pvc://models/smol.gguf"}});
    let i = isvc(1, s.clone(), None);
    let mut script = discovery_absent();
    script.push(step(Method::POST, EVENTS, echo()));
    script.push(step(Method::PATCH, STATUS, status_echo(&i)));
    let o = run(&i, &[], script).await;
    o.t.assert_clean();
    assert_eq!(
        o.result.expect("reconciles"),
        Action::requeue(timing().blocked)
    );
    let status = o.t.bodies(Method::PATCH, "/status")[0]["status"].clone();
    let d = condition(&status, "Degraded");
    assert_eq!(
        (d["status"].clone(), d["reason"].clone()),
        (json!("True"), json!("PersistentVolumeClaimNotFound"))
    );
    assert!(
        d["message"]
            .as_str()
            .is_some_and(|m| m.contains("ml/models")),
        "{d}"
    );
    let e = o.t.bodies(Method::POST, "/events")[0];
    assert_eq!(
        (e["type"].clone(), e["reason"].clone()),
        (json!("Warning"), json!("PersistentVolumeClaimNotFound"))
    );

    let again = isvc(1, s, Some(&status));
    let o = run(&again, &[], discovery_absent()).await;
    o.t.assert_clean();
    assert!(o.result.is_ok());
}

/// A spec the schema accepts but the build rejects is Degraded with the build's reason.
#[tokio::test]
async fn an_unbuildable_spec_is_degraded_with_the_reason() {
    let s = json!({"model": {"source": "/models/smol.gguf"},
                   "runtime": {"engine": {"kvCacheMemory": "lots"}}});
    let i = isvc(1, s, None);
    let mut script = discovery_absent();
    script.push(step(Method::POST, EVENTS, echo()));
    script.push(step(Method::PATCH, STATUS, status_echo(&i)));
    let o = run(&i, &[], script).await;
    o.t.assert_clean();
    let status = &o.t.bodies(Method::PATCH, "/status")[0]["status"];
    let d = condition(status, "Degraded");
    assert_eq!(d["reason"], "InvalidEngineSettings");
    assert!(
        d["message"].as_str().is_some_and(|m| m.contains("lots")),
        "{d}"
    );
}

/// An image that cannot be pulled shows as Degraded with the kubelet's message.
#[tokio::test]
async fn an_image_pull_failure_shows_as_degraded() {
    let first = isvc(1, spec(), None);
    let o = run(&first, &[], create_script(&first)).await;
    let status = o.t.bodies(Method::PATCH, "/status")[0]["status"].clone();
    let deployment = live(
        o.t.bodies(Method::PATCH, DEPLOYMENT)[0],
        json!({"replicas": 1, "updatedReplicas": 1, "observedGeneration": 1}),
    );
    let service = live(o.t.bodies(Method::PATCH, SERVICE)[0], json!({}));
    let dashboard = live(o.t.bodies(Method::PATCH, DASHBOARD)[0], Value::Null);
    let pod = json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "chat-abc", "namespace": NS,
                     "labels": {"ferrite.dev/inferenceservice": "chat"}},
        "status": {"containerStatuses": [{"name": "server", "image": "nope:1", "imageID": "",
            "ready": false, "restartCount": 0,
            "state": {"waiting": {"reason": "ImagePullBackOff",
                                  "message": "Back-off pulling image \"nope:1\""}}}]}});
    let i = isvc(1, spec(), Some(&status));
    let mut script = discovery_absent();
    script.extend([
        step(Method::POST, EVENTS, echo()),
        step(Method::PATCH, STATUS, status_echo(&i)),
    ]);
    let o = run(&i, &[deployment, service, dashboard, pod], script).await;
    o.t.assert_clean();
    assert_eq!(
        o.result.expect("reconciles"),
        Action::requeue(timing().progressing)
    );
    let status = &o.t.bodies(Method::PATCH, "/status")[0]["status"];
    let d = condition(status, "Degraded");
    assert_eq!(d["reason"], "ImagePullBackOff");
    assert!(
        d["message"].as_str().is_some_and(|m| m.contains("nope:1")),
        "{d}"
    );
}

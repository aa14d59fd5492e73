//! The pure status step: rollout completeness as `kubectl rollout status` judges it, failures
//! read from pods, and the conditions computed from them.

use ferrite_operator::build::lws::LeaderWorkerSet;
use ferrite_operator::status::{
    self, DEGRADED, Finding, MonitorState, Observation, PROGRESSING, READY, Workload, pod_failure,
    rollout,
};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use serde_json::{Value, json};

fn deployment(generation: i64, replicas: i64, status: Value) -> Deployment {
    serde_json::from_value(json!({"metadata": {"name": "d", "generation": generation},
        "spec": {"replicas": replicas, "selector": {}, "template": {}}, "status": status}))
    .expect("deployment")
}

/// A LeaderWorkerSet's rollout counts groups: complete once LWS saw the generation and every
/// wanted group is updated and ready, none left over, no update in progress.
#[test]
fn a_group_rollout_is_complete_when_every_group_is_updated_and_ready() {
    let groups = |generation: i64, want: i32, status: Value| -> LeaderWorkerSet {
        serde_json::from_value(json!({
            "apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet",
            "metadata": {"name": "big", "namespace": "ml", "generation": generation},
            "spec": {"replicas": want, "startupPolicy": "LeaderCreated",
                     "leaderWorkerTemplate": {"size": 2, "restartPolicy": "RecreateGroupOnPodRestart",
                         "leaderTemplate": {}, "workerTemplate": {}},
                     "rolloutStrategy": {"type": "RollingUpdate",
                         "rollingUpdateConfiguration": {"maxSurge": 0, "maxUnavailable": 1}}},
            "status": status}))
        .expect("a LeaderWorkerSet")
    };
    let full =
        json!({"observedGeneration": 2, "replicas": 2, "updatedReplicas": 2, "readyReplicas": 2});
    let updating = json!({"observedGeneration": 2, "replicas": 2, "updatedReplicas": 2,
        "readyReplicas": 2, "conditions": [{"type": "UpdateInProgress", "status": "True",
        "reason": "GroupsUpdating", "message": "", "lastTransitionTime": "2026-11-29T00:00:00Z"}]});
    let cases = [
        ("finished", 2, full.clone(), true),
        ("LWS has not seen the generation", 3, full.clone(), false),
        ("an update in progress", 2, updating, false),
        (
            "a group not ready",
            2,
            json!({"observedGeneration": 2, "replicas": 2, "updatedReplicas": 2, "readyReplicas": 1}),
            false,
        ),
        (
            "an old group left",
            2,
            json!({"observedGeneration": 2, "replicas": 3, "updatedReplicas": 2, "readyReplicas": 3}),
            false,
        ),
        ("no status yet", 2, Value::Null, false),
    ];
    for (what, generation, st, complete) in cases {
        let g = groups(generation, 2, st);
        let r = Workload::Groups(&g).rollout();
        assert_eq!(r.complete, complete, "{what}");
    }
    let g = groups(2, 2, full);
    let r = Workload::Groups(&g).rollout();
    assert_eq!((r.replicas, r.ready, r.stalled), (2, 2, false));
    // Status counts groups, and Ready says so.
    let o = Observation {
        workload: Some(Workload::Groups(&g)),
        ..obs(None, 2)
    };
    let s = status::compute(&o, None, &Time(Timestamp::UNIX_EPOCH));
    assert_eq!((s.replicas, s.ready_replicas), (2, 2));
    let ready = status::condition(&s, READY).expect("Ready");
    assert_eq!(
        (ready.status.as_str(), ready.reason.as_str()),
        ("True", "Available")
    );
}

#[test]
fn rollout_completeness_follows_kubectl() {
    let full = json!({"observedGeneration": 2, "replicas": 2, "updatedReplicas": 2,
                      "readyReplicas": 2, "availableReplicas": 2});
    let cases = [
        ("finished", 2, full.clone(), true),
        (
            "controller has not seen the new generation",
            3,
            full.clone(),
            false,
        ),
        (
            "old pods still running",
            2,
            json!({"observedGeneration": 2, "replicas": 3, "updatedReplicas": 2, "readyReplicas": 3, "availableReplicas": 3}),
            false,
        ),
        (
            "new pods not available",
            2,
            json!({"observedGeneration": 2, "replicas": 2, "updatedReplicas": 2, "readyReplicas": 1, "availableReplicas": 1}),
            false,
        ),
        ("no status yet", 2, json!(null), false),
    ];
    for (what, generation, st, complete) in cases {
        let r = rollout(&deployment(generation, 2, st));
        assert_eq!(r.complete, complete, "{what}");
    }
    let stalled = json!({"observedGeneration": 1, "replicas": 1, "updatedReplicas": 1,
        "conditions": [{"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded"}]});
    assert!(rollout(&deployment(1, 1, stalled)).stalled);
}

fn pod(status: Value) -> Pod {
    serde_json::from_value(json!({"metadata": {"name": "p-1"}, "status": status})).expect("pod")
}

#[test]
fn pod_failures_name_the_pod_container_and_reason() {
    let crash = pod(
        json!({"containerStatuses": [{"name": "server", "image": "i", "imageID": "",
        "ready": false, "restartCount": 5,
        "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 5m0s"}}}]}),
    );
    let f = pod_failure(&[crash]).expect("a failure");
    assert_eq!(f.reason, "CrashLoopBackOff");
    assert!(
        f.message.contains("p-1") && f.message.contains("server"),
        "{}",
        f.message
    );

    let init = pod(
        json!({"initContainerStatuses": [{"name": "download", "image": "i", "imageID": "",
        "ready": false, "restartCount": 0,
        "state": {"waiting": {"reason": "ImagePullBackOff"}}}]}),
    );
    assert_eq!(
        pod_failure(&[init]).expect("a failure").reason,
        "ImagePullBackOff"
    );

    let unschedulable = pod(
        json!({"conditions": [{"type": "PodScheduled", "status": "False",
        "reason": "Unschedulable", "message": "0/3 nodes have nvidia.com/gpu"}]}),
    );
    let f = pod_failure(&[unschedulable]).expect("a failure");
    assert_eq!(f.reason, "Unschedulable");
    assert!(f.message.contains("nvidia.com/gpu"));

    // Starting up is not a failure.
    let starting = pod(
        json!({"containerStatuses": [{"name": "server", "image": "i", "imageID": "",
        "ready": false, "restartCount": 0,
        "state": {"waiting": {"reason": "ContainerCreating"}}}]}),
    );
    assert_eq!(pod_failure(&[starting]), None);
}

/// A container whose server wrote why it stopped is reported with the server's reason; one
/// that is running again (a retry under way) or wrote something else is not.
#[test]
fn the_servers_termination_message_names_the_failure() {
    let status = |state: Value, message: &str| {
        pod(
            json!({"containerStatuses": [{"name": "server", "image": "i", "imageID": "",
            "ready": false, "restartCount": 2, "state": state,
            "lastState": {"terminated": {"exitCode": 1, "message": message}}}]}),
        )
    };
    let back_off = json!({"waiting": {"reason": "CrashLoopBackOff"}});
    let f = pod_failure(&[status(
        back_off.clone(),
        "ModelLoadFailed: loading model /mnt/models/x.gguf: not a GGUF file\nlog line",
    )])
    .expect("a failure");
    assert_eq!(f.reason, "ModelLoadFailed");
    assert_eq!(
        f.message,
        "pod p-1, container server: loading model /mnt/models/x.gguf: not a GGUF file"
    );
    let just_exited = pod(
        json!({"containerStatuses": [{"name": "server", "image": "i",
        "imageID": "", "ready": false, "restartCount": 0,
        "state": {"terminated": {"exitCode": 1,
                                 "message": "ModelDownloadFailed: hf://a/b: HTTP 401"}}}]}),
    );
    assert_eq!(
        pod_failure(&[just_exited]).map(|f| f.reason),
        Some("ModelDownloadFailed".into())
    );
    let retrying = status(
        json!({"running": {"startedAt": "2026-11-26T00:00:00Z"}}),
        "ModelDownloadFailed: hf://a/b: timed out",
    );
    assert_eq!(pod_failure(&[retrying]), None);
    let other = status(back_off, "panic: something else");
    assert_eq!(
        pod_failure(&[other]).map(|f| f.reason),
        Some("CrashLoopBackOff".into())
    );
}

fn obs<'a>(d: Option<&'a Deployment>, desired: i32) -> Observation<'a> {
    Observation {
        generation: Some(4),
        blocked: None,
        desired_replicas: desired,
        workload: d.map(Workload::Deployment),
        pod_failure: None,
        monitor: MonitorState::Disabled,
        selector: Some("s".into()),
        url: Some("http://x".into()),
        autoscaling: None,
        served_name_conflict: None,
        adapters: Vec::new(),
    }
}

fn cond(s: &ferrite_api::crd::InferenceServiceStatus, t: &str) -> (String, String) {
    let c = status::condition(s, t).expect("condition");
    (c.status.clone(), c.reason.clone())
}

fn pair(a: &str, b: &str) -> (String, String) {
    (a.into(), b.into())
}

#[test]
fn conditions_for_each_situation() {
    let now = Time(Timestamp::UNIX_EPOCH);
    let done = deployment(
        1,
        1,
        json!({"observedGeneration": 1, "replicas": 1,
        "updatedReplicas": 1, "readyReplicas": 1, "availableReplicas": 1}),
    );
    let s = status::compute(&obs(Some(&done), 1), None, &now);
    assert_eq!(cond(&s, READY), pair("True", "Available"));
    assert_eq!(cond(&s, PROGRESSING), pair("False", "RolloutComplete"));
    assert_eq!(cond(&s, DEGRADED), pair("False", "AsExpected"));
    assert_eq!((s.observed_generation, s.ready_replicas), (Some(4), 1));

    let zero = deployment(1, 0, json!({"observedGeneration": 1}));
    let s = status::compute(&obs(Some(&zero), 0), None, &now);
    assert_eq!(cond(&s, READY), pair("False", "ScaledToZero"));

    // A blocked new spec while the old one still serves: Ready stays true and says so.
    let mut o = obs(Some(&done), 1);
    o.blocked = Some(Finding::new(
        "PersistentVolumeClaimNotFound",
        "claim x is missing",
    ));
    let s = status::compute(&o, None, &now);
    let ready = status::condition(&s, READY).expect("ready");
    assert_eq!(ready.status, "True");
    assert!(
        ready.message.contains("claim x is missing"),
        "{}",
        ready.message
    );
    assert_eq!(
        cond(&s, DEGRADED),
        pair("True", "PersistentVolumeClaimNotFound")
    );
    assert_eq!(
        cond(&s, PROGRESSING),
        pair("False", "PersistentVolumeClaimNotFound")
    );

    // Transition times survive an unchanged status and move on a change.
    let later = Time(Timestamp::from_second(1_000).expect("time"));
    let again = status::compute(&obs(Some(&done), 1), Some(&s), &later);
    let t = |st: &ferrite_api::crd::InferenceServiceStatus, c: &str| {
        status::condition(st, c)
            .expect("c")
            .last_transition_time
            .clone()
    };
    assert_eq!(t(&again, READY), t(&s, READY), "Ready stayed True");
    assert_eq!(t(&again, DEGRADED), later, "Degraded went False");
}

fn claimant(
    ns: &str,
    name: &str,
    served: &str,
    created: &str,
) -> ferrite_api::crd::InferenceService {
    serde_json::from_value(
        json!({"apiVersion": "ferrite.dev/v1alpha1", "kind": "InferenceService",
        "metadata": {"name": name, "namespace": ns, "uid": format!("{ns}-{name}"),
                     "creationTimestamp": created},
        "spec": {"model": {"source": "/m.gguf", "servedName": served}}}),
    )
    .expect("isvc")
}

/// A weighted group shares its holder's name: a weighted claimant in the holder's namespace is
/// no conflict, an unweighted one or one in another namespace (whatever its weight) is.
#[test]
fn a_weighted_claimant_in_the_holders_namespace_shares_the_name() {
    let weighted = |ns: &str, name: &str, created: &str, weight: Option<i32>| {
        let mut i = claimant(ns, name, "chat", created);
        i.spec.routing = Some(ferrite_api::crd::RoutingSpec {
            weight,
            ..Default::default()
        });
        i
    };
    let stable = weighted("team", "stable", "2026-01-01T00:00:00Z", Some(95));
    let canary = weighted("team", "canary", "2026-01-02T00:00:00Z", Some(5));
    let plain = weighted("team", "plain", "2026-01-03T00:00:00Z", None);
    let intruder = weighted("other", "intruder", "2026-01-04T00:00:00Z", Some(1000));
    let all = [&stable, &canary, &plain, &intruder];
    let conflict = |i| status::served_name_conflict(i, all.iter().copied());
    assert_eq!(conflict(&stable), None);
    assert_eq!(conflict(&canary), None);
    assert!(conflict(&plain).is_some());
    assert!(conflict(&intruder).is_some());
}

/// The oldest claimant holds a served name whatever the namespaces' order; a later one is
/// told who holds it and its own id; the holder, and a service alone with its name, are not.
#[test]
fn the_oldest_claimant_holds_a_served_name() {
    let old = claimant("zzz", "llm", "shared", "2026-01-01T00:00:00Z");
    let copy = claimant("aaa", "copy", "shared", "2026-01-02T00:00:00Z");
    let alone = claimant("aaa", "other", "mine", "2026-01-03T00:00:00Z");
    let all = [&old, &copy, &alone];
    assert_eq!(
        status::served_name_conflict(&old, all.iter().copied()),
        None
    );
    assert_eq!(
        status::served_name_conflict(&alone, all.iter().copied()),
        None
    );
    let f = status::served_name_conflict(&copy, all.iter().copied()).expect("conflict");
    assert_eq!(f.reason, status::SERVED_NAME_CONFLICT);
    assert!(
        f.message.contains("zzz/llm") && f.message.contains("aaa/copy"),
        "{}",
        f.message
    );
    // Created in the same second: namespace and name decide, the same way everywhere.
    let twin = claimant("bbb", "twin", "shared", "2026-01-01T00:00:00Z");
    let all = [&old, &twin];
    assert!(status::served_name_conflict(&old, all.iter().copied()).is_some());
    assert_eq!(
        status::served_name_conflict(&twin, all.iter().copied()),
        None
    );

    let mut o = obs(None, 1);
    o.served_name_conflict = Some(f);
    let s = status::compute(&o, None, &Time(Timestamp::UNIX_EPOCH));
    assert_eq!(cond(&s, READY), pair("False", status::SERVED_NAME_CONFLICT));
}

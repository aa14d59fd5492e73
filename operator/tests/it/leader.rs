//! Leader election: the Lease protocol against a real API server (the shared test cluster, a
//! namespace per test), including a takeover from a holder that died without letting go; and
//! a lost race answered by 409, against a scripted server.

use std::time::Duration;

use crate::apiserver::{self, ok, status_reply, step};
use ferrite_operator::leader::{LeaderElector, LeaseSettings, Role};
use ferrite_testkit::kube::Cluster;
use http::{Method, StatusCode};
use k8s_openapi::api::coordination::v1::Lease;
use kube::api::{Api, PostParams};
use serde_json::{Value, json};

const LEASES: &str = "/apis/coordination.k8s.io/v1/namespaces/ml/leases";

fn settings(ns: &str, identity: &str, secs: u64) -> LeaseSettings {
    LeaseSettings {
        name: "leader".into(),
        namespace: ns.into(),
        identity: identity.into(),
        lease_duration: Duration::from_secs(secs),
    }
}

async fn lease(client: &kube::Client, ns: &str) -> Value {
    let l = Api::<Lease>::namespaced(client.clone(), ns)
        .get("leader")
        .await
        .expect("the Lease");
    serde_json::to_value(l).expect("json")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_holder_at_a_time_with_renewal_and_release() {
    let Some(cluster) = Cluster::shared().await else {
        return;
    };
    let ns = cluster.namespace("lease").await;
    let client = cluster.client().await;
    let mut a = LeaderElector::new(client.clone(), settings(&ns, "a", 15));
    let mut b = LeaderElector::new(client.clone(), settings(&ns, "b", 15));
    assert_eq!(a.try_acquire().await.expect("a tries"), Role::Leader);
    assert_eq!(
        b.try_acquire().await.expect("b tries"),
        Role::Follower(Some("a".into()))
    );
    let first = lease(&client, &ns).await;
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert_eq!(a.try_acquire().await.expect("a renews"), Role::Leader);
    let renewed = lease(&client, &ns).await;
    assert_ne!(
        first["spec"]["renewTime"], renewed["spec"]["renewTime"],
        "renewal moves renewTime"
    );
    assert_eq!(renewed["spec"]["acquireTime"], first["spec"]["acquireTime"]);
    assert_eq!(
        b.try_acquire().await.expect("b tries"),
        Role::Follower(Some("a".into()))
    );

    a.release().await.expect("a releases");
    assert_eq!(b.try_acquire().await.expect("b tries"), Role::Leader);
    let lease = lease(&client, &ns).await;
    assert_eq!(lease["spec"]["holderIdentity"], "b");
    assert_eq!(lease["spec"]["leaseTransitions"], 1);
    assert_eq!(
        a.try_acquire().await.expect("a tries"),
        Role::Follower(Some("b".into()))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_holder_is_replaced_once_its_record_stops_changing_for_a_lease_duration() {
    let Some(cluster) = Cluster::shared().await else {
        return;
    };
    let ns = cluster.namespace("lease").await;
    let client = cluster.client().await;
    // The holder's clock is far off (renewTime in the future): only the local observation
    // of an unchanged record may decide expiry.
    let ghost: Lease = serde_json::from_value(json!({
        "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
        "metadata": {"name": "leader", "namespace": ns},
        "spec": {"holderIdentity": "ghost", "leaseDurationSeconds": 1,
                 "renewTime": "2099-01-01T00:00:00.000000Z", "leaseTransitions": 4}}))
    .expect("Lease");
    Api::<Lease>::namespaced(client.clone(), &ns)
        .create(&PostParams::default(), &ghost)
        .await
        .expect("lease stored");
    let mut b = LeaderElector::new(client.clone(), settings(&ns, "b", 1));
    assert_eq!(
        b.try_acquire().await.expect("tries"),
        Role::Follower(Some("ghost".into()))
    );
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(
        b.try_acquire().await.expect("tries"),
        Role::Follower(Some("ghost".into())),
        "not expired before a whole lease duration"
    );
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert_eq!(b.try_acquire().await.expect("tries"), Role::Leader);
    let lease = lease(&client, &ns).await;
    assert_eq!(lease["spec"]["holderIdentity"], "b");
    assert_eq!(lease["spec"]["leaseTransitions"], 5);
}

#[tokio::test]
async fn losing_the_write_race_makes_a_follower_not_a_second_leader() {
    let released = json!({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
        "metadata": {"name": "leader", "namespace": "ml", "resourceVersion": "3"},
        "spec": {"leaseDurationSeconds": 1}});
    let (client, verifier) = apiserver::start(vec![
        step(Method::GET, format!("{LEASES}/leader"), ok(released)),
        step(
            Method::PUT,
            format!("{LEASES}/leader"),
            status_reply(StatusCode::CONFLICT, "Conflict"),
        ),
    ]);
    let mut b = LeaderElector::new(client, settings("ml", "b", 15));
    assert_eq!(b.try_acquire().await.expect("tries"), Role::Follower(None));
    drop(b);
    let t = verifier.await.expect("verifier");
    t.assert_clean();
    let put = t.bodies(Method::PUT, "/leases/leader")[0];
    assert_eq!(
        put["metadata"]["resourceVersion"], "3",
        "the write is conditional on what was read"
    );
}

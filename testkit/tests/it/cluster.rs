//! The harness itself: a private cluster starts, serves, authorizes a ServiceAccount by RBAC,
//! and survives an apiserver restart; the shared cluster is joined by concurrent users.

use std::time::Duration;

use ferrite_testkit::kube::Cluster;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, ObjectMeta, PostParams};

fn cm(name: &str) -> ConfigMap {
    ConfigMap {
        metadata: ObjectMeta {
            name: Some(name.into()),
            ..ObjectMeta::default()
        },
        ..ConfigMap::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_private_cluster_serves_enforces_rbac_and_restarts() {
    let Some(mut cluster) = Cluster::start().await else {
        return;
    };
    let ns = cluster.namespace("kit").await;
    let admin = cluster.client().await;
    Api::<ConfigMap>::namespaced(admin.clone(), &ns)
        .create(&PostParams::default(), &cm("a"))
        .await
        .expect("admin creates");

    // A ServiceAccount without any binding is authenticated and forbidden.
    let kc = cluster.dir().join("sa.kubeconfig");
    cluster.service_account_kubeconfig(&ns, "nobody", &kc).await;
    let sa = ferrite_testkit::kube::client_from(&kc).await;
    let err = Api::<ConfigMap>::namespaced(sa, &ns)
        .get("a")
        .await
        .expect_err("RBAC forbids");
    match err {
        kube::Error::Api(s) => assert_eq!(s.code, 403, "{s:?}"),
        e => panic!("expected 403, got {e}"),
    }

    cluster.stop_apiserver();
    tokio::time::sleep(Duration::from_millis(500)).await;
    cluster.start_apiserver().await;
    let got = Api::<ConfigMap>::namespaced(cluster.client().await, &ns)
        .get("a")
        .await
        .expect("data survives an apiserver restart");
    assert_eq!(got.metadata.name.as_deref(), Some("a"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shared_cluster_serves_several_users() {
    let Some(first) = Cluster::shared().await else {
        return;
    };
    let Some(second) = Cluster::shared().await else {
        return;
    };
    assert_eq!(first.api_port, second.api_port, "one cluster");
    let ns = second.namespace("kit").await;
    Api::<ConfigMap>::namespaced(first.client().await, &ns)
        .create(&PostParams::default(), &cm("b"))
        .await
        .expect("creates in the shared cluster");
}

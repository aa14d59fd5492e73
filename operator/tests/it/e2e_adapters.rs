//! LoRA adapters on a real API server: an InferenceService declaring adapters, its two
//! stand-in pods running real ferrite-servers. The operator loads the adapters onto both
//! through the runtime's API, reports them per adapter in status, and follows edits to the
//! list (one added, one removed, one that cannot load) with no pod replaced.

use std::collections::BTreeSet;
use std::time::Duration;

use ferrite_testkit::e2e::{Applier, Operator, get_isvc, install, isvc, pods_ready_at};
use ferrite_testkit::kube::Cluster;
use ferrite_testkit::model::lora_adapter_dir;
use ferrite_testkit::process::{eventually, free_port};
use ferrite_testkit::server::{Server, post_json, start_server_at};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams};
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(90);

/// A ferrite-server at `host:port` as the operator's pod would run it: LoRA on, runtime
/// updates allowed, and no adapter of its own.
async fn lora_server(host: &'static str, port: u16) -> Server {
    lora_server_with(host, port, &[]).await
}

/// [`lora_server`] with more flags.
async fn lora_server_with(host: &'static str, port: u16, extra: &[&'static str]) -> Server {
    let mut flags = vec![
        "--enable-lora",
        "--max-loras",
        "2",
        "--max-cpu-loras",
        "16",
        "--allow-runtime-lora-updating",
        "true",
    ];
    flags.extend_from_slice(extra);
    tokio::task::spawn_blocking(move || {
        let mut s = start_server_at(host, port, &flags);
        s.wait_ready();
        s
    })
    .await
    .expect("server task")
}

/// The adapters a server lists in `/v1/models` (the entries with a parent), by name.
async fn served(base: &str) -> BTreeSet<String> {
    served_with(base, None).await
}

/// [`served`], sending `key` as the bearer token where given.
async fn served_with(base: &str, key: Option<&'static str>) -> BTreeSet<String> {
    let url = format!("{base}/v1/models");
    let list: Value = tokio::task::spawn_blocking(move || {
        let mut request = ureq::get(&url);
        if let Some(key) = key {
            request = request.set("Authorization", &format!("Bearer {key}"));
        }
        request
            .call()
            .expect("/v1/models")
            .into_json()
            .expect("JSON")
    })
    .await
    .expect("request thread");
    list["data"]
        .as_array()
        .expect("data")
        .iter()
        .filter(|m| m["parent"] == "smol")
        .map(|m| m["id"].as_str().expect("id").to_string())
        .collect()
}

/// `status.adapters` of `tuned` as (name, readyReplicas, reason).
async fn adapter_status(client: &kube::Client, ns: &str) -> Vec<(String, i64, String)> {
    adapter_status_of(client, ns, "tuned").await
}

/// `status.adapters` of `name` as (name, readyReplicas, reason).
async fn adapter_status_of(
    client: &kube::Client,
    ns: &str,
    name: &str,
) -> Vec<(String, i64, String)> {
    let Some(i) = get_isvc(client, ns, name).await else {
        return Vec::new();
    };
    i["status"]["adapters"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|s| {
                    (
                        s["name"].as_str().unwrap_or_default().to_string(),
                        s["readyReplicas"].as_i64().unwrap_or(-1),
                        s["reason"].as_str().unwrap_or_default().to_string(),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

async fn pod_uids(client: &kube::Client, ns: &str) -> BTreeSet<String> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    pods.list(&ListParams::default().labels("ferrite.dev/inferenceservice=tuned"))
        .await
        .expect("pods")
        .items
        .into_iter()
        .filter_map(|p| p.metadata.uid)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn declared_adapters_follow_the_list_on_running_pods_with_no_restart() {
    let Some(cluster) = Cluster::start().await else {
        return;
    };
    let client = cluster.client().await;
    let release = install(&cluster, &json!({}), "adapters").await;
    let _op = Operator::launch(&cluster, &release, "op-0", &["--adapter-sync-seconds=1"]).await;
    let ns = cluster.namespace("adapters").await;
    let port = free_port();
    let (one, two) = tokio::join!(
        lora_server("127.0.0.1", port),
        lora_server("127.0.0.2", port)
    );
    let dirs: Vec<String> = (1..=3)
        .map(|seed| lora_adapter_dir(seed).display().to_string())
        .collect();
    let spec = |adapters: Value| {
        isvc(
            &ns,
            "tuned",
            json!({"model": {"source": "/models/smol.gguf", "servedName": "smol",
                              "adapters": adapters, "lora": {"maxAdapters": 2}},
                   "runtime": {"port": port}, "replicas": 2}),
        )
    };
    let mut applier = Applier::new(client.clone()).await;
    // One adapter in PEFT form, one in llama.cpp's GGUF form.
    applier
        .apply(&spec(json!([
            {"name": "sql", "source": format!("{}/peft", dirs[0])},
            {"name": "tone", "source": format!("{}/adapter.gguf", dirs[1])}])))
        .await;
    eventually(WAIT, "two stand-in pods", async || {
        (pods_ready_at(&client, &ns, "tuned", &["127.0.0.1", "127.0.0.2"]).await >= 2).then_some(())
    })
    .await;
    let both = |names: &[&str]| names.iter().map(|n| n.to_string()).collect::<BTreeSet<_>>();
    eventually(
        WAIT,
        "both adapters on both servers, in status",
        async || {
            let s = adapter_status(&client, &ns).await;
            let want = vec![
                ("sql".to_string(), 2, String::new()),
                ("tone".to_string(), 2, String::new()),
            ];
            (s == want
                && served(&one.base).await == both(&["sql", "tone"])
                && served(&two.base).await == both(&["sql", "tone"]))
            .then_some(())
        },
    )
    .await;
    let pods = pod_uids(&client, &ns).await;
    assert_eq!(pods.len(), 2);

    // The openai-style request names the adapter.
    let (status, body, _) = post_json(
        format!("{}/v1/completions", two.base),
        json!({"model": "tone", "prompt": "The capital of France is", "max_tokens": 4}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["model"], "tone");

    // One removed, one added, one that cannot load: the servers follow, status says why
    // the broken one is not served, and no pod is replaced.
    applier
        .apply(&spec(json!([
            {"name": "sql", "source": format!("{}/peft", dirs[0])},
            {"name": "fresh", "source": format!("{}/peft", dirs[2])},
            {"name": "broken", "source": "/nonexistent/adapter"}])))
        .await;
    eventually(
        WAIT,
        "the edited list on both servers, in status",
        async || {
            let s = adapter_status(&client, &ns).await;
            let ok = s.len() == 3
                && s[0] == ("sql".to_string(), 2, String::new())
                && s[1] == ("fresh".to_string(), 2, String::new())
                && s[2].0 == "broken"
                && s[2].1 == 0
                && s[2].2 == "LoadFailed";
            (ok && served(&one.base).await == both(&["sql", "fresh"])
                && served(&two.base).await == both(&["sql", "fresh"]))
            .then_some(())
        },
    )
    .await;
    let i = get_isvc(&client, &ns, "tuned")
        .await
        .expect("the InferenceService");
    let message = i["status"]["adapters"][2]["message"]
        .as_str()
        .unwrap_or_default();
    assert!(
        message.contains("/nonexistent/adapter"),
        "the reason names the source: {message}"
    );
    assert_eq!(pod_uids(&client, &ns).await, pods, "no pod was replaced");
    let (status, body, _) = post_json(
        format!("{}/v1/completions", one.base),
        json!({"model": "tone", "prompt": "Hi", "max_tokens": 2}),
    )
    .await;
    assert!(
        status >= 400,
        "a removed adapter is no longer served: {status} {body}"
    );
}

/// A service with an API key: the operator reads the key from the Secret `spec.auth` names and
/// calls the pod's adapter API with it. Status says when the Secret is missing and when the
/// pod refuses the key it holds; once the Secret holds the pod's key, the adapter is loaded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adapters_of_a_service_with_an_api_key_are_loaded_with_its_key() {
    let Some(cluster) = Cluster::start().await else {
        return;
    };
    let client = cluster.client().await;
    let release = install(&cluster, &json!({}), "keyed").await;
    let _op = Operator::launch(&cluster, &release, "op-0", &["--adapter-sync-seconds=1"]).await;
    let ns = cluster.namespace("keyed").await;
    let port = free_port();
    let server = lora_server_with("127.0.0.1", port, &["--api-key", "right-key"]).await;
    let dir = lora_adapter_dir(1).display().to_string();
    let mut applier = Applier::new(client.clone()).await;
    applier
        .apply(&isvc(
            &ns,
            "keyed",
            json!({"model": {"source": "/models/smol.gguf", "servedName": "smol",
                             "adapters": [{"name": "sql", "source": format!("{dir}/peft")}]},
                   "runtime": {"port": port}, "replicas": 1,
                   "auth": {"apiKeySecretRef": {"name": "keys"}}}),
        ))
        .await;
    eventually(WAIT, "the stand-in pod", async || {
        (pods_ready_at(&client, &ns, "keyed", &["127.0.0.1"]).await >= 1).then_some(())
    })
    .await;
    let reason = async |want: &str| {
        let s = adapter_status_of(&client, &ns, "keyed").await;
        (s.len() == 1 && s[0].2 == want).then_some(())
    };
    eventually(WAIT, "the missing Secret in status", async || {
        reason("ApiKeySecretNotFound").await
    })
    .await;

    let secret = |key: &str| {
        // `data`, base64 as the API returns it (stringData is write-only, awkward to re-apply).
        let data =
            serde_json::to_value(k8s_openapi::ByteString(key.as_bytes().to_vec())).expect("base64");
        json!({"apiVersion": "v1", "kind": "Secret",
               "metadata": {"name": "keys", "namespace": ns},
               "data": {"api-key": data}})
    };
    applier.apply(&secret("wrong-key")).await;
    eventually(
        WAIT,
        "the pod refusing the wrong key, in status",
        async || reason("ApiKeyRefused").await,
    )
    .await;
    assert!(
        served_with(&server.base, Some("right-key"))
            .await
            .is_empty(),
        "nothing loaded with a refused key"
    );

    // The Secret fixed: the refusal made the operator read it again, well before its TTL.
    applier.apply(&secret("right-key")).await;
    eventually(WAIT, "the adapter loaded with the right key", async || {
        let s = adapter_status_of(&client, &ns, "keyed").await;
        (s == vec![("sql".to_string(), 1, String::new())]).then_some(())
    })
    .await;
    assert_eq!(
        served_with(&server.base, Some("right-key")).await,
        BTreeSet::from(["sql".to_string()])
    );
    let (status, _, _) = post_json(
        format!("{}/v1/completions", server.base),
        json!({"model": "sql", "prompt": "Hi", "max_tokens": 2}),
    )
    .await;
    assert_eq!(status, 401, "the pod still wants its key from clients");
}

//! The router binary serving HTTPS (`--tls-cert-file`, `--tls-key-file`) on a real API server
//! with a real ferrite-server behind it: a client that trusts the certificate gets its
//! completion, plain HTTP gets nothing, and when the files are replaced (as a kubelet updates a
//! mounted cert-manager Secret) new connections are served with the new certificate, with no
//! restart, while a stream open across the change finishes. With `--metrics-addr`, `/metrics`
//! is served there and not on the API port.

use std::path::Path;
use std::time::Duration;

use super::common::*;
use ferrite_testkit::process::{Guard, TempDir, eventually, free_port};
use serde_json::json;

/// A self-signed certificate for 127.0.0.1 and its key, as PEM.
fn certificate() -> (String, String) {
    let key = rcgen::KeyPair::generate().expect("key");
    let params = rcgen::CertificateParams::new(vec!["127.0.0.1".to_string()]).expect("params");
    let cert = params.self_signed(&key).expect("certificate");
    (cert.pem(), key.serialize_pem())
}

/// Writes the pair as a kubelet updates a Secret volume: new files, then one rename each.
fn install(dir: &Path, (cert, key): &(String, String)) {
    for (name, text) in [("tls.crt", cert), ("tls.key", key)] {
        let tmp = dir.join(format!(".{name}.new"));
        std::fs::write(&tmp, text).expect("write");
        std::fs::rename(&tmp, dir.join(name)).expect("rename");
    }
}

/// A completion over HTTPS trusting only `trusted`: the status, or the transport error.
async fn complete(url: String, trusted: String) -> Result<u16, String> {
    tokio::task::spawn_blocking(move || {
        let agent = ferrite_testkit::tls::agent(&trusted);
        let body = json!({"model": "chat", "prompt": "Hello", "max_tokens": 2});
        match agent.post(&url).send_json(body) {
            Ok(r) => Ok(r.status()),
            Err(ureq::Error::Status(code, _)) => Ok(code),
            Err(e) => Err(e.to_string()),
        }
    })
    .await
    .expect("request thread")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_router_serves_https_and_takes_a_renewed_certificate_without_a_restart() {
    let Some((cluster, client, ns, port)) = chat_service("tls", json!({})).await else {
        return;
    };
    let _server = server("127.0.0.1", port, "chat");
    ready_pod(&client, &ns, "chat", "chat-0", "127.0.0.1").await;
    let dir = TempDir::new("router-tls");
    let first = certificate();
    install(dir.path(), &first);
    let addr_port = free_port();
    let metrics_port = free_port();
    let mut cmd =
        std::process::Command::new(ferrite_testkit::server::workspace_binary("ferrite-router"));
    cmd.env("KUBECONFIG", cluster.admin_kubeconfig())
        .args(["--addr", &format!("127.0.0.1:{addr_port}")])
        .args(["--namespace", &ns, "--endpoints-from", "pods"])
        .arg(format!(
            "--tls-cert-file={}",
            dir.path().join("tls.crt").display()
        ))
        .arg(format!(
            "--tls-key-file={}",
            dir.path().join("tls.key").display()
        ))
        .arg("--tls-reload-seconds=1")
        .arg(format!("--metrics-addr=127.0.0.1:{metrics_port}"))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    let _router = Guard::spawn("ferrite-router", cmd).expect("spawn");
    let url = format!("https://127.0.0.1:{addr_port}/v1/completions");
    eventually(WAIT, "a completion over HTTPS", async || {
        (complete(url.clone(), first.0.clone()).await == Ok(200)).then_some(())
    })
    .await;
    // Plain HTTP on the same port is not served.
    let plain = format!("http://127.0.0.1:{addr_port}/v1/models");
    let answered = tokio::task::spawn_blocking(move || ureq::get(&plain).call().is_ok())
        .await
        .expect("request thread");
    assert!(!answered, "plain HTTP answered on the HTTPS port");
    // /metrics on its own port only (with tenants its series name every tenant).
    let (api_metrics, metrics) = {
        let trusted = first.0.clone();
        let api = format!("https://127.0.0.1:{addr_port}/metrics");
        let own = format!("http://127.0.0.1:{metrics_port}/metrics");
        tokio::task::spawn_blocking(move || {
            let status = match ferrite_testkit::tls::agent(&trusted).get(&api).call() {
                Ok(r) => r.status(),
                Err(ureq::Error::Status(code, _)) => code,
                Err(e) => panic!("{api}: {e}"),
            };
            let text = ureq::get(&own)
                .call()
                .expect("metrics")
                .into_string()
                .expect("text");
            (status, text)
        })
        .await
        .expect("request thread")
    };
    assert_eq!(api_metrics, 404);
    assert!(
        metrics.contains("ferrite_router_requests_total"),
        "{metrics}"
    );

    // A stream opened with the first certificate, read after the renewal.
    let stream_url = url.clone();
    let trusted = first.0.clone();
    let reader = tokio::task::spawn_blocking(move || {
        // 400 tokens: at the 2-core CI machine's slowest (a cold run, the CUDA build beside
        // it) that took more than the plain agent's 10 s.
        let agent = ferrite_testkit::tls::agent_within(&trusted, Duration::from_secs(180));
        let body = json!({"model": "chat", "prompt": "Once upon a time", "max_tokens": 400,
                          "ignore_eos": true, "stream": true});
        let r = agent
            .post(&stream_url)
            .send_json(body)
            .expect("the stream starts");
        let text = r.into_string().expect("the whole stream");
        (text, std::time::Instant::now())
    });

    let second = certificate();
    install(dir.path(), &second);
    eventually(WAIT, "the renewed certificate presented", async || {
        (complete(url.clone(), second.0.clone()).await == Ok(200)).then_some(())
    })
    .await;
    let renewed = std::time::Instant::now();
    let old = complete(url.clone(), first.0.clone()).await;
    assert!(
        old.is_err(),
        "a client trusting only the old certificate: {old:?}"
    );
    let (streamed, ended) = reader.await.expect("stream thread");
    assert!(streamed.ends_with("data: [DONE]\n\n"), "{streamed}");
    assert!(
        ended > renewed,
        "the stream was still open when the renewal was seen"
    );
    // A pair that does not load (a key of another certificate) leaves the current one.
    let (third_cert, _) = certificate();
    install(dir.path(), &(third_cert.clone(), second.1.clone()));
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(complete(url.clone(), second.0.clone()).await, Ok(200));
}

//! The External Metrics API over real HTTPS on 127.0.0.1: discovery, values, label selection,
//! Status errors, and TLS that a client actually verifies (server certificate and name, and
//! client certificates when a client CA is set).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use ferrite_api::signal::Signals;
use ferrite_net::tls::CertError;
use ferrite_operator::autoscale::store::{Key, SignalStore, Snapshot};
use ferrite_operator::external_metrics::{
    CertSource, ClientAuth, ExternalMetricValueList, RequestHeader, ServerTls, TlsError,
    TlsSettings, serve_tls, service_names,
};
use ferrite_testkit::tls::{agent, agent_with, client_config};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::oneshot;

const BASE: &str = "/apis/external.metrics.k8s.io/v1beta1";

/// A server on an ephemeral port, on its own runtime so the blocking client can call it.
struct Server {
    rt: tokio::runtime::Runtime,
    addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<std::io::Result<()>>>,
}

impl Server {
    fn start(tls: &ServerTls, store: Arc<SignalStore>) -> Self {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("runtime");
        let listener = rt
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (stop, stopped) = oneshot::channel::<()>();
        let tls = tls.clone();
        let task = rt.spawn(async move {
            serve_tls(listener, tls, store, async {
                let _ = stopped.await;
            })
            .await
        });
        Self {
            rt,
            addr,
            stop: Some(stop),
            task: Some(task),
        }
    }

    fn url(&self, path: &str) -> String {
        format!("https://127.0.0.1:{}{path}", self.addr.port())
    }

    /// Stops the server; it must return cleanly.
    fn shutdown(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            let res = self
                .rt
                .block_on(async { tokio::time::timeout(Duration::from_secs(10), task).await })
                .expect("server stops within 10 s")
                .expect("server task");
            res.expect("serve_tls returns Ok");
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

/// (status code, JSON body) of a GET, errors included.
fn get(agent: &ureq::Agent, url: &str, selector: Option<&str>) -> (u16, Value) {
    let mut req = agent.get(url);
    if let Some(s) = selector {
        req = req.query("labelSelector", s);
    }
    let resp = match req.call() {
        Ok(r) => r,
        Err(ureq::Error::Status(_, r)) => r,
        Err(e) => panic!("GET {url}: {e}"),
    };
    let code = resp.status();
    assert!(
        resp.content_type() == "application/json",
        "{url}: content type {}",
        resp.content_type()
    );
    (code, resp.into_json().expect("JSON body"))
}

fn list(
    agent: &ureq::Agent,
    server: &Server,
    ns: &str,
    metric: &str,
    sel: Option<&str>,
) -> ExternalMetricValueList {
    let (code, body) = get(
        agent,
        &server.url(&format!("{BASE}/namespaces/{ns}/{metric}")),
        sel,
    );
    assert_eq!(code, 200, "{body}");
    serde_json::from_value(body).expect("ExternalMetricValueList")
}

/// name → value of each item.
fn values(l: &ExternalMetricValueList) -> BTreeMap<String, String> {
    l.items
        .iter()
        .map(|i| {
            (
                i.metric_labels["ferrite.dev/inferenceservice"].clone(),
                i.value.0.clone(),
            )
        })
        .collect()
}

fn at(secs: u64) -> SystemTime {
    SystemTime::UNIX_EPOCH + Duration::from_secs(secs)
}

fn snapshot(
    waiting: f64,
    running: f64,
    pods: usize,
    kv: Option<f64>,
    when: SystemTime,
    labels: &[(&str, &str)],
) -> Snapshot {
    Snapshot {
        signals: Signals {
            queue_per_replica: (pods > 0).then(|| waiting / pods as f64),
            kv_usage: kv,
            waiting,
            running,
            reporting: pods,
            ..Signals::default()
        },
        at: when,
        labels: labels
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
    }
}

fn store() -> Arc<SignalStore> {
    let store = SignalStore::new();
    store.put(
        Key::new("ml", "chat"),
        snapshot(
            6.0,
            4.0,
            3,
            Some(0.5),
            at(1_700_000_000),
            &[("tier", "gold"), ("team", "a")],
        ),
    );
    store.put(
        Key::new("ml", "embed"),
        snapshot(1.0, 2.0, 2, None, at(1_700_000_060), &[("tier", "silver")]),
    );
    // No pod reporting yet: never an item, so HPA holds instead of scaling down on zeros.
    store.put(
        Key::new("ml", "cold"),
        snapshot(0.0, 0.0, 0, None, at(1_700_000_000), &[("tier", "gold")]),
    );
    store.put(
        Key::new("research", "chat"),
        snapshot(10.0, 3.0, 1, Some(0.9), at(1_700_000_120), &[]),
    );
    Arc::new(store)
}

fn self_signed(names: &[&str]) -> ServerTls {
    ServerTls::new(&TlsSettings {
        cert: CertSource::SelfSigned {
            names: names.iter().map(|n| n.to_string()).collect(),
        },
        clients: ClientAuth::any_client(),
    })
    .expect("TLS")
}

#[test]
fn discovery_documents() {
    let tls = self_signed(&["localhost", "127.0.0.1"]);
    let server = Server::start(&tls, store());
    let agent = agent(&tls.cert_pem());

    let (code, groups) = get(&agent, &server.url("/apis"), None);
    assert_eq!(code, 200);
    assert_eq!(groups["kind"], "APIGroupList");
    assert_eq!(groups["apiVersion"], "v1");
    let group = &groups["groups"][0];
    assert_eq!(group["name"], "external.metrics.k8s.io");
    assert_eq!(
        group["preferredVersion"],
        serde_json::json!({"groupVersion": "external.metrics.k8s.io/v1beta1", "version": "v1beta1"})
    );
    assert_eq!(group["versions"][0]["version"], "v1beta1");

    let (code, g) = get(&agent, &server.url("/apis/external.metrics.k8s.io"), None);
    assert_eq!(code, 200);
    assert_eq!(g["kind"], "APIGroup");
    assert_eq!(g["name"], "external.metrics.k8s.io");
    assert_eq!(g["preferredVersion"]["version"], "v1beta1");

    let (code, r) = get(&agent, &server.url(BASE), None);
    assert_eq!(code, 200);
    assert_eq!(r["kind"], "APIResourceList");
    assert_eq!(r["groupVersion"], "external.metrics.k8s.io/v1beta1");
    let resources = r["resources"].as_array().expect("resources");
    let names: Vec<&str> = resources
        .iter()
        .filter_map(|r| r["name"].as_str())
        .collect();
    assert_eq!(
        names,
        [
            "ferrite_requests_waiting",
            "ferrite_requests_running",
            "ferrite_queue_per_replica",
            "ferrite_kv_cache_usage"
        ]
    );
    for res in resources {
        assert_eq!(res["namespaced"], true);
        assert_eq!(res["kind"], "ExternalMetricValueList");
        assert_eq!(res["verbs"], serde_json::json!(["get"]));
    }

    for path in ["/healthz", "/readyz", "/livez"] {
        let body = agent
            .get(&server.url(path))
            .call()
            .expect("health")
            .into_string()
            .expect("body");
        assert_eq!(body, "ok");
    }
}

#[test]
fn metric_values_and_timestamps() {
    let tls = self_signed(&["localhost", "127.0.0.1"]);
    let server = Server::start(&tls, store());
    let agent = agent(&tls.cert_pem());

    let waiting = list(&agent, &server, "ml", "ferrite_requests_waiting", None);
    assert_eq!(waiting.api_version, "external.metrics.k8s.io/v1beta1");
    assert_eq!(waiting.kind, "ExternalMetricValueList");
    assert_eq!(
        values(&waiting),
        BTreeMap::from([("chat".into(), "6".into()), ("embed".into(), "1".into())])
    );
    let chat = &waiting.items[0];
    assert_eq!(chat.metric_name, "ferrite_requests_waiting");
    assert_eq!(
        chat.metric_labels,
        BTreeMap::from([
            (
                "ferrite.dev/inferenceservice".to_string(),
                "chat".to_string()
            ),
            ("team".to_string(), "a".to_string()),
            ("tier".to_string(), "gold".to_string()),
        ])
    );
    // The raw JSON: RFC 3339 timestamps of the scrape, quantities as strings, metadata {}.
    let (_, raw) = get(
        &agent,
        &server.url(&format!("{BASE}/namespaces/ml/ferrite_requests_waiting")),
        None,
    );
    assert_eq!(raw["metadata"], serde_json::json!({}));
    assert_eq!(raw["items"][0]["timestamp"], "2023-11-14T22:13:20Z");
    assert_eq!(raw["items"][1]["timestamp"], "2023-11-14T22:14:20Z");
    assert_eq!(raw["items"][1]["value"], "1");

    let queue = list(&agent, &server, "ml", "ferrite_queue_per_replica", None);
    assert_eq!(
        values(&queue),
        BTreeMap::from([("chat".into(), "2".into()), ("embed".into(), "500m".into())])
    );
    let running = list(&agent, &server, "ml", "ferrite_requests_running", None);
    assert_eq!(
        values(&running),
        BTreeMap::from([("chat".into(), "4".into()), ("embed".into(), "2".into())])
    );
    // embed exports no KV metric: left out, not zero.
    let kv = list(&agent, &server, "ml", "ferrite_kv_cache_usage", None);
    assert_eq!(
        values(&kv),
        BTreeMap::from([("chat".into(), "500m".into())])
    );

    // Namespaces are separate.
    let research = list(&agent, &server, "research", "ferrite_kv_cache_usage", None);
    assert_eq!(
        values(&research),
        BTreeMap::from([("chat".into(), "900m".into())])
    );
    assert_eq!(research.items[0].timestamp.0.as_second(), 1_700_000_120);
    let empty = list(
        &agent,
        &server,
        "nothing-here",
        "ferrite_requests_waiting",
        None,
    );
    assert!(empty.items.is_empty());
}

#[test]
fn label_selection() {
    let tls = self_signed(&["localhost", "127.0.0.1"]);
    let server = Server::start(&tls, store());
    let agent = agent(&tls.cert_pem());
    let names = |ns: &str, sel: &str| -> Vec<String> {
        values(&list(
            &agent,
            &server,
            ns,
            "ferrite_requests_waiting",
            Some(sel),
        ))
        .into_keys()
        .collect()
    };
    // What the built HPA sends.
    assert_eq!(names("ml", "ferrite.dev/inferenceservice=chat"), ["chat"]);
    assert_eq!(
        names("ml", "ferrite.dev/inferenceservice==embed"),
        ["embed"]
    );
    assert!(names("ml", "ferrite.dev/inferenceservice=nope").is_empty());
    assert!(names("ml", "tier=bronze").is_empty());
    assert_eq!(names("ml", "tier in (gold, silver)"), ["chat", "embed"]);
    assert_eq!(names("ml", "tier notin (gold)"), ["embed"]);
    assert_eq!(names("ml", "tier!=silver,team"), ["chat"]);
    assert!(names("ml", "!tier").is_empty());
    assert_eq!(names("research", "!tier"), ["chat"]);
    assert_eq!(names("ml", ""), ["chat", "embed"]);
}

#[test]
fn errors_are_kubernetes_status_objects() {
    let tls = self_signed(&["localhost", "127.0.0.1"]);
    let server = Server::start(&tls, store());
    let agent = agent(&tls.cert_pem());
    let check = |code: u16, body: &Value, reason: &str| {
        assert_eq!(body["kind"], "Status", "{body}");
        assert_eq!(body["apiVersion"], "v1");
        assert_eq!(body["status"], "Failure");
        assert_eq!(body["reason"], reason, "{body}");
        assert_eq!(body["code"], code);
        assert!(body["message"].as_str().is_some_and(|m| !m.is_empty()));
    };

    let (code, body) = get(
        &agent,
        &server.url(&format!("{BASE}/namespaces/ml/cpu_usage")),
        None,
    );
    assert_eq!(code, 404);
    check(404, &body, "NotFound");
    assert_eq!(body["details"]["name"], "cpu_usage");
    assert!(
        body["message"]
            .as_str()
            .is_some_and(|m| m.contains("cpu_usage"))
    );

    for bad in ["tier in (gold", "tier=gold=x", "Bad Key=x", "a in ()"] {
        let (code, body) = get(
            &agent,
            &server.url(&format!("{BASE}/namespaces/ml/ferrite_requests_waiting")),
            Some(bad),
        );
        assert_eq!(code, 400, "{bad:?}: {body}");
        check(400, &body, "BadRequest");
        assert!(
            body["message"]
                .as_str()
                .is_some_and(|m| m.contains("labelSelector")),
            "{body}"
        );
    }

    let (code, body) = get(
        &agent,
        &server.url(&format!(
            "{BASE}/namespaces/Not_A_Namespace/ferrite_requests_waiting"
        )),
        None,
    );
    assert_eq!(code, 400);
    check(400, &body, "BadRequest");

    let resp = agent
        .post(&server.url(&format!("{BASE}/namespaces/ml/ferrite_requests_waiting")))
        .send_string("{}");
    let Err(ureq::Error::Status(405, resp)) = resp else {
        panic!("POST answered {resp:?}");
    };
    assert_eq!(resp.header("allow"), Some("GET, HEAD"));
    check(405, &resp.into_json().expect("json"), "MethodNotAllowed");

    for path in [
        "/",
        "/api/v1/pods",
        "/apis/custom.metrics.k8s.io/v1beta1",
        &format!("{BASE}/ferrite_requests_waiting"),
        &format!("{BASE}/namespaces/ml/ferrite_requests_waiting/extra"),
    ] {
        let (code, body) = get(&agent, &server.url(path), None);
        assert_eq!(code, 404, "{path}");
        check(404, &body, "NotFound");
    }
}

#[test]
fn tls_is_required_and_verified() {
    let tls = self_signed(&["localhost", "127.0.0.1"]);
    let mut server = Server::start(&tls, store());

    // Plain HTTP on the TLS port gets no HTTP response.
    let plain = ureq::AgentBuilder::new()
        .timeout(Duration::from_secs(5))
        .build()
        .get(&format!("http://127.0.0.1:{}/healthz", server.addr.port()))
        .call();
    assert!(matches!(plain, Err(ureq::Error::Transport(_))), "{plain:?}");
    let raw = server.rt.block_on(async {
        let mut s = tokio::net::TcpStream::connect(server.addr)
            .await
            .expect("connect");
        s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .expect("write");
        let mut buf = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut buf)).await;
        buf
    });
    assert!(
        !String::from_utf8_lossy(&raw).contains("HTTP/1.1"),
        "{raw:?}"
    );

    // A client trusting some other certificate refuses this one.
    let other = self_signed(&["localhost", "127.0.0.1"]);
    let refused = agent(&other.cert_pem()).get(&server.url("/healthz")).call();
    let Err(ureq::Error::Transport(t)) = refused else {
        panic!("an untrusted certificate was accepted: {refused:?}");
    };
    // Same subject name, different key: the signature check is what fails.
    assert!(t.to_string().contains("invalid peer certificate"), "{t}");

    // The generated PEM is what a client must trust, and it works.
    assert!(tls.cert_pem().starts_with("-----BEGIN CERTIFICATE-----"));
    let trusting = agent(&tls.cert_pem());
    assert_eq!(
        trusting
            .get(&server.url("/healthz"))
            .call()
            .expect("trusted")
            .into_string()
            .expect("body"),
        "ok"
    );

    // ALPN offers only HTTP/1.1.
    let alpn = server.rt.block_on(async {
        let mut config = client_config(&tls.cert_pem(), None);
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        let tcp = tokio::net::TcpStream::connect(server.addr)
            .await
            .expect("connect");
        let stream = tokio_rustls::TlsConnector::from(Arc::new(config))
            .connect(ServerName::try_from("localhost").expect("name"), tcp)
            .await
            .expect("handshake");
        stream.get_ref().1.alpn_protocol().map(<[u8]>::to_vec)
    });
    assert_eq!(alpn.as_deref(), Some(&b"http/1.1"[..]));

    // Shutdown returns, and nothing listens afterwards.
    server.shutdown();
    assert!(trusting.get(&server.url("/healthz")).call().is_err());
}

/// The certificate names the Service's DNS names; a client dialling that name verifies it,
/// and the same certificate is refused for a name it does not carry.
#[test]
fn server_name_is_checked() {
    let names = service_names("ferrite-operator", "ferrite-system");
    let tls = ServerTls::new(&TlsSettings {
        cert: CertSource::SelfSigned {
            names: names.clone(),
        },
        clients: ClientAuth::any_client(),
    })
    .expect("TLS");
    let server = Server::start(&tls, store());
    let port = server.addr.port();
    let resolving = ureq::AgentBuilder::new()
        .tls_config(Arc::new(client_config(&tls.cert_pem(), None)))
        .resolver(move |netloc: &str| {
            assert!(
                netloc.starts_with("ferrite-operator.ferrite-system.svc"),
                "{netloc}"
            );
            Ok(vec![SocketAddr::from(([127, 0, 0, 1], port))])
        })
        .timeout(Duration::from_secs(10))
        .build();
    let url = format!(
        "https://ferrite-operator.ferrite-system.svc:{port}{BASE}/namespaces/ml/ferrite_requests_waiting"
    );
    let (code, body) = get(&resolving, &url, Some("ferrite.dev/inferenceservice=chat"));
    assert_eq!(code, 200);
    assert_eq!(body["items"][0]["value"], "6");

    let wrong_name = agent(&tls.cert_pem()).get(&server.url("/healthz")).call();
    let Err(ureq::Error::Transport(t)) = wrong_name else {
        panic!("a certificate without 127.0.0.1 was accepted for it: {wrong_name:?}");
    };
    assert!(t.to_string().contains("not valid for name"), "{t}");
}

/// A test CA, as cert-manager or the cluster would provide.
struct Ca {
    issuer: rcgen::Issuer<'static, rcgen::KeyPair>,
    pem: String,
}

impl Ca {
    fn new(name: &str) -> Self {
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, name);
        params.key_usages = vec![
            rcgen::KeyUsagePurpose::KeyCertSign,
            rcgen::KeyUsagePurpose::DigitalSignature,
        ];
        let key = rcgen::KeyPair::generate().expect("key");
        let cert = params.self_signed(&key).expect("CA");
        Self {
            pem: cert.pem(),
            issuer: rcgen::Issuer::new(params, key),
        }
    }

    /// (certificate PEM, key PEM) for `names`, for serving or client auth.
    fn issue(&self, cn: &str, names: &[&str], client: bool) -> (String, String) {
        let mut params =
            rcgen::CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())
                .expect("params");
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, cn);
        params.extended_key_usages = vec![if client {
            rcgen::ExtendedKeyUsagePurpose::ClientAuth
        } else {
            rcgen::ExtendedKeyUsagePurpose::ServerAuth
        }];
        let key = rcgen::KeyPair::generate().expect("key");
        let cert = params.signed_by(&key, &self.issuer).expect("sign");
        (cert.pem(), key.serialize_pem())
    }
}

fn client_identity(
    cert_pem: &str,
    key_pem: &str,
) -> (Vec<CertificateDer<'static>>, PrivateKeyDer<'static>) {
    let chain = CertificateDer::pem_slice_iter(cert_pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .expect("chain");
    let key = PrivatePkcs8KeyDer::from_pem_slice(key_pem.as_bytes()).expect("key");
    (chain, PrivateKeyDer::Pkcs8(key))
}

fn temp_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("ferrite-extmetrics-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&d).expect("dir");
    d
}

/// Certificates from files (a CA-signed chain), and what /apis requires of clients, as an
/// aggregated API server does: a certificate from the request-header CA (the aggregator's
/// proxy-client certificate) with an allowed common name; a changed CA or name list applies
/// at once, and without a CA nobody gets in.
#[test]
fn files_and_client_certificates() {
    let dir = temp_dir("mtls");
    let ca = Ca::new("ferrite test CA");
    let (server_cert, server_key) =
        ca.issue("ferrite-operator", &["localhost", "127.0.0.1"], false);
    let client_ca = Ca::new("requestheader client CA");
    let (client_cert, client_key) = client_ca.issue("front-proxy-client", &[], true);
    let write = |name: &str, text: &str| {
        let p = dir.join(name);
        std::fs::write(&p, text).expect("write");
        p
    };
    let clients = ClientAuth::request_header(Some(RequestHeader {
        ca_pem: client_ca.pem.clone(),
        allowed_names: vec!["front-proxy-client".into()],
    }))
    .expect("the request-header CA");
    let settings = TlsSettings {
        cert: CertSource::Files {
            cert: write("tls.crt", &server_cert),
            key: write("tls.key", &server_key),
        },
        clients: clients.clone(),
    };
    let tls = ServerTls::new(&settings).expect("TLS from files");
    assert_eq!(tls.cert_pem(), server_cert);
    let server = Server::start(&tls, store());
    let metric = server.url(&format!("{BASE}/namespaces/ml/ferrite_requests_waiting"));

    // Trusting the CA that signed the serving certificate is enough for the server side.
    let anonymous = agent(&ca.pem);
    let (code, body) = get(&anonymous, &metric, None);
    assert_eq!(code, 401, "{body}");
    assert_eq!(body["reason"], "Unauthorized");
    assert_eq!(body["kind"], "Status");
    let (code, _) = get(&anonymous, &server.url("/apis"), None);
    assert_eq!(code, 401);
    // The kubelet's probes need no certificate.
    assert_eq!(
        anonymous
            .get(&server.url("/healthz"))
            .call()
            .expect("healthz")
            .into_string()
            .expect("body"),
        "ok"
    );

    let aggregator = agent_with(client_config(
        &ca.pem,
        Some(client_identity(&client_cert, &client_key)),
    ));
    let (code, body) = get(&aggregator, &metric, Some("tier=gold"));
    assert_eq!(code, 200, "{body}");
    assert_eq!(body["items"][0]["value"], "6");

    // The CA's certificate for a name that is not allowed is forbidden, as kube-apiserver's
    // request-header authenticator refuses it.
    let (cert, key) = client_ca.issue("system:masters-wannabe", &[], true);
    let wrong_cn = agent_with(client_config(&ca.pem, Some(client_identity(&cert, &key))));
    let (code, body) = get(&wrong_cn, &metric, None);
    assert_eq!(code, 403, "{body}");
    assert_eq!(body["reason"], "Forbidden");
    assert!(
        body["message"]
            .as_str()
            .is_some_and(|m| m.contains("system:masters-wannabe")),
        "{body}"
    );
    // New allowed names apply to open connections from their next request.
    clients
        .set(Some(RequestHeader {
            ca_pem: client_ca.pem.clone(),
            allowed_names: vec!["front-proxy-client".into(), "system:masters-wannabe".into()],
        }))
        .expect("new names");
    assert_eq!(get(&wrong_cn, &metric, None).0, 200);
    // No CA known (the ConfigMap lost it): nobody reads metrics, the aggregator included.
    clients.set(None).expect("no CA");
    let (code, body) = get(&aggregator, &metric, None);
    assert_eq!(code, 401, "{body}");
    assert!(
        body["message"]
            .as_str()
            .is_some_and(|m| m.contains("extension-apiserver-authentication")),
        "{body}"
    );
    // A rotated CA applies from the next handshake: the old CA's certificate no longer
    // connects, one from the new CA does.
    let rotated = Ca::new("rotated requestheader client CA");
    clients
        .set(Some(RequestHeader {
            ca_pem: rotated.pem.clone(),
            allowed_names: vec!["front-proxy-client".into()],
        }))
        .expect("rotated CA");
    let old = agent_with(client_config(
        &ca.pem,
        Some(client_identity(&client_cert, &client_key)),
    ));
    assert!(
        matches!(old.get(&metric).call(), Err(ureq::Error::Transport(_))),
        "the old CA's certificate still connects"
    );
    let (cert, key) = rotated.issue("front-proxy-client", &[], true);
    let renewed = agent_with(client_config(&ca.pem, Some(client_identity(&cert, &key))));
    assert_eq!(get(&renewed, &metric, None).0, 200);

    // A certificate from another CA is refused at the handshake.
    let stranger_ca = Ca::new("someone else");
    let (cert, key) = stranger_ca.issue("intruder", &[], true);
    let stranger = agent_with(client_config(&ca.pem, Some(client_identity(&cert, &key))));
    let refused = stranger.get(&metric).call();
    assert!(
        matches!(refused, Err(ureq::Error::Transport(_))),
        "{refused:?}"
    );

    // Bad inputs are errors, not panics.
    let missing = ServerTls::new(&TlsSettings {
        cert: CertSource::Files {
            cert: dir.join("absent.crt"),
            key: dir.join("absent.key"),
        },
        clients: ClientAuth::any_client(),
    });
    assert!(
        matches!(missing, Err(TlsError::Cert(CertError::Read { .. }))),
        "{missing:?}"
    );
    let empty = ServerTls::new(&TlsSettings {
        cert: CertSource::Files {
            cert: write("empty.crt", ""),
            key: dir.join("tls.key"),
        },
        clients: ClientAuth::any_client(),
    });
    assert!(
        matches!(empty, Err(TlsError::Cert(CertError::NoCertificate(_)))),
        "{empty:?}"
    );
    let no_names = ServerTls::new(&TlsSettings {
        cert: CertSource::SelfSigned { names: Vec::new() },
        clients: ClientAuth::any_client(),
    });
    assert!(matches!(no_names, Err(TlsError::NoNames)), "{no_names:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

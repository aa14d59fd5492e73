//! The External Metrics API's certificates on a real API server. X.509 v1 certificates (what
//! `openssl x509 -req` makes without an extension file), which the API server accepts and
//! rustls refuses: the operator names the certificate and the cause, whether it is its own
//! kubeconfig's client certificate, the client CA of its External Metrics API, or a client
//! certificate presented to that API. The serving certificate: issued by the operator into its
//! Secret with the caBundle that trusts it, renewed without a restart, and cert-manager's
//! mounted files reread when they change.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use ferrite_operator::certs::x509_version;
use ferrite_testkit::e2e::{Applier, operator_binary};
use ferrite_testkit::kube::{Cluster, KubeUser, kubeconfig, workspace_root};
use ferrite_testkit::process::{Guard, TempDir, eventually, free_port};
use rustls_pki_types::CertificateDer;
use rustls_pki_types::pem::PemObject as _;

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("openssl");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn version_of(pem_file: &Path) -> Option<u8> {
    let pem = std::fs::read(pem_file).expect("certificate");
    let der = CertificateDer::pem_slice_iter(&pem).next()?.ok()?;
    x509_version(&der)
}

/// A v1 client certificate for `cn`, signed by the CA in `ca` (`.crt`/`.key`): returns the
/// certificate and key files.
fn v1_client(dir: &Path, ca: &Path, cn: &str) -> (PathBuf, PathBuf) {
    let (crt, key) = (dir.join(format!("{cn}.crt")), dir.join(format!("{cn}.key")));
    let csr = dir.join(format!("{cn}.csr"));
    openssl(
        dir,
        &[
            "req",
            "-new",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            key.to_str().expect("utf-8"),
            "-out",
            csr.to_str().expect("utf-8"),
            "-subj",
            &format!("/CN={cn}"),
        ],
    );
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            csr.to_str().expect("utf-8"),
            "-CA",
            &format!("{}.crt", ca.display()),
            "-CAkey",
            &format!("{}.key", ca.display()),
            "-CAcreateserial",
            "-out",
            crt.to_str().expect("utf-8"),
            "-days",
            "1",
        ],
    );
    assert_eq!(version_of(&crt), Some(1), "the fixture is X.509 v1");
    (crt, key)
}

fn run_operator(kubeconfig: &Path, args: &[&str], log: &Path) -> Guard {
    let file = std::fs::File::create(log).expect("log");
    let mut cmd = Command::new(operator_binary());
    cmd.args(["--http-addr", &format!("127.0.0.1:{}", free_port())])
        .args(["--no-leader-election"])
        .args(args)
        .env("KUBECONFIG", kubeconfig)
        .env("RUST_LOG", "info")
        .env_remove("KUBERNETES_SERVICE_HOST")
        .stdin(Stdio::null())
        .stdout(file.try_clone().expect("log"))
        .stderr(file);
    Guard::spawn("operator", cmd).expect("operator starts")
}

/// A kubeconfig whose client certificate is v1 stops the operator at start, with a message
/// naming that certificate and the fix, before any TLS handshake.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_v1_client_certificate_in_the_kubeconfig_is_refused_with_its_cause() {
    let Some(cluster) = Cluster::start().await else {
        return;
    };
    let dir = TempDir::new("v1-kubeconfig");
    let (crt, key) = v1_client(dir.path(), &cluster.pki_file("ca"), "v1-user");
    let kc = dir.path().join("kubeconfig");
    std::fs::write(
        &kc,
        kubeconfig(
            &cluster.url(),
            &cluster.ca_file(),
            &KubeUser::Certificate { cert: crt, key },
        ),
    )
    .expect("kubeconfig");
    let log = dir.path().join("operator.log");
    let mut op = run_operator(&kc, &["--external-metrics-addr", "off"], &log);
    let status = op
        .wait_timeout(Duration::from_secs(20))
        .expect("the operator exits");
    assert!(!status.success());
    let text = std::fs::read_to_string(&log).expect("log");
    assert!(
        text.contains("the kubeconfig's client certificate (user \"user\")")
            && text.contains("v1-user.crt is an X.509 v1 certificate")
            && text.contains("reissue it with extensions"),
        "{text}"
    );
}

/// The External Metrics API: a v1 client CA is refused at start; a v1 client certificate
/// presented by a client (the aggregator's, where its front-proxy certificate is v1) is logged
/// as such, not swallowed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn v1_certificates_at_the_external_metrics_api_are_named() {
    let Some(cluster) = Cluster::start().await else {
        return;
    };
    let mut applier = Applier::new(cluster.client().await).await;
    applier
        .apply_file(&workspace_root().join("crds/inferenceservice.yaml"))
        .await;
    let dir = TempDir::new("v1-external");

    // A v1 CA as --client-ca-file.
    let v1_ca = dir.path().join("v1-ca");
    openssl(
        dir.path(),
        &[
            "req",
            "-new",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            "v1-ca.key",
            "-out",
            "v1-ca.csr",
            "-subj",
            "/CN=v1-ca",
        ],
    );
    openssl(
        dir.path(),
        &[
            "x509",
            "-req",
            "-in",
            "v1-ca.csr",
            "-signkey",
            "v1-ca.key",
            "-out",
            "v1-ca.crt",
            "-days",
            "1",
        ],
    );
    assert_eq!(version_of(&dir.path().join("v1-ca.crt")), Some(1));
    let log = dir.path().join("ca.log");
    let ca_file = format!("{}.crt", v1_ca.display());
    let mut op = run_operator(
        &cluster.admin_kubeconfig(),
        &[
            "--external-metrics-addr",
            &format!("127.0.0.1:{}", free_port()),
            "--client-ca-file",
            &ca_file,
        ],
        &log,
    );
    let status = op.wait_timeout(Duration::from_secs(20)).expect("exits");
    assert!(!status.success());
    let text = std::fs::read_to_string(&log).expect("log");
    assert!(
        text.contains(&format!(
            "the client CA {ca_file} is an X.509 v1 certificate"
        )),
        "{text}"
    );

    // A good (v3) client CA, and a v1 client certificate it signed.
    let (crt, key) = v1_client(dir.path(), &cluster.pki_file("front-proxy-ca"), "proxy-v1");
    let port = free_port();
    let log = dir.path().join("handshake.log");
    let front_proxy_ca = cluster.pki_file("front-proxy-ca.crt");
    let _op = run_operator(
        &cluster.admin_kubeconfig(),
        &[
            "--external-metrics-addr",
            &format!("127.0.0.1:{port}"),
            "--client-ca-file",
            front_proxy_ca.to_str().expect("utf-8"),
        ],
        &log,
    );
    eventually(
        Duration::from_secs(30),
        "the External Metrics API to listen",
        async || {
            std::net::TcpStream::connect(("127.0.0.1", port))
                .ok()
                .map(|_| ())
        },
    )
    .await;
    // The handshake fails; what matters is what the operator says about it.
    Command::new("openssl")
        .args(["s_client", "-connect", &format!("127.0.0.1:{port}")])
        .args([
            "-cert",
            crt.to_str().expect("utf-8"),
            "-key",
            key.to_str().expect("utf-8"),
        ])
        .stdin(Stdio::null())
        .output()
        .expect("openssl s_client");
    let text = eventually(
        Duration::from_secs(10),
        "the handshake failure in the log",
        async || {
            let text = std::fs::read_to_string(&log).ok()?;
            text.contains("presented an X.509 v1 certificate")
                .then_some(text)
        },
    )
    .await;
    assert!(text.contains("reissue it with extensions"), "{text}");
}

/// The operator's own certificate (nothing rendered by the chart): at start it issues one into
/// the Secret, under the chart's RBAC, owned by the APIService, and sets the APIService's
/// caBundle; a client that trusts only that bundle reaches the API by the Service's name, as
/// the aggregator does, and any other name is refused (so the check is real). Clients are
/// held to the cluster's request-header CA and allowed names. A restarted operator serves the
/// same certificate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_operator_issues_its_certificate_and_the_bundle_that_trusts_it() {
    use ferrite_testkit::e2e::{
        Operator, external_client, external_client_as, install, live_ca_bundle,
    };
    use k8s_openapi::api::core::v1::Secret;
    let Some(cluster) = Cluster::start().await else {
        return;
    };
    let client = cluster.client().await;
    let release = install(
        &cluster,
        &serde_json::json!({"externalMetrics": {"enabled": true}}),
        "tls",
    )
    .await;
    assert!(
        ferrite_testkit::chart::one(&release.docs, "APIService")["spec"]["caBundle"].is_null(),
        "the chart renders no caBundle"
    );
    let op = Operator::launch(&cluster, &release, "op-0", &[]).await;
    let bundle = live_ca_bundle(&client).await;
    let secrets: kube::Api<Secret> =
        kube::Api::namespaced(client.clone(), ferrite_testkit::chart::NAMESPACE);
    // The keeper sets the bundle before it writes the Secret (so that no replica serves a
    // certificate the aggregator does not trust yet): the Secret may come a moment later.
    let secret = eventually(
        Duration::from_secs(30),
        "the operator's Secret",
        async || {
            secrets
                .get_opt("ferrite-ferrite-operator-external-metrics-tls")
                .await
                .ok()
                .flatten()
        },
    )
    .await;
    let data = secret.data.clone().expect("data");
    assert_eq!(data["ca.crt"].0, bundle.as_bytes());
    let owner = &secret.metadata.owner_references.clone().expect("owner")[0];
    assert_eq!(
        (owner.kind.as_str(), owner.name.as_str()),
        ("APIService", "v1beta1.external.metrics.k8s.io")
    );
    let (agent, base) = external_client(&cluster, &release, release.external_port, None).await;
    let url = format!("{base}/apis/external.metrics.k8s.io/v1beta1");
    let body: serde_json::Value = eventually(
        Duration::from_secs(30),
        "the External Metrics API over TLS",
        async || agent.get(&url).call().ok()?.into_json().ok(),
    )
    .await;
    assert_eq!(
        body["groupVersion"],
        "external.metrics.k8s.io/v1beta1",
        "{}",
        op.log()
    );
    // Who may read metrics comes from kube-system/extension-apiserver-authentication (read
    // under the chart's RoleBinding): the front-proxy CA's certificate for an allowed name
    // (above) gets in; no certificate is 401; the same CA's certificate for another name is
    // 403, as kube-apiserver's request-header authenticator refuses it.
    let metric =
        "/apis/external.metrics.k8s.io/v1beta1/namespaces/default/ferrite_requests_waiting";
    let status_of = |agent: &ureq::Agent, url: &str| match agent.get(url).call() {
        Ok(r) => r.status(),
        Err(ureq::Error::Status(code, _)) => code,
        Err(e) => panic!("{url}: {e}"),
    };
    assert_eq!(
        status_of(&agent, &format!("{base}{metric}")),
        200,
        "{}",
        op.log()
    );
    let (anonymous, _) =
        external_client_as(&cluster, &release, release.external_port, None, None).await;
    assert_eq!(status_of(&anonymous, &format!("{base}{metric}")), 401);
    let intruder = cluster.front_proxy_ca().client("intruder", &[]);
    let dir = TempDir::new("wrong-cn");
    let (crt, key) = (dir.path().join("i.crt"), dir.path().join("i.key"));
    std::fs::write(&crt, &intruder.cert).expect("write");
    std::fs::write(&key, &intruder.key).expect("write");
    let (wrong_cn, _) = external_client_as(
        &cluster,
        &release,
        release.external_port,
        None,
        Some(ferrite_testkit::tls::identity_files(&crt, &key)),
    )
    .await;
    assert_eq!(status_of(&wrong_cn, &format!("{base}{metric}")), 403);
    let (wrong, base) = external_client(
        &cluster,
        &release,
        release.external_port,
        Some("ferrite-elsewhere.ferrite-system.svc"),
    )
    .await;
    let err = wrong
        .get(&format!("{base}/apis/external.metrics.k8s.io/v1beta1"))
        .call()
        .err();
    assert!(
        err.is_some(),
        "a name the certificate does not carry was accepted"
    );
    // A restart keeps the Secret's certificate (no new one, the bundle unchanged).
    drop(op);
    let _op = Operator::launch(&cluster, &release, "op-1", &[]).await;
    eventually(
        Duration::from_secs(30),
        "the restarted operator",
        async || agent.get(&url).call().ok().map(|_| ()),
    )
    .await;
    let again = secrets
        .get("ferrite-ferrite-operator-external-metrics-tls")
        .await
        .expect("Secret");
    assert_eq!(again.data.expect("data")["tls.crt"], data["tls.crt"]);
    assert_eq!(live_ca_bundle(&client).await, bundle);
}

/// The certificate the server at 127.0.0.1:`port` presents, as PEM (openssl s_client).
fn presented(port: u16) -> Option<String> {
    let out = Command::new("openssl")
        .args(["s_client", "-connect", &format!("127.0.0.1:{port}")])
        .args([
            "-servername",
            "ferrite-ferrite-operator-external-metrics.ferrite-system.svc",
        ])
        .stdin(Stdio::null())
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let start = text.find("-----BEGIN CERTIFICATE-----")?;
    let end = text.find("-----END CERTIFICATE-----")? + "-----END CERTIFICATE-----".len();
    Some(text[start..end].to_string())
}

/// Renewal without a restart: with a 30 s validity the operator renews at 20 s, serves the new
/// certificate from the next handshake, and the bundle holds the new and the old one; a client
/// trusting the live bundle keeps reaching the API throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_operator_renews_its_certificate_without_a_restart() {
    use ferrite_testkit::e2e::{Operator, external_client, install, live_ca_bundle};
    let Some(cluster) = Cluster::start().await else {
        return;
    };
    let client = cluster.client().await;
    let release = install(
        &cluster,
        &serde_json::json!({"externalMetrics": {"enabled": true, "certValidity": "30s"}}),
        "renew",
    )
    .await;
    let op = Operator::launch(&cluster, &release, "op-0", &[]).await;
    let first_bundle = live_ca_bundle(&client).await;
    let port = release.external_port;
    let first = eventually(
        Duration::from_secs(30),
        "the first certificate",
        async || presented(port),
    )
    .await;
    assert!(
        first_bundle.contains(first.trim()),
        "{first_bundle}\n{first}"
    );
    let renewed = eventually(
        Duration::from_secs(60),
        "a renewed certificate",
        async || presented(port).filter(|c| c != &first),
    )
    .await;
    let bundle = live_ca_bundle(&client).await;
    assert!(
        bundle.contains(renewed.trim()) && bundle.contains(first.trim()),
        "the bundle trusts the new and the old certificate:\n{bundle}\n{}",
        op.log()
    );
    let (agent, base) = external_client(&cluster, &release, port, None).await;
    let url = format!("{base}/apis/external.metrics.k8s.io/v1beta1");
    assert!(agent.get(&url).call().is_ok(), "{}", op.log());
    assert!(
        op.log().contains("serving the renewed certificate"),
        "{}",
        op.log()
    );
}

/// cert-manager's path: the operator serves mounted files, and when they are replaced (as the
/// kubelet swaps a renewed Secret in) serves the new pair within seconds, without a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewed_certificate_files_are_served_without_a_restart() {
    let Some(cluster) = Cluster::start().await else {
        return;
    };
    ferrite_testkit::kube::standin::install_crd(&cluster.client().await).await;
    let dir = TempDir::new("tls-files");
    let pair = |n: &str| {
        openssl(
            dir.path(),
            &[
                "req",
                "-x509",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:P-256",
                "-nodes",
                "-days",
                "1",
                "-subj",
                &format!("/CN={n}"),
                "-addext",
                "subjectAltName=DNS:ferrite-operator.default.svc",
                "-keyout",
                &format!("{n}.key"),
                "-out",
                &format!("{n}.crt"),
            ],
        );
    };
    pair("one");
    pair("two");
    let (cert, key) = (dir.path().join("tls.crt"), dir.path().join("tls.key"));
    std::fs::copy(dir.path().join("one.crt"), &cert).expect("copy");
    std::fs::copy(dir.path().join("one.key"), &key).expect("copy");
    let port = free_port();
    let log = dir.path().join("operator.log");
    let mut op = run_operator(
        &cluster.admin_kubeconfig(),
        &[
            &format!("--external-metrics-addr=127.0.0.1:{port}"),
            &format!("--tls-cert-file={}", cert.display()),
            &format!("--tls-key-file={}", key.display()),
        ],
        &log,
    );
    let pem = |n: &str| std::fs::read_to_string(dir.path().join(format!("{n}.crt"))).expect("pem");
    eventually(
        Duration::from_secs(30),
        "the first pair served",
        async || {
            if let Some(s) = op.exited() {
                panic!(
                    "the operator exited with {s}: {}",
                    std::fs::read_to_string(&log).unwrap_or_default()
                );
            }
            presented(port).filter(|c| pem("one").contains(c.trim()))
        },
    )
    .await;
    // As the kubelet does: write aside, then rename over.
    for (from, to) in [("two.crt", &cert), ("two.key", &key)] {
        let tmp = dir.path().join(format!("{from}.tmp"));
        std::fs::copy(dir.path().join(from), &tmp).expect("copy");
        std::fs::rename(&tmp, to).expect("rename");
    }
    eventually(
        Duration::from_secs(20),
        "the renewed pair served",
        async || presented(port).filter(|c| pem("two").contains(c.trim())),
    )
    .await;
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(text.contains("serving the renewed certificate"), "{text}");
}

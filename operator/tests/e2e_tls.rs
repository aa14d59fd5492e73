//! X.509 v1 certificates (what `openssl x509 -req` makes without an extension file), which the
//! API server accepts and rustls refuses: the operator names the certificate and the cause,
//! whether it is its own kubeconfig's client certificate, the client CA of its External
//! Metrics API, or a client certificate presented to that API.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use common::e2e::{Applier, operator_binary};
use common::validate::root;
use ferrite_operator::certs::x509_version;
use ferrite_testkit::kube::{Cluster, KubeUser, kubeconfig};
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
        .apply_file(&root().join("crds/inferenceservice.yaml"))
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

/// The chart's self-signed certificate, as the operator serves it from the chart's Secret,
/// verifies against the APIService's caBundle under the Service's name, as the aggregator
/// checks it; under any other name it is refused (so the check is real).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_chart_certificate_verifies_for_the_apiservice_name_only() {
    use base64::Engine as _;
    use common::e2e::{Operator, external_client, install};
    let Some(cluster) = Cluster::start().await else {
        return;
    };
    let release = install(
        &cluster,
        &serde_json::json!({"externalMetrics": {"enabled": true}}),
        "tls",
    )
    .await;
    let api = common::chart::one(&release.docs, "APIService");
    let secret = release
        .docs
        .iter()
        .find(|d| d["type"] == "kubernetes.io/tls")
        .expect("Secret");
    let b64 = |v: &serde_json::Value| {
        base64::engine::general_purpose::STANDARD
            .decode(v.as_str().expect("base64"))
            .expect("base64")
    };
    assert_eq!(
        b64(&api["spec"]["caBundle"]),
        b64(&secret["data"]["ca.crt"]),
        "caBundle is the Secret's CA"
    );
    let _op = Operator::launch(&cluster, &release, "op-0", &[]).await;
    let (agent, base) = external_client(&release, release.external_port, None);
    let url = format!("{base}/apis/external.metrics.k8s.io/v1beta1");
    let body: serde_json::Value = eventually(
        Duration::from_secs(30),
        "the External Metrics API over TLS",
        async || agent.get(&url).call().ok()?.into_json().ok(),
    )
    .await;
    assert_eq!(body["groupVersion"], "external.metrics.k8s.io/v1beta1");
    let (wrong, base) = external_client(
        &release,
        release.external_port,
        Some("ferrite-elsewhere.ferrite-system.svc"),
    );
    let err = wrong
        .get(&format!("{base}/apis/external.metrics.k8s.io/v1beta1"))
        .call()
        .err();
    assert!(
        err.is_some(),
        "a name the certificate does not carry was accepted"
    );
}

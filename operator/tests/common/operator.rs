//! The real `ferrite-operator` binary as a child process, pointed at the in-memory API server
//! (`fake_api`) through a kubeconfig, with helpers to poll what it wrote.

use std::io::Write as _;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ferrite_operator::fake_api::FakeApi;
use serde_json::{Value, json};

use super::servers::free_port;

pub const ISVCS: &str = "/apis/ferrite.dev/v1alpha1/namespaces/ml/inferenceservices";

pub struct Operator {
    pub child: Child,
    pub port: u16,
    /// HTTPS port of the External Metrics API, and the certificate it serves.
    pub external_port: u16,
    pub cert_pem: String,
    _dir: TempDir,
}

pub struct TempDir(pub PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

impl Drop for Operator {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Operator {
    pub fn start(api: &FakeApi, identity: &str, extra: &[&str]) -> Operator {
        // A certificate for "localhost" that the test's client trusts, and nothing else.
        let cert =
            rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).expect("certificate");
        Operator::start_with_tls(
            api,
            identity,
            extra,
            &cert.cert.pem(),
            &cert.signing_key.serialize_pem(),
        )
    }

    /// Starts the binary serving the External Metrics API with this certificate and key (PEM).
    /// The Lease lives in namespace `ml` unless `extra` names another `--lease-namespace`.
    pub fn start_with_tls(
        api: &FakeApi,
        identity: &str,
        extra: &[&str],
        cert_pem: &str,
        key_pem: &str,
    ) -> Operator {
        let dir = std::env::temp_dir().join(format!(
            "ferrite-operator-test-{}-{identity}",
            std::process::id()
        ));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let kubeconfig = dir.join("kubeconfig");
        std::fs::File::create(&kubeconfig)
            .and_then(|mut f| f.write_all(api.kubeconfig("ml").as_bytes()))
            .expect("kubeconfig written");
        let port = free_port();
        let external_port = free_port();
        let (cert_file, key_file) = (dir.join("tls.crt"), dir.join("tls.key"));
        std::fs::write(&cert_file, cert_pem).expect("cert written");
        std::fs::write(&key_file, key_pem).expect("key written");
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_ferrite-operator"));
        cmd.args(["--http-addr", &format!("127.0.0.1:{port}")])
            .args(["--identity", identity]);
        if !extra.contains(&"--lease-namespace") {
            cmd.args(["--lease-namespace", "ml"]);
        }
        let child = cmd
            .args([
                "--external-metrics-addr",
                &format!("127.0.0.1:{external_port}"),
            ])
            .arg("--tls-cert-file")
            .arg(&cert_file)
            .arg("--tls-key-file")
            .arg(&key_file)
            .args(extra)
            .env("KUBECONFIG", &kubeconfig)
            .env_remove("KUBERNETES_SERVICE_HOST")
            .env("RUST_LOG", "info")
            // The operator logs to stdout; FERRITE_TEST_OPERATOR_LOGS=1 shows it.
            .stdout(
                if std::env::var_os("FERRITE_TEST_OPERATOR_LOGS").is_some() {
                    Stdio::inherit()
                } else {
                    Stdio::null()
                },
            )
            .stderr(Stdio::inherit())
            .spawn()
            .expect("ferrite-operator starts");
        Operator {
            child,
            port,
            external_port,
            cert_pem: cert_pem.to_string(),
            _dir: TempDir(dir),
        }
    }

    pub fn get(&self, path: &str) -> Result<(u16, String), String> {
        let url = format!("http://127.0.0.1:{}{path}", self.port);
        match ureq::get(&url).timeout(Duration::from_secs(5)).call() {
            Ok(r) => Ok((r.status(), r.into_string().map_err(|e| e.to_string())?)),
            Err(ureq::Error::Status(code, r)) => Ok((code, r.into_string().unwrap_or_default())),
            Err(e) => Err(e.to_string()),
        }
    }

    /// A sample of the operator's own exposition (without labels), once it answers.
    pub fn metric(&self, name: &str) -> Option<f64> {
        let (_, body) = self.get("/metrics").ok()?;
        body.lines()
            .find(|l| l.split_whitespace().next() == Some(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
    }

    pub fn terminate(&mut self) -> std::process::ExitStatus {
        let pid = self.child.id().to_string();
        let sent = Command::new("kill").args(["-TERM", &pid]).status();
        assert!(sent.is_ok_and(|s| s.success()), "SIGTERM sent");
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            if let Some(status) = self.child.try_wait().expect("waitable") {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "the operator did not exit after SIGTERM"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// Polls `f` until it returns `Some`, for at most `secs`.
pub async fn eventually<T>(secs: u64, what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

pub fn isvc(name: &str, source: &str) -> Value {
    json!({"apiVersion": "ferrite.dev/v1alpha1", "kind": "InferenceService",
           "metadata": {"name": name, "namespace": "ml"},
           "spec": {"model": {"source": source}}})
}

pub fn condition(api: &FakeApi, name: &str, type_: &str) -> Option<(String, String)> {
    let obj = api.get(&format!("{ISVCS}/{name}"))?;
    let c = obj["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == type_)?
        .clone();
    Some((
        c["status"].as_str()?.to_string(),
        c["reason"].as_str()?.to_string(),
    ))
}

pub async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    tokio::task::spawn_blocking(f).await.expect("blocking task")
}

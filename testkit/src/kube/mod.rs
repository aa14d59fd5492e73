//! A real Kubernetes control plane for tests: etcd, kube-apiserver (RBAC on, the aggregation
//! layer configured, optional audit log) and kube-controller-manager (garbage collector,
//! Deployment/ReplicaSet, HPA, quota and namespace controllers), all on free loopback ports with
//! a PKI of their own. No scheduler and no kubelet: pods are created but never run; a test
//! stands in for a running pod by patching its status.
//!
//! [`Cluster::start`] gives a test its own cluster (about 3 s of CPU to start), whose processes
//! die with the test process however it ends. [`Cluster::shared`] gives every test process of a
//! run the same cluster, each test in its own namespace; it stops once no test has used it for
//! a while.
//!
//! Without the binaries (see [`bins`]) both return `None` after a loud message, so a test can
//! skip; under `CI=true` that is a failure instead.

pub mod bins;
pub mod pki;
mod shared;
pub mod standin;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{Namespace, ServiceAccount};
use kube::api::{Api, ObjectMeta, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};

pub use crate::paths::{target_dir, workspace_root};
use crate::process::{Guard, free_port, unique};
pub use bins::Binaries;
pub use pki::{Authority, Pem, Pki};

/// What a cluster runs with.
#[derive(Debug, Clone)]
pub struct Options {
    /// Run kube-controller-manager (needed for garbage collection, ReplicaSets and pods, HPAs).
    pub controller_manager: bool,
    /// Write an audit log (Metadata level) of every request but kube-controller-manager's, for
    /// counting a client's requests.
    pub audit: bool,
    /// The HPA controller's sync period (`--horizontal-pod-autoscaler-sync-period`).
    pub hpa_sync_period: Duration,
    /// `--service-cluster-ip-range`: a Service beyond its size fails to be created (500,
    /// "range is full"), as in a real cluster whose range is used up.
    pub service_cidr: &'static str,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            controller_manager: true,
            audit: false,
            hpa_sync_period: Duration::from_secs(2),
            // 65,534 Services: bench-operator makes 1,000.
            service_cidr: "10.0.0.0/16",
        }
    }
}

/// A running test cluster.
#[derive(Debug)]
pub struct Cluster {
    dir: PathBuf,
    pub api_port: u16,
    processes: Processes,
    /// Held (shared) for as long as this process uses a shared cluster.
    _user: Option<std::fs::File>,
}

/// The processes of a private cluster, with what it takes to restart the apiserver.
#[derive(Debug, Default)]
struct Processes {
    etcd: Option<Guard>,
    apiserver: Option<Guard>,
    controller_manager: Option<Guard>,
    apiserver_cmd: Vec<String>,
    /// Removes the directory on drop unless the test failed or FERRITE_TEST_KEEP is set.
    owned_dir: bool,
}

fn is_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true" || v == "1")
}

/// The binaries, or `None` after a loud message (a panic under `CI=true`).
fn binaries_or_skip() -> Option<Binaries> {
    match bins::binaries() {
        Ok(b) => Some(b),
        Err(why) => {
            let msg = format!(
                "\n=== NO KUBERNETES CONTROL PLANE: {why}\n=== this test does not test anything here.\n"
            );
            if is_ci() {
                panic!("{msg}(CI=true: a missing control plane is a failure)");
            }
            eprintln!("{msg}");
            None
        }
    }
}

/// The command lines of a cluster, shared by private and shared clusters.
struct Plan {
    etcd: Vec<String>,
    apiserver: Vec<String>,
    controller_manager: Option<Vec<String>>,
}

fn s(p: &Path) -> String {
    p.display().to_string()
}

fn plan(bins: &Binaries, dir: &Path, api_port: u16, opts: &Options) -> Plan {
    let pki = dir.join("pki");
    let p = |f: &str| s(&pki.join(f));
    let (etcd_port, peer_port) = (free_port(), free_port());
    let etcd = vec![
        s(&bins.etcd),
        format!("--data-dir={}", s(&dir.join("etcd-data"))),
        format!("--listen-client-urls=http://127.0.0.1:{etcd_port}"),
        format!("--advertise-client-urls=http://127.0.0.1:{etcd_port}"),
        format!("--listen-peer-urls=http://127.0.0.1:{peer_port}"),
        format!("--initial-advertise-peer-urls=http://127.0.0.1:{peer_port}"),
        format!("--initial-cluster=default=http://127.0.0.1:{peer_port}"),
        "--log-level=warn".into(),
    ];
    let mut apiserver = vec![
        s(&bins.apiserver),
        format!("--etcd-servers=http://127.0.0.1:{etcd_port}"),
        format!("--secure-port={api_port}"),
        "--bind-address=127.0.0.1".into(),
        "--advertise-address=127.0.0.1".into(),
        format!("--tls-cert-file={}", p("apiserver.crt")),
        format!("--tls-private-key-file={}", p("apiserver.key")),
        format!("--client-ca-file={}", p("ca.crt")),
        "--service-account-issuer=https://kubernetes.default.svc.cluster.local".into(),
        format!("--service-account-key-file={}", p("sa.pub")),
        format!("--service-account-signing-key-file={}", p("sa.key")),
        format!("--service-cluster-ip-range={}", opts.service_cidr),
        "--authorization-mode=Node,RBAC".into(),
        // No token controller runs ahead of pods, and no kubelet mounts tokens.
        "--disable-admission-plugins=ServiceAccount".into(),
        // Loopback addresses are refused in Endpoints; nothing here needs kubernetes.default's.
        "--endpoint-reconciler-type=none".into(),
        // The aggregation layer (APIService), which authenticates to extension servers with the
        // front-proxy client certificate.
        format!("--requestheader-client-ca-file={}", p("front-proxy-ca.crt")),
        "--requestheader-allowed-names=front-proxy-client".into(),
        "--requestheader-username-headers=X-Remote-User".into(),
        "--requestheader-group-headers=X-Remote-Group".into(),
        "--requestheader-extra-headers-prefix=X-Remote-Extra-".into(),
        format!("--proxy-client-cert-file={}", p("front-proxy-client.crt")),
        format!("--proxy-client-key-file={}", p("front-proxy-client.key")),
        "--v=1".into(),
    ];
    if opts.audit {
        let policy = dir.join("audit-policy.yaml");
        // kube-controller-manager's own traffic (its controllers run as kube-system service
        // accounts) is left out: no test counts it, and with 1,000 objects it is most of the
        // log, which the tests and bench-operator read back.
        std::fs::write(
            &policy,
            "apiVersion: audit.k8s.io/v1\nkind: Policy\nomitStages: [RequestReceived]\nrules:\n  \
             - level: None\n    users: [\"system:kube-controller-manager\"]\n  \
             - level: None\n    userGroups: [\"system:serviceaccounts:kube-system\"]\n  \
             - level: Metadata\n",
        )
        .expect("audit policy written");
        apiserver.push(format!("--audit-policy-file={}", s(&policy)));
        apiserver.push(format!("--audit-log-path={}", s(&dir.join("audit.log"))));
        apiserver.push("--audit-log-mode=blocking".into());
    }
    let controller_manager = opts.controller_manager.then(|| {
        let kc = s(&dir.join("kube-controller-manager.kubeconfig"));
        vec![
            s(&bins.controller_manager),
            format!("--kubeconfig={kc}"),
            format!("--authentication-kubeconfig={kc}"),
            format!("--authorization-kubeconfig={kc}"),
            "--bind-address=127.0.0.1".into(),
            format!("--secure-port={}", free_port()),
            format!("--service-account-private-key-file={}", p("sa.key")),
            format!("--root-ca-file={}", p("ca.crt")),
            format!("--cluster-signing-cert-file={}", p("ca.crt")),
            format!("--cluster-signing-key-file={}", p("ca.key")),
            "--use-service-account-credentials=true".into(),
            "--leader-elect=false".into(),
            "--controllers=*,-nodeipam,-nodelifecycle,-cloud-node-lifecycle,-route,-service".into(),
            format!(
                "--horizontal-pod-autoscaler-sync-period={}s",
                opts.hpa_sync_period.as_secs().max(1)
            ),
            "--v=1".into(),
        ]
    });
    Plan {
        etcd,
        apiserver,
        controller_manager,
    }
}

/// A kubeconfig for `server`, trusting the cluster CA, as a client certificate or a token.
pub fn kubeconfig(server: &str, ca: &Path, user: &KubeUser) -> String {
    let user = match user {
        KubeUser::Certificate { cert, key } => format!(
            "    client-certificate: {}\n    client-key: {}\n",
            s(cert),
            s(key)
        ),
        KubeUser::Token(t) => format!("    token: {t}\n"),
    };
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: test\n  cluster:\n    server: {server}\n    certificate-authority: {}\nusers:\n- name: user\n  user:\n{user}contexts:\n- name: test\n  context:\n    cluster: test\n    user: user\ncurrent-context: test\n",
        s(ca)
    )
}

/// How a kubeconfig authenticates.
#[derive(Debug, Clone)]
pub enum KubeUser {
    Certificate { cert: PathBuf, key: PathBuf },
    Token(String),
}

fn write_kubeconfigs(dir: &Path, api_port: u16) {
    let pki = dir.join("pki");
    let server = format!("https://127.0.0.1:{api_port}");
    for (file, name) in [
        ("admin.kubeconfig", "admin"),
        (
            "kube-controller-manager.kubeconfig",
            "kube-controller-manager",
        ),
    ] {
        let user = KubeUser::Certificate {
            cert: pki.join(format!("{name}.crt")),
            key: pki.join(format!("{name}.key")),
        };
        std::fs::write(
            dir.join(file),
            kubeconfig(&server, &pki.join("ca.crt"), &user),
        )
        .expect("kubeconfig written");
    }
}

fn spawn(name: &str, argv: &[String], dir: &Path) -> Guard {
    let log = std::fs::File::create(dir.join(format!("{name}.log"))).expect("log file");
    let mut cmd = Command::new(&argv[0]);
    cmd.args(&argv[1..])
        .current_dir(dir)
        .stdin(Stdio::null())
        .stdout(log.try_clone().expect("log file"))
        .stderr(log);
    Guard::spawn(name, cmd).unwrap_or_else(|e| panic!("starting {}: {e}", argv[0]))
}

/// An admin client from a kubeconfig file.
pub async fn client_from(kubeconfig: &Path) -> kube::Client {
    let kc = Kubeconfig::read_from(kubeconfig).expect("kubeconfig parses");
    let config = kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
        .await
        .expect("kubeconfig loads");
    kube::Client::try_from(config).expect("client")
}

/// Waits until the apiserver answers `/readyz` with 200; `Err` with its log's tail when it
/// exits first or is not ready within 90 s.
async fn wait_ready(
    kubeconfig: &Path,
    apiserver: Option<&mut Guard>,
    dir: &Path,
) -> Result<(), String> {
    let client = client_from(kubeconfig).await;
    let deadline = Instant::now() + Duration::from_secs(90);
    let mut apiserver = apiserver;
    let log = || tail(&dir.join("kube-apiserver.log"), 30);
    loop {
        let req = http::Request::get("/readyz")
            .body(Vec::new())
            .expect("request");
        if client.request_text(req).await.is_ok() {
            return Ok(());
        }
        if let Some(a) = apiserver.as_deref_mut()
            && let Some(status) = a.exited()
        {
            return Err(format!(
                "kube-apiserver exited ({status}) before it was ready:\n{}",
                log()
            ));
        }
        if Instant::now() >= deadline {
            return Err(format!("kube-apiserver not ready within 90 s:\n{}", log()));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Whether etcd or the apiserver found a port taken under it: ports come from
/// [`free_port`], which another process may bind between our probe and their start.
fn lost_port_race(dir: &Path) -> bool {
    ["kube-apiserver.log", "etcd.log"].iter().any(|f| {
        std::fs::read_to_string(dir.join(f))
            .unwrap_or_default()
            .contains("address already in use")
    })
}

/// The last `n` lines of a file.
pub fn tail(path: &Path, n: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

impl Cluster {
    /// A cluster of this test's own, with kube-controller-manager; `None` (after a loud
    /// message) when the binaries are missing outside CI.
    pub async fn start() -> Option<Cluster> {
        Self::start_with(Options::default()).await
    }

    pub async fn start_with(opts: Options) -> Option<Cluster> {
        let bins = binaries_or_skip()?;
        const ATTEMPTS: u32 = 3;
        for attempt in 1..=ATTEMPTS {
            match Self::try_start(&bins, &opts).await {
                Ok(cluster) => return Some(cluster),
                Err((cluster, why)) if attempt < ATTEMPTS && lost_port_race(&cluster.dir) => {
                    eprintln!(
                        "ferrite-testkit: a private cluster lost a port race (attempt {attempt}); \
                         retrying on new ports\n{why}"
                    );
                }
                Err((_cluster, why)) => panic!("{why}"),
            }
        }
        unreachable!("the last attempt returns or panics")
    }

    /// One start on fresh ports and a fresh directory; on failure, the cluster (to be
    /// dropped, which stops what did start) and why.
    async fn try_start(bins: &Binaries, opts: &Options) -> Result<Cluster, (Cluster, String)> {
        let dir = target_dir()
            .join("ferrite-kube/clusters")
            .join(format!("c-{}", unique()));
        let _pki = Pki::create(&dir.join("pki"));
        let api_port = free_port();
        write_kubeconfigs(&dir, api_port);
        let plan = plan(bins, &dir, api_port, opts);
        let mut cluster = Cluster {
            processes: Processes {
                etcd: Some(spawn("etcd", &plan.etcd, &dir)),
                apiserver: Some(spawn("kube-apiserver", &plan.apiserver, &dir)),
                controller_manager: None,
                apiserver_cmd: plan.apiserver,
                owned_dir: true,
            },
            dir,
            api_port,
            _user: None,
        };
        let ready = wait_ready(
            &cluster.admin_kubeconfig(),
            cluster.processes.apiserver.as_mut(),
            &cluster.dir,
        )
        .await;
        if let Err(why) = ready {
            return Err((cluster, why));
        }
        if let Some(cm) = &plan.controller_manager {
            cluster.processes.controller_manager =
                Some(spawn("kube-controller-manager", cm, &cluster.dir));
        }
        Ok(cluster)
    }

    /// The cluster shared by every test process of this run (started by whichever comes
    /// first, stopped when none has used it for a while). Each test should work in a
    /// namespace of its own ([`Cluster::namespace`]) and leave cluster-wide objects alone.
    pub async fn shared() -> Option<Cluster> {
        let bins = binaries_or_skip()?;
        Some(shared::join(&bins).await)
    }

    /// The directory with the cluster's PKI, kubeconfigs and logs.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn url(&self) -> String {
        format!("https://127.0.0.1:{}", self.api_port)
    }

    /// The admin (system:masters) kubeconfig.
    pub fn admin_kubeconfig(&self) -> PathBuf {
        self.dir.join("admin.kubeconfig")
    }

    /// The cluster CA certificate file.
    pub fn ca_file(&self) -> PathBuf {
        self.dir.join("pki/ca.crt")
    }

    /// A file of the PKI (`front-proxy-ca.crt`, ...).
    pub fn pki_file(&self, name: &str) -> PathBuf {
        self.dir.join("pki").join(name)
    }

    /// The cluster CA, to issue more client certificates.
    pub fn ca(&self) -> Authority {
        self.authority("ca", pki::CA_NAME)
    }

    /// The front-proxy CA (the aggregator's client certificates chain to it).
    pub fn front_proxy_ca(&self) -> Authority {
        self.authority("front-proxy-ca", pki::FRONT_PROXY_CA_NAME)
    }

    fn authority(&self, file: &str, common_name: &str) -> Authority {
        let read = |ext: &str| {
            std::fs::read_to_string(self.pki_file(&format!("{file}.{ext}"))).expect("PKI file")
        };
        Authority::load(common_name, &read("crt"), &read("key"))
    }

    /// A client with cluster-admin rights.
    pub async fn client(&self) -> kube::Client {
        client_from(&self.admin_kubeconfig()).await
    }

    /// Creates a namespace named `<prefix>-<unique>` and returns its name.
    pub async fn namespace(&self, prefix: &str) -> String {
        let name = format!("{prefix}-{}", unique());
        let ns = Namespace {
            metadata: ObjectMeta {
                name: Some(name.clone()),
                ..ObjectMeta::default()
            },
            ..Namespace::default()
        };
        Api::<Namespace>::all(self.client().await)
            .create(&PostParams::default(), &ns)
            .await
            .unwrap_or_else(|e| panic!("creating namespace {name}: {e}"));
        name
    }

    /// Creates the ServiceAccount if needed and writes a kubeconfig authenticating as it with
    /// a token from the TokenRequest API, as a pod's projected token would.
    pub async fn service_account_kubeconfig(&self, ns: &str, name: &str, path: &Path) {
        let client = self.client().await;
        let sas: Api<ServiceAccount> = Api::namespaced(client, ns);
        if sas
            .get_opt(name)
            .await
            .expect("reading ServiceAccount")
            .is_none()
        {
            let sa = ServiceAccount {
                metadata: ObjectMeta {
                    name: Some(name.into()),
                    ..ObjectMeta::default()
                },
                ..ServiceAccount::default()
            };
            sas.create(&PostParams::default(), &sa)
                .await
                .expect("creating ServiceAccount");
        }
        let request = TokenRequest {
            spec: TokenRequestSpec {
                audiences: Vec::new(),
                expiration_seconds: Some(24 * 3600),
                ..TokenRequestSpec::default()
            },
            ..TokenRequest::default()
        };
        let token = sas
            .create_token_request(name, &PostParams::default(), &request)
            .await
            .expect("TokenRequest")
            .status
            .map(|s| s.token)
            .expect("a token");
        std::fs::write(
            path,
            kubeconfig(&self.url(), &self.ca_file(), &KubeUser::Token(token)),
        )
        .expect("kubeconfig written");
    }

    /// Kills kube-apiserver (SIGKILL), as an outage. Private clusters only.
    pub fn stop_apiserver(&mut self) {
        let a = self
            .processes
            .apiserver
            .as_mut()
            .expect("a private cluster's apiserver");
        a.kill();
    }

    /// Starts kube-apiserver again on the same port and etcd, and waits until it is ready.
    pub async fn start_apiserver(&mut self) {
        assert!(
            !self.processes.apiserver_cmd.is_empty(),
            "a private cluster"
        );
        let guard = spawn("kube-apiserver", &self.processes.apiserver_cmd, &self.dir);
        self.processes.apiserver = Some(guard);
        if let Err(why) = wait_ready(
            &self.admin_kubeconfig(),
            self.processes.apiserver.as_mut(),
            &self.dir,
        )
        .await
        {
            panic!("{why}");
        }
    }

    /// The audit log's events (JSON objects), when started with [`Options::audit`].
    pub fn audit_events(&self) -> Vec<serde_json::Value> {
        std::fs::read_to_string(self.dir.join("audit.log"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    }

    /// The last lines of a component's log (`kube-apiserver`, `kube-controller-manager`, `etcd`).
    pub fn log_tail(&self, component: &str, lines: usize) -> String {
        tail(&self.dir.join(format!("{component}.log")), lines)
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        // Processes first (in reverse), then the files, unless someone wants to read them.
        self.processes.controller_manager.take();
        self.processes.apiserver.take();
        self.processes.etcd.take();
        if !self.processes.owned_dir {
            return;
        }
        if std::thread::panicking() || std::env::var_os("FERRITE_TEST_KEEP").is_some() {
            eprintln!("test cluster files kept in {}", self.dir.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

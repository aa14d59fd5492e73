//! The operator on a real control plane (ferrite-testkit's cluster): the chart installed as
//! `helm install` would (its CRD and every rendered object, RBAC included), and the operator
//! binary run as the chart's ServiceAccount, with a token from the TokenRequest API, the chart's
//! arguments and environment, and the chart's volumes laid out as the kubelet would mount them.
//! Only the operator's Deployment is not applied: its process runs here instead, on loopback.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use base64::Engine as _;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DynamicObject, Patch, PatchParams, PostParams};
use kube::core::GroupVersionKind;
use kube::discovery::{ApiCapabilities, ApiResource, Discovery, Scope};
use serde_json::{Value, json};

use crate::chart::{
    NAMESPACE, granted, one_component, operator_deployment, render_values, router_deployment,
};
use crate::kube::{Cluster, Options, workspace_root};
use crate::process::{Guard, TempDir, eventually, free_port};
use crate::server::workspace_binary;
use crate::tls::{Identity, client_config, identity_files};

/// Field manager of the objects a test applies (not the operator's).
const TEST_MANAGER: &str = "ferrite-e2e";

/// Groups no test applies objects of: the metrics APIs that an operator serves through an
/// APIService. Another test's operator may have just stopped, and discovering a group whose
/// backend is gone fails the whole discovery.
const NOT_APPLIED: [&str; 3] = [
    "external.metrics.k8s.io",
    "custom.metrics.k8s.io",
    "metrics.k8s.io",
];

/// Discovers the cluster's API resources. Tests share one API server, where another test may be
/// adding or removing CRDs meanwhile (a group listed one moment answers 404 the next), so a
/// failed discovery is tried again, up to 5 s.
async fn discover(client: &kube::Client) -> Discovery {
    let mut attempt = 0;
    loop {
        match Discovery::new(client.clone())
            .exclude(&NOT_APPLIED)
            .run()
            .await
        {
            Ok(d) => return d,
            Err(e) if attempt < 25 => {
                eprintln!("API discovery failed ({e}); trying again");
                attempt += 1;
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => panic!("API discovery: {e}"),
        }
    }
}

/// Resolves kinds to API resources, rediscovering when a kind is new (a CRD just installed).
pub struct Applier {
    client: kube::Client,
    discovery: Discovery,
}

impl std::fmt::Debug for Applier {
    /// Neither the client nor the discovery cache is `Debug`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Applier").finish_non_exhaustive()
    }
}

impl Applier {
    pub async fn new(client: kube::Client) -> Applier {
        let discovery = discover(&client).await;
        Applier { client, discovery }
    }

    async fn resolve(&mut self, api_version: &str, kind: &str) -> (ApiResource, ApiCapabilities) {
        let (group, version) = api_version.split_once('/').unwrap_or(("", api_version));
        let gvk = GroupVersionKind::gvk(group, version, kind);
        for attempt in 0..50 {
            if let Some(found) = self.discovery.resolve_gvk(&gvk) {
                return found;
            }
            assert!(attempt < 49, "{api_version} {kind} is not served");
            tokio::time::sleep(Duration::from_millis(200)).await;
            self.discovery = discover(&self.client).await;
        }
        unreachable!()
    }

    /// The dynamic API of `obj`'s kind, in its namespace.
    pub async fn api_for(&mut self, obj: &Value) -> Api<DynamicObject> {
        let (ar, caps) = self
            .resolve(
                obj["apiVersion"].as_str().expect("apiVersion"),
                obj["kind"].as_str().expect("kind"),
            )
            .await;
        match (caps.scope, obj["metadata"]["namespace"].as_str()) {
            (Scope::Namespaced, Some(ns)) => Api::namespaced_with(self.client.clone(), ns, &ar),
            (Scope::Namespaced, None) => Api::default_namespaced_with(self.client.clone(), &ar),
            (Scope::Cluster, _) => Api::all_with(self.client.clone(), &ar),
        }
    }

    /// Server-side applies `obj` as the test's own field manager.
    pub async fn apply(&mut self, obj: &Value) -> DynamicObject {
        let api = self.api_for(obj).await;
        let name = obj["metadata"]["name"].as_str().expect("name");
        api.patch(
            name,
            &PatchParams::apply(TEST_MANAGER).force(),
            &Patch::Apply(obj),
        )
        .await
        .unwrap_or_else(|e| panic!("applying {} {name}: {e}", obj["kind"]))
    }

    /// Applies every document of a YAML file.
    pub async fn apply_file(&mut self, path: &Path) {
        for doc in yaml_docs(&std::fs::read_to_string(path).expect("YAML file")) {
            self.apply(&doc).await;
        }
    }
}

pub fn yaml_docs(text: &str) -> Vec<Value> {
    serde_yaml_ng::Deserializer::from_str(text)
        .map(|d| serde::Deserialize::deserialize(d).expect("YAML parses"))
        .filter(|v: &Value| !v.is_null())
        .collect()
}

/// Waits until the CRD `name` is Established.
pub async fn wait_crd(client: &kube::Client, name: &str) {
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let established = api.get_opt(name).await.ok().flatten().is_some_and(|c| {
            c.status
                .and_then(|s| s.conditions)
                .unwrap_or_default()
                .iter()
                .any(|c| c.type_ == "Established" && c.status == "True")
        });
        if established {
            return;
        }
        assert!(Instant::now() < deadline, "CRD {name} not established");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The Prometheus Operator's ServiceMonitor CRD, as far as the operator relies on it: the real
/// group, version, kind and names, with a schema that keeps every field (the real CRD's schema
/// is not in any registry reachable here).
pub fn service_monitor_crd() -> Value {
    json!({
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": "servicemonitors.monitoring.coreos.com"},
        "spec": {"group": "monitoring.coreos.com", "scope": "Namespaced",
            "names": {"kind": "ServiceMonitor", "listKind": "ServiceMonitorList",
                      "plural": "servicemonitors", "singular": "servicemonitor",
                      "categories": ["prometheus-operator"], "shortNames": ["smon"]},
            "versions": [{"name": "v1", "served": true, "storage": true,
                "schema": {"openAPIV3Schema": {"type": "object",
                    "properties": {"spec": {"type": "object",
                        "x-kubernetes-preserve-unknown-fields": true}}}}}]}
    })
}

/// Installs the ServiceMonitor CRD and waits until it is served.
pub async fn install_service_monitor_crd(client: &kube::Client) {
    Applier::new(client.clone())
        .await
        .apply(&service_monitor_crd())
        .await;
    wait_crd(client, "servicemonitors.monitoring.coreos.com").await;
}

/// A private cluster whose API server writes an audit log of every request (but
/// kube-controller-manager's), to read back what a client sent.
pub fn audited() -> Options {
    Options {
        audit: true,
        ..Options::default()
    }
}

/// The chart as installed into a cluster.
#[derive(Debug)]
pub struct Release {
    pub docs: Vec<Value>,
    /// Where the operator's External Metrics API listens (the APIService reaches it there).
    pub external_port: u16,
}

impl Release {
    /// The ServiceAccount of the Deployment of `component` (`operator`, `router`).
    fn service_account_of(&self, component: &str) -> String {
        one_component(&self.docs, "Deployment", component)["spec"]["template"]["spec"]
            ["serviceAccountName"]
            .as_str()
            .expect("serviceAccountName")
            .to_string()
    }

    /// The operator's ServiceAccount.
    pub fn service_account(&self) -> String {
        self.service_account_of("operator")
    }

    /// The operator's user name, as the API server (and its audit log) knows it.
    pub fn operator_user(&self) -> String {
        format!(
            "system:serviceaccount:{NAMESPACE}:{}",
            self.service_account()
        )
    }

    /// ferrite-router's ServiceAccount.
    pub fn router_service_account(&self) -> String {
        self.service_account_of("router")
    }

    /// ferrite-router's user name, as the API server knows it.
    pub fn router_user(&self) -> String {
        format!(
            "system:serviceaccount:{NAMESPACE}:{}",
            self.router_service_account()
        )
    }
}

/// Values every e2e install starts from: leader election on with a short Lease, text logs.
pub fn base_values() -> Value {
    json!({"logFormat": "text", "logLevel": "info,ferrite_operator=debug",
           "leaderElection": {"enabled": true, "leaseDurationSeconds": 15}})
}

/// Merges `over` into `base` (objects key by key; anything else replaces).
pub fn merge(base: &mut Value, over: &Value) {
    match (base, over) {
        (Value::Object(b), Value::Object(o)) => {
            for (k, v) in o {
                merge(b.entry(k.clone()).or_insert(Value::Null), v);
            }
        }
        (b, o) => *b = o.clone(),
    }
}

/// `helm install` of the chart with `values` (over [`base_values`]) into namespace
/// ferrite-system: the CRDs, then every rendered object but the Deployments and
/// PodDisruptionBudgets (the operator's and the router's: their processes run on loopback). The External Metrics Service, if any, becomes an ExternalName Service
/// for `localhost` on a free port, where the operator process will listen, and the APIService
/// points at that port.
pub async fn install(cluster: &Cluster, values: &Value, tag: &str) -> Release {
    let client = cluster.client().await;
    let mut all = base_values();
    merge(&mut all, values);
    let docs = render_values(&all, tag);
    let mut applier = Applier::new(client.clone()).await;
    applier
        .apply(&json!({"apiVersion": "v1", "kind": "Namespace",
                        "metadata": {"name": NAMESPACE}}))
        .await;
    for entry in std::fs::read_dir(workspace_root().join("crds")).expect("crds/") {
        let path = entry.expect("crds/ entry").path();
        applier.apply_file(&path).await;
    }
    wait_crd(&client, "inferenceservices.ferrite.dev").await;
    let external_port = free_port();
    for doc in &docs {
        let mut doc = doc.clone();
        match doc["kind"].as_str() {
            Some("Deployment" | "PodDisruptionBudget") => continue,
            Some("Service")
                if doc["metadata"]["labels"]["app.kubernetes.io/component"]
                    == "external-metrics" =>
            {
                doc["spec"] = json!({"type": "ExternalName", "externalName": "localhost",
                    "ports": [{"name": "https", "port": external_port, "protocol": "TCP"}]});
            }
            Some("APIService") => {
                doc["spec"]["service"]["port"] = json!(external_port);
            }
            _ => {}
        }
        applier.apply(&doc).await;
    }
    Release {
        docs,
        external_port,
    }
}

/// A running operator process.
#[derive(Debug)]
pub struct Operator {
    pub guard: Guard,
    pub identity: String,
    pub http_port: u16,
    /// Where its KEDA external scaler listens (`--keda-scaler-addr`, moved to loopback), when
    /// the chart turns it on.
    pub keda_scaler_port: u16,
    pub log: PathBuf,
    _dir: TempDir,
}

fn decode(data: &Value, key: &str, base64: bool) -> Vec<u8> {
    let s = data[key].as_str().unwrap_or_default();
    if base64 {
        base64::engine::general_purpose::STANDARD
            .decode(s)
            .expect("base64 Secret data")
    } else {
        s.as_bytes().to_vec()
    }
}

/// Lays out the container's volume mounts as files under `dir` (as the kubelet would mount
/// the chart's ConfigMaps and Secrets); returns mount path → local directory.
fn mount_volumes(
    docs: &[Value],
    pod: &Value,
    container: &Value,
    dir: &Path,
) -> Vec<(String, PathBuf)> {
    let mut mounts = Vec::new();
    for m in container["volumeMounts"].as_array().into_iter().flatten() {
        let name = m["name"].as_str().expect("mount name");
        let path = m["mountPath"].as_str().expect("mountPath").to_string();
        let volume = pod["volumes"]
            .as_array()
            .and_then(|v| v.iter().find(|v| v["name"] == name))
            .expect("the mount's volume");
        let (kind, object, b64) = if let Some(cm) = volume["configMap"]["name"].as_str() {
            ("ConfigMap", cm, false)
        } else if let Some(s) = volume["secret"]["secretName"].as_str() {
            ("Secret", s, true)
        } else {
            panic!("volume {name}: only ConfigMaps and Secrets are laid out");
        };
        let source = docs
            .iter()
            .find(|d| d["kind"] == kind && d["metadata"]["name"] == object)
            .unwrap_or_else(|| panic!("{kind} {object} is not rendered"));
        let local = dir.join(name);
        std::fs::create_dir_all(&local).expect("mount dir");
        for key in source["data"]
            .as_object()
            .into_iter()
            .flatten()
            .map(|(k, _)| k)
        {
            std::fs::write(local.join(key), decode(&source["data"], key, b64)).expect("file");
        }
        mounts.push((path, local));
    }
    mounts
}

/// Runs `bin` as the first container of the rendered `deployment` would run: as its
/// ServiceAccount (a kubeconfig with a token from the TokenRequest API, in place of the pod's
/// projected token), with its arguments (each through `arg`, then `extra` appended) and
/// environment (`identity` as the pod's name), its ConfigMap and Secret volumes laid out as
/// files and their mount paths in the arguments pointed there. Returns the process, its log
/// file, and the directory holding both.
async fn run_container(
    cluster: &Cluster,
    docs: &[Value],
    deployment: &Value,
    bin: &Path,
    identity: &str,
    arg: impl Fn(&str) -> String,
    extra: &[&str],
) -> (Guard, PathBuf, TempDir) {
    let pod = &deployment["spec"]["template"]["spec"];
    let container = &pod["containers"][0];
    let sa = pod["serviceAccountName"]
        .as_str()
        .expect("serviceAccountName");
    let dir = TempDir::new(&format!("ferrite-e2e-{identity}"));
    let kubeconfig = dir.path().join("kubeconfig");
    cluster
        .service_account_kubeconfig(NAMESPACE, sa, &kubeconfig)
        .await;
    let mounts = mount_volumes(docs, pod, container, dir.path());
    let args: Vec<String> = container["args"]
        .as_array()
        .expect("args")
        .iter()
        .filter_map(|a| a.as_str())
        .map(|a| {
            let mut a = arg(a);
            for (mount, local) in &mounts {
                a = a.replace(mount.as_str(), &local.display().to_string());
            }
            a
        })
        .chain(extra.iter().map(|s| s.to_string()))
        .collect();
    let mut env: BTreeMap<String, String> = BTreeMap::new();
    for e in container["env"].as_array().into_iter().flatten() {
        let name = e["name"].as_str().expect("env name").to_string();
        let value = match e["valueFrom"]["fieldRef"]["fieldPath"].as_str() {
            Some("metadata.name") => identity.to_string(),
            Some("metadata.namespace") => NAMESPACE.to_string(),
            Some(other) => panic!("env {name} from {other}"),
            None => e["value"].as_str().unwrap_or_default().to_string(),
        };
        env.insert(name, value);
    }
    let log = dir.path().join(format!("{identity}.log"));
    let file = std::fs::File::create(&log).expect("log file");
    let mut cmd = Command::new(bin);
    cmd.args(&args)
        .envs(&env)
        .env("KUBECONFIG", &kubeconfig)
        .env_remove("KUBERNETES_SERVICE_HOST")
        .stdin(Stdio::null())
        .stdout(file.try_clone().expect("log"))
        .stderr(file);
    let guard =
        Guard::spawn(identity, cmd).unwrap_or_else(|e| panic!("{} starts: {e}", bin.display()));
    (guard, log, dir)
}

impl Operator {
    /// Starts the operator binary as the chart's Deployment would run it, as `identity` (its
    /// pod name), with `extra` arguments appended. Its External Metrics API (if enabled)
    /// listens where the APIService points.
    pub async fn launch(
        cluster: &Cluster,
        release: &Release,
        identity: &str,
        extra: &[&str],
    ) -> Operator {
        Self::launch_on(cluster, release, identity, extra, release.external_port).await
    }

    /// [`Operator::launch`], with the External Metrics API on `external_port` (a second
    /// replica's, which the APIService does not reach).
    pub async fn launch_on(
        cluster: &Cluster,
        release: &Release,
        identity: &str,
        extra: &[&str],
        external_port: u16,
    ) -> Operator {
        let http_port = free_port();
        let keda_scaler_port = free_port();
        let (guard, log, dir) = run_container(
            cluster,
            &release.docs,
            operator_deployment(&release.docs),
            &operator_binary(),
            identity,
            |a| {
                if a.starts_with("--http-addr=") {
                    format!("--http-addr=127.0.0.1:{http_port}")
                } else if a.starts_with("--external-metrics-addr=") && !a.ends_with("=off") {
                    format!("--external-metrics-addr=127.0.0.1:{external_port}")
                } else if a.starts_with("--keda-scaler-addr=") {
                    format!("--keda-scaler-addr=127.0.0.1:{keda_scaler_port}")
                } else {
                    a.to_string()
                }
            },
            extra,
        )
        .await;
        let mut op = Operator {
            guard,
            identity: identity.to_string(),
            http_port,
            keda_scaler_port,
            log,
            _dir: dir,
        };
        op.refuse_usage_errors().await;
        op
    }

    /// Waits until the operator's HTTP port answers, and fails the test at once, with the
    /// operator's own message, if it exited with clap's usage status (2: a flag the binary
    /// refuses) instead of leaving the test to time out on whatever it expected next. Other
    /// exits are the test's to judge (some tests expect one).
    async fn refuse_usage_errors(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Some(status) = self.guard.exited() {
                assert_ne!(
                    status.code(),
                    Some(2),
                    "the operator refused its arguments:\n{}",
                    self.log()
                );
                return;
            }
            if std::net::TcpStream::connect(("127.0.0.1", self.http_port)).is_ok() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The operator's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// GET on the operator's own HTTP port: (status, body).
    pub fn get(&self, path: &str) -> Option<(u16, String)> {
        let url = format!("http://127.0.0.1:{}{path}", self.http_port);
        match ureq::get(&url).timeout(Duration::from_secs(3)).call() {
            Ok(r) => Some((r.status(), r.into_string().unwrap_or_default())),
            Err(ureq::Error::Status(code, r)) => Some((code, r.into_string().unwrap_or_default())),
            Err(_) => None,
        }
    }

    /// A sample of the operator's exposition (the first series of `name`).
    pub fn metric(&self, name: &str) -> Option<f64> {
        let (_, body) = self.get("/metrics")?;
        body.lines()
            .find(|l| {
                l.split_whitespace()
                    .next()
                    .is_some_and(|n| n == name || n.starts_with(&format!("{name}{{")))
            })
            .and_then(|l| l.split_whitespace().last())
            .and_then(|v| v.parse().ok())
    }

    /// SIGTERM, then the exit status (within 20 s).
    pub fn terminate(&mut self) -> std::process::ExitStatus {
        let log = self.log();
        self.guard
            .terminate(Duration::from_secs(20))
            .unwrap_or_else(|| panic!("{} did not exit after SIGTERM:\n{log}", self.identity))
    }
}

/// The operator binary: `FERRITE_OPERATOR_BIN`, else the workspace's, built beside the tests
/// (the operator's own tests build it; `cargo nextest run --workspace` builds it for every
/// suite).
pub fn operator_binary() -> PathBuf {
    std::env::var_os("FERRITE_OPERATOR_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_binary("ferrite-operator"))
}

/// A running ferrite-router process, run as the chart's router Deployment would run it.
#[derive(Debug)]
pub struct Router {
    pub guard: Guard,
    /// `http://127.0.0.1:port`: its `--addr`, moved to loopback.
    pub base: String,
    /// Its `--metrics-addr` (with tenants), moved to loopback; else [`Router::base`].
    pub metrics_base: String,
    pub log: PathBuf,
    _dir: TempDir,
}

impl Router {
    /// Starts the router binary with the rendered router Deployment's arguments (its `--addr`
    /// and any `--metrics-addr` on free loopback ports), environment and ServiceAccount.
    pub async fn launch(cluster: &Cluster, release: &Release) -> Router {
        let port = free_port();
        let metrics_port = free_port();
        let own_metrics =
            router_deployment(&release.docs)["spec"]["template"]["spec"]["containers"][0]["args"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|a| a.as_str().is_some_and(|a| a.starts_with("--metrics-addr=")));
        let (guard, log, dir) = run_container(
            cluster,
            &release.docs,
            router_deployment(&release.docs),
            &router_binary(),
            "router-0",
            |a| {
                if a.starts_with("--addr=") {
                    format!("--addr=127.0.0.1:{port}")
                } else if a.starts_with("--metrics-addr=") {
                    format!("--metrics-addr=127.0.0.1:{metrics_port}")
                } else {
                    a.to_string()
                }
            },
            &[],
        )
        .await;
        let metrics_port = if own_metrics { metrics_port } else { port };
        Router {
            guard,
            base: format!("http://127.0.0.1:{port}"),
            metrics_base: format!("http://127.0.0.1:{metrics_port}"),
            log,
            _dir: dir,
        }
    }

    /// The router's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// SIGTERM, then the exit status (within 20 s: the drain delay, then open streams).
    pub fn terminate(&mut self) -> std::process::ExitStatus {
        let log = self.log();
        self.guard
            .terminate(Duration::from_secs(20))
            .unwrap_or_else(|| panic!("ferrite-router did not exit after SIGTERM:\n{log}"))
    }
}

/// The router binary: `FERRITE_ROUTER_BIN`, else the workspace's, built beside the tests
/// (`cargo build -p ferrite-router`; `cargo nextest run --workspace` builds it).
pub fn router_binary() -> PathBuf {
    std::env::var_os("FERRITE_ROUTER_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_binary("ferrite-router"))
}

/// The APIService's live `caBundle` (PEM), once the operator has set it.
pub async fn live_ca_bundle(client: &kube::Client) -> String {
    use k8s_openapi::kube_aggregator::pkg::apis::apiregistration::v1::APIService;
    let api: Api<APIService> = Api::all(client.clone());
    eventually(
        Duration::from_secs(60),
        "the APIService's caBundle",
        async || {
            let bundle = api
                .get("v1beta1.external.metrics.k8s.io")
                .await
                .ok()?
                .spec?
                .ca_bundle?;
            String::from_utf8(bundle.0).ok().filter(|b| !b.is_empty())
        },
    )
    .await
}

/// An HTTPS client for an operator's External Metrics API on `port`, as the aggregator is one:
/// it verifies the server with the APIService's live caBundle under the Service's
/// `NAME.NAMESPACE.svc` name (`host` overrides that name, to see a wrong one refused), and
/// presents the cluster's front-proxy client certificate. Also the base URL to use with it.
pub async fn external_client(
    cluster: &Cluster,
    release: &Release,
    port: u16,
    host: Option<&str>,
) -> (ureq::Agent, String) {
    let identity = front_proxy_identity(cluster);
    external_client_as(cluster, release, port, host, Some(identity)).await
}

/// The cluster's front-proxy client certificate chain and key (CN `front-proxy-client`).
pub fn front_proxy_identity(cluster: &Cluster) -> Identity {
    identity_files(
        &cluster.pki_file("front-proxy-client.crt"),
        &cluster.pki_file("front-proxy-client.key"),
    )
}

/// [`external_client`] with any client identity, or none.
pub async fn external_client_as(
    cluster: &Cluster,
    release: &Release,
    port: u16,
    host: Option<&str>,
    identity: Option<Identity>,
) -> (ureq::Agent, String) {
    let client = cluster.client().await;
    let ca = live_ca_bundle(&client).await;
    let service = release
        .docs
        .iter()
        .find(|d| d["kind"] == "APIService")
        .and_then(|a| a["spec"]["service"]["name"].as_str())
        .expect("the APIService's Service");
    let host = host.map_or_else(|| format!("{service}.{NAMESPACE}.svc"), String::from);
    let resolve = move |_: &str| -> std::io::Result<Vec<std::net::SocketAddr>> {
        Ok(vec![std::net::SocketAddr::from(([127, 0, 0, 1], port))])
    };
    let agent = ureq::AgentBuilder::new()
        .tls_config(std::sync::Arc::new(client_config(&ca, identity)))
        .resolver(resolve)
        .timeout(Duration::from_secs(5))
        .build();
    (agent, format!("https://{host}"))
}

/// An InferenceService object.
pub fn isvc(ns: &str, name: &str, spec: Value) -> Value {
    json!({"apiVersion": "ferrite.dev/v1alpha1", "kind": "InferenceService",
           "metadata": {"name": name, "namespace": ns}, "spec": spec})
}

/// The InferenceServices of `ns`, as dynamic objects.
pub fn isvc_api(client: &kube::Client, ns: &str) -> Api<DynamicObject> {
    let ar = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("ferrite.dev", "v1alpha1", "InferenceService"),
        "inferenceservices",
    );
    Api::namespaced_with(client.clone(), ns, &ar)
}

/// The InferenceService `ns/name` as the API server holds it.
pub async fn get_isvc(client: &kube::Client, ns: &str, name: &str) -> Option<Value> {
    isvc_api(client, ns)
        .get_opt(name)
        .await
        .ok()
        .flatten()
        .map(|o| serde_json::to_value(o).expect("serializes"))
}

/// Waits up to `within` until the InferenceService `ns/name` is Degraded; its (status, reason,
/// message).
pub async fn degraded(
    client: &kube::Client,
    ns: &str,
    name: &str,
    within: Duration,
) -> (String, String, String) {
    eventually(within, &format!("{name} to be Degraded"), async || {
        condition(client, ns, name, "Degraded")
            .await
            .filter(|c| c.0 == "True")
    })
    .await
}

/// Waits up to `within` until condition `type_` of the InferenceService `ns/name` has
/// `reason`; its (status, reason, message).
pub async fn condition_with_reason(
    client: &kube::Client,
    ns: &str,
    name: &str,
    (type_, reason): (&str, &str),
    within: Duration,
) -> (String, String, String) {
    eventually(within, &format!("{name}'s {type_}: {reason}"), async || {
        condition(client, ns, name, type_)
            .await
            .filter(|c| c.1 == reason)
    })
    .await
}

/// (status, reason, message) of a condition of an InferenceService.
pub async fn condition(
    client: &kube::Client,
    ns: &str,
    name: &str,
    type_: &str,
) -> Option<(String, String, String)> {
    let obj = get_isvc(client, ns, name).await?;
    let c = obj["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == type_)?
        .clone();
    Some((
        c["status"].as_str()?.to_string(),
        c["reason"].as_str()?.to_string(),
        c["message"].as_str().unwrap_or_default().to_string(),
    ))
}

/// The pods of the InferenceService `name`, by its label.
async fn isvc_pods(client: &kube::Client, ns: &str, name: &str) -> Vec<Pod> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let label = format!("ferrite.dev/inferenceservice={name}");
    pods.list(&kube::api::ListParams::default().labels(&label))
        .await
        .expect("listing pods")
        .items
}

/// Makes every pod of the InferenceService `name` look like it runs and is ready, at `ip`
/// (where a real server listens, or nothing): what a kubelet would report.
pub async fn pods_ready(client: &kube::Client, ns: &str, name: &str, ip: &str) -> usize {
    pods_ready_at(client, ns, name, &[ip]).await
}

/// [`pods_ready`], the pods (by name) at `ips` in turn; the last IP serves the rest.
pub async fn pods_ready_at(client: &kube::Client, ns: &str, name: &str, ips: &[&str]) -> usize {
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let now = k8s_openapi::jiff::Timestamp::now().to_string();
    let mut live: Vec<Pod> = isvc_pods(client, ns, name)
        .await
        .into_iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .collect();
    live.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
    for (i, p) in live.iter().enumerate() {
        let ip = ips[i.min(ips.len() - 1)];
        let pod_name = p.metadata.name.clone().expect("pod name");
        let containers: Vec<Value> = p
            .spec
            .iter()
            .flat_map(|s| s.containers.iter())
            .map(|c| {
                json!({"name": c.name, "image": "stand-in", "imageID": "", "ready": true,
                       "started": true, "restartCount": 0,
                       "state": {"running": {"startedAt": now}}})
            })
            .collect();
        let cond = |t: &str| json!({"type": t, "status": "True", "lastTransitionTime": now});
        let status = json!({"status": {
            "phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}], "hostIP": ip,
            "startTime": now,
            "conditions": [cond("PodScheduled"), cond("Initialized"), cond("ContainersReady"),
                           cond("Ready")],
            "containerStatuses": containers}});
        pods.patch_status(&pod_name, &PatchParams::default(), &Patch::Merge(&status))
            .await
            .unwrap_or_else(|e| panic!("patching pod {pod_name}'s status: {e}"));
    }
    live.len()
}

/// Binds every unbound pod of the InferenceService `name` to Node `node` (created if
/// missing), as a scheduler would: Kubernetes' EndpointSlice controller skips pods on no node.
pub async fn bind_pods(client: &kube::Client, ns: &str, name: &str, node: &str) -> usize {
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(client.clone());
    if nodes
        .get_opt(node)
        .await
        .expect("reading the node")
        .is_none()
    {
        let n = serde_json::from_value(json!({"metadata": {"name": node}})).expect("a Node");
        nodes
            .create(&PostParams::default(), &n)
            .await
            .unwrap_or_else(|e| panic!("creating node {node}: {e}"));
    }
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let mut bound = 0;
    for p in isvc_pods(client, ns, name).await {
        let pod_name = p.metadata.name.clone().expect("pod name");
        if p.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_some() {
            continue;
        }
        let binding = json!({"apiVersion": "v1", "kind": "Binding",
            "metadata": {"name": pod_name},
            "target": {"apiVersion": "v1", "kind": "Node", "name": node}});
        pods.create_subresource::<Value, Value>(
            "binding",
            &pod_name,
            &PostParams::default(),
            &binding,
        )
        .await
        .unwrap_or_else(|e| panic!("binding pod {pod_name} to {node}: {e}"));
        bound += 1;
    }
    bound
}

/// Creates a ResourceQuota of `hard` limits in `ns` and waits until the quota controller has
/// counted it: until then, admission does not enforce a just-created quota.
pub async fn quota(client: &kube::Client, ns: &str, hard: Value) {
    use k8s_openapi::api::core::v1::ResourceQuota;
    Applier::new(client.clone())
        .await
        .apply(&json!({"apiVersion": "v1", "kind": "ResourceQuota",
            "metadata": {"name": "quota", "namespace": ns}, "spec": {"hard": hard}}))
        .await;
    let api: Api<ResourceQuota> = Api::namespaced(client.clone(), ns);
    let deadline = Instant::now() + Duration::from_secs(30);
    while api
        .get("quota")
        .await
        .ok()
        .and_then(|q| q.status?.used)
        .is_none()
    {
        assert!(
            Instant::now() < deadline,
            "the quota in {ns} was never counted"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Admission reads quotas from its own cache, which may lag the status by a moment.
    tokio::time::sleep(Duration::from_millis(500)).await;
}

/// Creates `obj` (not apply), for objects a test wants created exactly once.
pub async fn create(client: &kube::Client, obj: &Value) -> DynamicObject {
    let mut applier = Applier::new(client.clone()).await;
    let api = applier.api_for(obj).await;
    let dynamic: DynamicObject = serde_json::from_value(obj.clone()).expect("object");
    api.create(&PostParams::default(), &dynamic)
        .await
        .unwrap_or_else(|e| panic!("creating {} {}: {e}", obj["kind"], obj["metadata"]["name"]))
}

/// (verb, group, resource[/subresource]) of each of `user`'s requests, and the refused ones.
pub fn requests(cluster: &Cluster, user: &str) -> (Vec<(String, String, String)>, Vec<Value>) {
    let mut seen = Vec::new();
    let mut refused = Vec::new();
    let mut ids = BTreeSet::new();
    for e in cluster.audit_events() {
        if e["user"]["username"] != user || !ids.insert(e["auditID"].to_string()) {
            continue;
        }
        if e["responseStatus"]["code"] == 403 {
            refused.push(e.clone());
        }
        let r = &e["objectRef"];
        let mut resource = r["resource"].as_str().unwrap_or_default().to_string();
        if let Some(sub) = r["subresource"].as_str() {
            resource = format!("{resource}/{sub}");
        }
        let verb = e["verb"].as_str().unwrap_or_default().to_string();
        let group = r["apiGroup"].as_str().unwrap_or_default().to_string();
        // A server-side apply that creates the object (201) is authorized as create as well as
        // patch, though audited as a patch.
        if verb == "patch" && e["responseStatus"]["code"] == 201 {
            seen.push(("create".into(), group.clone(), resource.clone()));
        }
        seen.push((verb, group, resource));
    }
    (seen, refused)
}

/// Asserts from the audit log that the ServiceAccount `sa` (of the release's namespace) was
/// never refused, used every verb of every rule the rendered `docs` bind to it, and nothing
/// beyond them (discovery aside); `log` is the process's, for the message. Returns how many
/// distinct (verb, group, resource) uses it made.
pub fn assert_exact_rbac(cluster: &Cluster, docs: &[Value], sa: &str, log: &str) -> usize {
    assert_exact_rbac_with(cluster, docs, sa, log, &[])
}

/// [`assert_exact_rbac`], with `also` (verb, group, resource) granted elsewhere (a Role the
/// operator makes), which must be used too.
pub fn assert_exact_rbac_with(
    cluster: &Cluster,
    docs: &[Value],
    sa: &str,
    log: &str,
    also: &[(&str, &str, &str)],
) -> usize {
    let (used, granted) = rbac_uses_settled(cluster, docs, sa, log, also, |used, granted| {
        granted.iter().all(|g| used.contains(g))
    });
    let unused: Vec<_> = granted.iter().filter(|g| !used.contains(g)).collect();
    assert!(
        unused.is_empty(),
        "granted to {sa} but never used: {unused:?}\nused: {used:?}"
    );
    used.len()
}

/// For a test that exercises one part of a release: the ServiceAccount `sa` was never
/// refused and used nothing beyond the rules `docs` bind to it, and it used each of `must_use`
/// (verb, group, resource), each granted.
pub fn assert_rbac_covers(
    cluster: &Cluster,
    docs: &[Value],
    sa: &str,
    log: &str,
    must_use: &[(&str, &str, &str)],
) {
    let wanted = owned(must_use);
    let (used, granted) = rbac_uses_settled(cluster, docs, sa, log, &[], |used, _| {
        used.is_superset(&wanted)
    });
    for m in &wanted {
        assert!(granted.contains(m), "{m:?} is not granted to {sa}");
        assert!(used.contains(m), "{sa} never used {m:?}\nused: {used:?}");
    }
}

/// (verb, group, resource) uses or grants.
type Uses = BTreeSet<(String, String, String)>;

/// `uses` as owned (verb, group, resource) triples.
fn owned(uses: &[(&str, &str, &str)]) -> Uses {
    uses.iter()
        .map(|(v, g, r)| (v.to_string(), g.to_string(), r.to_string()))
        .collect()
}

/// [`rbac_uses`] once `settled` holds of them, or after 15 s: the API server writes a request's
/// audit event when its response is complete, which can be after the client (and a test
/// watching the result) has seen it, so a loaded machine's last uses can be a moment late.
fn rbac_uses_settled(
    cluster: &Cluster,
    docs: &[Value],
    sa: &str,
    log: &str,
    also: &[(&str, &str, &str)],
    settled: impl Fn(&Uses, &Uses) -> bool,
) -> (Uses, Uses) {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let (used, granted) = rbac_uses(cluster, docs, sa, log, also);
        if settled(&used, &granted) || Instant::now() > deadline {
            return (used, granted);
        }
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// What `sa` used, and what it is granted (the rules of `docs` and `also`), after asserting
/// that it was never refused and used nothing beyond them (discovery aside).
fn rbac_uses(
    cluster: &Cluster,
    docs: &[Value],
    sa: &str,
    log: &str,
    also: &[(&str, &str, &str)],
) -> (Uses, Uses) {
    let (seen, refused) = requests(cluster, &format!("system:serviceaccount:{NAMESPACE}:{sa}"));
    assert!(refused.is_empty(), "refused requests: {refused:#?}\n{log}");
    let used: Uses = seen.into_iter().collect();
    let mut granted = granted(docs, sa);
    granted.extend(owned(also));
    let ungranted: Vec<_> = used
        .iter()
        .filter(|u| !granted.contains(*u) && !u.2.is_empty())
        .collect();
    assert!(
        ungranted.is_empty(),
        "{sa} used beyond the rules: {ungranted:?}"
    );
    (used, granted)
}

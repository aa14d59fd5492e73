//! ferrite-operator: serves its own /metrics, /healthz and /readyz, wins the leader Lease,
//! then reconciles InferenceServices until SIGTERM, and hands the Lease back on the way out.

use k8s_openapi::api::networking::v1::NetworkPolicyPeer;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use anyhow::Context as _;
use clap::Parser;
use ferrite_operator::adapters::sync::{AdapterSync, AdapterViews};
use ferrite_operator::autoscale::routers::{RouterPods, RouterQueues};
use ferrite_operator::autoscale::runner::{Autoscaler, Views};
use ferrite_operator::autoscale::store::SignalStore;
use ferrite_operator::cache::Caches;
use ferrite_operator::config::{OperatorConfig, load_dashboards, load_resource_profiles};
use ferrite_operator::controller::{self, Context, Timing};
use ferrite_operator::external_metrics::keeper::Keeper;
use ferrite_operator::external_metrics::{
    CertSource, ClientAuth, RequestHeader, ServerTls, TlsSettings, serve_tls, service_names,
};
use ferrite_operator::leader::{self, Leadership, LeaseSettings};
use ferrite_operator::telemetry::{self, Health, Metrics};
use tokio::sync::watch;

/// How often the routers' queues are read: as often as the autoscaler's scrapes.
const ROUTER_SCRAPE: Duration = Duration::from_secs(1);

#[derive(Debug, Parser)]
#[command(version, about = "Kubernetes operator for ferrite InferenceServices")]
struct Args {
    /// Address of /metrics, /healthz and /readyz.
    #[arg(long, env = "FERRITE_OPERATOR_HTTP", default_value = "0.0.0.0:8080")]
    http_addr: SocketAddr,
    /// Directory of Grafana dashboard JSON files shipped with every InferenceService.
    #[arg(long, env = "FERRITE_DASHBOARDS_DIR")]
    dashboards_dir: Option<PathBuf>,
    /// YAML map of resource profiles (name to node selector, tolerations, affinity, runtime
    /// class, GPU resource name, pull secrets) for `spec.resourceProfile`.
    #[arg(long, env = "FERRITE_RESOURCE_PROFILES")]
    resource_profiles: Option<PathBuf>,
    /// A label (`KEY=VALUE`, repeatable) on every ServiceMonitor the operator makes, under
    /// the InferenceService's own: kube-prometheus-stack's `release`.
    #[arg(long = "monitor-label", value_parser = key_value)]
    monitor_labels: Vec<(String, String)>,
    /// Give every InferenceService a NetworkPolicy admitting only these peers to its pods'
    /// port: a JSON list of NetworkPolicyPeer objects (namespaceSelector/podSelector/ipBlock),
    /// as the chart renders for the router, the operator and Prometheus.
    #[arg(long, env = "FERRITE_NETWORK_POLICY_PEERS", value_parser = network_policy_peers)]
    network_policy_peers: Option<Peers>,
    /// ferrite-router's ServiceAccount (`NAMESPACE/NAME`), when it runs with tenants: each
    /// InferenceService with `spec.auth` gets a Role and RoleBinding letting that account
    /// read the one Secret holding its API key, which the router then sends in place of the
    /// tenant's. Needs `get` on Secrets (rbac.readApiKeySecrets) to grant it.
    #[arg(long, env = "FERRITE_ROUTER_SERVICE_ACCOUNT")]
    router_service_account: Option<ferrite_operator::config::ServiceAccountRef>,
    /// Write KEDA ScaledObjects for `autoscaling.mode: KEDA` (the operator's RBAC must allow
    /// them; the chart's keda.enabled). Without it, KEDA mode is Degraded and KEDA's CRD,
    /// where installed, is never watched.
    #[arg(long, env = "FERRITE_KEDA")]
    keda: bool,
    /// Write LeaderWorkerSets (kubernetes-sigs/lws) for vLLM replicas that span pods (the
    /// operator's RBAC must allow them; the chart's leaderWorkerSet.enabled). Without it, such
    /// a spec is Degraded.
    #[arg(long, env = "FERRITE_LEADER_WORKER_SETS")]
    leader_worker_sets: bool,
    /// The Prometheus (an http:// or https:// URL) that the triggers of KEDA-mode
    /// ScaledObjects read, unless a spec sets autoscaling.keda.serverAddress.
    #[arg(long, env = "FERRITE_KEDA_PROMETHEUS_ADDRESS", value_parser = http_url)]
    keda_prometheus_address: Option<String>,
    /// Serve KEDA's external scaler protocol (gRPC, plain HTTP/2) on this address: KEDA-mode
    /// InferenceServices then default to `scaler: External`, answered from the built-in
    /// autoscaler's signals. With --keda-scaler-address.
    #[arg(
        long,
        env = "FERRITE_KEDA_SCALER_ADDR",
        requires = "keda_scaler_address"
    )]
    keda_scaler_addr: Option<SocketAddr>,
    /// `host:port` at which KEDA reaches that server (the operator Service's DNS name), as the
    /// ScaledObjects' `scalerAddress`.
    #[arg(
        long,
        env = "FERRITE_KEDA_SCALER_ADDRESS",
        requires = "keda_scaler_addr"
    )]
    keda_scaler_address: Option<String>,
    /// ferrite-server image for CPU pods.
    #[arg(long, env = "FERRITE_SERVER_IMAGE")]
    ferrite_image: Option<String>,
    /// ferrite-server image built with CUDA, for pods with GPUs.
    #[arg(long, env = "FERRITE_SERVER_CUDA_IMAGE")]
    ferrite_cuda_image: Option<String>,
    /// vLLM OpenAI server image.
    #[arg(long, env = "FERRITE_VLLM_IMAGE")]
    vllm_image: Option<String>,
    /// How long the operator trusts its last look at which optional APIs the cluster serves
    /// (ServiceMonitor, KEDA, LeaderWorkerSet): one installed later is used within this.
    #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..=3600))]
    discovery_ttl_seconds: u64,
    /// Run without leader election (a single replica only).
    #[arg(long)]
    no_leader_election: bool,
    /// Lease name for leader election.
    #[arg(long, default_value = "ferrite-operator-leader")]
    lease_name: String,
    /// Lease namespace; defaults to the operator pod's namespace.
    #[arg(long, env = "POD_NAMESPACE", default_value = "default")]
    lease_namespace: String,
    /// This replica's identity in the Lease.
    #[arg(long, env = "POD_NAME")]
    identity: Option<String>,
    /// Lease duration in seconds. A standby takes over within this plus one 2 s retry after the
    /// leader vanishes, and within one retry after it hands the Lease back on SIGTERM; a leader
    /// that cannot renew for two thirds of it exits.
    #[arg(long, default_value_t = 15)]
    lease_seconds: u64,
    /// Seconds between passes of the adapter sync, which loads and unloads each
    /// InferenceService's LoRA adapters on its ready pods.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..=3600))]
    adapter_sync_seconds: u64,
    /// The ferrite-router pods (a label selector in --router-namespace): the requests they
    /// hold for saturated services (flow control) count as waiting on those services' pods,
    /// so the autoscaler scales on them.
    #[arg(long, env = "FERRITE_ROUTER_PODS")]
    router_pods: Option<String>,
    /// The routers' namespace; defaults to the operator pod's namespace.
    #[arg(long, env = "FERRITE_ROUTER_NAMESPACE")]
    router_namespace: Option<String>,
    /// The port of the routers' /metrics.
    #[arg(long, default_value_t = 8080)]
    router_port: i32,
    /// Log as JSON lines instead of text.
    #[arg(long, env = "FERRITE_LOG_JSON")]
    log_json: bool,
    /// HTTPS address of the External Metrics API (external.metrics.k8s.io/v1beta1) that HPAs
    /// read the InferenceServices' signals from; "off" disables it.
    #[arg(
        long,
        env = "FERRITE_EXTERNAL_METRICS_ADDR",
        default_value = "0.0.0.0:6443"
    )]
    external_metrics_addr: String,
    /// PEM certificate for the External Metrics API; without it a self-signed one is made for
    /// the Service's DNS names (register the APIService with its caBundle or insecureSkipTLSVerify).
    #[arg(long, env = "FERRITE_TLS_CERT_FILE", requires = "tls_key_file")]
    tls_cert_file: Option<PathBuf>,
    /// PEM private key matching --tls-cert-file.
    #[arg(long, env = "FERRITE_TLS_KEY_FILE", requires = "tls_cert_file")]
    tls_key_file: Option<PathBuf>,
    /// CA of the API server's front proxy (requestheader-client-ca-file), instead of reading
    /// it (and the allowed names) from kube-system/extension-apiserver-authentication, which is
    /// the default and is watched. Metric requests must present a client certificate it signed.
    #[arg(long, env = "FERRITE_CLIENT_CA_FILE")]
    client_ca_file: Option<PathBuf>,
    /// With --client-ca-file: the common names its client certificates may have
    /// (requestheader-allowed-names); none allows any name the CA signed.
    #[arg(long, value_delimiter = ',', requires = "client_ca_file")]
    requestheader_allowed_names: Vec<String>,
    /// Serve metrics to any client that reaches the port, without a client certificate.
    /// Insecure: anyone who can reach the operator reads every namespace's signals.
    #[arg(long, conflicts_with = "client_ca_file")]
    external_metrics_insecure_any_client: bool,
    /// Keep the External Metrics API's serving certificate in this Secret (in the operator's
    /// namespace): the operator issues a self-signed one, sets the APIService's caBundle, and
    /// renews both before expiry. Instead of --tls-cert-file.
    #[arg(long, env = "FERRITE_TLS_SECRET", conflicts_with = "tls_cert_file")]
    tls_secret: Option<String>,
    /// The APIService whose caBundle --tls-secret keeps.
    #[arg(long, default_value = "v1beta1.external.metrics.k8s.io")]
    api_service: String,
    /// Lifetime of each certificate --tls-secret issues (e.g. 365d, 12h, 90s); renewed with a
    /// third left.
    #[arg(long, default_value = "365d", value_parser = parse_duration)]
    tls_cert_validity: Duration,
    /// The operator's Service name, for the self-signed certificate's DNS names.
    #[arg(long, env = "FERRITE_SERVICE_NAME", default_value = "ferrite-operator")]
    service_name: String,
}

fn config(args: &Args) -> anyhow::Result<OperatorConfig> {
    let mut c = OperatorConfig::default();
    let set = |slot: &mut String, v: &Option<String>| {
        if let Some(v) = v {
            slot.clone_from(v);
        }
    };
    set(&mut c.ferrite_image, &args.ferrite_image);
    set(&mut c.ferrite_cuda_image, &args.ferrite_cuda_image);
    set(&mut c.vllm_image, &args.vllm_image);
    if let Some(dir) = &args.dashboards_dir {
        c.dashboards = load_dashboards(dir)?;
    }
    c.monitor_labels = args.monitor_labels.iter().cloned().collect();
    c.network_policy_peers = args.network_policy_peers.clone().map(|p| p.0);
    c.router_service_account = args.router_service_account.clone();
    c.keda_prometheus_address = args.keda_prometheus_address.clone();
    c.keda_scaler_address = args.keda_scaler_address.clone();
    c.keda = args.keda;
    c.leader_worker_sets = args.leader_worker_sets;
    if let Some(path) = &args.resource_profiles {
        c.resource_profiles = load_resource_profiles(path)?;
        tracing::info!(
            profiles = ?c.resource_profiles.keys().collect::<Vec<_>>(),
            "resource profiles loaded"
        );
    }
    Ok(c)
}

/// One flag's list of peers (a newtype: clap reads a bare `Vec` as a repeated flag).
#[derive(Debug, Clone)]
struct Peers(Vec<NetworkPolicyPeer>);

/// A JSON list of NetworkPolicyPeers, each naming at least one selector or block (an empty
/// peer would admit everyone).
fn network_policy_peers(s: &str) -> Result<Peers, String> {
    let peers: Vec<NetworkPolicyPeer> = serde_json::from_str(s)
        .map_err(|e| format!("not a JSON list of NetworkPolicyPeers: {e}"))?;
    if let Some(i) = peers.iter().position(|p| {
        p.namespace_selector.is_none() && p.pod_selector.is_none() && p.ip_block.is_none()
    }) {
        return Err(format!(
            "peer {i} selects nothing, which would admit every client"
        ));
    }
    Ok(Peers(peers))
}

/// `KEY=VALUE`, with a non-empty key.
fn key_value(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
        _ => Err(format!("{s:?} is not KEY=VALUE")),
    }
}

/// Resolves on SIGTERM or Ctrl-C.
async fn terminated() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = ctrl_c => {}
                }
            }
            Err(_) => {
                let _ = ctrl_c.await;
            }
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    if args.log_json {
        tracing_subscriber::fmt()
            .json()
            .with_env_filter(filter)
            .init();
    } else {
        tracing_subscriber::fmt().with_env_filter(filter).init();
    }
    let operator_config = config(&args)?;
    let metrics = Arc::new(Metrics::new()?);
    let health = Arc::new(Health::default());

    let (stop_tx, stop_rx) = watch::channel(false);
    tokio::spawn(async move {
        terminated().await;
        tracing::info!("shutting down");
        let _ = stop_tx.send(true);
    });

    let listener = tokio::net::TcpListener::bind(args.http_addr)
        .await
        .with_context(|| format!("binding {}", args.http_addr))?;
    tracing::info!(addr = %args.http_addr, "serving /metrics, /healthz, /readyz");
    let app = telemetry::router(metrics.clone(), health.clone());
    let http = tokio::spawn(
        axum::serve(listener, app)
            .with_graceful_shutdown(stopped(stop_rx.clone()))
            .into_future(),
    );

    // A v1 client certificate would otherwise fail deep in rustls with a misleading message.
    ferrite_operator::certs::check_kubeconfig()?;
    let client = kube::Client::try_default()
        .await
        .context("connecting to the Kubernetes API")?;
    let (caches, feeds) = Caches::start(client.clone());
    let views = Views::default();
    let adapter_views = AdapterViews::default();
    let ctx = Arc::new(Context::new(
        client.clone(),
        operator_config,
        metrics.clone(),
        Timing {
            discovery_ttl: Duration::from_secs(args.discovery_ttl_seconds),
            ..Timing::default()
        },
        caches,
        views.clone(),
        adapter_views.clone(),
    ));
    // The adapter sync, like the autoscaler, publishes for the status step and acts only
    // while this replica leads.
    let adapters = Arc::new(AdapterSync::new(
        ctx.caches.clone(),
        ctx.triggers.clone(),
        adapter_views,
        ferrite_api::keys::ApiKeys::new(
            client.clone(),
            "the chart grants it with rbac.readApiKeySecrets (default true)",
        ),
        Duration::from_secs(args.adapter_sync_seconds),
    ));
    tokio::spawn(adapters.clone().run(stopped(stop_rx.clone())));
    // The autoscaler follows the InferenceServices on its own; the controller only reads
    // what it publishes.
    let mut autoscaler = Autoscaler::new(
        client.clone(),
        Arc::new(SignalStore::new()),
        metrics.autoscaler.clone(),
        ctx.recorder.clone(),
        ctx.caches.clone(),
        ctx.triggers.clone(),
        views,
    )
    .serving_external_metrics(args.external_metrics_addr != "off");
    if let Some(selector) = &args.router_pods {
        let pods = RouterPods {
            namespace: args
                .router_namespace
                .clone()
                .unwrap_or_else(|| args.lease_namespace.clone()),
            selector: selector.clone(),
            port: args.router_port,
        };
        tracing::info!(namespace = %pods.namespace, selector = %pods.selector, "counting the routers' queues");
        autoscaler =
            autoscaler.with_routers(RouterQueues::start(client.clone(), pods, ROUTER_SCRAPE));
    }
    let autoscaler = Arc::new(autoscaler);
    tokio::spawn(autoscaler.clone().follow(feeds.autoscaler));
    tokio::spawn(controller::dispatch(feeds.controller, ctx.clone()));
    let external = external_metrics(&args, &client, autoscaler.store(), stop_rx.clone()).await?;
    if let Some(addr) = args.keda_scaler_addr {
        // Leader and standby alike: both scrape, and KEDA may reach either.
        let scaler = ferrite_operator::keda_scaler::Scaler::new(
            ctx.caches.clone(),
            autoscaler.store().clone(),
            autoscaler.routers().clone(),
        );
        let stop = stopped(stop_rx.clone());
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("binding --keda-scaler-addr {addr}"))?;
        tracing::info!(%addr, "serving KEDA's external scaler");
        tokio::spawn(async move {
            if let Err(e) = scaler.serve(listener, stop).await {
                tracing::error!(error = %e, "KEDA's external scaler stopped");
            }
        });
    }

    if args.no_leader_election {
        health.ready.store(true, Ordering::Relaxed);
        metrics.leader.set(1);
        autoscaler.set_acting(true);
        adapters.set_acting(true);
        controller::run(ctx, stopped(stop_rx.clone())).await?;
        autoscaler.set_acting(false);
        adapters.set_acting(false);
    } else {
        let identity = match &args.identity {
            Some(i) => i.clone(),
            None => hostname(),
        };
        let settings = LeaseSettings {
            name: args.lease_name.clone(),
            namespace: args.lease_namespace.clone(),
            identity,
            lease_duration: Duration::from_secs(args.lease_seconds.max(2)),
        };
        // Losing the Lease returns an error: the process exits non-zero at once (its
        // /healthz already failing), and the kubelet restarts it as a standby.
        let leader = Leader {
            ctx,
            autoscaler,
            adapters,
            health: &health,
            metrics: &metrics,
        };
        lead(client, settings, leader, stop_rx.clone()).await?;
    }
    let _ = http.await;
    if let Some(e) = external {
        let _ = e.await;
    }
    Ok(())
}

/// Completes once `rx` says the process is stopping.
async fn stopped(mut rx: watch::Receiver<bool>) {
    let _ = rx.wait_for(|s| *s).await;
}

/// How often mounted certificate files are reread for a renewal.
const CERT_FILE_POLL: Duration = Duration::from_secs(5);

/// `90s`, `15m`, `12h`, `365d`, or plain seconds.
fn parse_duration(s: &str) -> Result<Duration, String> {
    let (number, unit) = s.split_at(s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len()));
    let n: u64 = number
        .parse()
        .map_err(|_| format!("{s:?}: expected a number and s, m, h or d"))?;
    let scale = match unit {
        "" | "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86_400,
        _ => return Err(format!("{s:?}: the unit is s, m, h or d")),
    };
    match n.checked_mul(scale) {
        Some(secs) if secs > 0 => Ok(Duration::from_secs(secs)),
        _ => Err(format!("{s:?}: give a positive duration")),
    }
}

/// Starts the External Metrics API over TLS, unless turned off, with its certificate kept
/// current: reread from mounted files, or issued and renewed in the --tls-secret Secret.
async fn external_metrics(
    args: &Args,
    client: &kube::Client,
    store: &Arc<SignalStore>,
    stop: watch::Receiver<bool>,
) -> anyhow::Result<Option<tokio::task::JoinHandle<()>>> {
    if args.external_metrics_addr == "off" {
        return Ok(None);
    }
    let addr: SocketAddr = args
        .external_metrics_addr
        .parse()
        .with_context(|| format!("--external-metrics-addr {:?}", args.external_metrics_addr))?;
    let names = service_names(&args.service_name, &args.lease_namespace);
    let clients = client_auth(args, client, &stop)?;
    let tls = match &args.tls_secret {
        Some(secret) => {
            let keeper = Keeper {
                client: client.clone(),
                namespace: args.lease_namespace.clone(),
                secret: secret.clone(),
                api_service: args.api_service.clone(),
                names,
                validity: args.tls_cert_validity,
            };
            let material = keeper
                .ensure(std::time::SystemTime::now())
                .await
                .context("issuing the External Metrics API's certificate")?;
            let tls = ServerTls::from_pem(&material.cert_pem, &material.key_pem, clients)?;
            tokio::spawn(keeper.run(tls.clone(), material, stopped(stop.clone())));
            tls
        }
        None => {
            let settings = TlsSettings::from_flags(
                args.tls_cert_file.clone(),
                args.tls_key_file.clone(),
                names,
                clients,
            )?;
            let tls = ServerTls::new(&settings)?;
            if let CertSource::Files { cert, key } = settings.cert {
                tokio::spawn(tls.serving_cert().watch_files(
                    cert,
                    key,
                    CERT_FILE_POLL,
                    stopped(stop.clone()),
                ));
            }
            tls
        }
    };
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding {addr}"))?;
    tracing::info!(%addr, "serving the External Metrics API (external.metrics.k8s.io/v1beta1)");
    let store = store.clone();
    let shutdown = stopped(stop);
    Ok(Some(tokio::spawn(async move {
        if let Err(e) = serve_tls(listener, tls, store, shutdown).await {
            tracing::error!(error = %e, "External Metrics API server failed");
        }
    })))
}

/// Who may read the External Metrics API: the request-header CA from --client-ca-file, or the
/// one kube-apiserver publishes (watched from here on), or, explicitly, anyone.
fn client_auth(
    args: &Args,
    client: &kube::Client,
    stop: &watch::Receiver<bool>,
) -> anyhow::Result<Arc<ClientAuth>> {
    if args.external_metrics_insecure_any_client {
        tracing::warn!(
            "--external-metrics-insecure-any-client: any client that reaches the External \
             Metrics API reads every namespace's signals"
        );
        return Ok(ClientAuth::any_client());
    }
    if let Some(path) = &args.client_ca_file {
        let ca_pem = std::fs::read_to_string(path)
            .with_context(|| format!("--client-ca-file {}", path.display()))?;
        let what = format!("the client CA {}", path.display());
        ferrite_operator::certs::check_pem(ca_pem.as_bytes(), &what)?;
        let config = RequestHeader {
            ca_pem,
            allowed_names: args.requestheader_allowed_names.clone(),
        };
        return ClientAuth::request_header(Some(config))
            .with_context(|| format!("--client-ca-file {}", path.display()));
    }
    let clients = ClientAuth::request_header(None)?;
    tokio::spawn(clients.clone().watch(client.clone(), stopped(stop.clone())));
    Ok(clients)
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| format!("ferrite-operator-{}", std::process::id()))
}

/// What runs while this replica leads, and what the Lease loop tells as the role changes: a
/// standby serves reads (ready, the autoscaler observing so its External Metrics API serves
/// the leader's signals); the leader reconciles and the autoscaler acts; losing the Lease fails
/// `/healthz` at once.
struct Leader<'a> {
    ctx: Arc<Context>,
    autoscaler: Arc<Autoscaler>,
    adapters: Arc<AdapterSync>,
    health: &'a Health,
    metrics: &'a Metrics,
}

impl Leadership for Leader<'_> {
    fn standing_by(&self, _holder: Option<&str>) {
        self.health.ready.store(true, Ordering::Relaxed);
    }

    fn acquired(&self) {
        self.health.ready.store(true, Ordering::Relaxed);
        self.metrics.leader.set(1);
        self.autoscaler.set_acting(true);
        self.adapters.set_acting(true);
    }

    fn lost(&self) {
        self.health.failed.store(true, Ordering::Relaxed);
    }

    fn ended(&self) {
        self.autoscaler.set_acting(false);
        self.adapters.set_acting(false);
        self.metrics.leader.set(0);
    }
}

/// Waits for the Lease, then reconciles while renewing it (`leader::lead`). Losing the Lease
/// is an error, so the process exits rather than idle as a leader that no longer leads.
async fn lead(
    client: kube::Client,
    settings: LeaseSettings,
    leader: Leader<'_>,
    stop: watch::Receiver<bool>,
) -> anyhow::Result<()> {
    let ctx = leader.ctx.clone();
    let result = leader::lead(client, settings, &leader, stop, |shutdown| {
        controller::run(ctx, shutdown)
    })
    .await?;
    result.unwrap_or(Ok(()))
}

/// An http:// or https:// URL.
fn http_url(s: &str) -> Result<String, String> {
    match s.parse::<http::Uri>() {
        Ok(u) if matches!(u.scheme_str(), Some("http" | "https")) && u.host().is_some() => {
            Ok(s.to_string())
        }
        _ => Err(format!("{s:?} is not an http:// or https:// URL")),
    }
}

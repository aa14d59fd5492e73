//! The ferrite-router binary: watches InferenceServices and their pods, serves the OpenAI API
//! on one port, and drains on SIGTERM.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use ferrite_net::tls::ServingCert;
use ferrite_router::{Config, EndpointsFrom, FlowConfig, LimitConfig};

#[derive(Debug, Parser)]
#[command(about = "One OpenAI endpoint for every ferrite InferenceService")]
struct Args {
    /// Address to serve the API, /healthz, /readyz and /metrics on.
    #[arg(long, env = "FERRITE_ROUTER_ADDR", default_value = "0.0.0.0:8080")]
    addr: SocketAddr,
    /// Watch only this namespace (default: all the RBAC allows, cluster-wide).
    #[arg(long, env = "FERRITE_ROUTER_NAMESPACE")]
    namespace: Option<String>,
    /// Where each service's ready pods are read from: `endpoint-slices` (the EndpointSlices
    /// of the operator's Services; RBAC on endpointslices, no access to Pods) or `pods` (the
    /// operator's server pods; for clusters whose pod addresses EndpointSlices refuse, such
    /// as loopback test clusters).
    #[arg(
        long,
        env = "FERRITE_ROUTER_ENDPOINTS_FROM",
        value_enum,
        default_value_t
    )]
    endpoints_from: EndpointsFrom,
    /// Characters of the prompt that make the prefix-affinity key.
    #[arg(long, default_value_t = 256)]
    prefix_chars: usize,
    /// Prefix affinity's load bound: a replica takes a request while it holds at most
    /// (1 + epsilon) times the average load.
    #[arg(long, default_value_t = 0.25)]
    epsilon: f64,
    /// Milliseconds between scrapes of the replicas' /metrics.
    #[arg(long, default_value_t = 1000)]
    scrape_interval_ms: u64,
    /// Largest request body, bytes (the server's own limit: a body the replica would refuse
    /// is refused here, before it is held).
    #[arg(long, default_value_t = LimitConfig::default().max_body)]
    max_body: usize,
    /// Request bodies held in memory at once, bytes: reserved from `Content-Length` (the body
    /// limit when there is none) before a body is read, given back once it was sent on. Over
    /// it, requests are refused with 503 and Retry-After.
    #[arg(long, default_value_t = LimitConfig::default().max_buffered_bytes)]
    max_buffered_bytes: usize,
    /// Largest multipart/form-data body (`/v1/audio/transcriptions`, `/translations`),
    /// bytes: streamed to the replica as it arrives; its `model` field must come before the
    /// file, within the first 64 KiB.
    #[arg(long, default_value_t = LimitConfig::default().max_upload)]
    max_upload_body: usize,
    /// Requests open at once, from arrival until their response ends; more get 503.
    #[arg(long, default_value_t = LimitConfig::default().max_in_flight)]
    max_in_flight: usize,
    /// Requests held for services scaling from zero, in all; more get 503.
    #[arg(long, default_value_t = LimitConfig::default().max_held)]
    max_held: usize,
    /// Requests held for any one service; more get 503.
    #[arg(long, default_value_t = LimitConfig::default().max_held_per_service)]
    max_held_per_service: usize,
    /// Milliseconds a replica that refused a connection sits out (its pod may be listed Ready
    /// while it is gone), unless a scrape of its /metrics succeeds first.
    #[arg(long, default_value_t = 10_000)]
    set_aside_ms: u64,
    /// Client connections open at once; past it the listener stops accepting until one
    /// closes.
    #[arg(long, default_value_t = ferrite_net::ListenerLimits::default().max_connections)]
    max_connections: usize,
    /// Seconds for a request's head to arrive, and the most a kept-alive client connection
    /// may idle (slowloris is cut off).
    #[arg(long, default_value_t = 30)]
    header_read_timeout_seconds: u64,
    /// Seconds for a request's whole body to arrive; slower is a 408.
    #[arg(long, default_value_t = 60)]
    body_read_timeout_seconds: u64,
    /// Do not scale services up from zero (hold requests only).
    #[arg(long)]
    no_wake: bool,
    /// Seconds between SIGTERM and closing the listener: /readyz fails at once so endpoints
    /// drop this pod, while requests still arriving are served; open streams then finish.
    #[arg(long, default_value_t = 5)]
    drain_delay_seconds: u64,
    /// Authenticate every request as an InferenceTenant by its bearer key, allow it only the
    /// tenant's models, and hold it to the tenant's limits (off: the cluster's own gateway
    /// authenticates). The keys are the values of Secrets labelled ferrite.dev/tenant=<name>
    /// in --tenant-secrets-namespace.
    #[arg(long)]
    tenants: bool,
    /// Where the tenants' key Secrets are (default: this pod's namespace).
    #[arg(long, env = "POD_NAMESPACE")]
    tenant_secrets_namespace: Option<String>,
    /// With --tenants: the label selector of this router's pods in that namespace. Each
    /// replica then enforces a share of every tenant's limits, following the tenant's traffic
    /// each replica sees, read from the others every second (without it, each enforces them
    /// whole).
    #[arg(long)]
    peers: Option<String>,
    /// This replica's pod name, to tell itself among --peers (without it the limits are split
    /// evenly).
    #[arg(long, env = "POD_NAME")]
    pod_name: Option<String>,
    /// The port the other replicas serve their tenants' rates on (default: --metrics-addr's
    /// port, else --addr's).
    #[arg(long)]
    peer_port: Option<u16>,
    /// Send every request to a replica at once, even when all of its service's replicas are
    /// saturated (off: such requests wait in the router, in priority order and fair across
    /// tenants by tokens).
    #[arg(long)]
    no_flow_control: bool,
    /// A replica is saturated at this many requests in its own waiting queue...
    #[arg(long, default_value_t = FlowConfig::default().queue_depth)]
    saturation_queue_depth: f64,
    /// ...or at this KV-cache usage (0 to 1).
    #[arg(long, default_value_t = FlowConfig::default().kv_usage)]
    saturation_kv_cache_usage: f64,
    /// Requests waiting in the router for saturated services, in all; past it the lowest
    /// priority is shed with 429.
    #[arg(long, default_value_t = FlowConfig::default().max_queued)]
    max_queued: usize,
    /// Requests waiting for any one service.
    #[arg(long, default_value_t = FlowConfig::default().max_queued_per_service)]
    max_queued_per_service: usize,
    /// Seconds a request waits for a saturated service before a 503.
    #[arg(long, default_value_t = FlowConfig::default().max_wait.as_secs())]
    max_queue_wait_seconds: u64,
    /// Seconds after its last request a tenant keeps a batch slot the others cannot take.
    #[arg(long, default_value_t = FlowConfig::default().active_window.as_secs())]
    fair_share_window_seconds: u64,
    /// Serve HTTPS with this PEM certificate chain (e.g. a mounted cert-manager Secret's
    /// tls.crt), reread while it changes; with --tls-key-file.
    #[arg(long, requires = "tls_key_file")]
    tls_cert_file: Option<std::path::PathBuf>,
    /// The certificate's PEM private key.
    #[arg(long, requires = "tls_cert_file")]
    tls_key_file: Option<std::path::PathBuf>,
    /// Seconds between rereads of the certificate files: a renewed certificate is presented
    /// from the next handshake on, without a restart.
    #[arg(long, default_value_t = 10)]
    tls_reload_seconds: u64,
    /// Serve /metrics on this address (plain HTTP) instead of the API port, so clients of the
    /// API do not read it: with tenants its series name every tenant.
    #[arg(long)]
    metrics_addr: Option<std::net::SocketAddr>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let args = Args::parse();
    let client = kube::Client::try_default()
        .await
        .context("connecting to the Kubernetes API")?;
    let config = Config {
        prefix_chars: args.prefix_chars.max(1),
        epsilon: args.epsilon.max(0.0),
        limits: LimitConfig {
            max_body: args.max_body,
            max_upload: args.max_upload_body,
            max_buffered_bytes: args.max_buffered_bytes,
            max_in_flight: args.max_in_flight,
            max_held: args.max_held,
            max_held_per_service: args.max_held_per_service,
        },
        connect_timeout: Duration::from_secs(3),
        body_read_timeout: Duration::from_secs(args.body_read_timeout_seconds.max(1)),
        set_aside: Duration::from_millis(args.set_aside_ms),
        tenants: match (args.tenants, args.tenant_secrets_namespace) {
            (false, _) => None,
            (true, Some(ns)) => Some(ns),
            (true, None) => anyhow::bail!(
                "--tenants needs --tenant-secrets-namespace (or POD_NAMESPACE): where the \
                 tenants' key Secrets are"
            ),
        },
        peers: args.peers.map(|selector| ferrite_router::PeerConfig {
            selector,
            pod_name: args.pod_name,
            port: args
                .peer_port
                .or(args.metrics_addr.map(|a| a.port()))
                .unwrap_or(args.addr.port()),
        }),
        flow: (!args.no_flow_control).then_some(FlowConfig {
            queue_depth: args.saturation_queue_depth.max(0.0),
            kv_usage: args.saturation_kv_cache_usage.clamp(0.0, 1.0),
            max_queued: args.max_queued,
            max_queued_per_service: args.max_queued_per_service,
            max_wait: Duration::from_secs(args.max_queue_wait_seconds.max(1)),
            active_window: Duration::from_secs(args.fair_share_window_seconds),
        }),
    };
    let app = ferrite_router::start(
        client,
        args.namespace.as_deref(),
        args.endpoints_from,
        config,
        Duration::from_millis(args.scrape_interval_ms.max(100)),
        !args.no_wake,
    )
    .await
    .context("starting the router")?;
    let listener = tokio::net::TcpListener::bind(args.addr)
        .await
        .with_context(|| format!("binding {}", args.addr))?;
    tracing::info!(addr = %args.addr, "serving");
    let draining = app.clone();
    let drain_delay = Duration::from_secs(args.drain_delay_seconds);
    let limits = ferrite_net::ListenerLimits {
        max_connections: args.max_connections.max(1),
        header_read_timeout: Duration::from_secs(args.header_read_timeout_seconds.max(1)),
        // No Nagle delay on the client side either: the upstream side already sets it, and a
        // stream's small events must not wait for an ACK.
        nodelay: true,
    };
    let stop = async move {
        shutdown_signal().await;
        draining.draining.store(true, Ordering::SeqCst);
        tracing::info!(delay = ?drain_delay, "draining: /readyz fails");
        tokio::time::sleep(drain_delay).await;
        tracing::info!("closing the listener; open streams finish");
    };
    // Open streams finish however long they take; the pod's grace period bounds them.
    let streams = Duration::from_secs(24 * 3600);
    let routes = match args.metrics_addr {
        Some(addr) => {
            let metrics = tokio::net::TcpListener::bind(addr)
                .await
                .with_context(|| format!("binding {addr}"))?;
            tracing::info!(%addr, "serving /metrics");
            let routes = ferrite_router::metrics_routes(app.clone());
            let limits = ferrite_net::ListenerLimits::default();
            tokio::spawn(async move {
                let stop = std::future::pending();
                if let Err(e) =
                    ferrite_net::serve(metrics, routes, limits, stop, Duration::ZERO).await
                {
                    tracing::warn!(error = %e, "serving /metrics");
                }
            });
            ferrite_router::api_routes(app)
        }
        None => ferrite_router::routes(app),
    };
    match (args.tls_cert_file, args.tls_key_file) {
        (Some(cert), Some(key)) => {
            let serving = ServingCert::from_files(&cert, &key, None)
                .with_context(|| format!("loading the certificate {}", cert.display()))?;
            let config = serving.server_config(None, &[b"h2", b"http/1.1"])?;
            let every = Duration::from_secs(args.tls_reload_seconds.max(1));
            tokio::spawn(serving.watch_files(cert, key, every, std::future::pending()));
            tracing::info!("serving HTTPS");
            ferrite_net::serve_tls(listener, routes, limits, Arc::new(config), stop, streams)
                .await
                .context("serving")?;
        }
        _ => ferrite_net::serve(listener, routes, limits, stop, streams)
            .await
            .context("serving")?,
    }
    Ok(())
}

async fn shutdown_signal() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                tracing::warn!(error = %e, "no SIGTERM handler");
                std::future::pending::<()>().await;
            }
        }
    };
    tokio::select! {
        _ = term => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}

//! The ferrite-router binary: watches InferenceServices and their pods, serves the OpenAI API
//! on one port, and drains on SIGTERM.

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::time::Duration;

use anyhow::Context;
use axum::serve::ListenerExt;
use clap::Parser;
use ferrite_router::Config;

#[derive(Debug, Parser)]
#[command(about = "One OpenAI endpoint for every ferrite InferenceService")]
struct Args {
    /// Address to serve the API, /healthz, /readyz and /metrics on.
    #[arg(long, env = "FERRITE_ROUTER_ADDR", default_value = "0.0.0.0:8080")]
    addr: SocketAddr,
    /// Watch only this namespace (default: all the RBAC allows, cluster-wide).
    #[arg(long, env = "FERRITE_ROUTER_NAMESPACE")]
    namespace: Option<String>,
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
    /// Largest request body, bytes.
    #[arg(long, default_value_t = 32 << 20)]
    max_body: usize,
    /// Milliseconds a replica that refused a connection sits out (its pod may be listed Ready
    /// while it is gone), unless a scrape of its /metrics succeeds first.
    #[arg(long, default_value_t = 10_000)]
    set_aside_ms: u64,
    /// Do not scale services up from zero (hold requests only).
    #[arg(long)]
    no_wake: bool,
    /// Seconds between SIGTERM and closing the listener: /readyz fails at once so endpoints
    /// drop this pod, while requests still arriving are served; open streams then finish.
    #[arg(long, default_value_t = 5)]
    drain_delay_seconds: u64,
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
        max_body: args.max_body,
        connect_timeout: Duration::from_secs(3),
        set_aside: Duration::from_millis(args.set_aside_ms),
    };
    let app = ferrite_router::start(
        client,
        args.namespace.as_deref(),
        config,
        Duration::from_millis(args.scrape_interval_ms.max(100)),
        !args.no_wake,
    )
    .await
    .context("starting the router")?;
    // No Nagle delay on the client side either: the upstream side already sets it, and a
    // stream's small events must not wait for an ACK.
    let listener = tokio::net::TcpListener::bind(args.addr)
        .await
        .with_context(|| format!("binding {}", args.addr))?
        .tap_io(|tcp| {
            if let Err(e) = tcp.set_nodelay(true) {
                tracing::debug!(error = %e, "TCP_NODELAY");
            }
        });
    tracing::info!(addr = %args.addr, "serving");
    let draining = app.clone();
    let drain_delay = Duration::from_secs(args.drain_delay_seconds);
    axum::serve(listener, ferrite_router::routes(app))
        .with_graceful_shutdown(async move {
            shutdown_signal().await;
            draining.draining.store(true, Ordering::SeqCst);
            tracing::info!(delay = ?drain_delay, "draining: /readyz fails");
            tokio::time::sleep(drain_delay).await;
            tracing::info!("closing the listener; open streams finish");
        })
        .await
        .context("serving")?;
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

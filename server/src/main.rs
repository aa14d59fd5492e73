//! ferrite-server binary: loads the model, sizes the paged KV cache, warms up, starts the engine
//! thread and serves the OpenAI-compatible API. On SIGTERM it stops accepting, lets in-flight
//! requests finish (up to `--shutdown-timeout`), and exits 0.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::{Parser, ValueEnum};
use ferrite_api::termination::{LOAD_FAILED, START_FAILED};
use ferrite_runtime::engine::{self, stats::StatsSink};
use ferrite_server::api::{self, state::AppState, state::RequestLimits, state::Serving};
use ferrite_server::config::ServerArgs;
use ferrite_server::fetch;
use ferrite_server::metrics::http::HttpMetrics;
use ferrite_server::metrics::{self, CacheInfo, EngineMetrics, stats_log};
use tokio::sync::watch;
use tracing::{info, warn};

fn main() -> Result<()> {
    // Before any thread exists: each takes its arena at its first allocation.
    let arenas = ferrite_runtime::memory::use_one_arena();
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?
        .block_on(serve(arenas))
}

async fn serve(arenas: ferrite_runtime::memory::ArenaPolicy) -> Result<()> {
    tracing_subscriber::fmt()
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stdout()))
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    info!(?arenas, "malloc arenas");
    let args = ServerArgs::parse();
    let termination = args.termination_message_path.clone();
    let result = run(args).await;
    // Whatever stopped the start, Kubernetes shows it as the termination message, unless a
    // more specific one was written on the way (the kubelet provides the file, empty).
    if let (Err(e), Some(path)) = (&result, &termination)
        && std::fs::metadata(path).map_or(true, |m| m.len() == 0)
    {
        fetch::write_termination_message(path, &format!("{START_FAILED}: {e:#}"));
    }
    result
}

async fn run(args: ServerArgs) -> Result<()> {
    // An empty key would compare equal to a missing header: refuse it rather than serve open.
    anyhow::ensure!(
        args.api_key.as_deref().is_none_or(|k| !k.trim().is_empty()),
        "--api-key (FERRITE_API_KEY) is set but empty; unset it to serve without a key"
    );
    let served = args
        .served_model_name
        .first()
        .cloned()
        .unwrap_or_else(|| fetch::default_served_name(&args.model));
    let aliases = args.served_model_name.iter().skip(1).cloned().collect();
    let registry = metrics::process_registry()?;
    let http_metrics = HttpMetrics::new(&registry)?;
    let state = Arc::new(AppState::new(
        served.clone(),
        aliases,
        args.api_key.clone(),
        RequestLimits {
            max_queue_len: args.max_queue_len,
            max_request_sequences: usize::try_from(args.max_request_sequences)
                .unwrap_or(usize::MAX),
        },
        registry.clone(),
    ));

    // Listen first so that probes see 503 while the model loads, not connection refused.
    let addr: SocketAddr = format!("{}:{}", args.host, args.port)
        .parse()
        .with_context(|| format!("invalid --host/--port {}:{}", args.host, args.port))?;
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding {addr}"))?;
    info!(%addr, "listening");

    let (stop_tx, mut stop_rx) = watch::channel(false);
    {
        let state = state.clone();
        tokio::spawn(async move {
            shutdown_signal().await;
            state.start_draining();
            let _ = stop_tx.send(true);
        });
    }
    let limits = args.listener_limits();
    let body_read_timeout = Duration::from_secs_f64(args.body_read_timeout);
    let app = api::router(state.clone(), http_metrics, body_read_timeout);
    let mut server_stop = stop_rx.clone();
    let drain = Duration::from_secs(args.shutdown_timeout);
    let server = tokio::spawn(async move {
        let stop = async move {
            let _ = server_stop.wait_for(|&s| s).await;
        };
        ferrite_net::serve(listener, app, limits, stop, drain).await
    });

    // Downloads happen behind the open port too: a long one shows as a pending startup probe.
    let cache_dir = args
        .download_dir
        .clone()
        .unwrap_or_else(fetch::default_cache_dir);
    let model_path = tokio::select! {
        r = fetch::resolve(&args.model, &cache_dir, args.model_sha256.as_deref()) => match r {
            Ok(p) => p,
            Err(e) => {
                if let Some(path) = &args.termination_message_path {
                    fetch::write_termination_message(path, &e.termination_message());
                }
                return Err(anyhow::Error::new(e).context("fetching the model"));
            }
        },
        _ = stop_rx.wait_for(|&s| s) => {
            info!("shutdown requested while fetching the model");
            return Ok(());
        }
    };
    let config = args
        .engine_config(model_path)
        .context("the engine's settings")?;
    let sink_args = (args.clone(), registry.clone(), served.clone());
    let log_sink = stats_log::LogSink::default();
    let log = log_sink.clone();
    let starting = tokio::task::spawn_blocking(move || {
        engine::start(&config, |info| {
            let (args, registry, served) = sink_args;
            sinks(&args, &registry, &served, info, log).map_err(Into::into)
        })
    });
    let started = tokio::select! {
        r = starting => match r.context("the engine's start panicked")? {
            Ok(started) => started,
            Err(e) => {
                let reason = if e.is_load() { LOAD_FAILED } else { START_FAILED };
                let hint = match e {
                    engine::StartError::NoBlocks { .. } => " (raise --kv-cache-memory)",
                    _ => "",
                };
                if let Some(path) = &args.termination_message_path {
                    fetch::write_termination_message(path, &format!("{reason}: {e}{hint}"));
                }
                return Err(anyhow::Error::new(e).context(format!("starting the engine{hint}")));
            }
        },
        _ = stop_rx.wait_for(|&s| s) => {
            info!("shutdown requested while loading");
            return Ok(());
        }
    };
    let engine::Started {
        handle,
        thread: engine_thread,
        info: engine_info,
        tokenizer,
        chat_template,
    } = started;
    if !args.disable_log_stats {
        let every = Duration::from_secs_f64(args.log_stats_interval);
        stats_log::spawn(&registry, &served, log_sink, handle.clone(), every)?;
    }
    state.set_serving(Serving {
        engine: handle.clone(),
        tokenizer,
        chat_template,
        max_model_len: engine_info.max_model_len,
        vocab_size: engine_info.vocab_size,
    });
    let sched = engine_info.scheduler;
    info!(
        max_num_seqs = sched.max_num_seqs,
        max_num_batched_tokens = sched.max_num_batched_tokens,
        chunked_prefill = sched.chunked_prefill,
        "ready"
    );

    // Drain: the server stops accepting at the signal and returns once in-flight responses end.
    // An engine that dies ends the process: a server that cannot generate must not stay up
    // looking ready (its pod restarts, and the termination message says why).
    tokio::select! {
        _ = stop_rx.wait_for(|&s| s) => {}
        _ = engine_stopped(&handle) => {
            anyhow::bail!("the engine thread stopped unexpectedly (its log says why)");
        }
    }
    let limit = Duration::from_secs(args.shutdown_timeout);
    let started = Instant::now();
    match tokio::time::timeout(limit, server).await {
        Ok(r) => r.context("server task")??,
        Err(_) => {
            let st = handle.stats();
            warn!(
                running = st.num_running,
                waiting = st.num_waiting,
                "requests still in flight after --shutdown-timeout; exiting anyway"
            );
            return Ok(());
        }
    }
    handle.shutdown();
    let rest = limit.saturating_sub(started.elapsed());
    let joined = tokio::task::spawn_blocking(move || engine_thread.join());
    if tokio::time::timeout(rest.max(Duration::from_secs(1)), joined)
        .await
        .is_err()
    {
        warn!("the engine did not stop in time");
    }
    info!(secs = started.elapsed().as_secs_f64(), "shut down");
    Ok(())
}

/// The engine's two stats sinks: Prometheus, and (unless `--disable-log-stats`) the stats log
/// line.
fn sinks(
    args: &ServerArgs,
    registry: &prometheus::Registry,
    served: &str,
    info: &engine::EngineInfo,
    log: stats_log::LogSink,
) -> Result<Box<dyn StatsSink>, metrics::MetricsError> {
    let cache = CacheInfo {
        block_size: info.scheduler.block_size,
        num_gpu_blocks: info.num_gpu_blocks,
        num_cpu_blocks: info.num_cpu_blocks,
        cache_dtype: args
            .kv_cache_dtype
            .to_possible_value()
            .map_or_else(|| "auto".into(), |v| v.get_name().to_string()),
        swap_space_gib: args.swap_space,
        enable_prefix_caching: args.prefix_caching(),
    };
    let mut sinks: Vec<Box<dyn StatsSink>> = vec![Box::new(EngineMetrics::new(
        registry,
        served,
        info.max_model_len,
        &cache,
    )?)];
    if !args.disable_log_stats {
        sinks.push(Box::new(log));
    }
    Ok(Box::new(sinks))
}

/// Resolves when the engine thread has ended.
async fn engine_stopped(handle: &engine::EngineHandle) {
    let mut tick = tokio::time::interval(Duration::from_millis(500));
    while handle.is_alive() {
        tick.tick().await;
    }
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
    info!("shutdown signal received");
}

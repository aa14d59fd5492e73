//! ferrite-server binary: loads the model, sizes the paged KV cache, warms up, starts the engine
//! thread and serves the OpenAI-compatible API. On SIGTERM it stops accepting, lets in-flight
//! requests finish (up to `--shutdown-timeout`), and exits 0.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::{Parser, ValueEnum};
use ferrite_api::termination::{LOAD_FAILED, START_FAILED};
use ferrite_runtime::engine::{self, stats::StatsSink};
use ferrite_server::api::adapters::Adapters;
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

/// The server's life, as its steps: check the settings, listen (probes see 503 while the
/// model arrives, not a refused connection), fetch the model, start the engine, serve until
/// SIGTERM or the engine's death, drain.
async fn run(args: ServerArgs) -> Result<()> {
    refuse_empty_api_key(&args)?;
    let (served, aliases) = served_names(&args);
    let registry = metrics::process_registry()?;
    let state = app_state(&args, &served, aliases, &registry);
    let listener = listen(&args).await?;
    let stop = stop_on_signal(state.clone());
    let http = spawn_http(&args, listener, state.clone(), &registry, stop.clone())?;
    let Some(model) = until_stopped(&stop, "fetching the model", fetch_model(&args)).await? else {
        return Ok(());
    };
    let starting = start_engine(&args, model, &registry, &served);
    let Some((started, log_sink)) = until_stopped(&stop, "loading", starting).await? else {
        return Ok(());
    };
    let adapters = load_adapters(&args, &state, &started);
    let Some(adapters) = until_stopped(&stop, "loading LoRA adapters", adapters).await? else {
        return Ok(());
    };
    let serving = (started, adapters, log_sink);
    let (handle, engine_thread) = serve_with(&args, &state, &registry, &served, serving)?;
    // An engine that dies ends the process: a server that cannot generate must not stay up
    // looking ready (its pod restarts, and the termination message says why).
    tokio::select! {
        _ = wait_for_stop(&stop) => {}
        _ = engine_stopped(&handle) => {
            anyhow::bail!("the engine thread stopped unexpectedly (its log says why)");
        }
    }
    drain(&args, http, handle, engine_thread).await
}

/// An empty key would compare equal to a missing header: refuse it rather than serve open.
fn refuse_empty_api_key(args: &ServerArgs) -> Result<()> {
    anyhow::ensure!(
        args.api_key.as_deref().is_none_or(|k| !k.trim().is_empty()),
        "--api-key (FERRITE_API_KEY) is set but empty; unset it to serve without a key"
    );
    Ok(())
}

/// The name clients use (the first `--served-model-name`, else one from the source) and the
/// other names accepted.
fn served_names(args: &ServerArgs) -> (String, Vec<String>) {
    let served = args
        .served_model_name
        .first()
        .cloned()
        .unwrap_or_else(|| fetch::default_served_name(&args.model));
    (
        served,
        args.served_model_name.iter().skip(1).cloned().collect(),
    )
}

fn app_state(
    args: &ServerArgs,
    served: &str,
    aliases: Vec<String>,
    registry: &prometheus::Registry,
) -> Arc<AppState> {
    Arc::new(AppState::new(
        served.to_string(),
        aliases,
        args.api_key.clone(),
        RequestLimits {
            max_queue_len: args.max_queue_len,
            max_request_sequences: usize::try_from(args.max_request_sequences)
                .unwrap_or(usize::MAX),
        },
        registry.clone(),
    ))
}

async fn listen(args: &ServerArgs) -> Result<tokio::net::TcpListener> {
    let addr: SocketAddr = format!("{}:{}", args.host, args.port)
        .parse()
        .with_context(|| format!("invalid --host/--port {}:{}", args.host, args.port))?;
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding {addr}"))?;
    info!(%addr, "listening");
    Ok(listener)
}

/// Turns true at SIGTERM or Ctrl-C, once `/health` has started failing (draining).
fn stop_on_signal(state: Arc<AppState>) -> watch::Receiver<bool> {
    let (stop_tx, stop_rx) = watch::channel(false);
    tokio::spawn(async move {
        shutdown_signal().await;
        state.start_draining();
        let _ = stop_tx.send(true);
    });
    stop_rx
}

async fn wait_for_stop(stop: &watch::Receiver<bool>) {
    let _ = stop.clone().wait_for(|&s| s).await;
}

/// Serves the API until `stop`, then lets in-flight responses end (up to
/// `--shutdown-timeout`).
fn spawn_http(
    args: &ServerArgs,
    listener: tokio::net::TcpListener,
    state: Arc<AppState>,
    registry: &prometheus::Registry,
    stop: watch::Receiver<bool>,
) -> Result<tokio::task::JoinHandle<std::io::Result<()>>> {
    let http_metrics = HttpMetrics::new(registry)?;
    let body_read_timeout = Duration::from_secs_f64(args.body_read_timeout);
    let app = api::router(state, http_metrics, body_read_timeout);
    let limits = args.listener_limits();
    let drain = Duration::from_secs(args.shutdown_timeout);
    Ok(tokio::spawn(async move {
        ferrite_net::serve(listener, app, limits, wait_for_stop(&stop), drain).await
    }))
}

/// `work`'s result, or `None` when a shutdown is asked for first.
async fn until_stopped<T>(
    stop: &watch::Receiver<bool>,
    what: &str,
    work: impl std::future::Future<Output = Result<T>>,
) -> Result<Option<T>> {
    tokio::select! {
        r = work => r.map(Some),
        _ = wait_for_stop(stop) => {
            info!("shutdown requested while {what}");
            Ok(None)
        }
    }
}

/// Downloads what is not on disk, behind the open port (a long download shows as a pending
/// startup probe); a failure is also the termination message.
async fn fetch_model(args: &ServerArgs) -> Result<PathBuf> {
    let cache_dir = args
        .download_dir
        .clone()
        .unwrap_or_else(fetch::default_cache_dir);
    match fetch::resolve(&args.model, &cache_dir, args.model_sha256.as_deref()).await {
        Ok(path) => Ok(path),
        Err(e) => {
            if let Some(path) = &args.termination_message_path {
                fetch::write_termination_message(path, &e.termination_message());
            }
            Err(anyhow::Error::new(e).context("fetching the model"))
        }
    }
}

/// Builds the engine off the async workers (`engine::start`: load, size, warm, spawn), with
/// the stats sinks made from what it sized; a failure is also the termination message.
async fn start_engine(
    args: &ServerArgs,
    model: PathBuf,
    registry: &prometheus::Registry,
    served: &str,
) -> Result<(engine::Started, stats_log::LogSink)> {
    let config = args.engine_config(model).context("the engine's settings")?;
    let log_sink = stats_log::LogSink::default();
    let (sink_args, registry, served, log) = (
        args.clone(),
        registry.clone(),
        served.to_string(),
        log_sink.clone(),
    );
    let started = tokio::task::spawn_blocking(move || {
        engine::start(&config, |info| {
            sinks(&sink_args, &registry, &served, info, log).map_err(Into::into)
        })
    })
    .await
    .context("the engine's start panicked")?;
    match started {
        Ok(started) => Ok((started, log_sink)),
        Err(e) => {
            let reason = if e.is_load() {
                LOAD_FAILED
            } else {
                START_FAILED
            };
            let hint = match e {
                engine::StartError::NoBlocks { .. } => " (raise --kv-cache-memory)",
                _ => "",
            };
            if let Some(path) = &args.termination_message_path {
                fetch::write_termination_message(path, &format!("{reason}: {e}{hint}"));
            }
            Err(anyhow::Error::new(e).context(format!("starting the engine{hint}")))
        }
    }
}

/// The `--lora-modules` adapters, loaded for the started model (`None` when LoRA is off). As
/// in vLLM, one that cannot be loaded stops the start, and the termination message says why.
async fn load_adapters(
    args: &ServerArgs,
    state: &AppState,
    started: &engine::Started,
) -> Result<Option<Adapters>> {
    let Some(settings) = args.lora_settings() else {
        return Ok(None);
    };
    let adapters = Adapters::new(
        settings,
        started.model_config.clone(),
        started.device.clone(),
    );
    for (name, source) in &args.lora_modules {
        if let Err(e) = adapters.load(name, source, |n| state.is_base_name(n)).await {
            if let Some(path) = &args.termination_message_path {
                let msg = format!("{LOAD_FAILED}: LoRA adapter {name}: {}", e.message);
                fetch::write_termination_message(path, &msg);
            }
            anyhow::bail!("loading LoRA adapter {name} from {source}: {}", e.message);
        }
    }
    Ok(Some(adapters))
}

/// Hands the running engine and its adapters to the API (from here `/health` is 200) and
/// starts the stats log.
fn serve_with(
    args: &ServerArgs,
    state: &AppState,
    registry: &prometheus::Registry,
    served: &str,
    (started, adapters, log_sink): (engine::Started, Option<Adapters>, stats_log::LogSink),
) -> Result<(engine::EngineHandle, std::thread::JoinHandle<()>)> {
    let engine::Started {
        handle,
        thread,
        info,
        tokenizer,
        chat_template,
        grammars,
        model_config,
        ..
    } = started;
    if !args.disable_log_stats {
        let every = Duration::from_secs_f64(args.log_stats_interval);
        stats_log::spawn(registry, served, log_sink, handle.clone(), every)?;
    }
    state.set_serving(Serving {
        engine: handle.clone(),
        tokenizer,
        chat_template,
        max_model_len: info.max_model_len,
        vocab_size: info.vocab_size,
        adapters,
        grammars,
        tool_format: args.tool_call_parser,
        pooling: args.pooler_config,
        hidden_size: model_config.hidden_size,
    });
    let sched = info.scheduler;
    info!(
        max_num_seqs = sched.max_num_seqs,
        max_num_batched_tokens = sched.max_num_batched_tokens,
        chunked_prefill = sched.chunked_prefill,
        "ready"
    );
    Ok((handle, thread))
}

/// The listener has stopped accepting; waits for in-flight responses (up to
/// `--shutdown-timeout`), then stops the engine and joins its thread in what time is left.
async fn drain(
    args: &ServerArgs,
    http: tokio::task::JoinHandle<std::io::Result<()>>,
    handle: engine::EngineHandle,
    engine_thread: std::thread::JoinHandle<()>,
) -> Result<()> {
    let limit = Duration::from_secs(args.shutdown_timeout);
    let started = Instant::now();
    match tokio::time::timeout(limit, http).await {
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
    let mut metrics = EngineMetrics::new(registry, served, info.max_model_len, &cache)?;
    if args.lora_enabled() {
        metrics = metrics.with_lora(registry, args.max_loras as usize)?;
    }
    let mut sinks: Vec<Box<dyn StatsSink>> = vec![Box::new(metrics)];
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

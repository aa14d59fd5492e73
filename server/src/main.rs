//! ferrite-server binary: loads the model, sizes the paged KV cache, warms up, and serves.
//!
//! The OpenAI endpoints arrive with the serving engine; today the binary serves the probes and
//! model listing that sit in front of it.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result};
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Json};
use axum::routing::get;
use clap::Parser;
use ferrite_server::config::ServerArgs;
use ferrite_server::device::parse_device;
use ferrite_server::kv::{KvCache, KvCacheConfig};
use ferrite_server::model::{self, LoadOptions, SeqInput};
use tracing::info;

struct AppState {
    served_model_name: String,
    ready: AtomicBool,
    created: u64,
    /// Known once the model is loaded (0 before).
    max_model_len: AtomicUsize,
}

#[tokio::main]
async fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let args = ServerArgs::parse();
    let served = args.served_model_name.clone().unwrap_or_else(|| {
        args.model
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "model".into())
    });
    let state = Arc::new(AppState {
        served_model_name: served,
        ready: AtomicBool::new(false),
        created: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
        max_model_len: AtomicUsize::new(0),
    });

    // Listen first so that probes see 503 while the model loads, not connection refused.
    let addr: SocketAddr = format!("{}:{}", args.host, args.port)
        .parse()
        .with_context(|| format!("invalid --host/--port {}:{}", args.host, args.port))?;
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding {addr}"))?;
    info!(%addr, "listening");

    let load_args = args.clone();
    let loader = tokio::task::spawn_blocking(move || load_and_warm(&load_args));
    let state_for_load = state.clone();
    let app = axum::Router::new()
        .route("/health", get(health))
        .route("/version", get(version))
        .route("/v1/models", get(models))
        .with_state(state.clone());
    let server = tokio::spawn(async move {
        axum::serve(listener, app)
            .with_graceful_shutdown(shutdown_signal())
            .await
    });
    // The runtime stays alive for the life of the server; the serving engine will own it.
    let (max_len, _runtime) = loader.await.context("model loader panicked")??;
    state_for_load
        .max_model_len
        .store(max_len, Ordering::SeqCst);
    state_for_load.ready.store(true, Ordering::SeqCst);
    info!("ready");
    server.await.context("server task")??;
    info!("shut down");
    Ok(())
}

/// Loads the model, allocates the KV cache, and runs one forward so the first request does not
/// pay for lazy initialisation.
fn load_and_warm(args: &ServerArgs) -> Result<(usize, (model::LoadedModel, KvCache))> {
    let device = parse_device(&args.device)?;
    let t0 = Instant::now();
    let opts = LoadOptions {
        device: device.clone(),
        weight_mode: args.weights,
        max_model_len: args.max_model_len,
        tokenizer: args.tokenizer.clone(),
    };
    let loaded = model::load(&args.model, &opts)
        .with_context(|| format!("loading model {}", args.model.display()))?;
    let cfg = loaded.model.config();
    let probe = KvCacheConfig::for_model(cfg, args.block_size, 0, 0);
    let num_blocks = args
        .num_gpu_blocks
        .unwrap_or_else(|| probe.blocks_for_bytes(args.kv_cache_memory));
    let host_blocks = probe.blocks_for_bytes((args.swap_space * (1u64 << 30) as f64) as usize);
    anyhow::ensure!(
        num_blocks > 0,
        "the KV cache holds no block: raise --kv-cache-memory"
    );
    let kv = KvCacheConfig::for_model(cfg, args.block_size, num_blocks, host_blocks);
    let mut cache = KvCache::new(kv, &device)?;
    info!(
        weights = ?loaded.weight_mode,
        layers = cfg.num_layers,
        num_gpu_blocks = num_blocks,
        num_cpu_blocks = host_blocks,
        block_size = args.block_size,
        max_model_len = loaded.model.max_len(),
        secs = t0.elapsed().as_secs_f64(),
        "model loaded"
    );
    let warm: Vec<u32> = loaded.tokenizer.encode("Hello", false)?;
    let blocks = cache.allocator_mut().allocate_n(1)?;
    let input = SeqInput {
        tokens: &warm,
        start_pos: 0,
        block_table: &blocks,
    };
    loaded.model.forward(&[input], &cache)?;
    cache.allocator_mut().free_all(&blocks)?;
    let max_len = loaded.model.max_len();
    Ok((max_len, (loaded, cache)))
}

async fn health(State(s): State<Arc<AppState>>) -> impl IntoResponse {
    if s.ready.load(Ordering::SeqCst) {
        (StatusCode::OK, "")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "loading")
    }
}

async fn version() -> Json<serde_json::Value> {
    Json(serde_json::json!({ "version": env!("CARGO_PKG_VERSION") }))
}

async fn models(State(s): State<Arc<AppState>>) -> Json<serde_json::Value> {
    Json(serde_json::json!({
        "object": "list",
        "data": [{
            "id": s.served_model_name,
            "object": "model",
            "created": s.created,
            "owned_by": "ferrite",
            "root": s.served_model_name,
            "max_model_len": match s.max_model_len.load(Ordering::SeqCst) {
                0 => serde_json::Value::Null,
                n => n.into(),
            },
        }]
    }))
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

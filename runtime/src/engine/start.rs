//! The engine's one entry point, as vLLM's `EngineCore` builds itself: [`start`] loads the
//! model, sizes the KV cache from a memory budget, warms the forward, and spawns the loop with
//! the stats sinks its caller makes from what was sized. The server, benchmarks and tests start
//! an engine only through here.

use std::path::PathBuf;
use std::thread::JoinHandle;
use std::time::Instant;

use tracing::info;

use super::core::{self, EngineHandle};
use super::scheduler::{SchedulerConfig, SchedulerError};
use super::stats::StatsSink;
use super::structured::Grammars;
use crate::kv::{CacheDtype, KvCache, KvCacheConfig, KvError};
use crate::model::{self, ChatTemplate, LoadOptions, LoadedModel, ModelError, SeqInput, Tokenizer};

/// Everything the engine needs to build itself.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// A GGUF file or a Hugging Face folder, on disk.
    pub model: PathBuf,
    pub load: LoadOptions,
    pub kv: KvSizing,
    pub scheduling: Scheduling,
    /// Nice levels the compute threads run below the caller's (0: none), so the HTTP side
    /// keeps a core under load.
    pub compute_nice: i32,
}

/// How big the KV cache is.
#[derive(Debug, Clone, Copy)]
pub struct KvSizing {
    /// Tokens per block.
    pub block_size: usize,
    /// The device blocks.
    pub device: Budget,
    /// The host pool swapped-out blocks go to.
    pub host: Budget,
    pub dtype: CacheDtype,
}

/// A pool's size: a memory budget the engine divides by its model's block size, or exactly so
/// many blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Budget {
    Bytes(usize),
    Blocks(usize),
}

impl std::fmt::Display for Budget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Budget::Bytes(b) => write!(f, "{b} bytes"),
            Budget::Blocks(n) => write!(f, "{n} blocks"),
        }
    }
}

impl Budget {
    fn blocks(self, probe: &KvCacheConfig) -> usize {
        match self {
            Budget::Bytes(b) => probe.blocks_for_bytes(b),
            Budget::Blocks(n) => n,
        }
    }
}

/// What the scheduler may put in one step.
#[derive(Debug, Clone, Copy)]
pub struct Scheduling {
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
    pub chunked_prefill: bool,
    pub prefix_caching: bool,
    /// Most distinct LoRA adapters running at once (`--max-loras`).
    pub max_loras: usize,
}

/// What the engine sized, for its sinks and its caller.
#[derive(Debug, Clone, Copy)]
pub struct EngineInfo {
    pub max_model_len: usize,
    pub num_gpu_blocks: usize,
    pub num_cpu_blocks: usize,
    /// Token ids the sampler may produce (the smaller of the tokenizer's and the model's).
    pub vocab_size: usize,
    pub scheduler: SchedulerConfig,
}

/// A running engine and what requests need besides it.
#[derive(Debug)]
pub struct Started {
    pub handle: EngineHandle,
    /// The engine thread: joined after `handle.shutdown()`.
    pub thread: JoinHandle<()>,
    pub info: EngineInfo,
    pub tokenizer: Tokenizer,
    pub chat_template: Option<ChatTemplate>,
    /// The model's shapes and device, which LoRA adapters are loaded for
    /// (`model::lora::load`): an adapter's tensors must live on the model's own device.
    pub model_config: crate::model::ModelConfig,
    pub device: candle_core::Device,
    /// The grammar compiler for structured outputs (`None`: not available for this model's
    /// tokenizer; the start log says why).
    pub grammars: Option<std::sync::Arc<Grammars>>,
}

/// Why the engine did not start. [`StartError::is_load`] tells a model that cannot be served
/// (the weights, the cache they need, the first forward) from a setting that cannot be met.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("loading model {path}: {source}")]
    Load { path: PathBuf, source: ModelError },
    #[error("the KV cache holds no block: {budget} for blocks of {block_size} tokens")]
    NoBlocks { budget: Budget, block_size: usize },
    #[error("allocating the KV cache: {0}")]
    Cache(#[from] KvError),
    #[error("the warm-up forward failed: {0}")]
    Warm(String),
    #[error("making the stats sinks: {0}")]
    Sinks(Box<dyn std::error::Error + Send + Sync>),
    #[error(transparent)]
    Scheduler(#[from] SchedulerError),
    #[error("spawning the engine thread: {0}")]
    Spawn(std::io::Error),
}

impl StartError {
    /// Whether the model itself failed (loading, sizing its cache, its first forward).
    pub fn is_load(&self) -> bool {
        matches!(
            self,
            StartError::Load { .. }
                | StartError::NoBlocks { .. }
                | StartError::Cache(_)
                | StartError::Warm(_)
        )
    }
}

/// Loads, sizes, warms and spawns; `sinks` makes the stats sinks from what was sized.
/// Blocking (a load takes seconds to minutes): call it off the async workers.
pub fn start<F>(config: &EngineConfig, sinks: F) -> Result<Started, StartError>
where
    F: FnOnce(&EngineInfo) -> Result<Box<dyn StatsSink>, Box<dyn std::error::Error + Send + Sync>>,
{
    if let Err(e) = crate::priority::init_compute_pool(config.compute_nice) {
        tracing::warn!(error = %e, "compute threads keep the default priority");
    }
    let mut loaded = load(config)?;
    let mut cache = size_cache(config, &loaded)?;
    warm(&loaded, &mut cache)?;
    let info = info(config, &loaded, &cache);
    let sink = sinks(&info).map_err(StartError::Sinks)?;
    let tokenizer = loaded.tokenizer.clone();
    let grammars = grammars(&loaded);
    let chat_template = loaded.chat_template.take();
    let (model_config, device) = (loaded.model.config().clone(), loaded.model.device().clone());
    let (handle, thread) = core::spawn(loaded, cache, info.scheduler, sink)?;
    Ok(Started {
        handle,
        thread,
        info,
        tokenizer,
        chat_template,
        model_config,
        device,
        grammars,
    })
}

/// The grammar compiler over the model's vocabulary (a trie of every token's bytes).
fn grammars(loaded: &LoadedModel) -> Option<std::sync::Arc<Grammars>> {
    let t0 = Instant::now();
    let width = loaded.model.config().vocab_size;
    match Grammars::new(&loaded.tokenizer, width, &loaded.eos_token_ids) {
        Ok(g) => {
            info!(
                secs = t0.elapsed().as_secs_f64(),
                "structured outputs ready"
            );
            Some(std::sync::Arc::new(g))
        }
        Err(e) => {
            tracing::warn!(error = %e, "structured outputs are off");
            None
        }
    }
}

fn load(config: &EngineConfig) -> Result<LoadedModel, StartError> {
    let t0 = Instant::now();
    let loaded = model::load(&config.model, &config.load).map_err(|source| StartError::Load {
        path: config.model.clone(),
        source,
    })?;
    info!(
        weights = ?loaded.weight_mode,
        layers = loaded.model.config().num_layers,
        max_model_len = loaded.model.max_len(),
        secs = t0.elapsed().as_secs_f64(),
        "model loaded"
    );
    if loaded.model.device().is_cpu() {
        info!(paths = %crate::kernels::cpu_paths(), "CPU kernels");
    }
    Ok(loaded)
}

/// The device blocks and the host swap pool, from their budgets.
fn size_cache(config: &EngineConfig, loaded: &LoadedModel) -> Result<KvCache, StartError> {
    let (cfg, kv) = (loaded.model.config(), &config.kv);
    let probe = KvCacheConfig::for_model(cfg, kv.block_size, 0, 0).with_dtype(kv.dtype.dtype());
    let num_blocks = kv.device.blocks(&probe);
    if num_blocks == 0 {
        return Err(StartError::NoBlocks {
            budget: kv.device,
            block_size: kv.block_size,
        });
    }
    let host_blocks = kv.host.blocks(&probe);
    let sized = KvCacheConfig::for_model(cfg, kv.block_size, num_blocks, host_blocks)
        .with_dtype(kv.dtype.dtype());
    let cache = KvCache::new(sized, &config.load.device)?;
    info!(
        num_gpu_blocks = num_blocks,
        num_cpu_blocks = host_blocks,
        kv_cache_dtype = ?kv.dtype,
        block_size = kv.block_size,
        "KV cache sized"
    );
    Ok(cache)
}

/// One forward through a borrowed block, so the first request does not pay for lazy
/// initialisation; then the memory the load freed goes back to the system.
fn warm(loaded: &LoadedModel, cache: &mut KvCache) -> Result<(), StartError> {
    let warm_err = |e: &dyn std::fmt::Display| StartError::Warm(e.to_string());
    let tokens = loaded
        .tokenizer
        .encode("Hello", false)
        .map_err(|e| warm_err(&e))?;
    let blocks = cache
        .allocator_mut()
        .allocate_n(1)
        .map_err(|e| warm_err(&e))?;
    let input = SeqInput {
        tokens: &tokens,
        start_pos: 0,
        block_table: &blocks,
        adapter: None,
    };
    let forward = loaded.model.forward(&[input], cache).map(drop);
    cache
        .allocator_mut()
        .free_all(&blocks)
        .map_err(|e| warm_err(&e))?;
    forward.map_err(|e| warm_err(&e))?;
    crate::memory::release_free_memory();
    Ok(())
}

fn info(config: &EngineConfig, loaded: &LoadedModel, cache: &KvCache) -> EngineInfo {
    let num_gpu_blocks = cache.allocator().num_blocks();
    let max_model_len = loaded.model.max_len();
    let s = &config.scheduling;
    EngineInfo {
        max_model_len,
        num_gpu_blocks,
        num_cpu_blocks: cache.host_allocator().num_blocks(),
        vocab_size: loaded
            .tokenizer
            .vocab_size()
            .min(loaded.model.config().vocab_size),
        scheduler: SchedulerConfig {
            max_num_seqs: s.max_num_seqs,
            max_num_batched_tokens: s.max_num_batched_tokens,
            max_model_len,
            block_size: config.kv.block_size,
            chunked_prefill: s.chunked_prefill,
            // 1% of the blocks kept back when admitting, as vLLM's default watermark.
            watermark_blocks: num_gpu_blocks / 100,
            prefix_caching: s.prefix_caching,
            max_loras: s.max_loras,
        },
    }
}

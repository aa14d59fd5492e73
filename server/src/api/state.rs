//! What every handler shares: the served name, auth and admission settings, and — once the
//! model is loaded — the engine handle with the tokenizer and chat template.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use super::adapters::Adapters;
use super::error::ApiError;
use ferrite_runtime::engine::{EngineHandle, Grammars};
use ferrite_runtime::model::lora::LoraAdapter;
use ferrite_runtime::model::{ChatTemplate, Tokenizer};
use prometheus::Registry;

#[derive(Debug)]
pub struct AppState {
    pub served_model_name: String,
    /// Other names accepted in `model` (responses carry the first name).
    pub aliases: Vec<String>,
    /// Unix seconds, for `created` fields.
    pub created: u64,
    /// Bearer token required on `/v1/*` (vLLM's `--api-key`).
    pub api_key: Option<String>,
    /// What one request, and the queue, may hold.
    pub limits: RequestLimits,
    /// Everything `/metrics` exposes.
    pub registry: Registry,
    serving: OnceLock<Serving>,
    draining: AtomicBool,
}

/// What one request, and the queue, may hold.
#[derive(Debug, Clone, Copy)]
pub struct RequestLimits {
    /// Requests waiting for the engine beyond this are refused with 503.
    pub max_queue_len: Option<usize>,
    /// Most sequences (prompts × `n`) one request may add.
    pub max_request_sequences: usize,
}

/// The loaded model as the HTTP side sees it.
#[derive(Debug)]
pub struct Serving {
    pub engine: EngineHandle,
    pub tokenizer: Tokenizer,
    pub chat_template: Option<ChatTemplate>,
    pub max_model_len: usize,
    /// Token ids below this are valid in prompts: both the tokenizer and the model's
    /// embedding know them.
    pub vocab_size: usize,
    /// The LoRA adapters served (`None`: LoRA is off).
    pub adapters: Option<Adapters>,
    /// The grammar compiler for structured outputs (`None`: not available for this
    /// tokenizer).
    pub grammars: Option<Arc<Grammars>>,
    /// `--tool-call-parser` (`None`: recognised from the chat template).
    pub tool_format: Option<super::tool_parse::CallFormat>,
    /// How `/v1/embeddings` pools (`--pooler-config`).
    pub pooling: ferrite_runtime::engine::Pooling,
    /// The width of the model's hidden states: an embedding's dimensions.
    pub hidden_size: usize,
}

/// What a request's `model` names: the base model or one of its adapters.
#[derive(Debug, Clone)]
pub struct Resolved {
    /// The name responses carry.
    pub name: String,
    /// The adapter itself, once [`AppState::resolve_generation_model`] has it in memory.
    pub adapter: Option<Arc<LoraAdapter>>,
    /// Whether `name` is an adapter's.
    pub is_adapter: bool,
}

impl AppState {
    pub fn new(
        served_model_name: String,
        aliases: Vec<String>,
        api_key: Option<String>,
        limits: RequestLimits,
        registry: Registry,
    ) -> Self {
        Self {
            served_model_name,
            aliases,
            created: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
            api_key,
            limits,
            registry,
            serving: OnceLock::new(),
            draining: AtomicBool::new(false),
        }
    }

    /// Called once the model is loaded and warm; from then on `/health` answers 200.
    pub fn set_serving(&self, s: Serving) {
        let _ = self.serving.set(s);
    }

    pub fn serving(&self) -> Result<&Serving, ApiError> {
        if self.is_draining() {
            return Err(ApiError::unavailable("the server is shutting down", 5));
        }
        self.serving
            .get()
            .ok_or_else(|| ApiError::unavailable("the model is still loading", 5))
    }

    /// Runs CPU work on the loaded model (tokenizing, rendering a chat template) on the blocking
    /// pool: a long prompt must not hold an async worker that probes, scrapes and token
    /// streams share.
    pub async fn blocking<T, F>(self: &Arc<Self>, f: F) -> Result<T, ApiError>
    where
        T: Send + 'static,
        F: FnOnce(&Serving) -> Result<T, ApiError> + Send + 'static,
    {
        let state = self.clone();
        tokio::task::spawn_blocking(move || f(state.serving()?))
            .await
            .map_err(|e| ApiError::internal(format!("tokenizing failed: {e}")))?
    }

    pub fn loaded(&self) -> Option<&Serving> {
        self.serving.get()
    }

    pub fn is_ready(&self) -> bool {
        self.serving.get().is_some_and(|s| s.engine.is_alive()) && !self.is_draining()
    }

    /// Set on SIGTERM: readiness fails so that load balancers stop sending new work.
    pub fn start_draining(&self) {
        self.draining.store(true, Ordering::SeqCst);
    }

    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }

    /// Whether `name` is one the base model answers to.
    pub fn is_base_name(&self, name: &str) -> bool {
        name == self.served_model_name || self.aliases.iter().any(|a| a == name)
    }

    /// [`AppState::resolve_model`], with a named adapter in memory (paged in if it was
    /// paged out), for a request that generates.
    pub async fn resolve_generation_model(
        &self,
        model: Option<&str>,
    ) -> Result<Resolved, ApiError> {
        let mut r = self.resolve_model(model)?;
        if r.is_adapter {
            let adapters = self.loaded().and_then(|s| s.adapters.as_ref());
            r.adapter = match adapters {
                Some(a) => a.acquire(&r.name).await?,
                None => None,
            };
            if r.adapter.is_none() {
                // Unloaded between the two looks.
                return Err(ApiError::invalid_param(
                    "model",
                    format!("The model `{}` does not exist.", r.name),
                ));
            }
        }
        Ok(r)
    }

    /// The base model when `model` is absent or one of its names, else the adapter it names;
    /// 400 for anything else.
    pub fn resolve_model(&self, model: Option<&str>) -> Result<Resolved, ApiError> {
        let base = || Resolved {
            name: self.served_model_name.clone(),
            adapter: None,
            is_adapter: false,
        };
        let Some(m) = model.filter(|m| !self.is_base_name(m)) else {
            return Ok(base());
        };
        let served = self
            .loaded()
            .and_then(|s| s.adapters.as_ref())
            .is_some_and(|a| a.contains(m));
        match served {
            true => Ok(Resolved {
                name: m.to_string(),
                adapter: None,
                is_adapter: true,
            }),
            false => Err(ApiError::invalid_param(
                "model",
                format!(
                    "The model `{m}` does not exist. This server serves `{}`{}.",
                    self.served_model_name,
                    if self.loaded().is_some_and(|s| s.adapters.is_some()) {
                        " and the adapters /v1/models lists"
                    } else {
                        ""
                    }
                ),
            )),
        }
    }
}

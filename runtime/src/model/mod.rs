//! Model runtime: checkpoint formats, tokenizer, chat template, and the batched paged forward.
//! It knows tensors, never requests.

pub mod activation;
pub mod attention;
pub mod attention_kernel;
pub mod attention_meta;
pub mod cache_write;
pub mod chat_template;
pub mod config;
mod cpu_view;
pub mod cuda_graph;
#[cfg(feature = "cuda")]
mod cuda_view;
pub mod driver;
pub mod gguf;
pub mod llama;
pub mod lora;
pub mod moe;
pub mod norm;
pub mod rope;
pub mod safetensors;
pub mod step;
pub mod tokenizer;
pub mod weights;

use std::path::{Path, PathBuf};

use candle_core::Device;

pub use chat_template::{ChatMessage, ChatTemplate};
pub use config::{Activation, Arch, LocalLayers, ModelConfig, Moe, RopeScaling, RopeStyle};
pub use llama::{HiddenRows, LlamaModel, SeqInput};
pub use tokenizer::Tokenizer;
pub use weights::{Checkpoint, LlamaWeights, RawWeight, WeightMode, WeightSource};

/// Everything that can go wrong loading or running a model. Messages name the file, key or
/// tensor at fault so that a user can fix their checkpoint.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: {reason}")]
    Corrupt { path: PathBuf, reason: String },
    #[error(
        "unsupported model architecture '{0}' (supported: gemma2, gemma3, llama, mistral, mixtral, phi3, qwen2, qwen2moe, qwen3, qwen3moe)"
    )]
    UnsupportedArchitecture(String),
    #[error("unsupported: {0}")]
    Unsupported(String),
    #[error("missing metadata key '{0}'")]
    MissingMetadata(String),
    #[error("metadata key '{0}' has an invalid value")]
    InvalidMetadata(String),
    #[error("missing tensor '{0}'")]
    MissingTensor(String),
    #[error("tensor '{tensor}' has shape {got:?}, expected {expected:?}")]
    ShapeMismatch {
        tensor: String,
        expected: Vec<usize>,
        got: Vec<usize>,
    },
    #[error("invalid model config: {0}")]
    InvalidConfig(String),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("chat template: {0}")]
    ChatTemplate(String),
    #[error("invalid batch: {0}")]
    InvalidBatch(String),
    #[error("tensor operation failed: {0}")]
    Tensor(String),
}

/// How to load a model.
#[derive(Debug, Clone)]
pub struct LoadOptions {
    pub device: Device,
    pub weight_mode: WeightMode,
    /// Longest sequence to support; defaults to the model's context length.
    pub max_model_len: Option<usize>,
    /// A `tokenizer.json` overriding the one found with the model.
    pub tokenizer: Option<PathBuf>,
    /// Run every decode step op by op, without CUDA graphs (vLLM's `--enforce-eager`).
    pub enforce_eager: bool,
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self {
            device: Device::Cpu,
            weight_mode: WeightMode::default(),
            max_model_len: None,
            tokenizer: None,
            enforce_eager: false,
        }
    }
}

/// Which on-disk form a model came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModelFormat {
    Gguf,
    HfSafetensors,
}

/// A loaded model with everything needed to turn text into logits and back.
#[derive(Debug)]
pub struct LoadedModel {
    pub model: LlamaModel,
    pub tokenizer: Tokenizer,
    pub chat_template: Option<ChatTemplate>,
    pub format: ModelFormat,
    /// The weight mode in effect (`auto` resolved).
    pub weight_mode: WeightMode,
    /// Token ids that end generation (EOS, end-of-turn).
    pub eos_token_ids: Vec<u32>,
}

/// Loads a GGUF file or a Hugging Face folder.
pub fn load(path: &Path, opts: &LoadOptions) -> Result<LoadedModel, ModelError> {
    let meta = std::fs::metadata(path).map_err(|e| ModelError::Io {
        path: path.to_path_buf(),
        source: e,
    })?;
    if meta.is_dir() {
        load_hf_dir(path, opts)
    } else {
        load_gguf(path, opts)
    }
}

fn max_len(cfg: &ModelConfig, opts: &LoadOptions) -> Result<usize, ModelError> {
    let len = opts.max_model_len.unwrap_or(cfg.max_position_embeddings);
    if len == 0 {
        return Err(ModelError::InvalidConfig(
            "max model length must be positive".into(),
        ));
    }
    Ok(len)
}

/// A `tokenizer.json` to use instead of the GGUF's own metadata: `--tokenizer`, or one lying
/// next to the GGUF file.
fn tokenizer_file(path: &Path, opts: &LoadOptions) -> Option<PathBuf> {
    opts.tokenizer.clone().or_else(|| {
        let beside = path.parent()?.join("tokenizer.json");
        beside.exists().then_some(beside)
    })
}

fn load_gguf(path: &Path, opts: &LoadOptions) -> Result<LoadedModel, ModelError> {
    let mut file = gguf::GgufFile::open(path, &opts.device)?;
    let cfg = file.config()?;
    let from_metadata = Tokenizer::from_gguf(file.metadata());
    let tokenizer = match tokenizer_file(path, opts) {
        Some(tok_path) => {
            // Special-token ids live in the GGUF metadata even when the vocabulary does not.
            let (bos, eos) = match &from_metadata {
                Ok(t) => (t.bos_token_id(), t.eos_token_ids().to_vec()),
                Err(_) => (None, Vec::new()),
            };
            Tokenizer::from_file(&tok_path, bos, eos)?
        }
        None => from_metadata?,
    };
    let template = file.string("tokenizer.chat_template").map(str::to_string);
    let mode = opts.weight_mode.resolve(file.checkpoint(), &opts.device);
    tracing::info!(?mode, params = file.num_params(), "loading GGUF weights");
    let weights = LlamaWeights::load(&cfg, &mut file, mode, &opts.device)?;
    finish(
        cfg,
        weights,
        tokenizer,
        template,
        ModelFormat::Gguf,
        mode,
        opts,
    )
}

fn load_hf_dir(dir: &Path, opts: &LoadOptions) -> Result<LoadedModel, ModelError> {
    let hf = safetensors::HfConfig::read(dir)?;
    let mut src = safetensors::SafetensorsDir::open(dir, &opts.device)?;
    let cfg = hf.to_model_config(src.has_lm_head())?;
    src.set_norm_offset(cfg.arch.hf_norm_offset());
    let eos = hf
        .eos_token_id
        .as_ref()
        .map(|e| e.to_vec())
        .unwrap_or_default();
    let tok_path = opts
        .tokenizer
        .clone()
        .unwrap_or_else(|| dir.join("tokenizer.json"));
    let tokenizer = Tokenizer::from_file(&tok_path, hf.bos_token_id, eos)?;
    let template = safetensors::read_chat_template(dir)?;
    // Safetensors weights are dense already; there is nothing to keep quantized.
    let weights = LlamaWeights::load(&cfg, &mut src, WeightMode::Dense, &opts.device)?;
    let format = ModelFormat::HfSafetensors;
    finish(
        cfg,
        weights,
        tokenizer,
        template,
        format,
        WeightMode::Dense,
        opts,
    )
}

fn finish(
    cfg: ModelConfig,
    weights: LlamaWeights,
    tokenizer: Tokenizer,
    template: Option<String>,
    format: ModelFormat,
    weight_mode: WeightMode,
    opts: &LoadOptions,
) -> Result<LoadedModel, ModelError> {
    let chat_template = template
        .map(|src| {
            ChatTemplate::new(
                &src,
                tokenizer.token_text(tokenizer.bos_token_id()),
                tokenizer.token_text(tokenizer.eos_token_ids().first().copied()),
            )
        })
        .transpose()?;
    let eos_token_ids = tokenizer.eos_token_ids().to_vec();
    let max_len = max_len(&cfg, opts)?;
    let mut model = LlamaModel::new(cfg, weights, max_len, &opts.device)?;
    if opts.enforce_eager {
        model.set_max_graph_batch(0);
    }
    Ok(LoadedModel {
        model,
        tokenizer,
        chat_template,
        format,
        weight_mode,
        eos_token_ids,
    })
}

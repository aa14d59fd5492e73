//! Hugging Face model folders: `config.json`, `*.safetensors`, `tokenizer.json`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use serde::Deserialize;

use super::ModelError;
use super::config::{Activation, Arch, LocalLayers, ModelConfig, RopeScaling, RopeStyle};
use super::weights::{RawWeight, WeightSource};

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum OneOrMany {
    One(u32),
    Many(Vec<u32>),
}

impl OneOrMany {
    pub fn to_vec(&self) -> Vec<u32> {
        match self {
            OneOrMany::One(x) => vec![*x],
            OneOrMany::Many(v) => v.clone(),
        }
    }
}

#[derive(Debug, Deserialize)]
struct HfRopeScaling {
    #[serde(alias = "type")]
    rope_type: Option<String>,
    factor: Option<f32>,
    /// LongRoPE (Phi-3): per-frequency divisors, and the cos/sin scale when given.
    short_factor: Option<Vec<f32>>,
    long_factor: Option<Vec<f32>>,
    attention_factor: Option<f32>,
    low_freq_factor: Option<f32>,
    high_freq_factor: Option<f32>,
    original_max_position_embeddings: Option<usize>,
}

/// The subset of `config.json` a Llama-family model needs.
#[derive(Debug, Deserialize)]
pub struct HfConfig {
    #[serde(default)]
    architectures: Vec<String>,
    model_type: Option<String>,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    vocab_size: usize,
    rms_norm_eps: Option<f64>,
    rope_theta: Option<f32>,
    rope_scaling: Option<HfRopeScaling>,
    max_position_embeddings: Option<usize>,
    /// Phi-3 keeps LongRoPE's original context here, not in `rope_scaling`.
    original_max_position_embeddings: Option<usize>,
    /// Below 1 (Phi-4-mini), only this share of each head is rotated.
    partial_rotary_factor: Option<f32>,
    sliding_window: Option<usize>,
    #[serde(default)]
    use_sliding_window: Option<bool>,
    /// Gemma 3: every n-th layer global (default 6), unless `layer_types` lists each layer's
    /// `sliding_attention` or `full_attention`.
    sliding_window_pattern: Option<usize>,
    layer_types: Option<Vec<String>>,
    /// Gemma 3's RoPE base for its sliding layers (default 10000).
    rope_local_base_freq: Option<f32>,
    /// Gemma: attention scores scaled by `1 / sqrt(query_pre_attn_scalar)`.
    query_pre_attn_scalar: Option<f32>,
    final_logit_softcapping: Option<f32>,
    /// Gemma 2's soft-capped attention scores.
    attn_logit_softcapping: Option<f32>,
    /// `silu` in most families; Gemma calls it `hidden_activation`.
    #[serde(alias = "hidden_activation")]
    hidden_act: Option<String>,
    attention_bias: Option<bool>,
    tie_word_embeddings: Option<bool>,
    /// Qwen3-MoE's expert count; Mixtral calls it `num_local_experts`.
    #[serde(alias = "num_local_experts")]
    num_experts: Option<usize>,
    num_experts_per_tok: Option<usize>,
    moe_intermediate_size: Option<usize>,
    norm_topk_prob: Option<bool>,
    /// Qwen2-MoE's shared expert, run by every token under a sigmoid gate.
    shared_expert_intermediate_size: Option<usize>,
    /// Qwen3-MoE: every n-th layer is sparse, and `mlp_only_layers` are dense.
    decoder_sparse_step: Option<usize>,
    #[serde(default)]
    mlp_only_layers: Vec<usize>,
    pub bos_token_id: Option<u32>,
    pub eos_token_id: Option<OneOrMany>,
}

impl HfConfig {
    pub fn read(dir: &Path) -> Result<Self, ModelError> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|e| ModelError::Io {
            path: path.clone(),
            source: e,
        })?;
        let corrupt = |e: serde_json::Error| ModelError::Corrupt {
            path: path.clone(),
            reason: format!("invalid config.json: {e}"),
        };
        let config: serde_json::Value = serde_json::from_str(&text).map_err(corrupt)?;
        serde_json::from_value(text_model_config(config)).map_err(corrupt)
    }

    pub fn to_model_config(&self, has_lm_head: bool) -> Result<ModelConfig, ModelError> {
        let name = self
            .architectures
            .first()
            .cloned()
            .or_else(|| self.model_type.clone())
            .unwrap_or_else(|| "<none>".into());
        let arch = match name.as_str() {
            "LlamaForCausalLM" | "llama" => Arch::Llama,
            "MistralForCausalLM" | "mistral" => Arch::Mistral,
            "Qwen2ForCausalLM" | "qwen2" => Arch::Qwen2,
            "Qwen3ForCausalLM" | "qwen3" => Arch::Qwen3,
            "Qwen3MoeForCausalLM" | "qwen3_moe" => Arch::Qwen3Moe,
            "Qwen2MoeForCausalLM" | "qwen2_moe" => Arch::Qwen2Moe,
            "MixtralForCausalLM" | "mixtral" => Arch::Mistral,
            "Phi3ForCausalLM" | "phi3" => Arch::Phi3,
            "Gemma3ForCausalLM" | "gemma3_text" => Arch::Gemma3,
            "Gemma2ForCausalLM" | "gemma2" => Arch::Gemma2,
            other => return Err(ModelError::UnsupportedArchitecture(other.to_string())),
        };
        self.check_activation(&name, arch)?;
        let moe = self.moe(&name, arch)?;
        let head_dim = self.head_dim.unwrap_or_else(|| {
            self.hidden_size
                .checked_div(self.num_attention_heads)
                .unwrap_or(0)
        });
        // As Transformers: the rotated share of each head, rounded down.
        let rotary_dim = match self.partial_rotary_factor {
            Some(f) if (0.0..1.0).contains(&f) => (head_dim as f32 * f) as usize,
            _ => head_dim,
        };
        let rope_scaling = match &self.rope_scaling {
            None => RopeScaling::None,
            Some(s) => match (s.rope_type.as_deref(), s.factor) {
                (Some("default") | None, _) => RopeScaling::None,
                (Some("longrope" | "su"), _) => self.long_rope(s)?,
                (Some("linear"), Some(factor)) => RopeScaling::Linear { factor },
                (Some("llama3"), Some(factor)) => RopeScaling::Llama3 {
                    factor,
                    low_freq_factor: s.low_freq_factor.unwrap_or(1.0),
                    high_freq_factor: s.high_freq_factor.unwrap_or(4.0),
                    original_max_position: s.original_max_position_embeddings.unwrap_or(8192),
                },
                (Some(other), _) => {
                    return Err(ModelError::Unsupported(format!(
                        "rope scaling type '{other}'"
                    )));
                }
            },
        };
        let sliding_window = match arch {
            Arch::Qwen2 | Arch::Qwen2Moe if self.use_sliding_window != Some(true) => None,
            _ if !arch.uses_sliding_window() => None,
            _ => self.sliding_window.filter(|&w| w > 0),
        };
        let local_layers = match arch.global_layer_period() {
            Some(period) if sliding_window.is_some() => {
                Some(self.gemma_local_layers(arch, period)?)
            }
            _ => None,
        };
        let cfg = ModelConfig {
            arch,
            hidden_size: self.hidden_size,
            intermediate_size: self.intermediate_size,
            num_layers: self.num_hidden_layers,
            num_heads: self.num_attention_heads,
            num_kv_heads: self.num_key_value_heads.unwrap_or(self.num_attention_heads),
            head_dim,
            rotary_dim,
            vocab_size: self.vocab_size,
            rms_norm_eps: self.rms_norm_eps.unwrap_or(1e-6),
            rope_theta: self.rope_theta.unwrap_or(10_000.0),
            rope_scaling,
            rope_style: RopeStyle::Half,
            max_position_embeddings: self.max_position_embeddings.unwrap_or(4096),
            sliding_window,
            local_layers,
            attention_bias: self.attention_bias.unwrap_or(arch.attention_bias()),
            qk_norm: arch.qk_norm(),
            moe,
            tie_word_embeddings: self.tie_word_embeddings.unwrap_or(false) || !has_lm_head,
            activation: arch.activation(),
            embedding_scale: arch.embedding_scale(self.hidden_size),
            post_norms: arch.post_norms(),
            attention_scale: self.query_pre_attn_scalar.map(|s| 1.0 / s.sqrt()),
            final_logit_softcap: self.final_logit_softcapping.filter(|&c| c > 0.0),
            attn_logit_softcap: self.attn_logit_softcapping.filter(|&c| c > 0.0),
        };
        cfg.validate()?;
        Ok(cfg)
    }
}

impl HfConfig {
    /// Refuses a config whose FFN activation is not the one its family's code runs.
    fn check_activation(&self, name: &str, arch: Arch) -> Result<(), ModelError> {
        let Some(act) = self.hidden_act.as_deref() else {
            return Ok(());
        };
        let matches = match arch.activation() {
            Activation::Silu => matches!(act, "silu" | "swish"),
            Activation::GeluTanh => matches!(act, "gelu_pytorch_tanh" | "gelu_tanh"),
        };
        if matches {
            Ok(())
        } else {
            Err(ModelError::Unsupported(format!(
                "{name} with activation '{act}'"
            )))
        }
    }

    /// Gemma's sliding and global layers: `layer_types` where the config lists them, else
    /// every `sliding_window_pattern`-th layer (default: the family's `period`) global. Gemma
    /// 3's sliding layers have their own RoPE base (`rope_local_base_freq`, default 10000).
    fn gemma_local_layers(&self, arch: Arch, period: usize) -> Result<LocalLayers, ModelError> {
        let rope_theta =
            (arch == Arch::Gemma3).then(|| self.rope_local_base_freq.unwrap_or(10_000.0));
        let Some(types) = &self.layer_types else {
            let period = self.sliding_window_pattern.unwrap_or(period);
            return Ok(LocalLayers::every(
                period,
                self.num_hidden_layers,
                rope_theta,
            ));
        };
        let sliding = types
            .iter()
            .map(|t| match t.as_str() {
                "sliding_attention" => Ok(true),
                "full_attention" => Ok(false),
                other => Err(ModelError::Unsupported(format!(
                    "layer type '{other}' in layer_types"
                ))),
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(LocalLayers {
            sliding,
            rope_theta,
        })
    }

    /// Phi-3's LongRoPE. The cos/sin scale is the config's `attention_factor`, else
    /// `sqrt(1 + ln(s) / ln(original))` for `s` = max positions / original (1 when `s` <= 1),
    /// as Transformers and llama.cpp's converter compute it.
    fn long_rope(&self, s: &HfRopeScaling) -> Result<RopeScaling, ModelError> {
        let (Some(short), Some(long)) = (&s.short_factor, &s.long_factor) else {
            return Err(ModelError::InvalidConfig(
                "longrope scaling needs short_factor and long_factor".into(),
            ));
        };
        let max = self.max_position_embeddings.unwrap_or(4096);
        let original = self
            .original_max_position_embeddings
            .or(s.original_max_position_embeddings)
            .unwrap_or(max);
        let scale = max as f32 / original.max(1) as f32;
        let computed = if scale <= 1.0 {
            1.0
        } else {
            (1.0 + scale.ln() / (original as f32).ln()).sqrt()
        };
        Ok(RopeScaling::LongRope {
            short: short.clone(),
            long: long.clone(),
            original_max_position: original,
            attn_factor: s.attention_factor.unwrap_or(computed),
        })
    }

    /// The mixture of experts of Mixtral, Qwen3-MoE and Qwen2-MoE configs (every layer sparse;
    /// mixed dense and sparse layers are refused by name).
    fn moe(&self, name: &str, arch: Arch) -> Result<Option<super::config::Moe>, ModelError> {
        let experts = self.num_experts.unwrap_or(0);
        let is_moe = matches!(arch, Arch::Qwen3Moe | Arch::Qwen2Moe)
            || name.starts_with("Mixtral")
            || name == "mixtral";
        if !is_moe {
            if experts > 1 {
                return Err(ModelError::UnsupportedArchitecture(format!(
                    "{name} (mixture of experts)"
                )));
            }
            return Ok(None);
        }
        if self.decoder_sparse_step.unwrap_or(1) != 1 || !self.mlp_only_layers.is_empty() {
            return Err(ModelError::Unsupported(format!(
                "{name}: dense layers among sparse ones (decoder_sparse_step, mlp_only_layers)"
            )));
        }
        let per_token = self
            .num_experts_per_tok
            .ok_or_else(|| ModelError::MissingMetadata("num_experts_per_tok".into()))?;
        let shared_ffn = match arch {
            Arch::Qwen2Moe => Some(self.shared_expert_intermediate_size.ok_or_else(|| {
                ModelError::MissingMetadata("shared_expert_intermediate_size".into())
            })?),
            _ => None,
        };
        Ok(Some(super::config::Moe {
            num_experts: experts,
            experts_per_token: per_token,
            expert_ffn: self.moe_intermediate_size.unwrap_or(self.intermediate_size),
            // Mixtral always renormalises; the Qwen families say so in their configs.
            norm_top_k: match arch {
                Arch::Qwen3Moe | Arch::Qwen2Moe => self.norm_topk_prob.unwrap_or(false),
                _ => true,
            },
            shared_ffn,
        }))
    }
}

/// Gemma 3's defaults for what its configs leave out (Transformers' `Gemma3TextConfig`): the
/// multimodal checkpoints' `text_config` names only what differs from them.
fn gemma3_text_defaults() -> serde_json::Value {
    serde_json::json!({
        "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216,
        "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
        "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "attention_bias": false, "query_pre_attn_scalar": 256, "sliding_window": 4096,
        "rope_local_base_freq": 10000.0, "sliding_window_pattern": 6
    })
}

/// The language model's config of a checkpoint: a multimodal Gemma 3
/// (`Gemma3ForConditionalGeneration`) serves its `text_config` (images are not read), which
/// keeps the special tokens of the whole; Gemma 3 text configs get their family's defaults.
fn text_model_config(mut config: serde_json::Value) -> serde_json::Value {
    use serde_json::Value;
    let arch = config
        .pointer("/architectures/0")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string();
    if arch == "Gemma3ForConditionalGeneration"
        && let Some(Value::Object(mut text)) = config.get("text_config").cloned()
    {
        for key in ["bos_token_id", "eos_token_id"] {
            if let Some(v) = config.get(key)
                && !text.contains_key(key)
            {
                text.insert(key.into(), v.clone());
            }
        }
        text.insert(
            "architectures".into(),
            serde_json::json!(["Gemma3ForCausalLM"]),
        );
        text.insert("model_type".into(), "gemma3_text".into());
        config = Value::Object(text);
    }
    let gemma3_text = config.get("model_type").and_then(Value::as_str) == Some("gemma3_text");
    if gemma3_text
        && let (Value::Object(c), Value::Object(defaults)) = (&mut config, gemma3_text_defaults())
    {
        for (k, v) in defaults {
            c.entry(k).or_insert(v);
        }
    }
    config
}

/// Where a multimodal checkpoint keeps its language model's tensors, and the name each takes
/// here: `language_model.model.*` (Transformers before 4.52) or `model.language_model.*` for
/// `model.*`, and `language_model.lm_head.*` for `lm_head.*`.
const LANGUAGE_MODEL_PREFIXES: [(&str, &str); 3] = [
    ("language_model.model.", "model."),
    ("model.language_model.", "model."),
    ("language_model.lm_head.", "lm_head."),
];

/// Multimodal checkpoints' towers and projectors, which a text server never reads.
const NOT_LANGUAGE_MODEL: [&str; 4] = [
    "vision_tower.",
    "multi_modal_projector.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
];

/// A tensor's name with a multimodal checkpoint's language-model prefix made plain; `None` for
/// the towers' tensors.
fn language_model_name(name: String) -> Option<String> {
    if NOT_LANGUAGE_MODEL.iter().any(|p| name.starts_with(p)) {
        return None;
    }
    for (from, to) in LANGUAGE_MODEL_PREFIXES {
        if let Some(rest) = name.strip_prefix(from) {
            return Some(format!("{to}{rest}"));
        }
    }
    Some(name)
}

/// All tensors of a folder's safetensors files, served under canonical names.
#[derive(Debug)]
pub struct SafetensorsDir {
    tensors: HashMap<String, Tensor>,
    /// Added to every norm's weights ([`Arch::hf_norm_offset`]).
    norm_offset: f32,
}

impl SafetensorsDir {
    pub fn open(dir: &Path, device: &Device) -> Result<Self, ModelError> {
        let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(|e| ModelError::Io {
                path: dir.to_path_buf(),
                source: e,
            })?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
            .collect();
        files.sort();
        if files.is_empty() {
            return Err(ModelError::Corrupt {
                path: dir.to_path_buf(),
                reason: "no *.safetensors files".into(),
            });
        }
        let mut tensors = HashMap::new();
        for f in files {
            let t =
                candle_core::safetensors::load(&f, device).map_err(|e| ModelError::Corrupt {
                    path: f.clone(),
                    reason: format!("not a readable safetensors file: {e}"),
                })?;
            tensors.extend(
                t.into_iter()
                    .filter_map(|(name, t)| Some((language_model_name(name)?, t))),
            );
        }
        Ok(Self {
            tensors,
            norm_offset: 0.0,
        })
    }

    /// Serves norm weights plus `offset` (Gemma's `1 + weight`).
    pub fn set_norm_offset(&mut self, offset: f32) {
        self.norm_offset = offset;
    }

    pub fn has_lm_head(&self) -> bool {
        self.tensors.contains_key("lm_head.weight")
    }
}

/// Maps a canonical (GGUF-style) tensor name to its Hugging Face names, in the order tried
/// (Qwen3-MoE's and Mixtral's names for a router differ). Experts are stacked from per-expert
/// tensors by [`SafetensorsDir`], not named here.
pub fn hf_names(canonical: &str) -> Vec<String> {
    let fixed = match canonical {
        "token_embd.weight" => Some("model.embed_tokens.weight"),
        "output_norm.weight" => Some("model.norm.weight"),
        "output.weight" => Some("lm_head.weight"),
        _ => None,
    };
    if let Some(n) = fixed {
        return vec![n.to_string()];
    }
    let Some((layer, module, kind)) = split_layer_name(canonical) else {
        return Vec::new();
    };
    let hf: &[&str] = match module {
        "attn_norm" => &["input_layernorm"],
        // Gemma's norm before the FFN is `pre_feedforward_layernorm`; its
        // `post_attention_layernorm` norms the attention's output.
        "ffn_norm" => &["pre_feedforward_layernorm", "post_attention_layernorm"],
        "post_attention_norm" => &["post_attention_layernorm"],
        "post_ffw_norm" => &["post_feedforward_layernorm"],
        "attn_q" => &["self_attn.q_proj"],
        "attn_k" => &["self_attn.k_proj"],
        "attn_v" => &["self_attn.v_proj"],
        "attn_output" => &["self_attn.o_proj"],
        "attn_qkv" => &["self_attn.qkv_proj"],
        "attn_q_norm" => &["self_attn.q_norm"],
        "attn_k_norm" => &["self_attn.k_norm"],
        "ffn_gate" => &["mlp.gate_proj"],
        // Phi-3's `ffn_up` is gate and up fused.
        "ffn_up" => &["mlp.up_proj", "mlp.gate_up_proj"],
        "ffn_down" => &["mlp.down_proj"],
        "ffn_gate_inp" => &["mlp.gate", "block_sparse_moe.gate"],
        // Qwen2-MoE's shared expert and its gate.
        "ffn_gate_inp_shexp" => &["mlp.shared_expert_gate"],
        "ffn_gate_shexp" => &["mlp.shared_expert.gate_proj"],
        "ffn_up_shexp" => &["mlp.shared_expert.up_proj"],
        "ffn_down_shexp" => &["mlp.shared_expert.down_proj"],
        _ => &[],
    };
    hf.iter()
        .map(|m| format!("model.layers.{layer}.{m}.{kind}"))
        .collect()
}

/// The first Hugging Face name of `canonical` (the one a converter writes).
pub fn hf_name(canonical: &str) -> Option<String> {
    hf_names(canonical).into_iter().next()
}

/// `blk.3.attn_q.weight` -> `("3", "attn_q", "weight")`.
fn split_layer_name(canonical: &str) -> Option<(&str, &str, &str)> {
    let rest = canonical.strip_prefix("blk.")?;
    let (layer, rest) = rest.split_once('.')?;
    let (module, kind) = rest.rsplit_once('.')?;
    Some((layer, module, kind))
}

/// Per-expert Hugging Face names of a stacked expert tensor (`blk.N.ffn_gate_exps.weight`), as
/// a function of the expert: Qwen3-MoE's `mlp.experts.E.gate_proj`, then Mixtral's
/// `block_sparse_moe.experts.E.w1` (w1 gate, w3 up, w2 down).
fn expert_names(canonical: &str) -> Option<[impl Fn(usize) -> String; 2]> {
    let (layer, module, kind) = split_layer_name(canonical)?;
    let (qwen, mixtral) = match module {
        "ffn_gate_exps" => ("gate_proj", "w1"),
        "ffn_up_exps" => ("up_proj", "w3"),
        "ffn_down_exps" => ("down_proj", "w2"),
        _ => return None,
    };
    let name = move |prefix: &'static str, proj: &'static str| {
        let (layer, kind) = (layer.to_string(), kind.to_string());
        move |e: usize| format!("model.layers.{layer}.{prefix}.experts.{e}.{proj}.{kind}")
    };
    Some([name("mlp", qwen), name("block_sparse_moe", mixtral)])
}

impl SafetensorsDir {
    /// The experts' matrices stacked `[experts, out, in]`, as GGUF stores them.
    fn stacked_experts(&mut self, canonical: &str) -> Result<Option<Tensor>, ModelError> {
        let Some(namings) = expert_names(canonical) else {
            return Ok(None);
        };
        for name in namings {
            let mut experts = Vec::new();
            while let Some(t) = self.tensors.remove(&name(experts.len())) {
                experts.push(t);
            }
            if !experts.is_empty() {
                return Ok(Some(Tensor::stack(&experts, 0)?));
            }
        }
        Ok(None)
    }
}

impl WeightSource for SafetensorsDir {
    fn take(&mut self, name: &str) -> Result<Option<RawWeight>, ModelError> {
        if let Some(t) = self.stacked_experts(name)? {
            return Ok(Some(RawWeight::Dense(t)));
        }
        let Some(t) = hf_names(name)
            .into_iter()
            .find_map(|hf| self.tensors.remove(&hf))
        else {
            return Ok(None);
        };
        // Qwen2-MoE's shared-expert gate is a `[1, hidden]` matrix; GGUF stores the vector.
        if name.ends_with("ffn_gate_inp_shexp.weight") {
            return Ok(Some(RawWeight::Dense(t.flatten_all()?)));
        }
        if self.norm_offset != 0.0 && name.ends_with("norm.weight") {
            let t = (t.to_dtype(candle_core::DType::F32)? + f64::from(self.norm_offset))?;
            return Ok(Some(RawWeight::Dense(t)));
        }
        Ok(Some(RawWeight::Dense(t)))
    }
}

/// The chat template of a folder: `chat_template.jinja`, or `tokenizer_config.json`'s
/// `chat_template` (a string, or a list of named templates of which "default" is used).
pub fn read_chat_template(dir: &Path) -> Result<Option<String>, ModelError> {
    let jinja = dir.join("chat_template.jinja");
    if jinja.exists() {
        return std::fs::read_to_string(&jinja)
            .map(Some)
            .map_err(|e| ModelError::Io {
                path: jinja,
                source: e,
            });
    }
    let path = dir.join("tokenizer_config.json");
    let Ok(text) = std::fs::read_to_string(&path) else {
        return Ok(None);
    };
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| ModelError::Corrupt {
        path,
        reason: format!("invalid tokenizer_config.json: {e}"),
    })?;
    Ok(match v.get("chat_template") {
        Some(serde_json::Value::String(s)) => Some(s.clone()),
        Some(serde_json::Value::Array(list)) => list
            .iter()
            .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
            .or_else(|| list.first())
            .and_then(|t| t.get("template"))
            .and_then(|t| t.as_str())
            .map(str::to_string),
        _ => None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(extra: &str) -> Result<ModelConfig, ModelError> {
        let text = format!(
            r#"{{"architectures":["Phi3ForCausalLM"],"hidden_size":64,"intermediate_size":128,
            "num_hidden_layers":1,"num_attention_heads":4,"vocab_size":16{extra}}}"#
        );
        let hf: HfConfig = serde_json::from_str(&text).expect("config.json");
        hf.to_model_config(true)
    }

    #[test]
    fn longrope_scales_attention_as_transformers_does() {
        let factors = |x: f32| format!("[{}]", vec![x.to_string(); 8].join(","));
        let cfg = config(&format!(
            r#","max_position_embeddings":131072,"original_max_position_embeddings":4096,
            "rope_scaling":{{"type":"longrope","short_factor":{},"long_factor":{}}}"#,
            factors(1.0),
            factors(2.0)
        ))
        .expect("phi3");
        let RopeScaling::LongRope {
            short,
            long,
            original_max_position,
            attn_factor,
        } = &cfg.rope_scaling
        else {
            panic!("{:?}", cfg.rope_scaling)
        };
        assert_eq!(
            (short[0], long[0], *original_max_position),
            (1.0, 2.0, 4096)
        );
        let want = (1.0 + 32f32.ln() / 4096f32.ln()).sqrt();
        assert!((attn_factor - want).abs() < 1e-6, "{attn_factor} vs {want}");
        // The context picks the factors: long only past the original context.
        let short_freqs = super::super::rope::inv_freqs(&cfg, 4096);
        let long_freqs = super::super::rope::inv_freqs(&cfg, 4097);
        assert_eq!(short_freqs[1] / long_freqs[1], 2.0);
    }

    fn gemma(arch: &str, extra: &str) -> Result<ModelConfig, ModelError> {
        let text = format!(
            r#"{{"architectures":["{arch}"],"hidden_size":64,"intermediate_size":128,
            "num_hidden_layers":8,"num_attention_heads":4,"num_key_value_heads":1,"head_dim":32,
            "vocab_size":16,"sliding_window":512,"query_pre_attn_scalar":16,
            "hidden_activation":"gelu_pytorch_tanh"{extra}}}"#
        );
        let hf: HfConfig = serde_json::from_str(&text).expect("config.json");
        hf.to_model_config(false)
    }

    #[test]
    fn gemma3_reads_its_local_layers_scale_and_activation() {
        let cfg = gemma("Gemma3ForCausalLM", "").expect("gemma3");
        assert_eq!(cfg.arch, Arch::Gemma3);
        assert_eq!(cfg.activation, Activation::GeluTanh);
        assert_eq!(cfg.embedding_scale, Some(8.0));
        assert!(cfg.post_norms && cfg.qk_norm && cfg.tie_word_embeddings);
        assert_eq!(cfg.attention_scale, Some(0.25));
        assert_eq!(cfg.sliding_window, Some(512));
        // Every sixth layer global by default, the sliding ones at RoPE base 10000.
        let sliding: Vec<bool> = (0..8).map(|l| cfg.is_sliding(l)).collect();
        assert_eq!(sliding, [true, true, true, true, true, false, true, true]);
        assert_eq!(
            cfg.local_layers.as_ref().and_then(|l| l.rope_theta),
            Some(10_000.0)
        );
        // `layer_types` wins over the pattern; the local base is the config's.
        let types = r#","layer_types":["sliding_attention","full_attention","sliding_attention",
            "full_attention","sliding_attention","sliding_attention","sliding_attention",
            "full_attention"],"rope_local_base_freq":5000.0,"final_logit_softcapping":30.0"#;
        let cfg = gemma("Gemma3ForCausalLM", types).expect("layer_types");
        let sliding: Vec<bool> = (0..8).map(|l| cfg.is_sliding(l)).collect();
        assert_eq!(sliding, [true, false, true, false, true, true, true, false]);
        assert_eq!(
            cfg.local_layers.as_ref().and_then(|l| l.rope_theta),
            Some(5000.0)
        );
        assert_eq!(cfg.final_logit_softcap, Some(30.0));
        // A list of the wrong length is refused, not read short.
        let short = r#","layer_types":["sliding_attention","full_attention"]"#;
        let e = gemma("Gemma3ForCausalLM", short).expect_err("two layer types of eight");
        assert!(e.to_string().contains("layers"), "{e}");
    }

    /// A multimodal Gemma 3's config: its `text_config` (as gemma-3-4b-it's, which names only
    /// what differs from the defaults), the special tokens of the whole.
    #[test]
    fn a_multimodal_gemma3_serves_its_text_config_with_the_familys_defaults() {
        let text = r#"{"architectures":["Gemma3ForConditionalGeneration"],"eos_token_id":[1,106],
            "text_config":{"hidden_size":2560,"intermediate_size":10240,"model_type":"gemma3_text",
            "num_hidden_layers":34,"rope_scaling":{"factor":8.0,"rope_type":"linear"},
            "sliding_window":1024},"vision_config":{"hidden_size":1152}}"#;
        let value: serde_json::Value = serde_json::from_str(text).expect("json");
        let hf: HfConfig = serde_json::from_value(text_model_config(value)).expect("config");
        assert_eq!(
            hf.eos_token_id.as_ref().map(OneOrMany::to_vec),
            Some(vec![1, 106])
        );
        let cfg = hf.to_model_config(false).expect("gemma3 4b");
        assert_eq!(cfg.arch, Arch::Gemma3);
        assert_eq!(
            (
                cfg.num_heads,
                cfg.num_kv_heads,
                cfg.head_dim,
                cfg.vocab_size
            ),
            (8, 4, 256, 262_208)
        );
        assert_eq!((cfg.hidden_size, cfg.num_layers), (2560, 34));
        assert_eq!(cfg.attention_scale, Some(1.0 / 16.0));
        assert_eq!(cfg.rope_scaling, RopeScaling::Linear { factor: 8.0 });
        assert_eq!(cfg.sliding_window, Some(1024));
        assert!(cfg.is_sliding(0) && !cfg.is_sliding(5));
        // The language model's tensors under plain names, the vision tower's left out.
        for (name, want) in [
            (
                "language_model.model.layers.0.mlp.up_proj.weight",
                Some("model.layers.0.mlp.up_proj.weight"),
            ),
            (
                "model.language_model.embed_tokens.weight",
                Some("model.embed_tokens.weight"),
            ),
            ("language_model.lm_head.weight", Some("lm_head.weight")),
            (
                "vision_tower.vision_model.embeddings.patch_embedding.weight",
                None,
            ),
            (
                "model.multi_modal_projector.mm_input_projection_weight",
                None,
            ),
            (
                "model.layers.1.self_attn.q_proj.weight",
                Some("model.layers.1.self_attn.q_proj.weight"),
            ),
        ] {
            assert_eq!(language_model_name(name.into()).as_deref(), want, "{name}");
        }
    }

    #[test]
    fn gemma2_caps_its_scores_and_slides_every_other_layer() {
        let caps = r#","attn_logit_softcapping":50.0,"final_logit_softcapping":30.0"#;
        let cfg = gemma("Gemma2ForCausalLM", caps).expect("gemma2");
        assert_eq!(cfg.arch, Arch::Gemma2);
        assert_eq!(
            (cfg.attn_logit_softcap, cfg.final_logit_softcap),
            (Some(50.0), Some(30.0))
        );
        assert!(!cfg.qk_norm && cfg.post_norms);
        assert_eq!(cfg.activation, Activation::GeluTanh);
        let sliding: Vec<bool> = (0..8).map(|l| cfg.is_sliding(l)).collect();
        assert_eq!(
            sliding,
            [true, false, true, false, true, false, true, false]
        );
        // One RoPE for every layer.
        assert_eq!(cfg.local_layers.as_ref().and_then(|l| l.rope_theta), None);
    }

    #[test]
    fn what_gemma_support_lacks_is_refused_by_name() {
        // A family run with another activation than its code's is refused, not run wrong.
        let e = config(r#","hidden_act":"gelu""#).expect_err("Phi-3 with GELU");
        assert!(e.to_string().contains("activation 'gelu'"), "{e}");
        config(r#","hidden_act":"silu""#).expect("Phi-3 with SiLU");
    }

    #[test]
    fn partial_rotary_embeddings_rotate_a_share_of_each_head() {
        let cfg = config(r#","partial_rotary_factor":0.75"#).expect("Phi-4-mini");
        assert_eq!((cfg.head_dim, cfg.rotary_dim), (16, 12));
        // Frequencies over the rotated dimensions, as Transformers and llama.cpp compute them.
        let freqs = super::super::rope::inv_freqs(&cfg, 64);
        assert_eq!(freqs.len(), 6);
        assert!(
            (freqs[1] - 10_000f32.powf(-2.0 / 12.0)).abs() < 1e-7,
            "{freqs:?}"
        );
        // An odd share is refused, not rounded into a misread.
        let e = config(r#","partial_rotary_factor":0.25,"head_dim":12"#).expect_err("3 of 12");
        assert!(e.to_string().contains("rotary"), "{e}");
    }
}

//! GGUF checkpoints: hyper-parameters and tokenizer from metadata, tensors block-quantized.

use std::collections::HashMap;
use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};

use candle_core::Device;
use candle_core::quantized::GgmlDType;
use candle_core::quantized::gguf_file::{self, Content, Value};

use super::ModelError;
use super::config::{Arch, LocalLayers, ModelConfig, RopeScaling};
use super::weights::{Checkpoint, RawWeight, WeightSource};

/// An open GGUF file: parsed header plus a reader for tensor data.
pub struct GgufFile {
    path: PathBuf,
    content: Content,
    reader: BufReader<File>,
    device: Device,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

impl GgufFile {
    pub fn open(path: &Path, device: &Device) -> Result<Self, ModelError> {
        let file = File::open(path).map_err(|e| ModelError::Io {
            path: path.to_path_buf(),
            source: e,
        })?;
        let mut reader = BufReader::new(file);
        let content = Content::read(&mut reader).map_err(|e| ModelError::Corrupt {
            path: path.to_path_buf(),
            reason: format!("not a readable GGUF file: {e}"),
        })?;
        Ok(Self {
            path: path.to_path_buf(),
            content,
            reader,
            device: device.clone(),
        })
    }

    pub fn metadata(&self) -> &HashMap<String, Value> {
        &self.content.metadata
    }

    /// Elements in all tensors (the parameter count).
    pub fn num_params(&self) -> usize {
        self.content
            .tensor_infos
            .values()
            .map(|t| t.shape.elem_count())
            .sum()
    }

    /// What `auto` needs to know of the checkpoint: how many elements, and how many of them are
    /// floats rather than quantized blocks.
    pub fn checkpoint(&self) -> Checkpoint {
        let float = |t: &&gguf_file::TensorInfo| {
            matches!(
                t.ggml_dtype,
                GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16
            )
        };
        let infos = self.content.tensor_infos.values();
        Checkpoint {
            params: self.num_params(),
            float_params: infos.filter(float).map(|t| t.shape.elem_count()).sum(),
        }
    }

    pub fn has_tensor(&self, name: &str) -> bool {
        self.content.tensor_infos.contains_key(name)
    }

    fn get(&self, key: &str) -> Option<&Value> {
        self.content.metadata.get(key)
    }

    fn require(&self, key: &str) -> Result<&Value, ModelError> {
        self.get(key)
            .ok_or_else(|| ModelError::MissingMetadata(key.to_string()))
    }

    fn usize(&self, key: &str) -> Result<usize, ModelError> {
        value_usize(self.require(key)?).ok_or_else(|| ModelError::InvalidMetadata(key.to_string()))
    }

    fn opt_usize(&self, key: &str) -> Result<Option<usize>, ModelError> {
        self.get(key)
            .map(|v| value_usize(v).ok_or_else(|| ModelError::InvalidMetadata(key.to_string())))
            .transpose()
    }

    fn opt_f32(&self, key: &str) -> Result<Option<f32>, ModelError> {
        self.get(key)
            .map(|v| value_f32(v).ok_or_else(|| ModelError::InvalidMetadata(key.to_string())))
            .transpose()
    }

    pub fn string(&self, key: &str) -> Option<&str> {
        self.get(key)
            .and_then(|v| v.to_string().ok())
            .map(String::as_str)
    }

    /// Reads the architecture hyper-parameters.
    pub fn config(&mut self) -> Result<ModelConfig, ModelError> {
        let arch_name = self
            .string("general.architecture")
            .ok_or_else(|| ModelError::MissingMetadata("general.architecture".into()))?
            .to_string();
        let arch = Arch::from_gguf_name(&arch_name)
            .ok_or_else(|| ModelError::UnsupportedArchitecture(arch_name.clone()))?;
        let k = |s: &str| format!("{arch_name}.{s}");
        let hidden_size = self.usize(&k("embedding_length"))?;
        let num_heads = self.usize(&k("attention.head_count"))?;
        let num_kv_heads = self
            .opt_usize(&k("attention.head_count_kv"))?
            .unwrap_or(num_heads);
        let head_dim = match self.opt_usize(&k("attention.key_length"))? {
            Some(d) => d,
            None => hidden_size.checked_div(num_heads).unwrap_or(0),
        };
        let vocab_size = match self.opt_usize(&k("vocab_size"))? {
            Some(v) => v,
            None => match self.get("tokenizer.ggml.tokens") {
                Some(Value::Array(a)) => a.len(),
                _ => return Err(ModelError::MissingMetadata(k("vocab_size"))),
            },
        };
        // Fewer rotated dimensions than the head has: partial rotary embeddings (Phi-4-mini).
        let rotary_dim = self
            .opt_usize(&k("rope.dimension_count"))?
            .unwrap_or(head_dim);
        let rope_scaling = self.rope_scaling(&arch_name, rotary_dim)?;
        let intermediate_size = self.usize(&k("feed_forward_length"))?;
        let moe = self.moe(&arch_name, arch, intermediate_size)?;
        let num_layers = self.usize(&k("block_count"))?;
        // llama.cpp's Gemma 2 caps at 50 and 30 where the file does not say.
        let (attn_cap, final_cap) = if arch == Arch::Gemma2 {
            (Some(50.0), Some(30.0))
        } else {
            (None, None)
        };
        let softcap = |v: Option<f32>, default: Option<f32>| v.or(default).filter(|&c| c > 0.0);
        let attn_logit_softcap = softcap(self.opt_f32(&k("attn_logit_softcapping"))?, attn_cap);
        let final_logit_softcap = softcap(self.opt_f32(&k("final_logit_softcapping"))?, final_cap);
        let sliding_window = self
            .opt_usize(&k("attention.sliding_window"))?
            .filter(|&w| w > 0 && arch.uses_sliding_window());
        let cfg = ModelConfig {
            arch,
            hidden_size,
            intermediate_size,
            num_layers,
            num_heads,
            num_kv_heads,
            head_dim,
            rotary_dim,
            vocab_size,
            rms_norm_eps: self
                .opt_f32(&k("attention.layer_norm_rms_epsilon"))?
                .unwrap_or(1e-5) as f64,
            rope_theta: self.opt_f32(&k("rope.freq_base"))?.unwrap_or(10_000.0),
            rope_scaling,
            rope_style: arch.gguf_rope_style(),
            max_position_embeddings: self.opt_usize(&k("context_length"))?.unwrap_or(4096),
            sliding_window,
            // llama.cpp's Gemma 3: every sixth layer global, the others at RoPE base 10000;
            // Gemma 2: every other layer, one RoPE.
            local_layers: arch
                .global_layer_period()
                .filter(|_| sliding_window.is_some())
                .map(|period| {
                    let theta = (arch == Arch::Gemma3).then_some(10_000.0);
                    LocalLayers::every(period, num_layers, theta)
                }),
            attention_bias: arch.attention_bias() && self.has_tensor("blk.0.attn_q.bias"),
            qk_norm: arch.qk_norm(),
            moe,
            tie_word_embeddings: !self.has_tensor("output.weight"),
            activation: arch.activation(),
            embedding_scale: arch.embedding_scale(hidden_size),
            post_norms: arch.post_norms(),
            attention_scale: arch.gguf_attention_scale(num_layers, hidden_size, num_heads),
            final_logit_softcap,
            attn_logit_softcap,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// The mixture of experts of a file with more than one expert: Mixtral (filed as `llama`)
    /// and Qwen3-MoE, which both renormalise the chosen experts' weights, and Qwen2-MoE, which
    /// does not and adds a gated shared expert. Other families with experts are refused by name
    /// rather than run as dense models, as are shared experts elsewhere.
    fn moe(
        &self,
        arch_name: &str,
        arch: Arch,
        ffn: usize,
    ) -> Result<Option<super::config::Moe>, ModelError> {
        let k = |s: &str| format!("{arch_name}.{s}");
        let experts = self.opt_usize(&k("expert_count"))?.unwrap_or(0);
        if experts <= 1 {
            if matches!(arch, Arch::Qwen3Moe | Arch::Qwen2Moe) {
                return Err(ModelError::MissingMetadata(k("expert_count")));
            }
            return Ok(None);
        }
        if !matches!(arch, Arch::Llama | Arch::Qwen3Moe | Arch::Qwen2Moe) {
            return Err(ModelError::UnsupportedArchitecture(format!(
                "{arch_name} (mixture of experts)"
            )));
        }
        let shared = arch == Arch::Qwen2Moe;
        if !shared
            && (self.has_tensor("blk.0.ffn_gate_inp_shexp.weight")
                || self.has_tensor("blk.0.ffn_up_shexp.weight"))
        {
            return Err(ModelError::Unsupported(format!(
                "{arch_name}: shared experts"
            )));
        }
        Ok(Some(super::config::Moe {
            num_experts: experts,
            experts_per_token: self.usize(&k("expert_used_count"))?,
            expert_ffn: self
                .opt_usize(&k("expert_feed_forward_length"))?
                .unwrap_or(ffn),
            norm_top_k: !shared,
            shared_ffn: if shared {
                Some(self.usize(&k("expert_shared_feed_forward_length"))?)
            } else {
                None
            },
        }))
    }

    /// A 1-D F32 table of `rotary_dim / 2` rope factors.
    fn rope_factors(&mut self, name: &str, rotary_dim: usize) -> Result<Vec<f32>, ModelError> {
        let t = self
            .take(name)?
            .ok_or_else(|| ModelError::MissingTensor(name.into()))?;
        let factors = match t {
            RawWeight::Quantized(q) => q.dequantize(&candle_core::Device::Cpu)?,
            RawWeight::Dense(t) => t,
        };
        let factors = factors.flatten_all()?.to_vec1::<f32>()?;
        if factors.len() != rotary_dim / 2 {
            return Err(ModelError::ShapeMismatch {
                tensor: name.into(),
                expected: vec![rotary_dim / 2],
                got: vec![factors.len()],
            });
        }
        Ok(factors)
    }

    fn rope_scaling(&mut self, arch: &str, rotary_dim: usize) -> Result<RopeScaling, ModelError> {
        if self.has_tensor("rope_factors_long.weight") {
            let long = self.rope_factors("rope_factors_long.weight", rotary_dim)?;
            let short = self.rope_factors("rope_factors_short.weight", rotary_dim)?;
            let k = |s: &str| format!("{arch}.{s}");
            let original_max_position =
                match self.opt_usize(&k("rope.scaling.original_context_length"))? {
                    Some(n) => n,
                    None => self.usize(&k("context_length"))?,
                };
            let attn_factor = self.opt_f32(&k("rope.scaling.attn_factor"))?.unwrap_or(1.0);
            return Ok(RopeScaling::LongRope {
                short,
                long,
                original_max_position,
                attn_factor,
            });
        }
        if self.has_tensor("rope_freqs.weight") {
            let factors = self.rope_factors("rope_freqs.weight", rotary_dim)?;
            return Ok(RopeScaling::FreqFactors(factors));
        }
        let ty = self
            .string(&format!("{arch}.rope.scaling.type"))
            .map(str::to_string);
        let factor = self.opt_f32(&format!("{arch}.rope.scaling.factor"))?;
        match (ty.as_deref(), factor) {
            (None | Some("none"), _) => Ok(RopeScaling::None),
            (Some("linear"), Some(factor)) if factor > 0.0 => Ok(RopeScaling::Linear { factor }),
            (Some("linear"), _) => Err(ModelError::InvalidMetadata(format!(
                "{arch}.rope.scaling.factor"
            ))),
            (Some(other), _) => Err(ModelError::Unsupported(format!(
                "rope scaling type '{other}'"
            ))),
        }
    }
}

impl WeightSource for GgufFile {
    fn take(&mut self, name: &str) -> Result<Option<RawWeight>, ModelError> {
        if !self.has_tensor(name) {
            return Ok(None);
        }
        let q = self
            .content
            .tensor(&mut self.reader, name, &self.device)
            .map_err(|e| ModelError::Corrupt {
                path: self.path.clone(),
                reason: format!("tensor {name}: {e}"),
            })?;
        Ok(Some(RawWeight::Quantized(Box::new(q))))
    }
}

fn value_usize(v: &Value) -> Option<usize> {
    match v {
        Value::U8(x) => Some(*x as usize),
        Value::U16(x) => Some(*x as usize),
        Value::U32(x) => Some(*x as usize),
        Value::U64(x) => usize::try_from(*x).ok(),
        Value::I8(x) => usize::try_from(*x).ok(),
        Value::I16(x) => usize::try_from(*x).ok(),
        Value::I32(x) => usize::try_from(*x).ok(),
        Value::I64(x) => usize::try_from(*x).ok(),
        _ => None,
    }
}

fn value_f32(v: &Value) -> Option<f32> {
    match v {
        Value::F32(x) => Some(*x),
        Value::F64(x) => Some(*x as f32),
        other => value_usize(other).map(|x| x as f32),
    }
}

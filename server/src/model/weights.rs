//! Weight tensors of a Llama-family model, loaded from any [`WeightSource`].

use candle_core::quantized::{QMatMul, QTensor};
use candle_core::{DType, Device, Module, Tensor};

use super::ModelError;
use super::config::ModelConfig;

/// A tensor as a checkpoint stores it: block-quantized (GGUF) or dense.
#[derive(Debug)]
pub enum RawWeight {
    Quantized(QTensor),
    Dense(Tensor),
}

impl RawWeight {
    fn shape(&self) -> Vec<usize> {
        match self {
            RawWeight::Quantized(q) => q.shape().dims().to_vec(),
            RawWeight::Dense(t) => t.dims().to_vec(),
        }
    }

    fn dense(self, device: &Device) -> candle_core::Result<Tensor> {
        match self {
            RawWeight::Quantized(q) => q.dequantize(device),
            RawWeight::Dense(t) => t.to_device(device)?.to_dtype(DType::F32),
        }
    }
}

/// A checkpoint that hands out tensors by their canonical (GGUF-style) name, for example
/// `blk.3.attn_q.weight`. Each format maps these names onto its own.
pub trait WeightSource {
    fn take(&mut self, name: &str) -> Result<Option<RawWeight>, ModelError>;
}

/// How matrix weights are held in memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum WeightMode {
    /// Keep GGUF weights block-quantized and multiply with candle's quantized kernels. Per-row
    /// results do not depend on the batch, and decode reads 4-8x fewer bytes.
    #[default]
    Quantized,
    /// Dequantize everything to f32 at load.
    Dense,
}

/// `y = x Wᵀ (+ b)` over a flattened batch `[tokens, in]`.
#[derive(Debug, Clone)]
pub struct Linear {
    weight: QMatMul,
    bias: Option<Tensor>,
}

impl Linear {
    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let y = self.weight.forward(x)?;
        match &self.bias {
            Some(b) => y.broadcast_add(b),
            None => Ok(y),
        }
    }
}

#[derive(Debug, Clone)]
pub struct LayerWeights {
    pub attn_norm: Tensor,
    pub q: Linear,
    pub k: Linear,
    pub v: Linear,
    pub o: Linear,
    pub ffn_norm: Tensor,
    pub gate: Linear,
    pub up: Linear,
    pub down: Linear,
}

#[derive(Debug, Clone)]
pub struct LlamaWeights {
    /// `[vocab, hidden]`, dense: the lookup is a gather, not a matmul.
    pub embed: Tensor,
    pub layers: Vec<LayerWeights>,
    pub norm: Tensor,
    pub lm_head: Linear,
}

struct Loader<'a> {
    src: &'a mut dyn WeightSource,
    mode: WeightMode,
    device: &'a Device,
}

impl Loader<'_> {
    fn required(&mut self, name: &str) -> Result<RawWeight, ModelError> {
        self.src
            .take(name)?
            .ok_or_else(|| ModelError::MissingTensor(name.to_string()))
    }

    fn check_shape(name: &str, w: &RawWeight, expected: &[usize]) -> Result<(), ModelError> {
        let got = w.shape();
        if got != expected {
            return Err(ModelError::ShapeMismatch {
                tensor: name.to_string(),
                expected: expected.to_vec(),
                got,
            });
        }
        Ok(())
    }

    fn vector(&mut self, name: &str, len: usize) -> Result<Tensor, ModelError> {
        let w = self.required(name)?;
        Self::check_shape(name, &w, &[len])?;
        Ok(w.dense(self.device)?)
    }

    fn matmul(&self, name: &str, w: RawWeight) -> Result<QMatMul, ModelError> {
        let wrap = |e: candle_core::Error| ModelError::Tensor(format!("{name}: {e}"));
        Ok(match (w, self.mode) {
            (RawWeight::Quantized(q), WeightMode::Quantized) => {
                QMatMul::from_qtensor(q).map_err(wrap)?
            }
            (w, _) => QMatMul::Tensor(w.dense(self.device).map_err(wrap)?),
        })
    }

    fn linear(
        &mut self,
        prefix: &str,
        out: usize,
        inp: usize,
        bias: bool,
    ) -> Result<Linear, ModelError> {
        let name = format!("{prefix}.weight");
        let w = self.required(&name)?;
        Self::check_shape(&name, &w, &[out, inp])?;
        let weight = self.matmul(&name, w)?;
        let bias = if bias {
            Some(self.vector(&format!("{prefix}.bias"), out)?)
        } else {
            None
        };
        Ok(Linear { weight, bias })
    }
}

impl LlamaWeights {
    pub fn load(
        cfg: &ModelConfig,
        src: &mut dyn WeightSource,
        mode: WeightMode,
        device: &Device,
    ) -> Result<Self, ModelError> {
        let mut l = Loader { src, mode, device };
        let (h, ffn) = (cfg.hidden_size, cfg.intermediate_size);
        let embed_raw = l.required("token_embd.weight")?;
        Loader::check_shape("token_embd.weight", &embed_raw, &[cfg.vocab_size, h])?;
        let (embed, tied_head) = match embed_raw {
            RawWeight::Quantized(q) => {
                let dense = q.dequantize(device)?;
                (dense, RawWeight::Quantized(q))
            }
            RawWeight::Dense(t) => {
                let t = t.to_device(device)?.to_dtype(DType::F32)?;
                (t.clone(), RawWeight::Dense(t))
            }
        };
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for i in 0..cfg.num_layers {
            let p = |s: &str| format!("blk.{i}.{s}");
            let bias = cfg.attention_bias;
            layers.push(LayerWeights {
                attn_norm: l.vector(&p("attn_norm.weight"), h)?,
                q: l.linear(&p("attn_q"), cfg.q_dim(), h, bias)?,
                k: l.linear(&p("attn_k"), cfg.kv_dim(), h, bias)?,
                v: l.linear(&p("attn_v"), cfg.kv_dim(), h, bias)?,
                o: l.linear(&p("attn_output"), h, cfg.q_dim(), false)?,
                ffn_norm: l.vector(&p("ffn_norm.weight"), h)?,
                gate: l.linear(&p("ffn_gate"), ffn, h, false)?,
                up: l.linear(&p("ffn_up"), ffn, h, false)?,
                down: l.linear(&p("ffn_down"), h, ffn, false)?,
            });
        }
        let norm = l.vector("output_norm.weight", h)?;
        let lm_head = if cfg.tie_word_embeddings {
            Linear {
                weight: l.matmul("token_embd.weight", tied_head)?,
                bias: None,
            }
        } else {
            l.linear("output", cfg.vocab_size, h, false)?
        };
        Ok(Self {
            embed,
            layers,
            norm,
            lm_head,
        })
    }
}

impl From<candle_core::Error> for ModelError {
    fn from(e: candle_core::Error) -> Self {
        ModelError::Tensor(e.to_string())
    }
}

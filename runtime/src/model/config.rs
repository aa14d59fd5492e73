//! Architecture hyper-parameters, read from GGUF metadata or a Hugging Face `config.json`.

use super::ModelError;

/// Model families we run. All share the Llama block (RMSNorm, GQA attention with RoPE, a gated
/// FFN); they differ in attention biases, RoPE layout, sliding windows, per-head q/k norms
/// (Qwen3, Gemma 3), whether the FFN is a mixture of experts ([`Moe`]; Mixtral is a Llama with
/// one), and Gemma 3's extras (norms after each block, GeGLU, a scaled embedding, local and
/// global layers).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    Llama,
    Mistral,
    Qwen2,
    Qwen3,
    Qwen3Moe,
    /// Qwen2-MoE (and Qwen1.5-MoE): Qwen2's attention, experts plus a gated shared expert.
    Qwen2Moe,
    /// Phi-3 and Phi-3.5: Q/K/V and gate/up stored fused, LongRoPE scaling.
    Phi3,
    /// Gemma 3 (text): q/k norms, norms after attention and after the FFN as well as before,
    /// GeGLU, the embedding scaled by `sqrt(hidden)`, five sliding-window layers to one global.
    Gemma3,
    /// Gemma 2: Gemma 3's layer without q/k norms, every other layer sliding, soft-capped
    /// attention scores and logits.
    Gemma2,
}

impl Arch {
    const ALL: [Arch; 9] = [
        Arch::Llama,
        Arch::Mistral,
        Arch::Qwen2,
        Arch::Qwen3,
        Arch::Qwen3Moe,
        Arch::Qwen2Moe,
        Arch::Phi3,
        Arch::Gemma3,
        Arch::Gemma2,
    ];

    /// The family of a GGUF's `general.architecture`.
    pub fn from_gguf_name(name: &str) -> Option<Arch> {
        Self::ALL.into_iter().find(|a| a.gguf_name() == name)
    }

    /// How llama.cpp's converter leaves Q and K rows: permuted for the interleaved RoPE in
    /// Llama and Mistral files, in Hugging Face (rotate-half) order in every other family's.
    pub fn gguf_rope_style(self) -> RopeStyle {
        match self {
            Arch::Llama | Arch::Mistral => RopeStyle::Interleaved,
            _ => RopeStyle::Half,
        }
    }

    /// Q, K and V have biases (Qwen2, Qwen2-MoE).
    pub fn attention_bias(self) -> bool {
        matches!(self, Arch::Qwen2 | Arch::Qwen2Moe)
    }

    /// RMS norms over each head of q and of k (Qwen3, Qwen3-MoE, Gemma 3).
    pub fn qk_norm(self) -> bool {
        matches!(self, Arch::Qwen3 | Arch::Qwen3Moe | Arch::Gemma3)
    }

    /// Checkpoints store Q/K/V as one `attn_qkv` and gate/up as one `ffn_up` of twice the
    /// intermediate size, gate first (Phi-3).
    pub fn fused_projections(self) -> bool {
        self == Arch::Phi3
    }

    /// The name llama.cpp gives the family (`general.architecture`).
    pub fn gguf_name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Mistral => "mistral",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
            Arch::Qwen3Moe => "qwen3moe",
            Arch::Qwen2Moe => "qwen2moe",
            Arch::Phi3 => "phi3",
            Arch::Gemma3 => "gemma3",
            Arch::Gemma2 => "gemma2",
        }
    }

    /// Whether a sliding window in the checkpoint is applied. Not Phi-3's: llama.cpp, our
    /// reference, runs Phi-3 over the whole context (its Phi window is disabled,
    /// ggml-org/llama.cpp#13676), and so do we, from either form.
    pub fn uses_sliding_window(self) -> bool {
        self != Arch::Phi3
    }

    /// The FFN's gate activation: GeGLU in Gemma, SwiGLU elsewhere.
    pub fn activation(self) -> Activation {
        if self.is_gemma() {
            Activation::GeluTanh
        } else {
            Activation::Silu
        }
    }

    /// What token embeddings are multiplied by on the way in: `sqrt(hidden)` in Gemma.
    pub fn embedding_scale(self, hidden: usize) -> Option<f32> {
        self.is_gemma().then(|| (hidden as f32).sqrt())
    }

    /// What a Hugging Face checkpoint's norm weights are short of: Gemma's norms multiply by
    /// `1 + weight` (llama.cpp's converter stores the sum in GGUF files).
    pub fn hf_norm_offset(self) -> f32 {
        if self.is_gemma() { 1.0 } else { 0.0 }
    }

    /// Gemma 2 and 3, which share their layer's shape.
    fn is_gemma(self) -> bool {
        matches!(self, Arch::Gemma2 | Arch::Gemma3)
    }

    /// Every `n`-th layer attends globally, the others within the window (Gemma 3: 6, Gemma 2:
    /// 2); `None` where every layer slides alike.
    pub fn global_layer_period(self) -> Option<usize> {
        match self {
            Arch::Gemma3 => Some(6),
            Arch::Gemma2 => Some(2),
            _ => None,
        }
    }

    /// Gemma's query scale from the layer count, as llama.cpp sets it for GGUF files (which do
    /// not carry `query_pre_attn_scalar`): the 27B sizes (Gemma 2: 46 layers, Gemma 3: 62)
    /// scale by `1 / sqrt(hidden / heads)`, the others by `1 / sqrt(head_dim)` (`None`).
    pub fn gguf_attention_scale(self, layers: usize, hidden: usize, heads: usize) -> Option<f32> {
        let big = matches!((self, layers), (Arch::Gemma2, 46) | (Arch::Gemma3, 62));
        (big && heads > 0).then(|| 1.0 / ((hidden / heads) as f32).sqrt())
    }

    /// Norms of the attention's and the FFN's outputs as well as of their inputs (Gemma).
    pub fn post_norms(self) -> bool {
        self.is_gemma()
    }
}

/// The gate's activation of a gated FFN: the kernel's own enum, so nothing maps between two.
pub use crate::kernels::swiglu::Gate as Activation;

/// Which layers attend within [`ModelConfig::sliding_window`], and how their RoPE differs.
#[derive(Debug, Clone, PartialEq)]
pub struct LocalLayers {
    /// Per layer: it attends within the window (the others see the whole context).
    pub sliding: Vec<bool>,
    /// The sliding layers' RoPE base, unscaled (Gemma 3's `rope_local_base_freq`); `None`: the
    /// same RoPE as the global layers.
    pub rope_theta: Option<f32>,
}

impl LocalLayers {
    /// Every `period`-th layer global, the rest sliding (Gemma 3: 6, layers 5, 11, ... global).
    pub fn every(period: usize, layers: usize, rope_theta: Option<f32>) -> Self {
        Self {
            sliding: (0..layers).map(|i| (i + 1) % period.max(1) != 0).collect(),
            rope_theta,
        }
    }
}

/// A mixture-of-experts FFN: a router picks `experts_per_token` of `num_experts` SwiGLU experts
/// per token, weighted by the softmax of the router's logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Moe {
    pub num_experts: usize,
    pub experts_per_token: usize,
    /// Each expert's intermediate size.
    pub expert_ffn: usize,
    /// Renormalise the chosen experts' weights to sum to 1 (Mixtral, and Qwen3-MoE's
    /// `norm_topk_prob`); otherwise they keep their share of the softmax over all experts
    /// (Qwen2-MoE).
    pub norm_top_k: bool,
    /// The intermediate size of a shared expert every token runs, its output scaled by a
    /// sigmoid gate of the token (Qwen2-MoE); `None` without one.
    pub shared_ffn: Option<usize>,
}

/// How RoPE pairs up dimensions. GGUF Llama checkpoints have Q/K rows permuted for the
/// interleaved form; Hugging Face checkpoints (and Qwen2 GGUF) use the rotate-half form.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeStyle {
    Interleaved,
    Half,
}

#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    None,
    /// Position interpolation: every frequency divided by `factor`.
    Linear {
        factor: f32,
    },
    /// Llama 3.1 style frequency-dependent scaling.
    Llama3 {
        factor: f32,
        low_freq_factor: f32,
        high_freq_factor: f32,
        original_max_position: usize,
    },
    /// Per-frequency divisors stored in the checkpoint (GGUF `rope_freqs.weight`).
    FreqFactors(Vec<f32>),
    /// Phi-3's LongRoPE: per-frequency divisors, `long` when the served context is longer than
    /// `original_max_position` and `short` otherwise (chosen once, by the context, as llama.cpp
    /// does), and cos/sin scaled by `attn_factor`.
    LongRope {
        short: Vec<f32>,
        long: Vec<f32>,
        original_max_position: usize,
        attn_factor: f32,
    },
}

#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub arch: Arch,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// Dimensions of each head RoPE rotates, the first ones: `head_dim`, or fewer with partial
    /// rotary embeddings (Phi-4-mini: three quarters).
    pub rotary_dim: usize,
    pub vocab_size: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f32,
    pub rope_scaling: RopeScaling,
    pub rope_style: RopeStyle,
    pub max_position_embeddings: usize,
    pub sliding_window: Option<usize>,
    /// With a sliding window, the layers that use it (`None`: every layer, as Mistral).
    pub local_layers: Option<LocalLayers>,
    pub attention_bias: bool,
    /// RMS norms over each head of q and of k, before RoPE (Qwen3).
    pub qk_norm: bool,
    /// The FFN is a mixture of experts (`intermediate_size` is then unused).
    pub moe: Option<Moe>,
    pub tie_word_embeddings: bool,
    pub activation: Activation,
    /// Token embeddings are multiplied by this on the way in (Gemma: `sqrt(hidden)`).
    pub embedding_scale: Option<f32>,
    /// RMS norms of the attention's and the FFN's outputs before each residual add (Gemma).
    pub post_norms: bool,
    /// The attention scores' scale; `None`: `1 / sqrt(head_dim)` (Gemma's
    /// `query_pre_attn_scalar` sets another).
    pub attention_scale: Option<f32>,
    /// Logits become `cap · tanh(logits / cap)` (Gemma's `final_logit_softcapping`).
    pub final_logit_softcap: Option<f32>,
    /// Scaled attention scores become `cap · tanh(score / cap)` (Gemma 2's
    /// `attn_logit_softcapping`).
    pub attn_logit_softcap: Option<f32>,
}

impl From<&ModelConfig> for crate::kv::KvShape {
    fn from(c: &ModelConfig) -> Self {
        Self {
            num_layers: c.num_layers,
            num_kv_heads: c.num_kv_heads,
            head_dim: c.head_dim,
        }
    }
}

impl ModelConfig {
    /// Rejects configurations the runtime cannot execute, with the offending field named.
    pub fn validate(&self) -> Result<(), ModelError> {
        let bad = |msg: String| Err(ModelError::InvalidConfig(msg));
        let positive = [
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_layers", self.num_layers),
            ("num_heads", self.num_heads),
            ("num_kv_heads", self.num_kv_heads),
            ("head_dim", self.head_dim),
            ("vocab_size", self.vocab_size),
            ("max_position_embeddings", self.max_position_embeddings),
        ];
        for (name, v) in positive {
            if v == 0 {
                return bad(format!("{name} must be positive"));
            }
        }
        if !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return bad(format!(
                "num_heads ({}) is not a multiple of num_kv_heads ({})",
                self.num_heads, self.num_kv_heads
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return bad(format!(
                "head_dim ({}) must be even for RoPE",
                self.head_dim
            ));
        }
        if self.rotary_dim == 0
            || !self.rotary_dim.is_multiple_of(2)
            || self.rotary_dim > self.head_dim
        {
            return bad(format!(
                "rotary dimensions ({}) must be even and between 2 and head_dim ({})",
                self.rotary_dim, self.head_dim
            ));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            return bad(format!("rope_theta ({}) must be positive", self.rope_theta));
        }
        if let Some(m) = &self.moe {
            if m.num_experts == 0 || m.expert_ffn == 0 || m.shared_ffn == Some(0) {
                return bad("a mixture of experts needs experts of positive size".into());
            }
            if m.experts_per_token == 0 || m.experts_per_token > m.num_experts {
                return bad(format!(
                    "experts per token ({}) must be between 1 and the number of experts ({})",
                    m.experts_per_token, m.num_experts
                ));
            }
        }
        if let Some(local) = &self.local_layers
            && local.sliding.len() != self.num_layers
        {
            return bad(format!(
                "{} layers are marked sliding or global, the model has {}",
                local.sliding.len(),
                self.num_layers
            ));
        }
        if self.sliding_window == Some(0) {
            return bad("sliding_window must be positive".into());
        }
        let positive_reals = [
            ("embedding scale", self.embedding_scale),
            ("attention scale", self.attention_scale),
            ("final logit soft-cap", self.final_logit_softcap),
            ("attention soft-cap", self.attn_logit_softcap),
            (
                "local RoPE base",
                self.local_layers.as_ref().and_then(|l| l.rope_theta),
            ),
        ];
        for (name, v) in positive_reals {
            if let Some(v) = v
                && !(v.is_finite() && v > 0.0)
            {
                return bad(format!("{name} ({v}) must be positive"));
            }
        }
        let factor_lists: Vec<&Vec<f32>> = match &self.rope_scaling {
            RopeScaling::FreqFactors(f) => vec![f],
            RopeScaling::LongRope { short, long, .. } => vec![short, long],
            _ => Vec::new(),
        };
        for f in factor_lists {
            if f.len() != self.rotary_dim / 2 {
                return bad(format!(
                    "rope frequency factors have {} entries, expected rotary dimensions / 2 = {}",
                    f.len(),
                    self.rotary_dim / 2
                ));
            }
            if f.iter().any(|x| !(x.is_finite() && *x > 0.0)) {
                return bad("rope frequency factors must be positive".into());
            }
        }
        Ok(())
    }

    pub fn q_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }

    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// What attention scores are scaled by: [`Self::attention_scale`], else `1 / sqrt(head_dim)`.
    pub fn score_scale(&self) -> f32 {
        self.attention_scale
            .unwrap_or(1.0 / (self.head_dim as f32).sqrt())
    }

    /// Layer `l` attends within [`Self::sliding_window`] (when there is one).
    pub fn is_sliding(&self, l: usize) -> bool {
        self.sliding_window.is_some()
            && self
                .local_layers
                .as_ref()
                .is_none_or(|local| local.sliding.get(l).copied().unwrap_or(false))
    }
}

//! Architecture hyper-parameters, read from GGUF metadata or a Hugging Face `config.json`.

use super::ModelError;

/// Model families we run. All share the Llama block (RMSNorm, GQA attention with RoPE, SwiGLU);
/// they differ in attention biases, RoPE layout and sliding windows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    Llama,
    Mistral,
    Qwen2,
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
    pub vocab_size: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f32,
    pub rope_scaling: RopeScaling,
    pub rope_style: RopeStyle,
    pub max_position_embeddings: usize,
    pub sliding_window: Option<usize>,
    pub attention_bias: bool,
    pub tie_word_embeddings: bool,
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
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            return bad(format!("rope_theta ({}) must be positive", self.rope_theta));
        }
        if let RopeScaling::FreqFactors(f) = &self.rope_scaling
            && f.len() != self.head_dim / 2
        {
            return bad(format!(
                "rope frequency factors have {} entries, expected head_dim/2 = {}",
                f.len(),
                self.head_dim / 2
            ));
        }
        Ok(())
    }

    pub fn q_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }

    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }
}

//! Rotary position embeddings with the scaling variants found in checkpoint metadata.

use candle_core::{DType, Device, Result, Tensor};

use super::config::{ModelConfig, RopeScaling, RopeStyle};

/// Precomputed cos/sin tables, indexed by absolute position so that every token of a mixed
/// batch can carry its own position.
#[derive(Debug, Clone)]
pub struct Rope {
    cos: Tensor,
    sin: Tensor,
    style: RopeStyle,
    /// The heads' size: past the tables' `2 · half` dimensions (partial rotary embeddings,
    /// Phi-4-mini) the rest of each head passes through unrotated.
    head_dim: usize,
}

/// Inverse frequencies after scaling, for a model served with contexts up to `max_len`; public
/// for tests against closed-form values.
pub fn inv_freqs(cfg: &ModelConfig, max_len: usize) -> Vec<f32> {
    let d = cfg.rotary_dim;
    let base: Vec<f32> = (0..d / 2)
        .map(|i| 1.0 / cfg.rope_theta.powf(2.0 * i as f32 / d as f32))
        .collect();
    match &cfg.rope_scaling {
        RopeScaling::None => base,
        RopeScaling::Linear { factor } => base.iter().map(|f| f / factor).collect(),
        RopeScaling::FreqFactors(factors) => divide(&base, factors),
        RopeScaling::LongRope {
            short,
            long,
            original_max_position,
            ..
        } if max_len > *original_max_position => divide(&base, long),
        RopeScaling::LongRope { short, .. } => divide(&base, short),
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position,
        } => {
            let old = *original_max_position as f32;
            let low_wavelen = old / low_freq_factor;
            let high_wavelen = old / high_freq_factor;
            base.iter()
                .map(|&f| {
                    let wavelen = 2.0 * std::f32::consts::PI / f;
                    if wavelen < high_wavelen {
                        f
                    } else if wavelen > low_wavelen {
                        f / factor
                    } else {
                        let smooth = (old / wavelen - low_freq_factor)
                            / (high_freq_factor - low_freq_factor);
                        (1.0 - smooth) * f / factor + smooth * f
                    }
                })
                .collect()
        }
    }
}

/// Each frequency divided by its factor.
fn divide(freqs: &[f32], factors: &[f32]) -> Vec<f32> {
    freqs.iter().zip(factors).map(|(f, s)| f / s).collect()
}

impl Rope {
    pub fn new(cfg: &ModelConfig, max_len: usize, device: &Device) -> Result<Self> {
        let inv = inv_freqs(cfg, max_len);
        let inv = Tensor::from_vec(inv, (1, cfg.rotary_dim / 2), device)?;
        let pos = Tensor::arange(0u32, max_len as u32, device)?
            .to_dtype(DType::F32)?
            .reshape((max_len, 1))?;
        let freqs = pos.broadcast_mul(&inv)?;
        let (cos, sin) = (freqs.cos()?, freqs.sin()?);
        let (cos, sin) = match &cfg.rope_scaling {
            RopeScaling::LongRope { attn_factor, .. } if *attn_factor != 1.0 => {
                let m = f64::from(*attn_factor);
                ((cos * m)?, (sin * m)?)
            }
            _ => (cos, sin),
        };
        Ok(Self {
            cos,
            sin,
            style: cfg.rope_style,
            head_dim: cfg.head_dim,
        })
    }

    /// Tables made elsewhere (`[positions, head_dim / 2]` each; tests of the fused kernel).
    pub fn from_tables(cos: Tensor, sin: Tensor, style: RopeStyle) -> Self {
        let head_dim = 2 * cos.dim(1).unwrap_or(0);
        Self {
            cos,
            sin,
            style,
            head_dim,
        }
    }

    /// The same tables for heads of `head_dim`, of which they rotate the first `2 · half`.
    pub fn for_heads(self, head_dim: usize) -> Self {
        Self { head_dim, ..self }
    }

    /// Only part of each head is rotated.
    pub fn is_partial(&self) -> bool {
        self.cos.dim(1).is_ok_and(|half| 2 * half != self.head_dim)
    }

    /// `[positions, head_dim / 2]`: the cosine of each position's angle for each pair.
    pub fn cos(&self) -> &Tensor {
        &self.cos
    }

    pub fn sin(&self) -> &Tensor {
        &self.sin
    }

    pub fn style(&self) -> RopeStyle {
        self.style
    }

    /// The tables' rows at `positions` (`[tokens]`, u32), gathered once per forward and shared
    /// by every layer's q and k (four gathers per layer otherwise: on a GPU, four launches).
    pub fn at(&self, positions: &Tensor) -> Result<RopeAt> {
        let t = positions.dim(0)?;
        let half = self.cos.dim(1)?;
        let rows = |table: &Tensor| table.index_select(positions, 0)?.reshape((t, 1, half));
        Ok(RopeAt {
            cos: rows(&self.cos)?,
            sin: rows(&self.sin)?,
            style: self.style,
        })
    }
}

/// [`Rope`]'s rows for one forward's tokens.
#[derive(Debug, Clone)]
pub struct RopeAt {
    cos: Tensor,
    sin: Tensor,
    style: RopeStyle,
}

impl RopeAt {
    /// `[tokens, 1, head_dim / 2]`: each token's row of the cosine table.
    pub fn cos(&self) -> &Tensor {
        &self.cos
    }

    /// `[tokens, 1, head_dim / 2]`: each token's row of the sine table.
    pub fn sin(&self) -> &Tensor {
        &self.sin
    }

    /// Rotates `x` of shape `[tokens, heads, head_dim]`, token `i` by the `i`-th position: the
    /// first `2 · half` dimensions of each head, the rest as they are.
    pub fn apply(&self, x: &Tensor) -> Result<Tensor> {
        let (t, h, d) = x.dims3()?;
        let rotary = 2 * self.cos.dim(2)?;
        if rotary < d {
            let rotated = self.apply(&x.narrow(2, 0, rotary)?)?;
            return Tensor::cat(&[&rotated, &x.narrow(2, rotary, d - rotary)?], 2);
        }
        let x = x.reshape((t, h, 1, d))?.contiguous()?;
        let y = match self.style {
            RopeStyle::Interleaved => candle_nn::rotary_emb::rope_i(&x, &self.cos, &self.sin)?,
            RopeStyle::Half => candle_nn::rotary_emb::rope(&x, &self.cos, &self.sin)?,
        };
        y.reshape((t, h, d))
    }
}

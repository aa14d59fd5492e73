//! Weight tensors of a Llama-family model, loaded from any [`WeightSource`].

use std::borrow::Cow;
use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QMatMul, QStorage, QTensor};
use candle_core::{CpuStorage, CustomOp1, DType, Device, Layout, Module, Shape, Tensor};

use super::ModelError;
use super::config::ModelConfig;
use crate::kernels::Isa;
use crate::kernels::qgemm::{self, Bits, QWeights};

/// A tensor as a checkpoint stores it: block-quantized (GGUF) or dense. The quantized one is
/// boxed: with the `cuda` feature a `QTensor` is over 200 bytes, a `Tensor` one pointer.
#[derive(Debug)]
pub enum RawWeight {
    Quantized(Box<QTensor>),
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

/// How matrix weights are held in memory and multiplied.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum WeightMode {
    /// `packed` on CPU. On other devices, `dense` when the dequantized weights fit in
    /// [`AUTO_DENSE_MAX_BYTES`], else `quantized`.
    #[default]
    Auto,
    /// Keep weights 4- or 8-bit, repacked at load for our batched int8 GEMM
    /// ([`crate::kernels::qgemm`]), CPU only: fast at batch 1 (reads 4-8x fewer bytes than f32)
    /// and for large batches (each weight block serves every row of a step), and bitwise batch
    /// invariant. GGUF Q4_0, Q4_1 and Q8_0 are kept exactly; other types are requantized to
    /// 8 bits in blocks of 32.
    Packed,
    /// Keep GGUF weights block-quantized and multiply with candle's quantized kernels. Results
    /// are bitwise independent of the batch and decode reads 4-8x fewer bytes, but the kernels
    /// redo the weight unpacking for every row, so throughput barely grows with batch size.
    Quantized,
    /// Dequantize everything to f32 at load and use dense GEMM: slower at batch 1 (memory
    /// bound), several times faster for batches and prefill; batch invariant to ~1e-4.
    Dense,
    /// Keep both; a forward of fewer than [`HYBRID_MIN_DENSE_TOKENS`] tokens uses the quantized
    /// kernels, larger ones dense GEMM. Fastest at every batch size, but NOT batch invariant:
    /// the two paths round differently, so a request's greedy output can change with load.
    Hybrid,
}

/// Largest f32 weight footprint `auto` dequantizes.
pub const AUTO_DENSE_MAX_BYTES: usize = 4 << 30;

/// How a checkpoint stores its parameters, as far as resolving `auto` goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Checkpoint {
    /// Elements of every tensor.
    pub params: usize,
    /// Elements stored as floats (F32, F16, BF16) rather than 4- to 8-bit blocks.
    pub float_params: usize,
}

impl Checkpoint {
    /// Most of the weights are floats: an F16/BF16/F32 checkpoint rather than a quantized one
    /// (whose norms, and sometimes embeddings, are floats too).
    pub fn is_float(&self) -> bool {
        2 * self.float_params > self.params
    }

    fn fits_dense(&self) -> bool {
        self.params.saturating_mul(4) <= AUTO_DENSE_MAX_BYTES
    }
}

impl WeightMode {
    /// Resolves `auto` for `checkpoint` on `device`. On the CPU a quantized checkpoint is
    /// `packed`; a float one computes at its own precision (`dense`, or `quantized` where the
    /// f32 copy would pass [`AUTO_DENSE_MAX_BYTES`]: candle's kernels keep F16 and BF16 as they
    /// are), since repacking it to 8 bits would change its numerics without being asked
    /// (vLLM quantizes only with `--quantization`). Elsewhere `dense` when the f32 weights fit,
    /// else `quantized`. `packed` needs the CPU; elsewhere it falls back to `quantized`.
    pub fn resolve(self, checkpoint: Checkpoint, device: &Device) -> WeightMode {
        match self {
            WeightMode::Auto if device.is_cpu() && !checkpoint.is_float() => WeightMode::Packed,
            WeightMode::Packed if device.is_cpu() => WeightMode::Packed,
            WeightMode::Packed => WeightMode::Quantized,
            WeightMode::Auto if checkpoint.fits_dense() => WeightMode::Dense,
            WeightMode::Auto => WeightMode::Quantized,
            m => m,
        }
    }
}

/// Tokens in one forward from which dense GEMM beats the quantized kernels for the default
/// model on a 2-core AVX-512 machine (`bench-runtime --weights quantized|dense --batches 1,2,3,4`).
pub const HYBRID_MIN_DENSE_TOKENS: usize = 4;

/// One block of output rows of a [`Linear`]: the same weights in one or two representations.
#[derive(Debug, Clone)]
struct Part {
    /// Repacked 4/8-bit weights for [`crate::kernels::qgemm`] (`packed` mode).
    packed: Option<Arc<QWeights>>,
    quant: Option<QMatMul>,
    /// `[out, in]` f32. (Multiplying by its transposed view measured faster with candle's
    /// GEMM than storing `[in, out]`: 228 vs 160 tok/s at batch 32.)
    dense: Option<Tensor>,
    out: usize,
}

impl Part {
    /// `out` rows held only as packed weights (`packed` mode).
    fn packed(w: Arc<QWeights>, out: usize) -> Part {
        Part {
            packed: Some(w),
            quant: None,
            dense: None,
            out,
        }
    }

    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        if let Some(p) = &self.packed {
            return x.apply_op1_no_bwd(&PackedMatMul(p.clone()));
        }
        let tokens = x.dim(0)?;
        match (&self.quant, &self.dense) {
            (Some(q), Some(_)) if tokens < HYBRID_MIN_DENSE_TOKENS => q.forward(x),
            (_, Some(d)) => x.matmul(&d.t()?),
            (Some(q), None) => q.forward(x),
            (None, None) => candle_core::bail!("linear layer without weights"),
        }
    }

    /// Stacks `other` below `self` when both hold the same representations, else `None`.
    fn try_merge(&self, other: &Part) -> candle_core::Result<Option<Part>> {
        let packed = match (&self.packed, &other.packed) {
            (None, None) => None,
            (Some(a), Some(b)) => match a.stack(b) {
                Some(s) => Some(Arc::new(s)),
                None => return Ok(None),
            },
            _ => return Ok(None),
        };
        let quant = match (&self.quant, &other.quant) {
            (None, None) => None,
            (Some(QMatMul::QTensor(a)), Some(QMatMul::QTensor(b))) if a.dtype() == b.dtype() => {
                let (ka, kb) = (a.shape().dims()[1], b.shape().dims()[1]);
                if ka != kb {
                    return Ok(None);
                }
                // Block quantization runs along rows, so stacking rows is stacking bytes.
                let mut bytes = a.data()?.into_owned();
                bytes.extend_from_slice(&b.data()?);
                let storage = QStorage::from_data(Cow::Owned(bytes), &a.device(), a.dtype())?;
                let q = QTensor::new(storage, (self.out + other.out, ka))?;
                Some(QMatMul::from_qtensor(q)?)
            }
            _ => return Ok(None),
        };
        let dense = match (&self.dense, &other.dense) {
            (None, None) => None,
            (Some(a), Some(b)) => Some(Tensor::cat(&[a, b], 0)?),
            _ => return Ok(None),
        };
        Ok(Some(Part {
            packed,
            quant,
            dense,
            out: self.out + other.out,
        }))
    }
}

/// [`QWeights::matmul`] as a candle op over `[tokens, in]` f32 on the CPU.
struct PackedMatMul(Arc<QWeights>);

impl CustomOp1 for PackedMatMul {
    fn name(&self) -> &'static str {
        "packed-matmul"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let w = &self.0;
        let x = super::cpu_view::contiguous::<f32>(s, l, "packed-matmul: the input")?;
        let (m, k) = l.shape().dims2()?;
        if k != w.cols() {
            candle_core::bail!(
                "packed-matmul: input has {k} features, weights {}",
                w.cols()
            );
        }
        let y = w.matmul_vec(Isa::best(), x, m);
        Ok((CpuStorage::F32(y), Shape::from((m, w.rows()))))
    }
}

/// Reads a GGUF tensor's blocks into the packed layout: Q4_0, Q4_1 and Q8_0 exactly (their
/// blocks are 32 values with f16 scales), anything else dequantized and requantized to 8 bits.
fn pack(name: &str, q: &QTensor, device: &Device) -> Result<QWeights, ModelError> {
    let (n, k) = q.shape().dims2()?;
    let err = |e: qgemm::QuantError| ModelError::Tensor(format!("{name}: {e}"));
    let (bits, block_bytes) = match q.dtype() {
        GgmlDType::Q4_0 => (Bits::Four, 18),
        GgmlDType::Q4_1 => (Bits::Four, 20),
        GgmlDType::Q8_0 => (Bits::Eight, 34),
        _ => {
            let w = q.dequantize(device)?.flatten_all()?.to_vec1::<f32>()?;
            return QWeights::quantize(&w, n, k).map_err(err);
        }
    };
    let data = q.data()?;
    let kb = k / qgemm::QK;
    if k % qgemm::QK != 0 || data.len() != n * kb * block_bytes {
        return Err(ModelError::Tensor(format!(
            "{name}: {:?} tensor {n} x {k} holds {} bytes",
            q.dtype(),
            data.len()
        )));
    }
    let f16_at = |at: usize| half::f16::from_le_bytes([data[at], data[at + 1]]).to_f32();
    let dtype = q.dtype();
    QWeights::from_blocks(n, k, bits, |col, b| {
        let at = (col * kb + b) * block_bytes;
        let d = f16_at(at);
        let mut blk = qgemm::Block {
            d,
            m: 0.0,
            q: [0; qgemm::QK],
        };
        match dtype {
            GgmlDType::Q8_0 => {
                for (i, v) in blk.q.iter_mut().enumerate() {
                    *v = i16::from(data[at + 2 + i] as i8);
                }
            }
            _ => {
                // Q4_0 is `d · (q - 8)`; Q4_1 is `d · q + m`. Low nibbles hold values 0..16,
                // high nibbles 16..32.
                let (m, qs) = match dtype {
                    GgmlDType::Q4_1 => (f16_at(at + 2), at + 4),
                    _ => (-8.0 * d, at + 2),
                };
                blk.m = m;
                for i in 0..qgemm::QK / 2 {
                    blk.q[i] = i16::from(data[qs + i] & 15);
                    blk.q[i + 16] = i16::from(data[qs + i] >> 4);
                }
            }
        }
        blk
    })
    .map_err(err)
}

/// `y = x Wᵀ (+ b)` over a flattened batch `[tokens, in]`. Projections that read the same input
/// (Q/K/V, gate/up) are fused, so one GEMM replaces several small ones.
#[derive(Debug, Clone)]
pub struct Linear {
    parts: Vec<Part>,
    bias: Option<Tensor>,
}

impl Linear {
    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let y = match self.parts.as_slice() {
            [one] => one.forward(x)?,
            parts => {
                let ys = parts
                    .iter()
                    .map(|p| p.forward(x))
                    .collect::<candle_core::Result<Vec<_>>>()?;
                Tensor::cat(&ys, 1)?
            }
        };
        match &self.bias {
            Some(b) => y.broadcast_add(b),
            None => Ok(y),
        }
    }

    pub fn out_features(&self) -> usize {
        self.parts.iter().map(|p| p.out).sum()
    }

    /// Number of separate matrices (1 when fully fused).
    pub fn num_parts(&self) -> usize {
        self.parts.len()
    }

    /// Stacks projections of the same input along the output dimension, merging their weights
    /// into one matrix where the representations allow (e.g. the same quantization type).
    pub fn fuse(linears: Vec<Linear>) -> candle_core::Result<Linear> {
        let with_bias = linears.iter().filter(|l| l.bias.is_some()).count();
        let bias = if with_bias == 0 {
            None
        } else if with_bias == linears.len() {
            let b: Vec<Tensor> = linears.iter().filter_map(|l| l.bias.clone()).collect();
            Some(Tensor::cat(&b, 0)?)
        } else {
            candle_core::bail!("cannot fuse projections where only some have a bias")
        };
        let mut parts: Vec<Part> = Vec::new();
        for p in linears.into_iter().flat_map(|l| l.parts) {
            let merged = match parts.last() {
                Some(last) => last.try_merge(&p)?,
                None => None,
            };
            match (merged, parts.last_mut()) {
                (Some(m), Some(last)) => *last = m,
                _ => parts.push(p),
            }
        }
        Ok(Linear { parts, bias })
    }
}

#[derive(Debug, Clone)]
pub struct LayerWeights {
    pub attn_norm: Tensor,
    /// Q, K and V stacked: output `[tokens, q_dim + 2 * kv_dim]`.
    pub qkv: Linear,
    /// The weights of the RMS norms over each head of q and of k, `[head_dim]` each (Qwen3).
    pub qk_norm: Option<(Tensor, Tensor)>,
    pub o: Linear,
    pub ffn_norm: Tensor,
    pub ffn: Ffn,
    /// The weights of the norms of the attention's and the FFN's outputs (Gemma).
    pub post_norms: Option<(Tensor, Tensor)>,
}

/// A layer's feed-forward network.
#[derive(Debug, Clone)]
pub enum Ffn {
    Dense {
        /// Gate and up stacked: output `[tokens, 2 * intermediate]`.
        gate_up: Linear,
        down: Linear,
    },
    Experts(Experts),
}

/// A mixture of experts' weights: the router and each expert's SwiGLU FFN.
#[derive(Debug, Clone)]
pub struct Experts {
    /// `[experts, hidden]` f32: routing decides which weights run, so it is never quantized.
    pub router: Tensor,
    /// Per expert, gate and up stacked: output `[tokens, 2 * expert_ffn]`.
    pub gate_up: Vec<Linear>,
    pub down: Vec<Linear>,
    pub shared: Option<SharedExpert>,
}

/// Qwen2-MoE's shared expert: a SwiGLU FFN every token runs, scaled by `sigmoid(gate · h)`.
#[derive(Debug, Clone)]
pub struct SharedExpert {
    /// `[1, hidden]` f32.
    pub gate: Tensor,
    pub gate_up: Linear,
    pub down: Linear,
}

/// The token-embedding table.
#[derive(Debug, Clone)]
pub enum Embedding {
    /// `[vocab, hidden]` in f32: the lookup is a gather, not a matmul.
    Dense(Tensor),
    /// The tied output head's packed rows, dequantized per looked-up token, so a packed model
    /// keeps no f32 copy of the table (113 MB for SmolLM2). Exact for Q8_0 and Q4_1 tables.
    Packed(Arc<QWeights>),
}

impl Embedding {
    /// Rows `ids` as `[ids.len(), hidden]` f32 on `device`.
    /// The rows of `ids` (`[tokens]`, u32, on the model's device; a view is fine).
    pub fn lookup(&self, ids: &Tensor) -> Result<Tensor, ModelError> {
        match self {
            Embedding::Dense(t) => Ok(t.index_select(ids, 0)?),
            Embedding::Packed(w) => {
                // Packed weights live on the CPU, where reading the ids back is a copy.
                let ids = ids.to_vec1::<u32>()?;
                let h = w.cols();
                if let Some(&bad) = ids.iter().find(|&&id| id as usize >= w.rows()) {
                    return Err(ModelError::InvalidBatch(format!(
                        "token id {bad} is outside the embedding table ({})",
                        w.rows()
                    )));
                }
                let mut out = vec![0f32; ids.len() * h];
                for (row, &id) in out.chunks_exact_mut(h.max(1)).zip(&ids) {
                    w.dequantize_row(id as usize, row);
                }
                Ok(Tensor::from_vec(out, (ids.len(), h), &Device::Cpu)?)
            }
        }
    }
}

#[derive(Debug, Clone)]
pub struct LlamaWeights {
    pub embed: Embedding,
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

    fn part(&self, name: &str, w: RawWeight, out: usize) -> Result<Part, ModelError> {
        let wrap = |e: candle_core::Error| ModelError::Tensor(format!("{name}: {e}"));
        if self.mode == WeightMode::Packed {
            let packed = match w {
                RawWeight::Quantized(q) => pack(name, &q, self.device)?,
                RawWeight::Dense(t) => {
                    let (n, k) = t.dims2().map_err(wrap)?;
                    let f = t
                        .to_dtype(DType::F32)
                        .and_then(|t| t.flatten_all()?.to_vec1());
                    QWeights::quantize(&f.map_err(wrap)?, n, k)
                        .map_err(|e| ModelError::Tensor(format!("{name}: {e}")))?
                }
            };
            return Ok(Part::packed(Arc::new(packed), out));
        }
        let quantized = |q: QTensor| QMatMul::from_qtensor(q).map_err(wrap);
        let (quant, dense) = match (w, self.mode) {
            (RawWeight::Quantized(q), WeightMode::Quantized | WeightMode::Auto) => {
                (Some(quantized(*q)?), None)
            }
            (RawWeight::Quantized(q), WeightMode::Hybrid) => {
                let d = q.dequantize(self.device).map_err(wrap)?;
                (Some(quantized(*q)?), Some(d))
            }
            (w, _) => (None, Some(w.dense(self.device).map_err(wrap)?)),
        };
        // candle keeps f32/f16 GGUF tensors dense inside QMatMul; hold those only once.
        let (quant, dense) = match (quant, dense) {
            (Some(QMatMul::Tensor(t)), None) => (None, Some(t.to_dtype(DType::F32).map_err(wrap)?)),
            (Some(QMatMul::Tensor(_) | QMatMul::TensorF16(_)), Some(d)) => (None, Some(d)),
            other => other,
        };
        Ok(Part {
            packed: None,
            quant,
            dense,
            out,
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
        let part = self.part(&name, w, out)?;
        let bias = if bias {
            Some(self.vector(&format!("{prefix}.bias"), out)?)
        } else {
            None
        };
        Ok(Linear {
            parts: vec![part],
            bias,
        })
    }
}

impl Loader<'_> {
    /// The `n` experts' matrices of a stacked `[n, out, inp]` tensor, one [`Linear`] each.
    fn experts(
        &mut self,
        prefix: &str,
        n: usize,
        out: usize,
        inp: usize,
    ) -> Result<Vec<Linear>, ModelError> {
        let name = format!("{prefix}.weight");
        let w = self.required(&name)?;
        Self::check_shape(&name, &w, &[n, out, inp])?;
        split_experts(&name, w, n, self.device)?
            .into_iter()
            .enumerate()
            .map(|(e, w)| {
                Ok(Linear {
                    parts: vec![self.part(&format!("{name}[{e}]"), w, out)?],
                    bias: None,
                })
            })
            .collect()
    }

    fn ffn(&mut self, cfg: &ModelConfig, i: usize) -> Result<Ffn, ModelError> {
        let p = |s: &str| format!("blk.{i}.{s}");
        let h = cfg.hidden_size;
        let Some(moe) = cfg.moe else {
            let ffn = cfg.intermediate_size;
            if cfg.arch.fused_projections() {
                return Ok(Ffn::Dense {
                    gate_up: self.linear(&p("ffn_up"), 2 * ffn, h, false)?,
                    down: self.linear(&p("ffn_down"), h, ffn, false)?,
                });
            }
            let gate = self.linear(&p("ffn_gate"), ffn, h, false)?;
            let up = self.linear(&p("ffn_up"), ffn, h, false)?;
            return Ok(Ffn::Dense {
                gate_up: Linear::fuse(vec![gate, up])?,
                down: self.linear(&p("ffn_down"), h, ffn, false)?,
            });
        };
        let (n, f) = (moe.num_experts, moe.expert_ffn);
        let router_name = p("ffn_gate_inp.weight");
        let router = self.required(&router_name)?;
        Self::check_shape(&router_name, &router, &[n, h])?;
        let gates = self.experts(&p("ffn_gate_exps"), n, f, h)?;
        let ups = self.experts(&p("ffn_up_exps"), n, f, h)?;
        let gate_up = gates
            .into_iter()
            .zip(ups)
            .map(|(g, u)| Linear::fuse(vec![g, u]))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let shared = match moe.shared_ffn {
            Some(sf) => {
                let gate = self.vector(&p("ffn_gate_inp_shexp.weight"), h)?;
                let g = self.linear(&p("ffn_gate_shexp"), sf, h, false)?;
                let u = self.linear(&p("ffn_up_shexp"), sf, h, false)?;
                Some(SharedExpert {
                    gate: gate.reshape((1, h))?,
                    gate_up: Linear::fuse(vec![g, u])?,
                    down: self.linear(&p("ffn_down_shexp"), h, sf, false)?,
                })
            }
            None => None,
        };
        Ok(Ffn::Experts(Experts {
            router: router.dense(self.device)?,
            gate_up,
            down: self.experts(&p("ffn_down_exps"), n, h, f)?,
            shared,
        }))
    }
}

/// Cuts a stacked `[n, out, in]` tensor into its `n` matrices. Quantized blocks run along rows,
/// so each expert's blocks are one contiguous run of the bytes.
fn split_experts(
    name: &str,
    w: RawWeight,
    n: usize,
    device: &Device,
) -> Result<Vec<RawWeight>, ModelError> {
    match w {
        RawWeight::Dense(t) => (0..n).map(|e| Ok(RawWeight::Dense(t.get(e)?))).collect(),
        RawWeight::Quantized(q) => {
            let dims = q.shape().dims().to_vec();
            let data = q.data()?;
            if n == 0 || !data.len().is_multiple_of(n) {
                return Err(ModelError::Tensor(format!(
                    "{name}: {} bytes do not split into {n} experts",
                    data.len()
                )));
            }
            data.chunks_exact(data.len() / n)
                .map(|bytes| {
                    let storage =
                        QStorage::from_data(Cow::Owned(bytes.to_vec()), device, q.dtype())?;
                    Ok(RawWeight::Quantized(Box::new(QTensor::new(
                        storage,
                        (dims[1], dims[2]),
                    )?)))
                })
                .collect()
        }
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
        let h = cfg.hidden_size;
        let embed_raw = l.required("token_embd.weight")?;
        Loader::check_shape("token_embd.weight", &embed_raw, &[cfg.vocab_size, h])?;
        let tied = cfg.tie_word_embeddings;
        let (embed, tied_head) = match embed_raw {
            RawWeight::Quantized(q) if tied && mode == WeightMode::Packed => {
                let w = Arc::new(pack("token_embd.weight", &q, device)?);
                let head = Part::packed(w.clone(), cfg.vocab_size);
                (Embedding::Packed(w), Some(head))
            }
            RawWeight::Quantized(q) => {
                let table = Embedding::Dense(q.dequantize(device)?);
                let head = tied
                    .then(|| l.part("token_embd.weight", RawWeight::Quantized(q), cfg.vocab_size))
                    .transpose()?;
                (table, head)
            }
            RawWeight::Dense(t) => {
                let t = t.to_device(device)?.to_dtype(DType::F32)?;
                let head = tied
                    .then(|| {
                        l.part(
                            "token_embd.weight",
                            RawWeight::Dense(t.clone()),
                            cfg.vocab_size,
                        )
                    })
                    .transpose()?;
                (Embedding::Dense(t), head)
            }
        };
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for i in 0..cfg.num_layers {
            let p = |s: &str| format!("blk.{i}.{s}");
            let bias = cfg.attention_bias;
            let qkv = if cfg.arch.fused_projections() {
                l.linear(&p("attn_qkv"), cfg.q_dim() + 2 * cfg.kv_dim(), h, bias)?
            } else {
                let q = l.linear(&p("attn_q"), cfg.q_dim(), h, bias)?;
                let k = l.linear(&p("attn_k"), cfg.kv_dim(), h, bias)?;
                let v = l.linear(&p("attn_v"), cfg.kv_dim(), h, bias)?;
                Linear::fuse(vec![q, k, v])?
            };
            let qk_norm = if cfg.qk_norm {
                let d = cfg.head_dim;
                let q_norm = l.vector(&p("attn_q_norm.weight"), d)?;
                Some((q_norm, l.vector(&p("attn_k_norm.weight"), d)?))
            } else {
                None
            };
            let post_norms = if cfg.post_norms {
                let attn = l.vector(&p("post_attention_norm.weight"), h)?;
                Some((attn, l.vector(&p("post_ffw_norm.weight"), h)?))
            } else {
                None
            };
            layers.push(LayerWeights {
                attn_norm: l.vector(&p("attn_norm.weight"), h)?,
                qkv,
                qk_norm,
                o: l.linear(&p("attn_output"), h, cfg.q_dim(), false)?,
                ffn_norm: l.vector(&p("ffn_norm.weight"), h)?,
                ffn: l.ffn(cfg, i)?,
                post_norms,
            });
        }
        let norm = l.vector("output_norm.weight", h)?;
        let lm_head = match tied_head {
            Some(part) => Linear {
                parts: vec![part],
                bias: None,
            },
            None => l.linear("output", cfg.vocab_size, h, false)?,
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

#[cfg(test)]
mod resolve_tests {
    use super::{AUTO_DENSE_MAX_BYTES, Checkpoint, WeightMode};
    use candle_core::Device;

    #[test]
    fn auto_keeps_a_float_checkpoint_at_its_precision_on_the_cpu() {
        let cpu = &Device::Cpu;
        let q4 = Checkpoint {
            params: 135_000_000,
            float_params: 1_000_000,
        };
        let f16 = Checkpoint {
            params: 135_000_000,
            float_params: 135_000_000,
        };
        let big = Checkpoint {
            params: AUTO_DENSE_MAX_BYTES,
            float_params: AUTO_DENSE_MAX_BYTES,
        };
        assert_eq!(WeightMode::Auto.resolve(q4, cpu), WeightMode::Packed);
        assert_eq!(WeightMode::Auto.resolve(f16, cpu), WeightMode::Dense);
        assert_eq!(WeightMode::Auto.resolve(big, cpu), WeightMode::Quantized);
        // Asked for, a float checkpoint is repacked.
        assert_eq!(WeightMode::Packed.resolve(f16, cpu), WeightMode::Packed);
        assert_eq!(WeightMode::Dense.resolve(q4, cpu), WeightMode::Dense);
    }
}

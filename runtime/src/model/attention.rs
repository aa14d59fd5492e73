//! Paged attention: every token of a mixed batch attends to its own sequence's keys and values,
//! read from the block pools through that sequence's block table.
//!
//! Two implementations share one metadata type. On CPU a fused kernel walks the block tables
//! directly (one op per layer for the whole batch). On other devices the same maths is composed
//! from generic tensor ops (gather, matmul, softmax). The two are tested against each other.

use candle_core::{CpuStorage, CustomOp3, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

/// Where each token of the flattened batch sits: which sequence, which position.
#[derive(Debug, Clone)]
pub struct AttnMeta {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
    pub scale: f32,
    /// Tokens further back than this are not attended (Mistral-style sliding window).
    pub sliding_window: Option<usize>,
    /// Per token: index into `seqs`.
    pub token_seq: Vec<u32>,
    /// Per token: absolute position within its sequence.
    pub token_pos: Vec<u32>,
    /// Per sequence: its block table.
    pub block_tables: Vec<Vec<u32>>,
}

impl AttnMeta {
    /// Cache slot of position `pos` of sequence `seq`.
    #[inline]
    pub fn slot(&self, seq: usize, pos: usize) -> usize {
        self.block_tables[seq][pos / self.block_size] as usize * self.block_size
            + pos % self.block_size
    }

    /// First position a token at `pos` may attend to.
    #[inline]
    fn window_start(&self, pos: usize) -> usize {
        match self.sliding_window {
            Some(w) => (pos + 1).saturating_sub(w),
            None => 0,
        }
    }
}

/// Which attention implementation a model uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AttentionBackend {
    /// The fused CPU kernel where it applies (f32 on CPU), the generic path elsewhere.
    #[default]
    Auto,
    /// Always the generic tensor-op path.
    Generic,
}

/// Attention output `[tokens, num_heads * head_dim]` for queries `q` of the same shape, over the
/// layer's key/value slot tensors `[num_slots, num_kv_heads * head_dim]`.
pub fn paged_attention(
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    meta: &AttnMeta,
    backend: AttentionBackend,
) -> Result<Tensor> {
    let fused = q.device().is_cpu() && q.dtype() == DType::F32 && k_cache.dtype() == DType::F32;
    if backend == AttentionBackend::Auto && fused {
        q.contiguous()?
            .apply_op3_no_bwd(k_cache, v_cache, &CpuPagedAttention(meta))
    } else {
        paged_attention_generic(q, k_cache, v_cache, meta)
    }
}

/// Device-generic path: gathers each sequence's keys and values and runs masked softmax
/// attention with ordinary tensor ops.
pub fn paged_attention_generic(
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    meta: &AttnMeta,
) -> Result<Tensor> {
    let device = q.device();
    let (nh, kvh, hd) = (meta.num_heads, meta.num_kv_heads, meta.head_dim);
    let group = nh / kvh;
    let mut outs = Vec::with_capacity(meta.block_tables.len());
    let mut t = 0;
    while t < meta.token_seq.len() {
        let seq = meta.token_seq[t] as usize;
        let first_pos = meta.token_pos[t] as usize;
        let mut n = 1;
        while t + n < meta.token_seq.len() && meta.token_seq[t + n] as usize == seq {
            n += 1;
        }
        let last_pos = first_pos + n - 1;
        let ctx = last_pos + 1;
        let slots: Vec<u32> = (0..ctx).map(|p| meta.slot(seq, p) as u32).collect();
        let slots = Tensor::from_vec(slots, ctx, device)?;
        // [ctx, kvh, hd] -> [kvh, 1, ctx, hd] -> [kvh, group, ctx, hd] -> [nh, ctx, hd]
        let expand = |c: &Tensor| -> Result<Tensor> {
            c.index_select(&slots, 0)?
                .to_dtype(q.dtype())?
                .reshape((ctx, kvh, hd))?
                .transpose(0, 1)?
                .unsqueeze(1)?
                .broadcast_as((kvh, group, ctx, hd))?
                .reshape((nh, ctx, hd))
        };
        let k = expand(k_cache)?;
        let v = expand(v_cache)?;
        let qs = q
            .narrow(0, t, n)?
            .reshape((n, nh, hd))?
            .transpose(0, 1)?
            .contiguous()?;
        let scores = (qs.matmul(&k.t()?)? * meta.scale as f64)?; // [nh, n, ctx]
        let mask: Vec<f32> = (0..n)
            .flat_map(|i| {
                let pos = first_pos + i;
                let start = meta.window_start(pos);
                (0..ctx).map(move |j| {
                    if j < start || j > pos {
                        f32::NEG_INFINITY
                    } else {
                        0.0
                    }
                })
            })
            .collect();
        let mask = Tensor::from_vec(mask, (1, n, ctx), device)?.to_dtype(scores.dtype())?;
        let probs = candle_nn::ops::softmax_last_dim(&scores.broadcast_add(&mask)?)?;
        let o = probs.matmul(&v)?; // [nh, n, hd]
        outs.push(o.transpose(0, 1)?.reshape((n, nh * hd))?);
        t += n;
    }
    Tensor::cat(&outs, 0)
}

/// The fused CPU kernel. One task per (token, kv head): the query heads sharing that kv head
/// read each key once.
struct CpuPagedAttention<'a>(&'a AttnMeta);

impl CustomOp3 for CpuPagedAttention<'_> {
    fn name(&self) -> &'static str {
        "paged-attention"
    }

    fn cpu_fwd(
        &self,
        q: &CpuStorage,
        ql: &Layout,
        k: &CpuStorage,
        kl: &Layout,
        v: &CpuStorage,
        vl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let meta = self.0;
        let (nh, kvh, hd) = (meta.num_heads, meta.num_kv_heads, meta.head_dim);
        let group = nh / kvh;
        let kv_dim = kvh * hd;
        let (q, kc, vc) = (
            contiguous_f32(q, ql)?,
            contiguous_f32(k, kl)?,
            contiguous_f32(v, vl)?,
        );
        let tokens = meta.token_seq.len();
        if q.len() != tokens * nh * hd {
            candle_core::bail!(
                "paged-attention: q has {} values, expected {}",
                q.len(),
                tokens * nh * hd
            );
        }
        let num_slots = kc.len() / kv_dim;
        for (s, bt) in meta.block_tables.iter().enumerate() {
            if let Some(&b) = bt
                .iter()
                .find(|&&b| (b as usize + 1) * meta.block_size > num_slots)
            {
                candle_core::bail!(
                    "paged-attention: sequence {s} references block {b} outside the pool"
                );
            }
        }
        let mut out = vec![0f32; tokens * nh * hd];
        out.par_chunks_mut(group * hd)
            .enumerate()
            .for_each(|(chunk, out)| {
                let t = chunk / kvh;
                let g = chunk % kvh;
                let seq = meta.token_seq[t] as usize;
                let pos = meta.token_pos[t] as usize;
                let start = meta.window_start(pos);
                let ctx = pos + 1 - start;
                let qh = &q[t * nh * hd + g * group * hd..][..group * hd];
                let mut scores = vec![0f32; group * ctx];
                for j in 0..ctx {
                    let slot = meta.slot(seq, start + j);
                    let key = &kc[slot * kv_dim + g * hd..][..hd];
                    for h in 0..group {
                        scores[h * ctx + j] = dot(&qh[h * hd..][..hd], key) * meta.scale;
                    }
                }
                for h in 0..group {
                    let s = &mut scores[h * ctx..][..ctx];
                    let max = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    let mut sum = 0f32;
                    for x in s.iter_mut() {
                        *x = (*x - max).exp();
                        sum += *x;
                    }
                    let inv = 1.0 / sum;
                    s.iter_mut().for_each(|x| *x *= inv);
                }
                for j in 0..ctx {
                    let slot = meta.slot(seq, start + j);
                    let val = &vc[slot * kv_dim + g * hd..][..hd];
                    for h in 0..group {
                        axpy(scores[h * ctx + j], val, &mut out[h * hd..][..hd]);
                    }
                }
            });
        Ok((CpuStorage::F32(out), Shape::from((tokens, nh * hd))))
    }
}

fn contiguous_f32<'a>(s: &'a CpuStorage, l: &Layout) -> Result<&'a [f32]> {
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&s.as_slice::<f32>()?[a..b]),
        None => candle_core::bail!("paged-attention needs contiguous inputs"),
    }
}

/// Dot product in eight independent lanes so that the compiler vectorises it.
#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ac, ar) = a.split_at(a.len() / 8 * 8);
    let (bc, br) = b.split_at(ac.len());
    for (x, y) in ac.chunks_exact(8).zip(bc.chunks_exact(8)) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let tail: f32 = ar.iter().zip(br).map(|(x, y)| x * y).sum();
    acc.iter().sum::<f32>() + tail
}

#[inline]
fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi += a * xi;
    }
}

//! Paged attention: every token of a mixed batch attends to its own sequence's keys and values,
//! read from the block pools through that sequence's block table.
//!
//! Three implementations share one metadata type. On CPU a fused kernel walks the block tables
//! directly (one op per layer for the whole batch); on CUDA a kernel does the same
//! (`attention_kernel`, `runtime/kernels/paged_attention.cu`). Elsewhere, and for heads the CUDA
//! kernel declines, the same maths is composed from generic tensor ops (gather, matmul,
//! softmax). They are tested against each other.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, DType, Layout, Result, Shape, Tensor, WithDType};
use half::{bf16, f16};
use rayon::prelude::*;

pub use super::attention_meta::AttnMeta;
use super::cpu_view::contiguous;
use crate::kernels::exp::exp_approx;
use crate::kernels::simd::F32Path;
use crate::kernels::softcap::softcap;

/// Which attention implementation a model uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AttentionBackend {
    /// The fused kernel where it applies (f32 queries on CPU, or on CUDA for heads whose rows
    /// fit the kernel's shared memory, with an f32, f16 or bf16 cache), the generic path
    /// elsewhere.
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
    let types = q.dtype() == DType::F32
        && k_cache.dtype() == v_cache.dtype()
        && matches!(k_cache.dtype(), DType::F32 | DType::F16 | DType::BF16);
    let device = q.device().is_cpu()
        || (q.device().is_cuda() && super::attention_kernel::launch_shape(meta).is_some());
    if backend == AttentionBackend::Auto && types && device {
        q.contiguous()?
            .apply_op3_no_bwd(k_cache, v_cache, &PagedAttention(meta))
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
        let mut scores = (qs.matmul(&k.t()?)? * meta.scale as f64)?; // [nh, n, ctx]
        if let Some(cap) = meta.softcap {
            let cap = f64::from(cap);
            scores = ((scores / cap)?.tanh()? * cap)?;
        }
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

/// The fused kernel: on CPU below, on CUDA in `attention_kernel`. On CPU, one task per (tile of
/// up to [`TILE_TOKENS`] consecutive tokens of one sequence, kv head): the tile's query rows
/// (tokens × the query heads sharing that kv head) stream over the keys in chunks of [`KC`], so
/// each key and value is loaded once per tile instead of once per token, with an online softmax
/// (running max and sum per row).
struct PagedAttention<'a>(&'a AttnMeta);

/// Query tokens per tile: with 3 query heads per kv head (SmolLM2), 96 rows share each key.
const TILE_TOKENS: usize = 32;

impl CustomOp3 for PagedAttention<'_> {
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
        let what = [
            "paged-attention: queries",
            "paged-attention: keys",
            "paged-attention: values",
        ];
        let q = contiguous::<f32>(q, ql, what[0])?;
        match (k, v) {
            (CpuStorage::F32(_), CpuStorage::F32(_)) => self.run(
                q,
                contiguous::<f32>(k, kl, what[1])?,
                contiguous::<f32>(v, vl, what[2])?,
            ),
            (CpuStorage::F16(_), CpuStorage::F16(_)) => self.run(
                q,
                contiguous::<f16>(k, kl, what[1])?,
                contiguous::<f16>(v, vl, what[2])?,
            ),
            (CpuStorage::BF16(_), CpuStorage::BF16(_)) => self.run(
                q,
                contiguous::<bf16>(k, kl, what[1])?,
                contiguous::<bf16>(v, vl, what[2])?,
            ),
            _ => candle_core::bail!(
                "paged-attention: keys {:?} and values {:?} need one cache type of f32, f16, bf16",
                k.dtype(),
                v.dtype()
            ),
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        q: &candle_core::CudaStorage,
        ql: &Layout,
        k: &candle_core::CudaStorage,
        kl: &Layout,
        v: &candle_core::CudaStorage,
        vl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        super::attention_kernel::cuda::forward(self.0, q, ql, k, kl, v, vl)
    }
}

impl PagedAttention<'_> {
    fn run<T: KvElem>(&self, q: &[f32], kc: &[T], vc: &[T]) -> Result<(CpuStorage, Shape)> {
        let meta = self.0;
        let (nh, kvh, hd) = (meta.num_heads, meta.num_kv_heads, meta.head_dim);
        let group = nh / kvh;
        let kv_dim = kvh * hd;
        let tokens = meta.token_seq.len();
        meta.check_operands(q.len(), kc.len() / kv_dim)?;
        // Tiles in kv-head-major order, so each tile's output rows `[t][h]` are one
        // contiguous run of `by_head` (`[g][t][h][d]`); no tile allocates its own.
        let mut ranges = Vec::new();
        let mut t = 0;
        while t < tokens {
            let mut end = t + 1;
            while end < tokens && end - t < TILE_TOKENS && meta.token_seq[end] == meta.token_seq[t]
            {
                end += 1;
            }
            ranges.push((t, end));
            t = end;
        }
        let mut by_head = vec![0f32; tokens * nh * hd];
        let mut tiles = Vec::with_capacity(ranges.len() * kvh);
        let mut rest = by_head.as_mut_slice();
        for g in 0..kvh {
            for &(t0, t1) in &ranges {
                let (o, tail) = rest.split_at_mut((t1 - t0) * group * hd);
                tiles.push((t0, t1, g, o));
                rest = tail;
            }
        }
        tiles
            .par_iter_mut()
            .for_each(|(t0, t1, g, o)| tile(meta, q, kc, vc, *t0, *t1, *g, o));
        let mut out = vec![0f32; tokens * nh * hd];
        for (g, head) in by_head.chunks_exact(tokens * group * hd).enumerate() {
            for (t, rows) in head.chunks_exact(group * hd).enumerate() {
                out[t * nh * hd + g * group * hd..][..group * hd].copy_from_slice(rows);
            }
        }
        Ok((CpuStorage::F32(out), Shape::from((tokens, nh * hd))))
    }
}

/// Keys per chunk: one 512-bit vector of scores per query row.
const KC: usize = 16;

/// An element of the KV cache as the fused kernel reads it: f32 as it is, or f16 / bf16
/// widened to f32 on load. Widening is exact, so a cache type changes what is stored (rounded
/// once, when a token's keys are written) but never how the kernel sums, and the kernel stays
/// batch invariant for each type.
pub trait KvElem: WithDType + Copy + Send + Sync + sealed::Sealed {
    /// Widens `src` into `dst` (same length).
    fn widen(src: &[Self], dst: &mut [f32]);
}

mod sealed {
    /// The three cache types the kernel's vector loads know.
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::f16 {}
    impl Sealed for half::bf16 {}
}

impl KvElem for f32 {
    #[inline(always)]
    fn widen(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
}

impl KvElem for f16 {
    #[inline(always)]
    fn widen(src: &[f16], dst: &mut [f32]) {
        use half::slice::HalfFloatSliceExt;
        src.convert_to_f32_slice(dst);
    }
}

impl KvElem for bf16 {
    #[inline(always)]
    fn widen(src: &[bf16], dst: &mut [f32]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = f32::from_bits(u32::from(s.to_bits()) << 16);
        }
    }
}
/// Query rows per micro-tile.
const RT: usize = 4;

/// Folds 16 lanes with `f` as a halving tree (8 + 4 + 2 + 1 lane-wise steps).
#[inline(always)]
fn reduce(mut v: [f32; KC], f: impl Fn(f32, f32) -> f32) -> f32 {
    let mut width = KC / 2;
    while width > 0 {
        for j in 0..width {
            v[j] = f(v[j], v[j + width]);
        }
        width /= 2;
    }
    v[0]
}

/// Writes keys `kc[rows[j]..][..hd]` (`j < n`; zeros for the rest) transposed into `kt`
/// (`[hd][KC]`). Exact either way; the AVX-512 path does a 16 × 16 block in 64 shuffles
/// where the scalar loop moves 256 floats one by one, which mattered for decode, where a
/// tile has only a few query rows to share each chunk's transposition.
fn transpose_keys<T: KvElem>(
    kc: &[T],
    rows: &[usize; KC],
    n: usize,
    hd: usize,
    kt: &mut [f32],
    path: F32Path,
) {
    #[cfg(target_arch = "x86_64")]
    match path {
        F32Path::Avx512 if hd.is_multiple_of(KC) => {
            // SAFETY: `path` is one this CPU has (`F32Path::available`).
            unsafe { x86::transpose_keys(kc, rows, n, hd, kt) };
            return;
        }
        F32Path::Avx2 if hd.is_multiple_of(8) => {
            // SAFETY: as above (AVX2 paths need F16C too, `has_avx2_fma`).
            unsafe { x86::transpose_keys_avx2(kc, rows, n, hd, kt) };
            return;
        }
        _ => {}
    }
    let _ = path;
    // Each key widened a few elements at a time (`KvElem::widen`, vectorized where the type
    // needs it), then scattered into its column.
    let mut wide = [0f32; 8];
    for (j, &at) in rows.iter().enumerate() {
        if j >= n {
            (0..hd).for_each(|d| kt[d * KC + j] = 0.0);
            continue;
        }
        for (c, key) in kc[at..][..hd].chunks(wide.len()).enumerate() {
            T::widen(key, &mut wide[..key.len()]);
            for (i, &v) in wide[..key.len()].iter().enumerate() {
                kt[(c * wide.len() + i) * KC + j] = v;
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{KC, KvElem};

    /// 16 cache elements widened to f32 in one vector.
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn load16<T: KvElem>(src: &[T]) -> __m512 {
        assert!(src.len() >= KC);
        let p = src.as_ptr();
        // SAFETY: `src` holds at least KC elements, and each branch reads the type its dtype
        // names (`KvElem` is sealed: f32, f16 and bf16 only); unaligned loads.
        unsafe {
            match T::DTYPE {
                candle_core::DType::F16 => _mm512_cvtph_ps(_mm256_loadu_si256(p.cast::<__m256i>())),
                candle_core::DType::BF16 => _mm512_castsi512_ps(_mm512_slli_epi32::<16>(
                    _mm512_cvtepu16_epi32(_mm256_loadu_si256(p.cast::<__m256i>())),
                )),
                _ => _mm512_loadu_ps(p.cast::<f32>()),
            }
        }
    }

    /// 16 × 16 transposes: 32-bit and 64-bit interleaves, then two rounds of 128-bit lane
    /// shuffles.
    #[target_feature(enable = "avx512f")]
    pub(super) fn transpose_keys<T: KvElem>(
        kc: &[T],
        rows: &[usize; KC],
        n: usize,
        hd: usize,
        kt: &mut [f32],
    ) {
        for c in 0..hd / KC {
            let mut r = [_mm512_setzero_ps(); KC];
            for (j, v) in r.iter_mut().enumerate().take(n) {
                *v = load16(&kc[rows[j] + c * KC..][..KC]);
            }
            let mut t = [_mm512_setzero_ps(); KC];
            for i in 0..KC / 2 {
                t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
                t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
            }
            let mut u = [_mm512_setzero_ps(); KC];
            for i in 0..KC / 4 {
                let (a, b, c2, d) = (t[4 * i], t[4 * i + 1], t[4 * i + 2], t[4 * i + 3]);
                let lo = |x: __m512, y: __m512| {
                    _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(x), _mm512_castps_pd(y)))
                };
                let hi = |x: __m512, y: __m512| {
                    _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(x), _mm512_castps_pd(y)))
                };
                u[4 * i] = lo(a, c2);
                u[4 * i + 1] = hi(a, c2);
                u[4 * i + 2] = lo(b, d);
                u[4 * i + 3] = hi(b, d);
            }
            let mut v = [_mm512_setzero_ps(); KC];
            for i in 0..2 {
                for k in 0..4 {
                    let (x, y) = (u[8 * i + k], u[8 * i + 4 + k]);
                    v[8 * i + k] = _mm512_shuffle_f32x4::<0x88>(x, y);
                    v[8 * i + 4 + k] = _mm512_shuffle_f32x4::<0xdd>(x, y);
                }
            }
            for k in 0..8 {
                let out = [
                    _mm512_shuffle_f32x4::<0x88>(v[k], v[8 + k]),
                    _mm512_shuffle_f32x4::<0xdd>(v[k], v[8 + k]),
                ];
                for (h, o) in out.iter().enumerate() {
                    let d = c * KC + 8 * h + k;
                    let dst = &mut kt[d * KC..][..KC];
                    // SAFETY: `dst` holds KC floats.
                    unsafe { _mm512_storeu_ps(dst.as_mut_ptr(), *o) };
                }
            }
        }
    }

    /// 8 cache elements widened to f32 in one 256-bit vector.
    #[target_feature(enable = "avx2,f16c")]
    #[inline]
    fn load8<T: KvElem>(src: &[T]) -> __m256 {
        assert!(src.len() >= 8);
        let p = src.as_ptr();
        // SAFETY: `src` holds at least 8 elements, and each branch reads the type its dtype
        // names (`KvElem` is sealed: f32, f16 and bf16 only); unaligned loads.
        unsafe {
            match T::DTYPE {
                candle_core::DType::F16 => _mm256_cvtph_ps(_mm_loadu_si128(p.cast::<__m128i>())),
                candle_core::DType::BF16 => _mm256_castsi256_ps(_mm256_slli_epi32::<16>(
                    _mm256_cvtepu16_epi32(_mm_loadu_si128(p.cast::<__m128i>())),
                )),
                _ => _mm256_loadu_ps(p.cast::<f32>()),
            }
        }
    }

    /// [`transpose_keys`] in 8 × 8 blocks (two keys' groups of 8 by `hd / 8` dimension
    /// groups): 32-bit interleaves, 64-bit shuffles, then 128-bit lane swaps.
    #[target_feature(enable = "avx2,f16c")]
    pub(super) fn transpose_keys_avx2<T: KvElem>(
        kc: &[T],
        rows: &[usize; KC],
        n: usize,
        hd: usize,
        kt: &mut [f32],
    ) {
        for g in 0..KC / 8 {
            for c in 0..hd / 8 {
                let r: [__m256; 8] = std::array::from_fn(|i| {
                    let j = 8 * g + i;
                    if j < n {
                        load8(&kc[rows[j] + 8 * c..][..8])
                    } else {
                        _mm256_setzero_ps()
                    }
                });
                let t: [__m256; 8] = std::array::from_fn(|i| {
                    let (x, y) = (r[i / 2 * 2], r[i / 2 * 2 + 1]);
                    if i % 2 == 0 {
                        _mm256_unpacklo_ps(x, y)
                    } else {
                        _mm256_unpackhi_ps(x, y)
                    }
                });
                // Rows (a..h) in `t`: a0 b0 a1 b1 | a4 b4 a5 b5, a2 b2 a3 b3 | a6 b6 a7 b7, and
                // the same for c d, e f, g h; `u[4q + i]` holds column i (and i + 4) of rows
                // 4q..4q+4.
                let u: [__m256; 8] = std::array::from_fn(|i| {
                    let (q, i) = (i / 4, i % 4);
                    let (x, y) = (t[4 * q + i / 2], t[4 * q + 2 + i / 2]);
                    if i % 2 == 0 {
                        _mm256_shuffle_ps::<0x44>(x, y)
                    } else {
                        _mm256_shuffle_ps::<0xee>(x, y)
                    }
                });
                for k in 0..8 {
                    let (x, y) = (u[k % 4], u[4 + k % 4]);
                    let col = if k < 4 {
                        _mm256_permute2f128_ps::<0x20>(x, y)
                    } else {
                        _mm256_permute2f128_ps::<0x31>(x, y)
                    };
                    let dst = &mut kt[(8 * c + k) * KC + 8 * g..][..8];
                    // SAFETY: `dst` holds 8 floats.
                    unsafe { _mm256_storeu_ps(dst.as_mut_ptr(), col) };
                }
            }
        }
    }
}

/// The micro-tile written once over [`F32s`] and compiled per ISA by the entry points below.
mod vector {
    use super::{Chunk, KC, Rows, exp_approx};
    use crate::kernels::exp::exp;
    use crate::kernels::simd::*;
    use crate::kernels::softcap::softcap_vector;

    /// [`super::micro_tile_portable`] in vectors: each row's [`KC`] scores as `N` vectors of
    /// `S::LANES`, the portable path's operations lane for lane (fused multiply-adds in the same
    /// order, the same halving trees, the same exponential).
    ///
    /// # Safety
    /// The CPU has `S`'s features, and `N · S::LANES == KC`.
    // Rows and vectors index several register arrays at once; iterators would hide that.
    #[allow(clippy::needless_range_loop)]
    #[inline(always)]
    unsafe fn micro_tile<S: F32s, const R: usize, const N: usize>(c: &Chunk, s: Rows) {
        let (hd, lanes) = (c.hd, S::LANES);
        assert!(N * lanes == KC && hd.is_multiple_of(KC));
        assert!(c.q.len() >= R * hd && s.out.len() >= R * hd);
        assert!(c.kt.len() >= hd * KC && c.vs.len() >= KC * hd && s.m.len() >= R);
        // SAFETY: the caller checked `S`'s features. Every load and store below is of one
        // vector inside a row of KC (or hd, a multiple of KC) floats, as asserted above.
        unsafe {
            let mut sc = [[S::splat(0.0); N]; R];
            for d in 0..hd {
                let p = c.kt.as_ptr().add(d * KC);
                let kd: [S::V; N] = std::array::from_fn(|h| S::load(p.add(h * lanes)));
                for (i, si) in sc.iter_mut().enumerate() {
                    let qd = S::splat(c.q[i * hd + d]);
                    for h in 0..N {
                        si[h] = S::fma(qd, kd[h], si[h]);
                    }
                }
            }
            let mut e = [[0f32; KC]; R];
            let mut alpha = [0f32; R];
            let (mut jmin, mut jmax) = (KC, 0);
            let scale = S::splat(c.scale);
            for i in 0..R {
                let Some((jlo, jhi)) = c.ranges[i] else {
                    continue;
                };
                (jmin, jmax) = (jmin.min(jlo), jmax.max(jhi));
                let x: [S::V; N] = std::array::from_fn(|h| {
                    let mut scaled = S::mul(sc[i][h], scale);
                    if c.softcap > 0.0 {
                        scaled = softcap_vector::<S>(scaled, c.softcap);
                    }
                    S::keep_range(scaled, f32::NEG_INFINITY, h * lanes, jlo, jhi)
                });
                let mx = s.m[i].max(fold::<S, N>(x, |a, b| S::max(a, b)));
                let ei = x.map(|xh| exp::<S>(S::sub(xh, S::splat(mx))));
                alpha[i] = exp_approx(s.m[i] - mx);
                s.l[i] = s.l[i].mul_add(alpha[i], fold::<S, N>(ei, |a, b| S::add(a, b)));
                s.m[i] = mx;
                for h in 0..N {
                    S::store(e[i].as_mut_ptr().add(h * lanes), ei[h]);
                }
            }
            if jmin > jmax {
                return;
            }
            for ci in 0..hd / KC {
                let mut acc = [[S::splat(0.0); N]; R];
                for i in 0..R {
                    if c.ranges[i].is_some() {
                        let a = S::splat(alpha[i]);
                        let o = s.out.as_ptr().add(i * hd + ci * KC);
                        for h in 0..N {
                            acc[i][h] = S::mul(S::load(o.add(h * lanes)), a);
                        }
                    }
                }
                for j in jmin..=jmax {
                    let p = c.vs.as_ptr().add(j * hd + ci * KC);
                    let v: [S::V; N] = std::array::from_fn(|h| S::load(p.add(h * lanes)));
                    for (ai, ei) in acc.iter_mut().zip(&e) {
                        let pj = S::splat(ei[j]);
                        for h in 0..N {
                            ai[h] = S::fma(pj, v[h], ai[h]);
                        }
                    }
                }
                for (i, ai) in acc.iter().enumerate() {
                    if c.ranges[i].is_some() {
                        let o = s.out.as_mut_ptr().add(i * hd + ci * KC);
                        for h in 0..N {
                            S::store(o.add(h * lanes), ai[h]);
                        }
                    }
                }
            }
        }
    }

    /// # Safety
    /// The CPU has AVX-512F, and `hd` is a multiple of KC.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn avx512<const R: usize>(c: &Chunk, s: Rows) {
        // SAFETY: the caller checked AVX-512F; 1 × 16 lanes = KC.
        unsafe { micro_tile::<Avx512, R, 1>(c, s) }
    }

    /// # Safety
    /// The CPU has AVX2 and FMA, and `hd` is a multiple of KC.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn avx2<const R: usize>(c: &Chunk, s: Rows) {
        // SAFETY: the caller checked AVX2 and FMA; 2 × 8 lanes = KC.
        unsafe { micro_tile::<Avx2, R, 2>(c, s) }
    }

    /// # Safety
    /// `hd` is a multiple of KC (every ARM64 CPU has NEON).
    #[cfg(target_arch = "aarch64")]
    #[target_feature(enable = "neon")]
    pub(super) unsafe fn neon<const R: usize>(c: &Chunk, s: Rows) {
        // SAFETY: every ARM64 CPU has NEON; 4 × 4 lanes = KC.
        unsafe { micro_tile::<Neon, R, 4>(c, s) }
    }
}

/// Scores of `R` query rows (`[R][hd]`) against a chunk of keys transposed to `[hd][KC]`:
/// `s[i][j] = Σ_d q[i][d] · k[j][d]` as fused multiply-adds in `d` order. Every row does the
/// same operations whatever `R`, so a row's scores never depend on its neighbours.
#[inline(always)]
fn scores<const R: usize>(q: &[f32], kt: &[f32], hd: usize) -> [[f32; KC]; R] {
    let mut s = [[0f32; KC]; R];
    for d in 0..hd {
        let kd: &[f32; KC] = kt[d * KC..][..KC].try_into().expect("KC floats");
        for i in 0..R {
            let qd = q[i * hd + d];
            for j in 0..KC {
                s[i][j] = qd.mul_add(kd[j], s[i][j]);
            }
        }
    }
    s
}

/// Attention for tokens `t0..t1` (one sequence, consecutive positions) and kv head `g`, into
/// `out` rows `[t][h]` (`(t1 - t0) * group * hd` floats).
#[allow(clippy::too_many_arguments)]
pub fn tile<T: KvElem>(
    meta: &AttnMeta,
    q: &[f32],
    kc: &[T],
    vc: &[T],
    t0: usize,
    t1: usize,
    g: usize,
    out: &mut [f32],
) {
    SCRATCH.with(|cell| match cell.try_borrow_mut() {
        Ok(mut s) => tile_with(meta, q, kc, vc, (t0, t1, g), out, &mut s),
        // Only re-entry could find it borrowed, and nothing in a tile calls into rayon; a
        // fresh scratch keeps even that case correct.
        Err(_) => tile_with(meta, q, kc, vc, (t0, t1, g), out, &mut Scratch::default()),
    });
}

/// A tile's working rows, kept per thread: a decode step runs ~100 tiles per layer, and with
/// their own allocations each the two compute threads took turns at the allocator's lock.
#[derive(Default)]
struct Scratch {
    m: Vec<f32>,
    l: Vec<f32>,
    qs: Vec<f32>,
    kt: Vec<f32>,
    vs: Vec<f32>,
}

thread_local! {
    static SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::default();
}

/// `buf` cleared to `len` copies of `v`, keeping its capacity.
fn refill(buf: &mut Vec<f32>, len: usize, v: f32) -> &mut [f32] {
    buf.clear();
    buf.resize(len, v);
    buf
}

fn tile_with<T: KvElem>(
    meta: &AttnMeta,
    q: &[f32],
    kc: &[T],
    vc: &[T],
    (t0, t1, g): (usize, usize, usize),
    out: &mut [f32],
    scratch: &mut Scratch,
) {
    let (nh, kvh, hd) = (meta.num_heads, meta.num_kv_heads, meta.head_dim);
    let group = nh / kvh;
    let kv_dim = kvh * hd;
    let seq = meta.token_seq[t0] as usize;
    let rows = (t1 - t0) * group;
    // Per row: its query, valid key range, running max, sum and output.
    let pos = |r: usize| meta.token_pos[t0 + r / group] as usize;
    let Scratch { m, l, qs, kt, vs } = scratch;
    let m = refill(m, rows, f32::NEG_INFINITY);
    let l = refill(l, rows, 0.0);
    out.iter_mut().for_each(|v| *v = 0.0);
    let first = (t0..t1)
        .map(|t| meta.window_start(meta.token_pos[t] as usize))
        .min()
        .unwrap_or(0);
    let last = meta.token_pos[t1 - 1] as usize;
    // Chunks start at multiples of KC in position space, whatever the tile, so that a row's
    // operations never depend on the rows beside it.
    let qs = refill(qs, rows * hd, 0.0);
    for row in 0..rows {
        let (t, h) = (t0 + row / group, row % group);
        qs[row * hd..][..hd].copy_from_slice(&q[t * nh * hd + (g * group + h) * hd..][..hd]);
    }
    let kt = refill(kt, hd * KC, 0.0);
    let path = tile_path(hd);
    // The chunk's values widened to f32 once, `[KC][hd]`, for every micro-tile of the tile.
    let vs = refill(vs, KC * hd, 0.0);
    let mut c0 = first / KC * KC;
    while c0 <= last {
        let n = KC.min(last + 1 - c0);
        let mut krows = [0usize; KC];
        for j in 0..n {
            let at = meta.slot(seq, c0 + j) * kv_dim + g * hd;
            krows[j] = at;
            T::widen(&vc[at..][..hd], &mut vs[j * hd..][..hd]);
        }
        transpose_keys(kc, &krows, n, hd, kt, path);
        let mut r = 0;
        while r < rows {
            let take = RT.min(rows - r);
            // Each row's keys within this chunk (`None` when they all fall outside it).
            let ranges = std::array::from_fn(|i| {
                let p = (i < take).then(|| pos(r + i))?;
                let (lo, hi) = (meta.window_start(p).max(c0), p.min(c0 + n - 1));
                (lo <= hi).then(|| (lo - c0, hi - c0))
            });
            let chunk = Chunk {
                q: &qs[r * hd..(r + take) * hd],
                kt,
                vs,
                hd,
                scale: meta.scale,
                softcap: meta.softcap.unwrap_or(0.0),
                ranges,
            };
            let state = Rows {
                m: &mut m[r..r + take],
                l: &mut l[r..r + take],
                out: &mut out[r * hd..(r + take) * hd],
            };
            micro_tile(&chunk, state, path);
            r += take;
        }
        c0 += KC;
    }
    for row in 0..rows {
        let inv = 1.0 / l[row];
        out[row * hd..][..hd].iter_mut().for_each(|v| *v *= inv);
    }
}

/// One micro-tile's view of a chunk: up to [`RT`] query rows against [`KC`] keys.
struct Chunk<'a> {
    /// The rows' queries, `[rows][hd]`.
    q: &'a [f32],
    /// The chunk's keys transposed, `[hd][KC]`.
    kt: &'a [f32],
    /// The chunk's values, `[KC][hd]`.
    vs: &'a [f32],
    hd: usize,
    scale: f32,
    /// The scores' soft-cap (`kernels::softcap`); 0 for none.
    softcap: f32,
    /// Per row: the keys `lo..=hi` (chunk indices) it attends to in this chunk.
    ranges: [Option<(usize, usize)>; RT],
}

/// The online-softmax state of a micro-tile's rows: running max, sum and output `[rows][hd]`.
struct Rows<'a> {
    m: &'a mut [f32],
    l: &'a mut [f32],
    out: &'a mut [f32],
}

/// The micro-tile path for head size `hd`: the vector ones need it to be a multiple of [`KC`].
fn tile_path(hd: usize) -> F32Path {
    if hd.is_multiple_of(KC) {
        F32Path::best()
    } else {
        F32Path::Portable
    }
}

/// One online-softmax step of a micro-tile over a chunk, in vectors where `path` says so (the
/// compiler left the portable loops scalar: one `vfmadd231ss` per score). Every path does the
/// same operations in the same order for every row, whatever the other rows, so each is batch
/// invariant and they agree bit for bit.
fn micro_tile(c: &Chunk, s: Rows, path: F32Path) {
    macro_rules! rows {
        ($($f:ident)::+) => {
            match s.m.len() {
                1 => $($f)::+::<1>(c, s),
                2 => $($f)::+::<2>(c, s),
                3 => $($f)::+::<3>(c, s),
                _ => $($f)::+::<RT>(c, s),
            }
        };
    }
    match path {
        // SAFETY: `tile_path` chose a path this CPU has (`F32Path::available`), and only for
        // `hd` a multiple of KC.
        #[cfg(target_arch = "x86_64")]
        F32Path::Avx512 => unsafe { rows!(vector::avx512) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        F32Path::Avx2 => unsafe { rows!(vector::avx2) },
        // SAFETY: as above.
        #[cfg(target_arch = "aarch64")]
        F32Path::Neon => unsafe { rows!(vector::neon) },
        _ => rows!(micro_tile_portable),
    }
}

// Rows, keys and lanes index several arrays at once; iterators would hide that.
#[allow(clippy::needless_range_loop)]
fn micro_tile_portable<const R: usize>(c: &Chunk, s: Rows) {
    let hd = c.hd;
    let sc = scores::<R>(c.q, c.kt, hd);
    // Softmax step per row; rows whose keys all fall outside this chunk skip it.
    let mut e = [[0f32; KC]; R];
    let mut alpha = [0f32; R];
    let (mut jmin, mut jmax) = (KC, 0);
    for (i, si) in sc.iter().enumerate() {
        let Some((jlo, jhi)) = c.ranges[i] else {
            continue;
        };
        (jmin, jmax) = (jmin.min(jlo), jmax.max(jhi));
        // Masked lanes hold -inf, so their weights come out +0. Reductions are fixed
        // halving trees: the same order for every row, and on both paths.
        let mut x = [0f32; KC];
        for j in 0..KC {
            x[j] = if (jlo..=jhi).contains(&j) {
                let y = si[j] * c.scale;
                if c.softcap > 0.0 {
                    softcap(y, c.softcap)
                } else {
                    y
                }
            } else {
                f32::NEG_INFINITY
            };
        }
        let mx = s.m[i].max(reduce(x, f32::max));
        for j in 0..KC {
            e[i][j] = exp_approx(x[j] - mx);
        }
        alpha[i] = exp_approx(s.m[i] - mx);
        s.l[i] = s.l[i].mul_add(alpha[i], reduce(e[i], |a, b| a + b));
        s.m[i] = mx;
    }
    if jmin > jmax {
        return;
    }
    // o = o · alpha + Σ_j e_j · v_j, 16 output lanes of every row at a time, so each value
    // vector is loaded once and the rows' sums run side by side. A row's lanes outside its
    // own key range have weight +0, and adding +0 · v to a sum leaves its value unchanged (at
    // most a zero's sign), so the tile's range can serve every row.
    for ci in 0..hd.div_ceil(KC) {
        let w = KC.min(hd - ci * KC);
        let mut acc = [[0f32; KC]; R];
        for i in 0..R {
            if c.ranges[i].is_some() {
                let o = &s.out[i * hd + ci * KC..][..w];
                for d in 0..w {
                    acc[i][d] = o[d] * alpha[i];
                }
            }
        }
        for j in jmin..=jmax {
            let src = &c.vs[j * hd + ci * KC..][..w];
            // Full chunks are read in place (a partial one pads a copy).
            let mut padded = [0f32; KC];
            let v: &[f32; KC] = match src.try_into() {
                Ok(full) => full,
                Err(_) => {
                    padded[..w].copy_from_slice(src);
                    &padded
                }
            };
            for i in 0..R {
                let pj = e[i][j];
                for d in 0..KC {
                    acc[i][d] = pj.mul_add(v[d], acc[i][d]);
                }
            }
        }
        for i in 0..R {
            if c.ranges[i].is_some() {
                s.out[i * hd + ci * KC..][..w].copy_from_slice(&acc[i][..w]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferrite_testkit::random::values;
    use proptest::prelude::*;

    /// Every transposition this CPU has (AVX-512, AVX2, the widening scalar one) gives every
    /// key exactly, widened from each cache type; missing keys are zeros.
    #[test]
    fn fast_transpose_matches_scalar() {
        let hd = 64;
        // Integers up to 2^8 with a fraction bf16 keeps: exact in every type.
        let kc: Vec<f32> = (0..40 * hd).map(|i| (i % 251) as f32 * 0.5).collect();
        let rows: [usize; KC] = std::array::from_fn(|j| ((j * 7) % 40) * hd);
        let halves: Vec<f16> = kc.iter().map(|&x| f16::from_f32(x)).collect();
        let brains: Vec<bf16> = kc.iter().map(|&x| bf16::from_f32(x)).collect();
        for path in F32Path::available() {
            for n in [KC, 9, 5] {
                let mut kts = [
                    vec![f32::NAN; hd * KC],
                    vec![0.0; hd * KC],
                    vec![0.0; hd * KC],
                ];
                transpose_keys(&kc, &rows, n, hd, &mut kts[0], path);
                transpose_keys(&halves, &rows, n, hd, &mut kts[1], path);
                transpose_keys(&brains, &rows, n, hd, &mut kts[2], path);
                assert_eq!(kts[0], kts[1], "f16, n {n}, {path:?}");
                assert_eq!(kts[0], kts[2], "bf16, n {n}, {path:?}");
                let kt = &kts[0];
                for d in 0..hd {
                    for j in 0..KC {
                        let want = if j < n { kc[rows[j] + d] } else { 0.0 };
                        assert_eq!(
                            kt[d * KC + j],
                            want,
                            "n {n}, d {d}, key {j}, {path:?}: row {:?}",
                            &kt[d * KC..][..KC]
                        );
                    }
                }
            }
        }
    }

    /// The vector micro-tiles agree with the portable one bit for bit, for every row count,
    /// row ranges inside the chunk, inactive rows, running states from earlier chunks, with
    /// and without a soft-cap.
    /// Each path this CPU lacks is skipped (one line).
    #[test]
    fn vector_micro_tiles_match_portable() {
        for (path, isa, present) in F32Path::all() {
            if crate::kernels::isa_or_skip("vector_micro_tiles_match_portable", isa, present) {
                check_micro_tile(path);
            }
        }
    }

    fn check_micro_tile(path: F32Path) {
        proptest!(|(
            rows in 1usize..=RT,
            hd in prop::sample::select(vec![16usize, 64, 128]),
            ranges in prop::collection::vec(prop::option::of((0usize..KC, 0usize..KC)), RT),
            fresh in any::<bool>(),
            capped in any::<bool>(),
            seed in any::<u64>(),
        )| {
            let q = values(rows * hd, seed, 2.0);
            let kt = values(hd * KC, seed ^ 1, 2.0);
            let vs = values(KC * hd, seed ^ 2, 2.0);
            let ranges: [Option<(usize, usize)>; RT] = std::array::from_fn(|i| {
                ranges[i].filter(|_| i < rows).map(|(a, b)| (a.min(b), a.max(b)))
            });
            // A soft-cap of 1.5 bends every score of these (up to ~|8|) strongly.
            let softcap = if capped { 1.5 } else { 0.0 };
            let chunk = Chunk { q: &q, kt: &kt, vs: &vs, hd, scale: 0.125, softcap, ranges };
            let m0: Vec<f32> = if fresh {
                vec![f32::NEG_INFINITY; rows]
            } else {
                values(rows, seed ^ 3, 4.0)
            };
            let l0: Vec<f32> = values(rows, seed ^ 4, 1.0).iter().map(|x| x.abs()).collect();
            let o0 = if fresh { vec![0.0; rows * hd] } else { values(rows * hd, seed ^ 5, 1.0) };
            let mut got = Vec::new();
            for p in [F32Path::Portable, path] {
                let (mut m, mut l, mut out) = (m0.clone(), l0.clone(), o0.clone());
                micro_tile(&chunk, Rows { m: &mut m, l: &mut l, out: &mut out }, p);
                got.push((m, l, out));
            }
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            prop_assert_eq!(bits(&got[0].0), bits(&got[1].0), "running max");
            prop_assert_eq!(bits(&got[0].1), bits(&got[1].1), "running sum");
            prop_assert_eq!(bits(&got[0].2), bits(&got[1].2), "output");
        });
    }
}

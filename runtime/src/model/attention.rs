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
use crate::kv::layout::{cpu_key_index, keys_transposed};

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
        let expand = |rows: Tensor| -> Result<Tensor> {
            rows.to_dtype(q.dtype())?
                .reshape((ctx, kvh, hd))?
                .transpose(0, 1)?
                .unsqueeze(1)?
                .broadcast_as((kvh, group, ctx, hd))?
                .reshape((nh, ctx, hd))
        };
        let key_rows = if keys_transposed(device) {
            // Each element of each position's keys, where the CPU pool keeps it.
            let kv_dim = kvh * hd;
            let at: Vec<u32> = (0..ctx)
                .flat_map(|p| {
                    let slot = meta.slot(seq, p);
                    (0..kv_dim).map(move |c| cpu_key_index(slot, c, kv_dim, meta.block_size) as u32)
                })
                .collect();
            let at = Tensor::from_vec(at, ctx * kv_dim, device)?;
            k_cache
                .flatten_all()?
                .index_select(&at, 0)?
                .reshape((ctx, kv_dim))?
        } else {
            k_cache.index_select(&slots, 0)?
        };
        let k = expand(key_rows)?;
        let v = expand(v_cache.index_select(&slots, 0)?)?;
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

/// A CPU key pool: `[slots, kv_dim]` elements, each block transposed (`kv::layout`).
struct KeyPool<'a, T> {
    kc: &'a [T],
    kv_dim: usize,
    block_size: usize,
}

impl<T: KvElem> KeyPool<'_, T> {
    /// The chunk's keys in columns `col0..col0 + hd` (one kv head) at `slots[..n]`, widened
    /// into `kt` (`[hd][KC]`); zeros past `n`. Positions in consecutive slots of one block are
    /// one contiguous run per dimension in the pool, so a chunk inside a block is `hd` plain
    /// copies: the cached keys are never transposed at run time.
    fn gather(
        &self,
        slots: &[usize; KC],
        n: usize,
        col0: usize,
        hd: usize,
        kt: &mut [f32],
        path: F32Path,
    ) {
        let bs = self.block_size;
        let mut j = 0;
        while j < n {
            let start = slots[j];
            let mut len = 1;
            while j + len < n && slots[j + len] == start + len && !(start + len).is_multiple_of(bs)
            {
                len += 1;
            }
            let at = cpu_key_index(start, col0, self.kv_dim, bs);
            let run = &self.kc[at..][..(hd - 1) * bs + len];
            if len == KC {
                // A whole chunk inside one block: the common case, in vectors.
                widen_rows(run, bs, hd, kt, path);
            } else {
                for d in 0..hd {
                    T::widen(&run[d * bs..][..len], &mut kt[d * KC + j..][..len]);
                }
            }
            j += len;
        }
        if n < KC {
            for d in 0..hd {
                kt[d * KC + n..(d + 1) * KC].fill(0.0);
            }
        }
    }
}

/// `hd` rows of [`KC`] elements, `stride` apart in `src`, widened into `kt` (`[hd][KC]`): one
/// vector load, conversion and store per row where `path` has them. Exact on every path.
fn widen_rows<T: KvElem>(src: &[T], stride: usize, hd: usize, kt: &mut [f32], path: F32Path) {
    assert!(src.len() >= (hd - 1) * stride + KC && kt.len() >= hd * KC);
    #[cfg(target_arch = "x86_64")]
    match path {
        // SAFETY: `path` is one this CPU has (`F32Path::available`); bounds asserted above.
        F32Path::Avx512 => return unsafe { x86::widen_rows_avx512(src, stride, hd, kt) },
        // SAFETY: as above (the AVX2 path needs F16C too, `has_avx2_fma`).
        F32Path::Avx2 => return unsafe { x86::widen_rows_avx2(src, stride, hd, kt) },
        _ => {}
    }
    let _ = path;
    for d in 0..hd {
        T::widen(&src[d * stride..][..KC], &mut kt[d * KC..][..KC]);
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{KC, KvElem};

    /// [`super::widen_rows`] in 512-bit vectors (16 lanes: one row each).
    ///
    /// # Safety
    /// The CPU has AVX-512F; `src` holds `(hd - 1) · stride + KC` elements and `kt` `hd · KC`.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn widen_rows_avx512<T: KvElem>(
        src: &[T],
        stride: usize,
        hd: usize,
        kt: &mut [f32],
    ) {
        for d in 0..hd {
            // SAFETY: the caller's bounds; each branch reads the type its dtype names
            // (`KvElem` is sealed: f32, f16 and bf16 only); unaligned loads.
            unsafe {
                let p = src.as_ptr().add(d * stride);
                let v = match T::DTYPE {
                    candle_core::DType::F16 => {
                        _mm512_cvtph_ps(_mm256_loadu_si256(p.cast::<__m256i>()))
                    }
                    candle_core::DType::BF16 => _mm512_castsi512_ps(_mm512_slli_epi32::<16>(
                        _mm512_cvtepu16_epi32(_mm256_loadu_si256(p.cast::<__m256i>())),
                    )),
                    _ => _mm512_loadu_ps(p.cast::<f32>()),
                };
                _mm512_storeu_ps(kt.as_mut_ptr().add(d * KC), v);
            }
        }
    }

    /// [`super::widen_rows`] in 256-bit vectors (two per row).
    ///
    /// # Safety
    /// The CPU has AVX2 and F16C; bounds as [`widen_rows_avx512`].
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn widen_rows_avx2<T: KvElem>(
        src: &[T],
        stride: usize,
        hd: usize,
        kt: &mut [f32],
    ) {
        for d in 0..hd {
            for h in 0..KC / 8 {
                // SAFETY: as above.
                unsafe {
                    let p = src.as_ptr().add(d * stride + 8 * h);
                    let v = match T::DTYPE {
                        candle_core::DType::F16 => {
                            _mm256_cvtph_ps(_mm_loadu_si128(p.cast::<__m128i>()))
                        }
                        candle_core::DType::BF16 => _mm256_castsi256_ps(_mm256_slli_epi32::<16>(
                            _mm256_cvtepu16_epi32(_mm_loadu_si128(p.cast::<__m128i>())),
                        )),
                        _ => _mm256_loadu_ps(p.cast::<f32>()),
                    };
                    _mm256_storeu_ps(kt.as_mut_ptr().add(d * KC + 8 * h), v);
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
    let keys = KeyPool {
        kc,
        kv_dim,
        block_size: meta.block_size,
    };
    let mut c0 = first / KC * KC;
    while c0 <= last {
        prefetch_chunk(meta, seq, c0 + KC, last, (g, hd, kv_dim), kc, vc);
        let n = KC.min(last + 1 - c0);
        let mut slots = [0usize; KC];
        for (j, slot) in slots.iter_mut().enumerate().take(n) {
            *slot = meta.slot(seq, c0 + j);
            T::widen(
                &vc[*slot * kv_dim + g * hd..][..hd],
                &mut vs[j * hd..][..hd],
            );
        }
        keys.gather(&slots, n, g * hd, hd, kt, path);
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

/// Prefetches kv head `g`'s keys and values of the chunk at `c0` (nothing past `last`), so that
/// they arrive while the chunk before is computed: a step reads every cached key and value
/// once per layer, from L3 or memory at batch 32 (`perf` had the tile waiting on those loads).
fn prefetch_chunk<T>(
    meta: &AttnMeta,
    seq: usize,
    c0: usize,
    last: usize,
    (g, hd, kv_dim): (usize, usize, usize),
    kc: &[T],
    vc: &[T],
) {
    if c0 > last {
        return;
    }
    use crate::kernels::prefetch;
    let line = 64 / size_of::<T>().max(1);
    let keys = cpu_key_index(meta.slot(seq, c0), g * hd, kv_dim, meta.block_size);
    for d in 0..hd {
        prefetch(kc.as_ptr().wrapping_add(keys + d * meta.block_size));
    }
    for j in 0..KC.min(last + 1 - c0) {
        let at = meta.slot(seq, c0 + j) * kv_dim + g * hd;
        for e in (0..hd).step_by(line) {
            prefetch(vc.as_ptr().wrapping_add(at + e));
        }
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

    /// Gathering a chunk's keys from a pool written through the layout's index gives every
    /// key exactly, widened from each cache type, across block boundaries and out-of-order
    /// blocks; missing keys are zeros.
    #[test]
    fn gathered_keys_are_the_keys_written() {
        let (hd, kvh) = (64, 2);
        let kv_dim = hd * kvh;
        // Integers up to 2^8 with a fraction bf16 keeps: exact in every type.
        let key = |slot: usize, col: usize| ((slot * 31 + col) % 251) as f32 * 0.5;
        // Blocks of 8, slots 20..28 then 8..16: consecutive numbers across a block's end
        // (20..24 is block 2, 24..28 block 3) must still break the run there, and so must the
        // jump. Blocks of 16, slots 16..32: one whole run, the vector paths' case.
        let cases: [(usize, [usize; KC]); 2] = [
            (8, std::array::from_fn(|j| if j < 8 { 20 + j } else { j })),
            (16, std::array::from_fn(|j| 16 + j)),
        ];
        for (bs, slots) in cases {
            let mut kc = vec![0f32; 5 * bs * kv_dim];
            for slot in 0..5 * bs {
                for col in 0..kv_dim {
                    kc[cpu_key_index(slot, col, kv_dim, bs)] = key(slot, col);
                }
            }
            let halves: Vec<f16> = kc.iter().map(|&x| f16::from_f32(x)).collect();
            let brains: Vec<bf16> = kc.iter().map(|&x| bf16::from_f32(x)).collect();
            for path in F32Path::available() {
                for n in [KC, 9, 5] {
                    for g in 0..kvh {
                        let col0 = g * hd;
                        let mut kts = [
                            vec![f32::NAN; hd * KC],
                            vec![f32::NAN; hd * KC],
                            vec![0.0; hd * KC],
                        ];
                        let block_size = bs;
                        KeyPool {
                            kc: &kc[..],
                            kv_dim,
                            block_size,
                        }
                        .gather(&slots, n, col0, hd, &mut kts[0], path);
                        KeyPool {
                            kc: &halves[..],
                            kv_dim,
                            block_size,
                        }
                        .gather(&slots, n, col0, hd, &mut kts[1], path);
                        KeyPool {
                            kc: &brains[..],
                            kv_dim,
                            block_size,
                        }
                        .gather(&slots, n, col0, hd, &mut kts[2], path);
                        let case = format!("blocks of {bs}, n {n}, head {g}, {path:?}");
                        assert_eq!(kts[0], kts[1], "f16, {case}");
                        assert_eq!(kts[0], kts[2], "bf16, {case}");
                        for d in 0..hd {
                            for j in 0..KC {
                                let want = if j < n { key(slots[j], col0 + d) } else { 0.0 };
                                assert_eq!(kts[0][d * KC + j], want, "{case}, d {d}, key {j}");
                            }
                        }
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

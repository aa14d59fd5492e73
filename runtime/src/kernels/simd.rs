//! One f32 vector interface over the instruction sets the CPU kernels use: AVX-512F, AVX2 +
//! FMA and ARM64 NEON. A kernel that does the same operations on every ISA is written once,
//! generic over [`F32s`] and `#[inline(always)]`, and compiled per ISA inside a
//! `#[target_feature]` entry point (which is where the methods inline).
//!
//! Each method is the lane-wise form of one scalar f32 operation (IEEE add, multiply, divide,
//! fused multiply-add, round half to even), so a kernel written over it does, lane for lane,
//! what its portable loop does and gives the same bits; the kernels' tests check every path
//! this CPU has against those loops.

/// Which vector path the f32 kernels (attention micro-tile, SwiGLU, exponential) take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum F32Path {
    /// 16 lanes.
    Avx512,
    /// 8 lanes, with FMA.
    Avx2,
    /// 4 lanes (every ARM64 CPU has NEON and FMA).
    Neon,
    /// Plain Rust, the reference.
    Portable,
}

impl F32Path {
    /// The widest path this CPU has at or below [`super::ISA_CAP_VAR`]'s cap, once per process.
    pub fn best() -> F32Path {
        static BEST: std::sync::OnceLock<F32Path> = std::sync::OnceLock::new();
        *BEST.get_or_init(|| {
            let floor = super::Cap::from_env().map_or(0, |c| c.f32.rank());
            super::at_or_below(F32Path::available(), F32Path::rank, floor)
                .unwrap_or(F32Path::Portable)
        })
    }

    /// Place in this architecture's order, widest first.
    fn rank(self) -> u8 {
        match self {
            F32Path::Avx512 | F32Path::Neon => 0,
            F32Path::Avx2 => 1,
            F32Path::Portable => 2,
        }
    }

    /// Every path this CPU can run, widest first (tests compare them all).
    pub fn available() -> Vec<F32Path> {
        let mut paths = Vec::new();
        if super::has_avx512f() {
            paths.push(F32Path::Avx512);
        }
        if super::has_avx2_fma() {
            paths.push(F32Path::Avx2);
        }
        if cfg!(target_arch = "aarch64") {
            paths.push(F32Path::Neon);
        }
        paths.push(F32Path::Portable);
        paths
    }

    /// Every vector path of this architecture, with whether this CPU has it (tests skip the
    /// ones it lacks with one line).
    #[cfg(test)]
    pub(crate) fn all() -> Vec<(F32Path, &'static str, bool)> {
        let have = F32Path::available();
        let paths: &[(F32Path, &str)] = if cfg!(target_arch = "aarch64") {
            &[(F32Path::Neon, "NEON")]
        } else if cfg!(target_arch = "x86_64") {
            &[
                (F32Path::Avx512, "AVX-512F"),
                (F32Path::Avx2, "AVX2 and FMA"),
            ]
        } else {
            &[]
        };
        paths
            .iter()
            .map(|&(p, name)| (p, name, have.contains(&p)))
            .collect()
    }
}

/// f32 vectors of one instruction set. Implementors are unit types; every method needs the
/// CPU features its type names, which callers check (through [`F32Path`]) before entering.
pub(crate) trait F32s {
    /// Lanes per vector.
    const LANES: usize;
    type V: Copy;

    /// # Safety
    /// For this and every method: the CPU has the implementor's features.
    unsafe fn splat(x: f32) -> Self::V;
    /// # Safety
    /// `p` is valid for reading [`F32s::LANES`] floats (unaligned is fine).
    unsafe fn load(p: *const f32) -> Self::V;
    /// [`F32s::LANES`] bfloat16 values (their bits) widened to f32, exactly.
    ///
    /// # Safety
    /// `p` is valid for reading [`F32s::LANES`] `u16`s (unaligned is fine).
    unsafe fn load_bf16(p: *const u16) -> Self::V;
    /// # Safety
    /// `p` is valid for writing [`F32s::LANES`] floats (unaligned is fine).
    unsafe fn store(p: *mut f32, v: Self::V);
    /// # Safety
    /// As [`F32s::splat`].
    unsafe fn add(a: Self::V, b: Self::V) -> Self::V;
    /// # Safety
    /// As [`F32s::splat`].
    unsafe fn sub(a: Self::V, b: Self::V) -> Self::V;
    /// # Safety
    /// As [`F32s::splat`].
    unsafe fn mul(a: Self::V, b: Self::V) -> Self::V;
    /// # Safety
    /// As [`F32s::splat`].
    unsafe fn div(a: Self::V, b: Self::V) -> Self::V;
    /// `a · b + c`, rounded once (`f32::mul_add`).
    ///
    /// # Safety
    /// As [`F32s::splat`].
    unsafe fn fma(a: Self::V, b: Self::V, c: Self::V) -> Self::V;
    /// `f32::max` on lanes that are not NaN.
    ///
    /// # Safety
    /// As [`F32s::splat`].
    unsafe fn max(a: Self::V, b: Self::V) -> Self::V;
    /// `f32::min` on lanes that are not NaN.
    ///
    /// # Safety
    /// As [`F32s::splat`].
    unsafe fn min(a: Self::V, b: Self::V) -> Self::V;
    /// `f32::round_ties_even`.
    ///
    /// # Safety
    /// As [`F32s::splat`].
    unsafe fn round_even(v: Self::V) -> Self::V;
    /// `2^n` for integral `n` in -126..=127, built from the exponent bits.
    ///
    /// # Safety
    /// As [`F32s::splat`].
    unsafe fn pow2(n: Self::V) -> Self::V;
    /// `v`, with `+0` in the lanes where `x < limit` (false for NaN).
    ///
    /// # Safety
    /// As [`F32s::splat`].
    unsafe fn zero_below(x: Self::V, limit: Self::V, v: Self::V) -> Self::V;
    /// `v` in the lanes whose index `first + lane` lies in `lo..=hi`, `fill` elsewhere.
    ///
    /// # Safety
    /// As [`F32s::splat`].
    unsafe fn keep_range(v: Self::V, fill: f32, first: usize, lo: usize, hi: usize) -> Self::V;
    /// The portable halving tree inside one vector: lanes `j` and `j + LANES/2` with `f`, then
    /// `j + LANES/4`, …, `j + 1`; lane 0's result.
    ///
    /// # Safety
    /// As [`F32s::splat`].
    unsafe fn fold_lanes(v: Self::V, f: impl Fn(Self::V, Self::V) -> Self::V) -> f32;
}

/// The portable halving tree over `N` vectors holding `N · LANES` consecutive values: vector
/// `j` with `j + N/2` (lanes `i` and `i + N·LANES/2`), and so on down to one vector, then
/// [`F32s::fold_lanes`].
///
/// # Safety
/// The CPU has `S`'s features.
#[inline(always)]
pub(crate) unsafe fn fold<S: F32s, const N: usize>(
    mut v: [S::V; N],
    f: impl Fn(S::V, S::V) -> S::V,
) -> f32 {
    debug_assert!(N.is_power_of_two());
    let mut n = N;
    while n > 1 {
        n /= 2;
        for j in 0..n {
            v[j] = f(v[j], v[j + n]);
        }
    }
    // SAFETY: the caller checked `S`'s features.
    unsafe { S::fold_lanes(v[0], f) }
}

#[cfg(target_arch = "x86_64")]
pub(crate) use x86::{Avx2, Avx512};

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::F32s;

    /// 512-bit vectors; needs AVX-512F.
    #[derive(Debug, Clone, Copy)]
    pub(crate) struct Avx512;

    /// 256-bit vectors; needs AVX2 and FMA.
    #[derive(Debug, Clone, Copy)]
    pub(crate) struct Avx2;

    impl F32s for Avx512 {
        const LANES: usize = 16;
        type V = __m512;

        #[inline]
        #[target_feature(enable = "avx512f")]
        unsafe fn splat(x: f32) -> __m512 {
            _mm512_set1_ps(x)
        }
        #[inline]
        #[target_feature(enable = "avx512f")]
        unsafe fn load(p: *const f32) -> __m512 {
            // SAFETY: the caller passes 16 readable floats.
            unsafe { _mm512_loadu_ps(p) }
        }
        #[inline]
        #[target_feature(enable = "avx512f")]
        unsafe fn load_bf16(p: *const u16) -> __m512 {
            // SAFETY: the caller passes 16 readable values.
            let h = unsafe { _mm256_loadu_si256(p.cast()) };
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
        }
        #[inline]
        #[target_feature(enable = "avx512f")]
        unsafe fn store(p: *mut f32, v: __m512) {
            // SAFETY: the caller passes room for 16 floats.
            unsafe { _mm512_storeu_ps(p, v) }
        }
        #[inline]
        #[target_feature(enable = "avx512f")]
        unsafe fn add(a: __m512, b: __m512) -> __m512 {
            _mm512_add_ps(a, b)
        }
        #[inline]
        #[target_feature(enable = "avx512f")]
        unsafe fn sub(a: __m512, b: __m512) -> __m512 {
            _mm512_sub_ps(a, b)
        }
        #[inline]
        #[target_feature(enable = "avx512f")]
        unsafe fn mul(a: __m512, b: __m512) -> __m512 {
            _mm512_mul_ps(a, b)
        }
        #[inline]
        #[target_feature(enable = "avx512f")]
        unsafe fn div(a: __m512, b: __m512) -> __m512 {
            _mm512_div_ps(a, b)
        }
        #[inline]
        #[target_feature(enable = "avx512f")]
        unsafe fn fma(a: __m512, b: __m512, c: __m512) -> __m512 {
            _mm512_fmadd_ps(a, b, c)
        }
        #[inline]
        #[target_feature(enable = "avx512f")]
        unsafe fn max(a: __m512, b: __m512) -> __m512 {
            _mm512_max_ps(a, b)
        }
        #[inline]
        #[target_feature(enable = "avx512f")]
        unsafe fn min(a: __m512, b: __m512) -> __m512 {
            _mm512_min_ps(a, b)
        }
        #[inline]
        #[target_feature(enable = "avx512f")]
        unsafe fn round_even(v: __m512) -> __m512 {
            _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(v)
        }
        #[inline]
        #[target_feature(enable = "avx512f")]
        unsafe fn pow2(n: __m512) -> __m512 {
            let biased = _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127));
            _mm512_castsi512_ps(_mm512_slli_epi32::<23>(biased))
        }
        #[inline]
        #[target_feature(enable = "avx512f")]
        unsafe fn zero_below(x: __m512, limit: __m512, v: __m512) -> __m512 {
            _mm512_maskz_mov_ps(!_mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, limit), v)
        }
        #[inline]
        #[target_feature(enable = "avx512f")]
        unsafe fn keep_range(v: __m512, fill: f32, first: usize, lo: usize, hi: usize) -> __m512 {
            let lanes = _mm512_add_epi32(
                _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                _mm512_set1_epi32(first as i32),
            );
            let inside = _mm512_cmpge_epi32_mask(lanes, _mm512_set1_epi32(lo as i32))
                & _mm512_cmple_epi32_mask(lanes, _mm512_set1_epi32(hi as i32));
            _mm512_mask_blend_ps(inside, _mm512_set1_ps(fill), v)
        }
        #[inline]
        #[target_feature(enable = "avx512f")]
        unsafe fn fold_lanes(v: __m512, f: impl Fn(__m512, __m512) -> __m512) -> f32 {
            let v = f(v, _mm512_shuffle_f32x4::<0b01_00_11_10>(v, v));
            let v = f(v, _mm512_shuffle_f32x4::<0b10_11_00_01>(v, v));
            let v = f(v, _mm512_permute_ps::<0b01_00_11_10>(v));
            _mm512_cvtss_f32(f(v, _mm512_permute_ps::<0b10_11_00_01>(v)))
        }
    }

    impl F32s for Avx2 {
        const LANES: usize = 8;
        type V = __m256;

        #[inline]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn splat(x: f32) -> __m256 {
            _mm256_set1_ps(x)
        }
        #[inline]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn load(p: *const f32) -> __m256 {
            // SAFETY: the caller passes 8 readable floats.
            unsafe { _mm256_loadu_ps(p) }
        }
        #[inline]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn load_bf16(p: *const u16) -> __m256 {
            // SAFETY: the caller passes 8 readable values.
            let h = unsafe { _mm_loadu_si128(p.cast()) };
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
        }
        #[inline]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn store(p: *mut f32, v: __m256) {
            // SAFETY: the caller passes room for 8 floats.
            unsafe { _mm256_storeu_ps(p, v) }
        }
        #[inline]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn add(a: __m256, b: __m256) -> __m256 {
            _mm256_add_ps(a, b)
        }
        #[inline]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn sub(a: __m256, b: __m256) -> __m256 {
            _mm256_sub_ps(a, b)
        }
        #[inline]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn mul(a: __m256, b: __m256) -> __m256 {
            _mm256_mul_ps(a, b)
        }
        #[inline]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn div(a: __m256, b: __m256) -> __m256 {
            _mm256_div_ps(a, b)
        }
        #[inline]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn fma(a: __m256, b: __m256, c: __m256) -> __m256 {
            _mm256_fmadd_ps(a, b, c)
        }
        #[inline]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn max(a: __m256, b: __m256) -> __m256 {
            _mm256_max_ps(a, b)
        }
        #[inline]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn min(a: __m256, b: __m256) -> __m256 {
            _mm256_min_ps(a, b)
        }
        #[inline]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn round_even(v: __m256) -> __m256 {
            _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(v)
        }
        #[inline]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn pow2(n: __m256) -> __m256 {
            let biased = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
            _mm256_castsi256_ps(_mm256_slli_epi32::<23>(biased))
        }
        #[inline]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn zero_below(x: __m256, limit: __m256, v: __m256) -> __m256 {
            _mm256_and_ps(_mm256_cmp_ps::<_CMP_NLT_UQ>(x, limit), v)
        }
        #[inline]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn keep_range(v: __m256, fill: f32, first: usize, lo: usize, hi: usize) -> __m256 {
            let lanes = _mm256_add_epi32(
                _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                _mm256_set1_epi32(first as i32),
            );
            let inside = _mm256_and_si256(
                _mm256_cmpgt_epi32(lanes, _mm256_set1_epi32(lo as i32 - 1)),
                _mm256_cmpgt_epi32(_mm256_set1_epi32(hi as i32 + 1), lanes),
            );
            _mm256_blendv_ps(_mm256_set1_ps(fill), v, _mm256_castsi256_ps(inside))
        }
        #[inline]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn fold_lanes(v: __m256, f: impl Fn(__m256, __m256) -> __m256) -> f32 {
            let v = f(v, _mm256_permute2f128_ps::<1>(v, v));
            let v = f(v, _mm256_permute_ps::<0b01_00_11_10>(v));
            _mm256_cvtss_f32(f(v, _mm256_permute_ps::<0b10_11_00_01>(v)))
        }
    }
}

#[cfg(target_arch = "aarch64")]
pub(crate) use arm::Neon;

#[cfg(target_arch = "aarch64")]
mod arm {
    use std::arch::aarch64::*;

    use super::F32s;

    /// 128-bit vectors; every ARM64 CPU has them (and fused multiply-add).
    #[derive(Debug, Clone, Copy)]
    pub(crate) struct Neon;

    impl F32s for Neon {
        const LANES: usize = 4;
        type V = float32x4_t;

        #[inline]
        #[target_feature(enable = "neon")]
        unsafe fn splat(x: f32) -> float32x4_t {
            vdupq_n_f32(x)
        }
        #[inline]
        #[target_feature(enable = "neon")]
        unsafe fn load(p: *const f32) -> float32x4_t {
            // SAFETY: the caller passes 4 readable floats.
            unsafe { vld1q_f32(p) }
        }
        #[inline]
        #[target_feature(enable = "neon")]
        unsafe fn load_bf16(p: *const u16) -> float32x4_t {
            // SAFETY: the caller passes 4 readable values.
            unsafe { vreinterpretq_f32_u32(vshll_n_u16::<16>(vld1_u16(p))) }
        }
        #[inline]
        #[target_feature(enable = "neon")]
        unsafe fn store(p: *mut f32, v: float32x4_t) {
            // SAFETY: the caller passes room for 4 floats.
            unsafe { vst1q_f32(p, v) }
        }
        #[inline]
        #[target_feature(enable = "neon")]
        unsafe fn add(a: float32x4_t, b: float32x4_t) -> float32x4_t {
            vaddq_f32(a, b)
        }
        #[inline]
        #[target_feature(enable = "neon")]
        unsafe fn sub(a: float32x4_t, b: float32x4_t) -> float32x4_t {
            vsubq_f32(a, b)
        }
        #[inline]
        #[target_feature(enable = "neon")]
        unsafe fn mul(a: float32x4_t, b: float32x4_t) -> float32x4_t {
            vmulq_f32(a, b)
        }
        #[inline]
        #[target_feature(enable = "neon")]
        unsafe fn div(a: float32x4_t, b: float32x4_t) -> float32x4_t {
            vdivq_f32(a, b)
        }
        #[inline]
        #[target_feature(enable = "neon")]
        unsafe fn fma(a: float32x4_t, b: float32x4_t, c: float32x4_t) -> float32x4_t {
            // vfmaq_f32(acc, x, y) = acc + x · y, rounded once.
            vfmaq_f32(c, a, b)
        }
        #[inline]
        #[target_feature(enable = "neon")]
        unsafe fn max(a: float32x4_t, b: float32x4_t) -> float32x4_t {
            vmaxnmq_f32(a, b)
        }
        #[inline]
        #[target_feature(enable = "neon")]
        unsafe fn min(a: float32x4_t, b: float32x4_t) -> float32x4_t {
            vminnmq_f32(a, b)
        }
        #[inline]
        #[target_feature(enable = "neon")]
        unsafe fn round_even(v: float32x4_t) -> float32x4_t {
            vrndnq_f32(v)
        }
        #[inline]
        #[target_feature(enable = "neon")]
        unsafe fn pow2(n: float32x4_t) -> float32x4_t {
            let biased = vaddq_s32(vcvtnq_s32_f32(n), vdupq_n_s32(127));
            vreinterpretq_f32_s32(vshlq_n_s32::<23>(biased))
        }
        #[inline]
        #[target_feature(enable = "neon")]
        unsafe fn zero_below(x: float32x4_t, limit: float32x4_t, v: float32x4_t) -> float32x4_t {
            vbslq_f32(vcltq_f32(x, limit), vdupq_n_f32(0.0), v)
        }
        #[inline]
        #[target_feature(enable = "neon")]
        unsafe fn keep_range(
            v: float32x4_t,
            fill: f32,
            first: usize,
            lo: usize,
            hi: usize,
        ) -> float32x4_t {
            let index = [0u32, 1, 2, 3];
            // SAFETY: `index` holds 4 u32.
            let lanes = vaddq_u32(
                unsafe { vld1q_u32(index.as_ptr()) },
                vdupq_n_u32(first as u32),
            );
            let inside = vandq_u32(
                vcgeq_u32(lanes, vdupq_n_u32(lo as u32)),
                vcleq_u32(lanes, vdupq_n_u32(hi as u32)),
            );
            vbslq_f32(inside, v, vdupq_n_f32(fill))
        }
        #[inline]
        #[target_feature(enable = "neon")]
        unsafe fn fold_lanes(
            v: float32x4_t,
            f: impl Fn(float32x4_t, float32x4_t) -> float32x4_t,
        ) -> f32 {
            let v = f(v, vextq_f32::<2>(v, v));
            vgetq_lane_f32::<0>(f(v, vextq_f32::<1>(v, v)))
        }
    }
}

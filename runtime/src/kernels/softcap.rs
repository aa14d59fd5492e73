//! Soft-capping, `cap · tanh(x / cap)`: Gemma 2's attention scores (inside the attention
//! micro-tile) and Gemma's logits. `tanh(u) = 1 − 2 / (1 + e^{2u})` through the shared
//! [`exp_approx`], so the vector code does the same operations as the scalar and gives the same
//! bits; about 1e-6 of `cap` from the exact value. candle's `tanh` is a libm call per element:
//! over a batch of 32 rows of a 50k vocabulary it cost a decode step 40%.

use rayon::prelude::*;

use super::exp::{EXP_MAX, exp, exp_approx};
use super::simd::{F32Path, F32s};

/// `cap · tanh(y / cap)`.
#[inline(always)]
pub(crate) fn softcap(y: f32, cap: f32) -> f32 {
    let e = exp_approx((y * (2.0 / cap)).min(EXP_MAX));
    cap * (1.0 - 2.0 / (1.0 + e))
}

/// [`softcap`] on one vector, operation for operation.
///
/// # Safety
/// The CPU has `S`'s features.
#[inline(always)]
pub(crate) unsafe fn softcap_vector<S: F32s>(y: S::V, cap: f32) -> S::V {
    // SAFETY: the caller checked `S`'s features.
    unsafe {
        let z = S::min(S::mul(y, S::splat(2.0 / cap)), S::splat(EXP_MAX));
        let e = exp::<S>(z);
        let t = S::sub(
            S::splat(1.0),
            S::div(S::splat(2.0), S::add(S::splat(1.0), e)),
        );
        S::mul(S::splat(cap), t)
    }
}

/// Elements a thread takes at least (a decode step's logits split across the pool).
const PAR_CHUNK: usize = 16 * 1024;

/// Every element of `xs` soft-capped at `cap`, in place.
pub fn softcap_in_place(xs: &mut [f32], cap: f32) {
    let path = F32Path::best();
    xs.par_chunks_mut(PAR_CHUNK)
        .for_each(|chunk| run(path, chunk, cap));
}

/// One run of elements on `path`, which must be one [`F32Path::available`] lists.
fn run(path: F32Path, xs: &mut [f32], cap: f32) {
    match path {
        // SAFETY: `path` is one this CPU has (`F32Path::available`).
        #[cfg(target_arch = "x86_64")]
        F32Path::Avx512 => unsafe { vector::avx512(xs, cap) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        F32Path::Avx2 => unsafe { vector::avx2(xs, cap) },
        // SAFETY: as above.
        #[cfg(target_arch = "aarch64")]
        F32Path::Neon => unsafe { vector::neon(xs, cap) },
        _ => xs.iter_mut().for_each(|x| *x = softcap(*x, cap)),
    }
}

mod vector {
    use super::{softcap, softcap_vector};
    use crate::kernels::simd::*;

    /// Whole vectors through [`softcap_vector`], the tail through [`softcap`] (the same bits).
    ///
    /// # Safety
    /// The CPU has `S`'s features.
    #[inline(always)]
    unsafe fn run<S: F32s>(xs: &mut [f32], cap: f32) {
        let lanes = S::LANES;
        let whole = xs.len() / lanes * lanes;
        // SAFETY: the caller checked `S`'s features; each vector lies inside `xs[..whole]`.
        unsafe {
            for i in (0..whole).step_by(lanes) {
                let p = xs.as_mut_ptr().add(i);
                S::store(p, softcap_vector::<S>(S::load(p), cap));
            }
        }
        for x in &mut xs[whole..] {
            *x = softcap(*x, cap);
        }
    }

    /// # Safety
    /// The CPU has AVX-512F.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn avx512(xs: &mut [f32], cap: f32) {
        // SAFETY: the caller checked AVX-512F.
        unsafe { run::<Avx512>(xs, cap) }
    }

    /// # Safety
    /// The CPU has AVX2 and FMA.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn avx2(xs: &mut [f32], cap: f32) {
        // SAFETY: the caller checked AVX2 and FMA.
        unsafe { run::<Avx2>(xs, cap) }
    }

    /// # Safety
    /// None beyond an ARM64 CPU, which always has NEON.
    #[cfg(target_arch = "aarch64")]
    #[target_feature(enable = "neon")]
    pub(super) unsafe fn neon(xs: &mut [f32], cap: f32) {
        // SAFETY: every ARM64 CPU has NEON.
        unsafe { run::<Neon>(xs, cap) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn softcap_is_cap_tanh() {
        for cap in [1.5f32, 30.0, 50.0] {
            for i in -400..=400 {
                let y = i as f32 * 0.37;
                let want = f64::from(cap) * (f64::from(y) / f64::from(cap)).tanh();
                let got = f64::from(softcap(y, cap));
                assert!(
                    (got - want).abs() <= 3e-6 * f64::from(cap),
                    "cap {cap}, {y}: {got} vs {want}"
                );
            }
        }
        assert_eq!(softcap(1e30, 50.0), 50.0);
        assert_eq!(softcap(-1e30, 50.0), -50.0);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(32))]
        /// Every vector path this CPU has gives the portable path's bits, at every length.
        #[test]
        fn vector_paths_match_portable(len in 0usize..100, seed in any::<u64>()) {
            let xs = ferrite_testkit::random::values(len, seed, 80.0);
            let mut want = xs.clone();
            run(F32Path::Portable, &mut want, 30.0);
            for path in F32Path::available() {
                let mut got = xs.clone();
                run(path, &mut got, 30.0);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                prop_assert_eq!(bits(&got), bits(&want), "{:?}", path);
            }
            let mut all = xs.clone();
            softcap_in_place(&mut all, 30.0);
            prop_assert_eq!(all, want);
        }
    }
}

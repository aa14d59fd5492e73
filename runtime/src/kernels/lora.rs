//! The two halves of a LoRA update of one row, `y += s · B (A x)`, with the factors stored
//! transposed (`model::lora`): `shrink` (`u = A x`) and `expand` (`y += s · B u`). Factors are
//! f32 or bfloat16 ([`Factor`]), widened to f32 exactly as they are loaded; the sums are f32.
//!
//! Both are written once over [`super::simd`] and run 16, 8 or 4 lanes at a time on AVX-512,
//! AVX2 or NEON, or as plain loops; each lane does the portable loop's operations in its order
//! (a multiply, then an add: never a fused multiply-add), so every path gives the same bits.
//! Nothing depends on other rows, so a row's update is the same alone or in any batch.
//!
//! - `shrink`: `u[j] = (p0[j] + p1[j]) + (p2[j] + p3[j])`, where running sum `pc` adds
//!   `A[j][i] · x[i]` for the inputs `i ≡ c (mod 4)` in order; lanes run over `j`, and the four
//!   sums are independent chains.
//! - `expand`: `y[o] += s · Σ_j B[o][j] · u[j]`, the sum in order of `j` from 0; lanes run over
//!   `o`.
//!
//! Both read their factors once, front to back, keeping the sums in a small buffer (in L1):
//! the update of a row is memory-bound (each step reads every adapter's factors once per
//! row), and one sequential stream is what the prefetchers serve fastest.

use half::bf16;

use super::simd::{F32Path, F32s};

/// An element of stored factors: f32 as it is, or bfloat16, whose widening to f32 is exact
/// (a 16-bit shift), so a kernel sums the same values whatever the path.
pub(crate) trait Factor: Copy + Send + Sync + 'static {
    fn widen(self) -> f32;
    /// [`F32s::LANES`] elements from `p`, widened.
    ///
    /// # Safety
    /// The CPU has `S`'s features; `p` is valid for reading [`F32s::LANES`] elements.
    unsafe fn load<S: F32s>(p: *const Self) -> S::V;
}

impl Factor for f32 {
    #[inline(always)]
    fn widen(self) -> f32 {
        self
    }
    #[inline(always)]
    unsafe fn load<S: F32s>(p: *const f32) -> S::V {
        // SAFETY: as the trait says.
        unsafe { S::load(p) }
    }
}

impl Factor for bf16 {
    #[inline(always)]
    fn widen(self) -> f32 {
        self.to_f32()
    }
    #[inline(always)]
    unsafe fn load<S: F32s>(p: *const bf16) -> S::V {
        // SAFETY: as the trait says; bf16 is a u16 of the same layout.
        unsafe { S::load_bf16(p.cast::<u16>()) }
    }
}

/// Running sums `shrink` keeps along the input.
const SPLIT: usize = 4;

/// `u = A x` for `at` = Aᵀ (`[fan_in][rank]`, row-major) and `x` (`fan_in` long).
pub(crate) fn shrink<W: Factor>(at: &[W], rank: usize, x: &[f32]) -> Vec<f32> {
    assert_eq!(at.len(), x.len() * rank, "Aᵀ is not {} x {rank}", x.len());
    let mut u = vec![0f32; rank];
    match F32Path::best() {
        // SAFETY: `best` is a path this CPU has.
        #[cfg(target_arch = "x86_64")]
        F32Path::Avx512 => unsafe { vector::shrink_avx512(at, rank, x, &mut u) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        F32Path::Avx2 => unsafe { vector::shrink_avx2(at, rank, x, &mut u) },
        // SAFETY: as above.
        #[cfg(target_arch = "aarch64")]
        F32Path::Neon => unsafe { vector::shrink_neon(at, rank, x, &mut u) },
        _ => shrink_portable(at, rank, x, &mut u, 0),
    }
    u
}

/// `y[o] += scale · Σ_j B[o][j] · u[j]` for `bt` = Bᵀ (`[u.len()][y.len()]`, row-major).
pub(crate) fn expand<W: Factor>(bt: &[W], u: &[f32], scale: f32, y: &mut [f32]) {
    assert_eq!(
        bt.len(),
        u.len() * y.len(),
        "Bᵀ is not {} x {}",
        u.len(),
        y.len()
    );
    match F32Path::best() {
        // SAFETY: `best` is a path this CPU has.
        #[cfg(target_arch = "x86_64")]
        F32Path::Avx512 => unsafe { vector::expand_avx512(bt, u, scale, y) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        F32Path::Avx2 => unsafe { vector::expand_avx2(bt, u, scale, y) },
        // SAFETY: as above.
        #[cfg(target_arch = "aarch64")]
        F32Path::Neon => unsafe { vector::expand_neon(bt, u, scale, y) },
        _ => expand_portable(bt, u, scale, y, 0),
    }
}

/// [`shrink`] for `u[from..]`, one element at a time: the reference, and the vector paths' tail.
fn shrink_portable<W: Factor>(at: &[W], rank: usize, x: &[f32], u: &mut [f32], from: usize) {
    for (j, uj) in u.iter_mut().enumerate().skip(from) {
        let mut p = [0f32; SPLIT];
        for (i, &xi) in x.iter().enumerate() {
            p[i % SPLIT] += at[i * rank + j].widen() * xi;
        }
        *uj = (p[0] + p[1]) + (p[2] + p[3]);
    }
}

/// [`expand`] for `y[from..]`, one element at a time: the reference, and the vector paths' tail.
fn expand_portable<W: Factor>(bt: &[W], u: &[f32], scale: f32, y: &mut [f32], from: usize) {
    let n = y.len();
    for (o, yo) in y.iter_mut().enumerate().skip(from) {
        let mut acc = 0f32;
        for (j, &uj) in u.iter().enumerate() {
            acc += bt[j * n + o].widen() * uj;
        }
        *yo += scale * acc;
    }
}

mod vector {
    use super::Factor;
    use crate::kernels::simd::*;

    /// [`super::shrink_portable`] a vector of `u` at a time; the tail on the portable loop.
    ///
    /// # Safety
    /// The CPU has `S`'s features; `at` is `[x.len()][rank]` and `u` is `rank` long.
    /// One pass down Aᵀ, row by row (a single sequential stream, which the prefetchers
    /// follow; passing over it once per lane block made `rank / lanes` strided streams), the
    /// four running sums of every lane kept in a buffer that stays in L1.
    #[inline(always)]
    unsafe fn shrink<S: F32s, W: Factor>(at: &[W], rank: usize, x: &[f32], u: &mut [f32]) {
        let lanes = S::LANES;
        let wide = rank / lanes * lanes;
        let mut p = vec![0f32; super::SPLIT * wide];
        // SAFETY: the caller checked `S`'s features; `at` holds `x.len()` rows of `rank` (the
        // public entry asserts it), so lanes j..j + LANES with j + LANES <= wide <= rank of
        // every row are in it, and `p` holds SPLIT rows of `wide`.
        unsafe {
            for (i, &xi) in x.iter().enumerate() {
                let xi = S::splat(xi);
                let row = at.as_ptr().add(i * rank);
                let pc = p.as_mut_ptr().add((i % super::SPLIT) * wide);
                let mut j = 0;
                while j < wide {
                    let a = W::load::<S>(row.add(j));
                    S::store(pc.add(j), S::add(S::load(pc.add(j)), S::mul(a, xi)));
                    j += lanes;
                }
            }
            let mut j = 0;
            while j < wide {
                let sum = |c: usize| S::load(p.as_ptr().add(c * wide + j));
                let v = S::add(S::add(sum(0), sum(1)), S::add(sum(2), sum(3)));
                S::store(u.as_mut_ptr().add(j), v);
                j += lanes;
            }
        }
        super::shrink_portable(at, rank, x, u, wide);
    }

    /// Bᵀ row by row (one sequential stream; a block of outputs at a time read `rank`
    /// strided streams at once), the sums kept in a buffer that stays in L1, then added to
    /// `y` once.
    #[inline(always)]
    unsafe fn expand<S: F32s, W: Factor>(bt: &[W], u: &[f32], scale: f32, y: &mut [f32]) {
        let (lanes, n) = (S::LANES, y.len());
        let wide = n / lanes * lanes;
        let mut acc = vec![0f32; wide];
        // SAFETY: the caller checked `S`'s features; `bt` holds `u.len()` rows of `n` (the
        // public entry asserts it), so lanes o..o + LANES with o + LANES <= wide <= n of every
        // row are in it, as they are in `acc` and `y`.
        unsafe {
            for (j, &uj) in u.iter().enumerate() {
                let w = S::splat(uj);
                let row = bt.as_ptr().add(j * n);
                let mut o = 0;
                while o < wide {
                    let v = W::load::<S>(row.add(o));
                    let a = acc.as_mut_ptr().add(o);
                    S::store(a, S::add(S::load(a), S::mul(v, w)));
                    o += lanes;
                }
            }
            let s = S::splat(scale);
            let mut o = 0;
            while o < wide {
                let at = y.as_mut_ptr().add(o);
                S::store(
                    at,
                    S::add(S::load(at), S::mul(s, S::load(acc.as_ptr().add(o)))),
                );
                o += lanes;
            }
        }
        super::expand_portable(bt, u, scale, y, wide);
    }

    macro_rules! entry {
        ($shrink:ident, $expand:ident, $s:ty, $feat:literal, $arch:literal) => {
            /// # Safety
            /// The CPU has the features named in the attribute.
            #[cfg(target_arch = $arch)]
            #[target_feature(enable = $feat)]
            pub(super) unsafe fn $shrink<W: Factor>(
                at: &[W],
                rank: usize,
                x: &[f32],
                u: &mut [f32],
            ) {
                // SAFETY: the caller checked the features; the wrapper checked the shapes.
                unsafe { shrink::<$s, W>(at, rank, x, u) }
            }

            /// # Safety
            /// The CPU has the features named in the attribute.
            #[cfg(target_arch = $arch)]
            #[target_feature(enable = $feat)]
            pub(super) unsafe fn $expand<W: Factor>(
                bt: &[W],
                u: &[f32],
                scale: f32,
                y: &mut [f32],
            ) {
                // SAFETY: as above.
                unsafe { expand::<$s, W>(bt, u, scale, y) }
            }
        };
    }

    entry!(shrink_avx512, expand_avx512, Avx512, "avx512f", "x86_64");
    entry!(shrink_avx2, expand_avx2, Avx2, "avx2,fma", "x86_64");
    entry!(shrink_neon, expand_neon, Neon, "neon", "aarch64");
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Every path this CPU has, for one case: `(u, y)` bits.
    fn on_every_path<W: Factor>(
        at: &[W],
        rank: usize,
        x: &[f32],
        bt: &[W],
        y0: &[f32],
    ) -> Vec<(F32Path, Vec<u32>, Vec<u32>)> {
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<u32>>();
        F32Path::available()
            .into_iter()
            .map(|path| {
                let mut u = vec![0f32; rank];
                let mut y = y0.to_vec();
                match path {
                    // SAFETY: `available` lists paths this CPU has; shapes as the wrappers check.
                    #[cfg(target_arch = "x86_64")]
                    F32Path::Avx512 => unsafe {
                        vector::shrink_avx512(at, rank, x, &mut u);
                        vector::expand_avx512(bt, &u, 0.75, &mut y);
                    },
                    // SAFETY: as above.
                    #[cfg(target_arch = "x86_64")]
                    F32Path::Avx2 => unsafe {
                        vector::shrink_avx2(at, rank, x, &mut u);
                        vector::expand_avx2(bt, &u, 0.75, &mut y);
                    },
                    // SAFETY: as above.
                    #[cfg(target_arch = "aarch64")]
                    F32Path::Neon => unsafe {
                        vector::shrink_neon(at, rank, x, &mut u);
                        vector::expand_neon(bt, &u, 0.75, &mut y);
                    },
                    _ => {
                        shrink_portable(at, rank, x, &mut u, 0);
                        expand_portable(bt, &u, 0.75, &mut y, 0);
                    }
                }
                (path, bits(&u), bits(&y))
            })
            .collect()
    }

    #[test]
    fn close_to_the_f64_product() {
        let (fan_in, rank, fan_out) = (45, 6, 21);
        let at = ferrite_testkit::random::values(fan_in * rank, 1, 1.0);
        let bt = ferrite_testkit::random::values(rank * fan_out, 2, 1.0);
        let x = ferrite_testkit::random::values(fan_in, 3, 1.0);
        let y0 = ferrite_testkit::random::values(fan_out, 4, 1.0);
        let u = shrink(&at, rank, &x);
        let mut y = y0.clone();
        expand(&bt, &u, 0.5, &mut y);
        for (j, &uj) in u.iter().enumerate() {
            let want: f64 = (0..fan_in)
                .map(|i| f64::from(at[i * rank + j] * x[i]))
                .sum();
            assert!((f64::from(uj) - want).abs() < 1e-4, "u[{j}] {uj} vs {want}");
        }
        for (o, &yo) in y.iter().enumerate() {
            let d: f64 = (0..rank)
                .map(|j| f64::from(bt[j * fan_out + o]) * f64::from(u[j]))
                .sum();
            let want = f64::from(y0[o]) + 0.5 * d;
            assert!((f64::from(yo) - want).abs() < 1e-4, "y[{o}] {yo} vs {want}");
        }
    }

    /// The vector paths of this architecture the CPU lacks get their skip line (the proptest
    /// below runs every path it has).
    #[test]
    fn vector_paths_this_cpu_lacks_are_named() {
        for (_, isa, present) in F32Path::all() {
            crate::kernels::isa_or_skip("lora vector_paths_match_portable", isa, present);
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        /// Every vector path gives the portable loop's bits, at every shape (both tails).
        #[test]
        fn vector_paths_match_portable(
            fan_in in 1usize..70,
            rank in 1usize..40,
            fan_out in 1usize..90,
            seed in any::<u64>(),
        ) {
            let at = ferrite_testkit::random::values(fan_in * rank, seed, 1.0);
            let bt = ferrite_testkit::random::values(rank * fan_out, seed ^ 1, 1.0);
            let x = ferrite_testkit::random::values(fan_in, seed ^ 2, 3.0);
            let y0 = ferrite_testkit::random::values(fan_out, seed ^ 3, 3.0);
            // f32 factors, then the same rounded to bfloat16, which every path widens exactly.
            let half = |v: &[f32]| v.iter().map(|&f| bf16::from_f32(f)).collect::<Vec<_>>();
            for (dtype, runs) in [
                ("f32", on_every_path(&at, rank, &x, &bt, &y0)),
                ("bf16", on_every_path(&half(&at), rank, &x, &half(&bt), &y0)),
            ] {
                let (_, u0, y0bits) = runs.last().cloned().expect("the portable path");
                for (path, u, y) in runs {
                    prop_assert_eq!(&u, &u0, "{} u on {:?}", dtype, path);
                    prop_assert_eq!(&y, &y0bits, "{} y on {:?}", dtype, path);
                }
            }
        }
    }
}

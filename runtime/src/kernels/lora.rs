//! The two halves of a LoRA update, `y += s · B (A x)`, for rows of one adapter, with the
//! factors stored transposed (`model::lora`): `shrink_rows` (`u = A x`) and `expand_rows`
//! (`y += s · B u`). Factors are f32 or bfloat16 ([`Factor`]), widened to f32 exactly as they
//! are loaded; the sums are f32.
//!
//! Both are written once over [`super::simd`] and run 16, 8 or 4 lanes at a time on AVX-512,
//! AVX2 or NEON, or as plain loops; each lane does the portable loop's operations in its order
//! (a multiply, then an add: never a fused multiply-add), so every path gives the same bits.
//! Each row's sums are its own, in the same order whatever rows it is computed with, so a
//! row's update is the same alone or in any batch.
//!
//! - shrink: `u[j] = (p0[j] + p1[j]) + (p2[j] + p3[j])`, where running sum `pc` adds
//!   `A[j][i] · x[i]` for the inputs `i ≡ c (mod 4)` in order; lanes run over `j`, and the four
//!   sums are independent chains.
//! - expand: `y[o] += s · Σ_j B[o][j] · u[j]`, the sum in order of `j` from 0; lanes run over
//!   `o`.
//!
//! A lone row (a decode step's sequence on its own adapter) is memory-bound: each step reads
//! every adapter's factors once, so its kernels read them front to back in one stream, the
//! shrink's sums in registers and the expand's in a buffer in L1, prefetching ahead as data
//! used once (a step's factors are more than the caches hold, and would push out the base
//! model's weights). Several
//! rows of one adapter (a prefill, sequences sharing an adapter) are compute-bound, the
//! factors in the caches: those kernels load each factor element once for up to four rows,
//! every row's sums in registers (`prefill of 8 x 128 tokens` in bench-runtime `--lora`).

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

/// `u = A x` for each row `x` of `xs` (each `fan_in` long), into row `r` of `us`
/// (`[xs.len()][rank]`), for `at` = Aᵀ (`[fan_in][rank]`, row-major). Each row's bits are
/// the same alone or among any others.
pub(crate) fn shrink_rows<W: Factor>(at: &[W], rank: usize, xs: &[&[f32]], us: &mut [f32]) {
    assert_eq!(us.len(), xs.len() * rank, "u is not {} x {rank}", xs.len());
    for x in xs {
        assert_eq!(at.len(), x.len() * rank, "Aᵀ is not {} x {rank}", x.len());
    }
    match F32Path::best() {
        // SAFETY: `best` is a path this CPU has.
        #[cfg(target_arch = "x86_64")]
        F32Path::Avx512 => unsafe { vector::shrink_avx512(at, rank, xs, us) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        F32Path::Avx2 => unsafe { vector::shrink_avx2(at, rank, xs, us) },
        // SAFETY: as above.
        #[cfg(target_arch = "aarch64")]
        F32Path::Neon => unsafe { vector::shrink_neon(at, rank, xs, us) },
        _ => {
            for (x, u) in xs.iter().zip(us.chunks_exact_mut(rank)) {
                shrink_portable(at, rank, x, u, 0);
            }
        }
    }
}

/// `y[o] += scale · Σ_j B[o][j] · u[j]` for each pair of `us` and `ys`, for `bt` = Bᵀ
/// (`[rank][n]`, row-major; every `u` is `rank` long and every `y` is `n`). Each row's bits
/// are the same alone or among any others.
pub(crate) fn expand_rows<W: Factor>(bt: &[W], us: &[&[f32]], scale: f32, ys: &mut [&mut [f32]]) {
    assert_eq!(
        us.len(),
        ys.len(),
        "{} u rows for {} y rows",
        us.len(),
        ys.len()
    );
    for (u, y) in us.iter().zip(ys.iter()) {
        assert_eq!(
            bt.len(),
            u.len() * y.len(),
            "Bᵀ is not {} x {}",
            u.len(),
            y.len()
        );
    }
    match F32Path::best() {
        // SAFETY: `best` is a path this CPU has.
        #[cfg(target_arch = "x86_64")]
        F32Path::Avx512 => unsafe { vector::expand_avx512(bt, us, scale, ys) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        F32Path::Avx2 => unsafe { vector::expand_avx2(bt, us, scale, ys) },
        // SAFETY: as above.
        #[cfg(target_arch = "aarch64")]
        F32Path::Neon => unsafe { vector::expand_neon(bt, us, scale, ys) },
        _ => {
            for (u, y) in us.iter().zip(ys.iter_mut()) {
                expand_portable(bt, u, scale, y, 0);
            }
        }
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

    /// How far ahead of the row being read the factors are prefetched, in bytes: enough lines
    /// in flight to cover the memory's latency at the rate a core reads bfloat16 factors
    /// (1 KiB left a decode step's update at ~55% of the read ceiling, 8 KiB ~65%).
    const AHEAD: usize = 8192;

    /// Prefetches every cache line of `base` (the factors, `len` bytes) up to `to` bytes in
    /// that `next` has not reached yet.
    #[inline(always)]
    fn prefetch_to(base: *const u8, len: usize, next: &mut usize, to: usize) {
        let to = to.min(len);
        while *next < to {
            crate::kernels::prefetch_once(base.wrapping_add(*next));
            *next += 64;
        }
    }

    /// [`super::shrink_portable`] a vector of `u` at a time; the tail on the portable loop.
    ///
    /// # Safety
    /// The CPU has `S`'s features; `at` is `[x.len()][rank]` and `u` is `rank` long.
    /// Lanes go in blocks of up to `MAX_BLOCK` vectors whose four running sums each stay in
    /// registers for the whole of Aᵀ: a rank-16 adapter's row is one to four vectors, and a
    /// loop that kept its sums in memory spent more on loading and storing them, and on its
    /// per-row overhead, than on the factors. The first block's pass prefetches the whole of
    /// Aᵀ ahead of it, so the later blocks (a row wider than a block) read it from the caches.
    #[inline(always)]
    unsafe fn shrink<S: F32s, W: Factor, const MAX_BLOCK: usize>(
        at: &[W],
        rank: usize,
        x: &[f32],
        u: &mut [f32],
    ) {
        let lanes = S::LANES;
        let wide = rank / lanes * lanes;
        let mut j = 0;
        while j < wide {
            let first = j == 0;
            // SAFETY: as this function's contract; the block's lanes j..j + b * LANES are
            // within `wide`.
            unsafe {
                j += lanes
                    * match ((wide - j) / lanes).min(MAX_BLOCK) {
                        1 => shrink_block::<S, W, 1>(at, rank, x, u, j, first),
                        2 => shrink_block::<S, W, 2>(at, rank, x, u, j, first),
                        3 => shrink_block::<S, W, 3>(at, rank, x, u, j, first),
                        _ => shrink_block::<S, W, 4>(at, rank, x, u, j, first),
                    };
            }
        }
        super::shrink_portable(at, rank, x, u, wide);
    }

    /// `u[j0..j0 + B · LANES]`, the four running sums of each lane in registers; prefetches
    /// all of Aᵀ ahead when `prefetch`. Returns `B`.
    ///
    /// # Safety
    /// As [`shrink`]; `j0 + B · LANES <= rank`.
    #[inline(always)]
    unsafe fn shrink_block<S: F32s, W: Factor, const B: usize>(
        at: &[W],
        rank: usize,
        x: &[f32],
        u: &mut [f32],
        j0: usize,
        prefetch: bool,
    ) -> usize {
        let lanes = S::LANES;
        let (bytes, row_bytes) = (std::mem::size_of_val(at), rank * std::mem::size_of::<W>());
        let mut fetched = if prefetch { 0 } else { bytes };
        // SAFETY: the caller checked `S`'s features; row `i` of Aᵀ holds `rank` elements, so
        // lanes j0 + b · LANES .. + LANES for b < B are in it, as they are in `u`.
        unsafe {
            let zero = S::splat(0.0);
            let (mut p0, mut p1, mut p2, mut p3) = ([zero; B], [zero; B], [zero; B], [zero; B]);
            let row = |i: usize| at.as_ptr().add(i * rank + j0);
            // Row `i` adds to sums `i mod SPLIT`: SPLIT rows at a time, so that each sum is a
            // named local the compiler keeps in registers.
            let whole = x.len() / super::SPLIT * super::SPLIT;
            let mut i = 0;
            while i < whole {
                let to = (i + super::SPLIT) * row_bytes + AHEAD;
                prefetch_to(at.as_ptr().cast(), bytes, &mut fetched, to);
                accumulate::<S, W, B>(&mut p0, row(i), *x.get_unchecked(i));
                accumulate::<S, W, B>(&mut p1, row(i + 1), *x.get_unchecked(i + 1));
                accumulate::<S, W, B>(&mut p2, row(i + 2), *x.get_unchecked(i + 2));
                accumulate::<S, W, B>(&mut p3, row(i + 3), *x.get_unchecked(i + 3));
                i += super::SPLIT;
            }
            for (c, i) in (whole..x.len()).enumerate() {
                let pc = match c {
                    0 => &mut p0,
                    1 => &mut p1,
                    _ => &mut p2,
                };
                accumulate::<S, W, B>(pc, row(i), *x.get_unchecked(i));
            }
            for (b, (((&s0, &s1), &s2), &s3)) in p0.iter().zip(&p1).zip(&p2).zip(&p3).enumerate() {
                let v = S::add(S::add(s0, s1), S::add(s2, s3));
                S::store(u.as_mut_ptr().add(j0 + b * lanes), v);
            }
        }
        B
    }

    /// `acc[b] += row[b · LANES..][..LANES] · xi` for each `b`.
    ///
    /// # Safety
    /// The CPU has `S`'s features; `row` is valid for reading `B · LANES` elements.
    #[inline(always)]
    unsafe fn accumulate<S: F32s, W: Factor, const B: usize>(
        acc: &mut [S::V; B],
        row: *const W,
        xi: f32,
    ) {
        // SAFETY: as this function's contract.
        unsafe {
            let xi = S::splat(xi);
            for (b, a) in acc.iter_mut().enumerate() {
                *a = S::add(*a, S::mul(W::load::<S>(row.add(b * S::LANES)), xi));
            }
        }
    }

    /// Bᵀ row by row (one sequential stream; a block of outputs at a time read `rank`
    /// strided streams at once, and a pass over four rows at a time was slower too), the
    /// sums kept in a buffer that stays in L1, then added to `y` once.
    #[inline(always)]
    unsafe fn expand<S: F32s, W: Factor>(bt: &[W], u: &[f32], scale: f32, y: &mut [f32]) {
        let (lanes, n) = (S::LANES, y.len());
        let wide = n / lanes * lanes;
        // The thread's buffer, not a new one per call: a decode step makes thousands of these
        // calls (every adapter, projection and layer), each a few microseconds.
        let mut acc = EXPAND_SUMS.take();
        acc.clear();
        acc.resize(wide, 0.0);
        let (bytes, row_bytes) = (std::mem::size_of_val(bt), n * std::mem::size_of::<W>());
        let mut fetched = 0;
        // SAFETY: the caller checked `S`'s features; `bt` holds `u.len()` rows of `n` (the
        // public entry asserts it), so lanes o..o + LANES with o + LANES <= wide <= n of every
        // row are in it, as they are in `acc` and `y`.
        unsafe {
            for (j, &uj) in u.iter().enumerate() {
                prefetch_to(
                    bt.as_ptr().cast(),
                    bytes,
                    &mut fetched,
                    (j + 1) * row_bytes + AHEAD,
                );
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
        EXPAND_SUMS.set(acc);
        super::expand_portable(bt, u, scale, y, wide);
    }

    thread_local! {
        /// [`expand`]'s sums, kept between calls.
        static EXPAND_SUMS: std::cell::Cell<Vec<f32>> = const { std::cell::Cell::new(Vec::new()) };
    }

    /// [`shrink`] for each row of `xs`, `MAX_ROWS` rows at a time through [`shrink_multi`]
    /// (a prefill, or several sequences on one adapter), a lone row through [`shrink`].
    ///
    /// # Safety
    /// The CPU has `S`'s features; every `x` is `fan_in` long, `at` is `[fan_in][rank]` and
    /// `us` is `[xs.len()][rank]`.
    #[inline(always)]
    unsafe fn shrink_rows<S: F32s, W: Factor, const MAX_BLOCK: usize, const MAX_ROWS: usize>(
        at: &[W],
        rank: usize,
        xs: &[&[f32]],
        us: &mut [f32],
    ) {
        let mut r = 0;
        // SAFETY: as this function's contract, for the rows r..r + k.
        unsafe {
            while r < xs.len() {
                let (x, u) = (&xs[r..], &mut us[r * rank..]);
                r += match (xs.len() - r).min(MAX_ROWS) {
                    1 => {
                        shrink::<S, W, MAX_BLOCK>(at, rank, x[0], &mut u[..rank]);
                        1
                    }
                    2 => shrink_multi::<S, W, 2>(at, rank, x, u),
                    3 => shrink_multi::<S, W, 3>(at, rank, x, u),
                    _ => shrink_multi::<S, W, 4>(at, rank, x, u),
                };
            }
        }
    }

    /// The first `R` rows of `xs` into the first `R` rows of `us`, one vector of lanes at a
    /// time, the four running sums of each row in registers, so each element of Aᵀ is loaded
    /// once for `R` rows. Returns `R`.
    ///
    /// # Safety
    /// As [`shrink_rows`], with at least `R` rows.
    #[inline(always)]
    unsafe fn shrink_multi<S: F32s, W: Factor, const R: usize>(
        at: &[W],
        rank: usize,
        xs: &[&[f32]],
        us: &mut [f32],
    ) -> usize {
        let lanes = S::LANES;
        let wide = rank / lanes * lanes;
        let fan_in = xs[0].len();
        let x: [&[f32]; R] = std::array::from_fn(|r| xs[r]);
        let whole = fan_in / super::SPLIT * super::SPLIT;
        // SAFETY: the caller checked `S`'s features; row `i` of Aᵀ holds `rank` elements, so
        // lanes j..j + LANES with j + LANES <= wide are in it, as they are in each row of
        // `us`; every `x[r]` is `fan_in` long.
        unsafe {
            let add = |acc: &mut [S::V; R], i: usize, a: S::V| {
                for (r, p) in acc.iter_mut().enumerate() {
                    *p = S::add(*p, S::mul(a, S::splat(*x[r].get_unchecked(i))));
                }
            };
            let mut j = 0;
            while j < wide {
                let zero = S::splat(0.0);
                let (mut p0, mut p1, mut p2, mut p3) = ([zero; R], [zero; R], [zero; R], [zero; R]);
                let a = |i: usize| W::load::<S>(at.as_ptr().add(i * rank + j));
                let mut i = 0;
                while i < whole {
                    add(&mut p0, i, a(i));
                    add(&mut p1, i + 1, a(i + 1));
                    add(&mut p2, i + 2, a(i + 2));
                    add(&mut p3, i + 3, a(i + 3));
                    i += super::SPLIT;
                }
                for (c, i) in (whole..fan_in).enumerate() {
                    let pc = match c {
                        0 => &mut p0,
                        1 => &mut p1,
                        _ => &mut p2,
                    };
                    add(pc, i, a(i));
                }
                for r in 0..R {
                    let v = S::add(S::add(p0[r], p1[r]), S::add(p2[r], p3[r]));
                    S::store(us.as_mut_ptr().add(r * rank + j), v);
                }
                j += lanes;
            }
        }
        for (r, x) in x.iter().enumerate() {
            super::shrink_portable(at, rank, x, &mut us[r * rank..][..rank], wide);
        }
        R
    }

    /// [`expand`] for each pair of `us` and `ys`, `MAX_ROWS` rows at a time through
    /// [`expand_multi`], a lone row through [`expand`].
    ///
    /// # Safety
    /// The CPU has `S`'s features; `bt` is `[rank][n]`, every `u` is `rank` long and every
    /// `y` is `n` long.
    #[inline(always)]
    unsafe fn expand_rows<S: F32s, W: Factor, const MAX_ROWS: usize>(
        bt: &[W],
        us: &[&[f32]],
        scale: f32,
        ys: &mut [&mut [f32]],
    ) {
        let mut r = 0;
        // SAFETY: as this function's contract, for the rows r..r + k.
        unsafe {
            while r < us.len() {
                let (u, y) = (&us[r..], &mut ys[r..]);
                r += match (us.len() - r).min(MAX_ROWS) {
                    1 => {
                        expand::<S, W>(bt, u[0], scale, y[0]);
                        1
                    }
                    2 => expand_multi::<S, W, 2>(bt, u, scale, y),
                    3 => expand_multi::<S, W, 3>(bt, u, scale, y),
                    _ => expand_multi::<S, W, 4>(bt, u, scale, y),
                };
            }
        }
    }

    /// The first `R` rows, one vector of outputs at a time: each row's sums in registers,
    /// each element of Bᵀ loaded once for `R` rows (it is in the caches: the rows that share
    /// an adapter come after each other). Returns `R`.
    ///
    /// # Safety
    /// As [`expand_rows`], with at least `R` rows.
    #[inline(always)]
    unsafe fn expand_multi<S: F32s, W: Factor, const R: usize>(
        bt: &[W],
        us: &[&[f32]],
        scale: f32,
        ys: &mut [&mut [f32]],
    ) -> usize {
        let (lanes, rank, n) = (S::LANES, us[0].len(), ys[0].len());
        let wide = n / lanes * lanes;
        // SAFETY: the caller checked `S`'s features; `bt` holds `rank` rows of `n`, so lanes
        // o..o + LANES with o + LANES <= wide <= n of every row are in it, as they are in
        // every `y`; every `u` is `rank` long.
        unsafe {
            let s = S::splat(scale);
            let mut o = 0;
            while o < wide {
                let mut acc = [S::splat(0.0); R];
                for j in 0..rank {
                    let b = W::load::<S>(bt.as_ptr().add(j * n + o));
                    for (r, a) in acc.iter_mut().enumerate() {
                        *a = S::add(*a, S::mul(b, S::splat(*us[r].get_unchecked(j))));
                    }
                }
                for (r, a) in acc.iter().enumerate() {
                    let at = ys[r].as_mut_ptr().add(o);
                    S::store(at, S::add(S::load(at), S::mul(s, *a)));
                }
                o += lanes;
            }
        }
        for r in 0..R {
            super::expand_portable(bt, us[r], scale, ys[r], wide);
        }
        R
    }

    macro_rules! entry {
        (
            $shrink:ident, $expand:ident, $s:ty, block $block:literal, rows $rows:literal,
            $feat:literal, $arch:literal
        ) => {
            /// # Safety
            /// The CPU has the features named in the attribute.
            #[cfg(target_arch = $arch)]
            #[target_feature(enable = $feat)]
            pub(super) unsafe fn $shrink<W: Factor>(
                at: &[W],
                rank: usize,
                xs: &[&[f32]],
                us: &mut [f32],
            ) {
                // SAFETY: the caller checked the features; the wrapper checked the shapes.
                unsafe { shrink_rows::<$s, W, $block, $rows>(at, rank, xs, us) }
            }

            /// # Safety
            /// The CPU has the features named in the attribute.
            #[cfg(target_arch = $arch)]
            #[target_feature(enable = $feat)]
            pub(super) unsafe fn $expand<W: Factor>(
                bt: &[W],
                us: &[&[f32]],
                scale: f32,
                ys: &mut [&mut [f32]],
            ) {
                // SAFETY: as above.
                unsafe { expand_rows::<$s, W, $rows>(bt, us, scale, ys) }
            }
        };
    }

    // Sums kept in registers: AVX2 has 16 vector registers, AVX-512 and NEON 32.
    entry!(shrink_avx512, expand_avx512, Avx512, block 4, rows 4, "avx512f", "x86_64");
    entry!(shrink_avx2, expand_avx2, Avx2, block 3, rows 3, "avx2,fma", "x86_64");
    entry!(shrink_neon, expand_neon, Neon, block 4, rows 4, "neon", "aarch64");
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Every path this CPU has, for one case of `xs.len()` rows: `(u, y)` bits of all rows.
    fn on_every_path<W: Factor>(
        at: &[W],
        rank: usize,
        xs: &[Vec<f32>],
        bt: &[W],
        y0: &[Vec<f32>],
    ) -> Vec<(F32Path, Vec<u32>, Vec<u32>)> {
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<u32>>();
        let xs: Vec<&[f32]> = xs.iter().map(Vec::as_slice).collect();
        F32Path::available()
            .into_iter()
            .map(|path| {
                let mut us = vec![0f32; xs.len() * rank];
                let mut ys = y0.to_vec();
                run_path(path, at, rank, &xs, &mut us, bt, &mut ys);
                (path, bits(&us), bits(&ys.concat()))
            })
            .collect()
    }

    /// Both halves on `path` (one this CPU has).
    fn run_path<W: Factor>(
        path: F32Path,
        at: &[W],
        rank: usize,
        xs: &[&[f32]],
        us: &mut [f32],
        bt: &[W],
        ys: &mut [Vec<f32>],
    ) {
        match path {
            // SAFETY: callers pass paths `available` lists; shapes as the wrappers check.
            #[cfg(target_arch = "x86_64")]
            F32Path::Avx512 => unsafe { vector::shrink_avx512(at, rank, xs, us) },
            // SAFETY: as above.
            #[cfg(target_arch = "x86_64")]
            F32Path::Avx2 => unsafe { vector::shrink_avx2(at, rank, xs, us) },
            // SAFETY: as above.
            #[cfg(target_arch = "aarch64")]
            F32Path::Neon => unsafe { vector::shrink_neon(at, rank, xs, us) },
            _ => {
                for (x, u) in xs.iter().zip(us.chunks_exact_mut(rank)) {
                    shrink_portable(at, rank, x, u, 0);
                }
            }
        }
        let u: Vec<&[f32]> = us.chunks_exact(rank).collect();
        let mut y: Vec<&mut [f32]> = ys.iter_mut().map(Vec::as_mut_slice).collect();
        match path {
            // SAFETY: as above.
            #[cfg(target_arch = "x86_64")]
            F32Path::Avx512 => unsafe { vector::expand_avx512(bt, &u, 0.75, &mut y) },
            // SAFETY: as above.
            #[cfg(target_arch = "x86_64")]
            F32Path::Avx2 => unsafe { vector::expand_avx2(bt, &u, 0.75, &mut y) },
            // SAFETY: as above.
            #[cfg(target_arch = "aarch64")]
            F32Path::Neon => unsafe { vector::expand_neon(bt, &u, 0.75, &mut y) },
            _ => {
                for (u, y) in u.iter().zip(y.iter_mut()) {
                    expand_portable(bt, u, 0.75, y, 0);
                }
            }
        }
    }

    #[test]
    fn close_to_the_f64_product() {
        let (fan_in, rank, fan_out) = (45, 6, 21);
        let at = ferrite_testkit::random::values(fan_in * rank, 1, 1.0);
        let bt = ferrite_testkit::random::values(rank * fan_out, 2, 1.0);
        let xs: Vec<Vec<f32>> = (0..3)
            .map(|r| ferrite_testkit::random::values(fan_in, 3 + r, 1.0))
            .collect();
        let y0 = ferrite_testkit::random::values(fan_out, 9, 1.0);
        let x: Vec<&[f32]> = xs.iter().map(Vec::as_slice).collect();
        let mut us = vec![0f32; 3 * rank];
        shrink_rows(&at, rank, &x, &mut us);
        let mut ys = vec![y0.clone(); 3];
        let u: Vec<&[f32]> = us.chunks_exact(rank).collect();
        expand_rows(
            &bt,
            &u,
            0.5,
            &mut ys.iter_mut().map(Vec::as_mut_slice).collect::<Vec<_>>(),
        );
        for (r, (u, y)) in u.iter().zip(&ys).enumerate() {
            for (j, &uj) in u.iter().enumerate() {
                let want: f64 = (0..fan_in)
                    .map(|i| f64::from(at[i * rank + j] * xs[r][i]))
                    .sum();
                assert!(
                    (f64::from(uj) - want).abs() < 1e-4,
                    "u[{r}][{j}] {uj} vs {want}"
                );
            }
            for (o, &yo) in y.iter().enumerate() {
                let d: f64 = (0..rank)
                    .map(|j| f64::from(bt[j * fan_out + o]) * f64::from(u[j]))
                    .sum();
                let want = f64::from(y0[o]) + 0.5 * d;
                assert!(
                    (f64::from(yo) - want).abs() < 1e-4,
                    "y[{r}][{o}] {yo} vs {want}"
                );
            }
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
        /// Every vector path gives the portable loop's bits, at every shape (both tails) and
        /// for any number of rows at once (the portable loop does each row alone, so this is
        /// also each row's batch invariance).
        #[test]
        fn vector_paths_match_portable(
            fan_in in 1usize..70,
            rank in 1usize..40,
            fan_out in 1usize..90,
            rows in 1usize..10,
            seed in any::<u64>(),
        ) {
            let at = ferrite_testkit::random::values(fan_in * rank, seed, 1.0);
            let bt = ferrite_testkit::random::values(rank * fan_out, seed ^ 1, 1.0);
            let row = |r: usize, n: usize, k: u64| {
                ferrite_testkit::random::values(n, seed ^ k ^ ((r as u64) << 8), 3.0)
            };
            let x: Vec<Vec<f32>> = (0..rows).map(|r| row(r, fan_in, 2)).collect();
            let y0: Vec<Vec<f32>> = (0..rows).map(|r| row(r, fan_out, 3)).collect();
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

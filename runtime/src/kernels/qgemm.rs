//! A batch-invariant quantized GEMM: `y = x Wᵀ` with `W` kept as 4- or 8-bit blocks and `x`
//! quantized per row to int8 at every call.
//!
//! Weights `[n, k]` are held in blocks of [`QK`] values along `k`, each `w = d · q + m`:
//! - [`Bits::Four`]: `q ∈ 0..=15` with a per-block minimum `m` (GGUF Q4_0 and Q4_1 map onto this
//!   exactly), half a byte per weight;
//! - [`Bits::Eight`]: `q ∈ -127..=127`, `m = 0` (GGUF Q8_0 exactly; any other type is
//!   dequantized and requantized to this).
//!
//! They are repacked at load into panels of [`NR`] output columns, so that one 64-byte load feeds
//! 16 columns of a `vpdpbusd`, and every weight block is reused across all rows of a step.
//!
//! Activations are quantized per row and block, symmetrically (`x ≈ da · qa`), so a row's
//! integers depend on that row alone. Each output element is then reduced block by block, in
//! order: an exact integer dot per block, then `acc = dot · (da · d) + acc` (and, for 4 bits,
//! `acc = m · (da · Σqa) + acc`), each a fused multiply-add. Every ISA path and every tile shape
//! does exactly these operations, so a row's result is bitwise the same alone or in a batch of
//! any size, on every path ([`Isa`]).
//!
//! `k` need not be a multiple of [`QK`]: the last block is padded with zeros, which add nothing.

use std::mem::MaybeUninit;

use rayon::prelude::*;

use super::Isa;

/// Values per quantization block (GGUF's Q4_0, Q4_1 and Q8_0 use 32 too).
pub const QK: usize = 32;
/// Output columns per packed panel: one 512-bit vector of i32 or f32.
pub const NR: usize = 16;
/// Most rows per micro-tile.
const MR: usize = 4;

/// How many bits each weight keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bits {
    /// Unsigned 0..=15 with a per-block scale and minimum.
    Four,
    /// Signed -127..=127 with a per-block scale.
    Eight,
}

impl Bits {
    /// Bytes of one panel block (`NR` columns × `QK` values).
    const fn panel_block_bytes(self) -> usize {
        match self {
            Bits::Four => QK * NR / 2,
            Bits::Eight => QK * NR,
        }
    }
}

/// One weight block as a caller hands it over: `w[i] = d · q[i] + m`.
#[derive(Debug, Clone, Copy)]
pub struct Block {
    pub d: f32,
    pub m: f32,
    /// `0..=15` for [`Bits::Four`]; `-127..=127` (as `i8`, stored in `i16`) for [`Bits::Eight`].
    pub q: [i16; QK],
}

/// Quantized weights of one `[n, k]` matrix, repacked into column panels.
#[derive(Debug, Clone)]
pub struct QWeights {
    n: usize,
    k: usize,
    /// Blocks per row.
    kb: usize,
    bits: Bits,
    /// Per panel and block: for `Eight`, `[k/4 = 8][NR][4]` i8; for `Four`, `[4][NR][4]` bytes
    /// whose low nibbles hold values `4j..4j+4` and high nibbles `16+4j..16+4j+4`.
    data: Vec<u8>,
    /// `[panel][block][NR]` scales `d` (0 in padding columns).
    scales: Vec<f32>,
    /// `[panel][block][NR]`: minimums `m` for `Four`; for `Eight`, the column sums `Σq` as i32
    /// bits (the VNNI path offsets activations by 128 and subtracts `128 · Σq`).
    extra: Vec<u32>,
}

/// Error for weights that do not fit the kernel's formats.
#[derive(Debug, thiserror::Error)]
pub enum QuantError {
    #[error("weights are not {n} x {k}: {len} values")]
    Shape { n: usize, k: usize, len: usize },
    #[error("block value {q} is out of range for {bits:?}")]
    Range { q: i16, bits: Bits },
}

/// Symmetric 8-bit quantization of up to [`QK`] values; the rest of `q` is zeroed.
///
/// It runs on every activation row of every matmul, so AVX-512 does it in two vectors, AVX2 in
/// four and NEON in eight where present; the portable loops compile to scalar code (a
/// sequential `max` fold and saturating casts). All round half to even and give the same bytes and scale.
fn quantize_sym(x: &[f32], q: &mut [i8; QK]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if super::has_avx512f() {
        // SAFETY: AVX-512F is present.
        return unsafe { x86::quantize_sym(x, q) };
    } else if super::has_avx2_fma() {
        // SAFETY: AVX2 is present.
        return unsafe { x86::quantize_sym_avx2(x, q) };
    }
    #[cfg(target_arch = "aarch64")]
    // SAFETY: every ARM64 CPU has NEON.
    return unsafe { arm::quantize_sym(x, q) };
    #[allow(unreachable_code)]
    quantize_sym_portable(x, q)
}

/// Up to [`QK`] values zero-padded to a whole block, as every quantizer reads them (the vector
/// ones too: a masked load would skip the lanes past `x`, but emulators (QEMU) still touch
/// their memory).
fn padded(x: &[f32]) -> [f32; QK] {
    let mut v = [0f32; QK];
    let n = x.len().min(QK);
    v[..n].copy_from_slice(&x[..n]);
    v
}

fn quantize_sym_portable(x: &[f32], q: &mut [i8; QK]) -> f32 {
    let v = padded(x);
    // `v · 0` is NaN exactly when `v` is infinite or NaN.
    let poison = v.iter().fold(0f32, |a, &e| a + e * 0.0);
    let amax = v.iter().fold(0f32, |m, &e| m.max(e.abs()));
    match quant_scale(poison.is_nan(), amax) {
        Some((d, inv)) => {
            for (o, e) in q.iter_mut().zip(v) {
                *o = (e * inv).round_ties_even().clamp(-127.0, 127.0) as i8;
            }
            d
        }
        None => {
            *q = [0; QK];
            if poison.is_nan() { f32::NAN } else { 0.0 }
        }
    }
}

/// A block's scale and its inverse, or `None` when it quantizes to zeros: all zero, or
/// poisoned by an infinity or NaN (NaN in, NaN out: a NaN scale poisons every product).
fn quant_scale(poisoned: bool, amax: f32) -> Option<(f32, f32)> {
    if poisoned || amax == 0.0 {
        return None;
    }
    let d = amax / 127.0;
    Some((d, 1.0 / d))
}

impl QWeights {
    /// Packs `n` columns of `kb = ceil(k / QK)` blocks each, handed over by `block(col, b)`.
    pub fn from_blocks(
        n: usize,
        k: usize,
        bits: Bits,
        mut block: impl FnMut(usize, usize) -> Block,
    ) -> Result<QWeights, QuantError> {
        let kb = k.div_ceil(QK);
        let panels = n.div_ceil(NR);
        let pbb = bits.panel_block_bytes();
        let mut data = vec![0u8; panels * kb * pbb];
        let mut scales = vec![0f32; panels * kb * NR];
        let mut extra = vec![0u32; panels * kb * NR];
        for col in 0..n {
            let (p, c) = (col / NR, col % NR);
            for b in 0..kb {
                let blk = block(col, b);
                let at = (p * kb + b) * NR + c;
                scales[at] = blk.d;
                let base = (p * kb + b) * pbb;
                match bits {
                    Bits::Four => {
                        if let Some(&q) = blk.q.iter().find(|&&q| !(0..=15).contains(&q)) {
                            return Err(QuantError::Range { q, bits });
                        }
                        extra[at] = blk.m.to_bits();
                        for i in 0..QK {
                            let (j, hi) = ((i % 16) / 4, i >= 16);
                            let byte = &mut data[base + j * NR * 4 + c * 4 + i % 4];
                            *byte |= (blk.q[i] as u8) << if hi { 4 } else { 0 };
                        }
                    }
                    Bits::Eight => {
                        if let Some(&q) = blk.q.iter().find(|&&q| !(-127..=127).contains(&q)) {
                            return Err(QuantError::Range { q, bits });
                        }
                        let sum: i32 = blk.q.iter().map(|&q| i32::from(q)).sum();
                        extra[at] = sum as u32;
                        for i in 0..QK {
                            data[base + (i / 4) * NR * 4 + c * 4 + i % 4] = blk.q[i] as i8 as u8;
                        }
                    }
                }
            }
        }
        Ok(QWeights {
            n,
            k,
            kb,
            bits,
            data,
            scales,
            extra,
        })
    }

    /// Quantizes row-major f32 `w` (`n` rows of `k`) to 8 bits.
    pub fn quantize(w: &[f32], n: usize, k: usize) -> Result<QWeights, QuantError> {
        if w.len() != n * k {
            return Err(QuantError::Shape { n, k, len: w.len() });
        }
        let mut q = [0i8; QK];
        QWeights::from_blocks(n, k, Bits::Eight, |col, b| {
            let x = &w[col * k + b * QK..col * k + ((b + 1) * QK).min(k)];
            let d = quantize_sym(x, &mut q);
            Block {
                d,
                m: 0.0,
                q: q.map(i16::from),
            }
        })
    }

    /// Block `b` of column `col`, as [`QWeights::from_blocks`] took it (for stacking).
    pub fn block(&self, col: usize, b: usize) -> Block {
        let (p, c) = (col / NR, col % NR);
        let at = (p * self.kb + b) * NR + c;
        let base = (p * self.kb + b) * self.bits.panel_block_bytes();
        let mut q = [0i16; QK];
        let m = match self.bits {
            Bits::Four => {
                for (i, v) in q.iter_mut().enumerate() {
                    let byte = self.data[base + ((i % 16) / 4) * NR * 4 + c * 4 + i % 4];
                    *v = i16::from(if i >= 16 { byte >> 4 } else { byte & 15 });
                }
                f32::from_bits(self.extra[at])
            }
            Bits::Eight => {
                for (i, v) in q.iter_mut().enumerate() {
                    *v = i16::from(self.data[base + (i / 4) * NR * 4 + c * 4 + i % 4] as i8);
                }
                0.0
            }
        };
        Block {
            d: self.scales[at],
            m,
            q,
        }
    }

    /// `self` with `other`'s columns after its own (projections of the same input fused).
    pub fn stack(&self, other: &QWeights) -> Option<QWeights> {
        if self.k != other.k || self.bits != other.bits {
            return None;
        }
        QWeights::from_blocks(self.n + other.n, self.k, self.bits, |col, b| {
            if col < self.n {
                self.block(col, b)
            } else {
                other.block(col - self.n, b)
            }
        })
        .ok()
    }

    /// Output features.
    pub fn rows(&self) -> usize {
        self.n
    }

    /// Input features.
    pub fn cols(&self) -> usize {
        self.k
    }

    pub fn bits(&self) -> Bits {
        self.bits
    }

    /// Bytes held, which is what a forward reads.
    pub fn bytes(&self) -> usize {
        self.data.len() + 4 * (self.scales.len() + self.extra.len())
    }

    /// The weights as f32 `[n, k]` (tests and the reference path).
    pub fn dequantize(&self) -> Vec<f32> {
        let mut w = vec![0f32; self.n * self.k];
        for (col, row) in w.chunks_exact_mut(self.k.max(1)).enumerate() {
            self.dequantize_row(col, row);
        }
        w
    }

    /// Output feature `col`'s `k` weights as f32 into `out`: `d · q + m` per block, as GGUF
    /// dequantizes Q8_0 and Q4_1 (so those come out exactly). A tied embedding table reads its
    /// rows here instead of keeping an f32 copy.
    pub fn dequantize_row(&self, col: usize, out: &mut [f32]) {
        for b in 0..self.kb {
            let blk = self.block(col, b);
            for i in 0..QK.min(self.k - b * QK) {
                out[b * QK + i] = blk.d * f32::from(blk.q[i]) + blk.m;
            }
        }
    }

    /// `y = x Wᵀ` for `m` rows of `x` (`[m, k]`) into `y` (`[m, n]`), on `isa`.
    pub fn matmul(&self, isa: Isa, x: &[f32], m: usize, y: &mut [f32]) {
        // SAFETY: `f32` and `MaybeUninit<f32>` share a layout, and `matmul_into` only writes
        // initialized values.
        let y = unsafe { &mut *(y as *mut [f32] as *mut [MaybeUninit<f32>]) };
        self.matmul_into(isa, x, m, y);
    }

    /// `x Wᵀ` as a new `[m, n]` buffer. Every element is written once, so the buffer is not
    /// zeroed first (zeroing the outputs was 3% of a prefill).
    pub fn matmul_vec(&self, isa: Isa, x: &[f32], m: usize) -> Vec<f32> {
        let len = m * self.n;
        let mut y = Vec::with_capacity(len);
        self.matmul_into(isa, x, m, &mut y.spare_capacity_mut()[..len]);
        // SAFETY: `matmul_into` wrote all `m * n` elements (every row of every panel's columns).
        unsafe { y.set_len(len) };
        y
    }

    /// [`QWeights::matmul`] into a buffer that need not be initialized; writes every element.
    fn matmul_into(&self, isa: Isa, x: &[f32], m: usize, y: &mut [MaybeUninit<f32>]) {
        assert_eq!(x.len(), m * self.k, "input is not {m} x {}", self.k);
        assert_eq!(y.len(), m * self.n, "output is not {m} x {}", self.n);
        // Only the VNNI 8-bit kernels read the offset (unsigned) copy of the activations.
        let offset = matches!(isa, Isa::Avx512Vnni | Isa::AvxVnni) && self.bits == Bits::Eight;
        let a = QuantRows::quantize(x, m, self.k, self.kb, offset);
        let panels = self.n.div_ceil(NR);
        // Threads split the output columns: each element is still one thread's fixed-order sum.
        // A few pieces per thread, so that a thread the OS delays leaves some of its share to
        // the others rather than keeping them waiting at the join.
        let most = isa.panels_per_tile();
        let chunk = panels
            .div_ceil(PIECES_PER_THREAD * rayon::current_num_threads().max(1))
            .next_multiple_of(most);
        let out = SendPtr(y.as_mut_ptr().cast::<f32>());
        let starts: Vec<usize> = (0..panels).step_by(chunk).collect();
        starts.par_iter().for_each(|&first| {
            let out = &out;
            let mut tile: Tile = [[0f32; NR * PMAX]; MR];
            let end = (first + chunk).min(panels);
            let mut p = first;
            while p < end {
                let group = most.min(end - p);
                let cols = (group * NR).min(self.n - p * NR);
                for r0 in (0..m).step_by(MR) {
                    let rows = MR.min(m - r0);
                    self.tile(isa, &a, p, group, r0, rows, &mut tile);
                    for (r, t) in tile.iter().enumerate().take(rows) {
                        // SAFETY: each (row, column) is written by the one task that owns its
                        // panels, inside `y`'s bounds (checked above); `y` outlives the loop.
                        unsafe {
                            let dst = out.0.add((r0 + r) * self.n + p * NR);
                            std::ptr::copy_nonoverlapping(t.as_ptr(), dst, cols);
                        }
                    }
                }
                p += group;
            }
        });
    }

    /// Output `rows` × (`group` · NR) starting at row `r0` and panel `p` into `out`.
    #[allow(clippy::too_many_arguments)]
    fn tile(
        &self,
        isa: Isa,
        a: &QuantRows,
        p: usize,
        group: usize,
        r0: usize,
        rows: usize,
        out: &mut Tile,
    ) {
        // Fewer rows take more panels at once, so that enough independent dot products are in
        // flight to hide `vpdpbusd`'s latency. Integer sums are exact in any order, and every
        // float step stays per element, so the shape never changes a result. Panels a shape
        // does not take are left to the recursion below; other ISAs take one at a time.
        let took = match (isa, rows, group) {
            (Isa::Avx512Vnni, 1, 4..) => 4,
            (Isa::Avx512Vnni, 2.., 3..) => 3,
            (Isa::Avx512Vnni, _, 2..) => 2,
            _ => 1,
        };
        #[cfg(target_arch = "x86_64")]
        macro_rules! shapes {
            ($f:ident) => {
                match (rows, took) {
                    (1, 4) => x86::$f::<1, 4>(self, a, p, r0, out),
                    (1, 2) => x86::$f::<1, 2>(self, a, p, r0, out),
                    (1, _) => x86::$f::<1, 1>(self, a, p, r0, out),
                    (2, 3) => x86::$f::<2, 3>(self, a, p, r0, out),
                    (2, 2) => x86::$f::<2, 2>(self, a, p, r0, out),
                    (2, _) => x86::$f::<2, 1>(self, a, p, r0, out),
                    (3, 3) => x86::$f::<3, 3>(self, a, p, r0, out),
                    (3, 2) => x86::$f::<3, 2>(self, a, p, r0, out),
                    (3, _) => x86::$f::<3, 1>(self, a, p, r0, out),
                    (_, 2) => x86::$f::<MR, 2>(self, a, p, r0, out),
                    (_, 3) => x86::$f::<MR, 3>(self, a, p, r0, out),
                    (_, _) => x86::$f::<MR, 1>(self, a, p, r0, out),
                }
            };
        }
        // One-panel kernels, by row count.
        #[allow(unused_macros)]
        macro_rules! by_rows {
            ($($f:ident)::+) => {
                match rows {
                    1 => $($f)::+::<1>(self, a, p, r0, out),
                    2 => $($f)::+::<2>(self, a, p, r0, out),
                    3 => $($f)::+::<3>(self, a, p, r0, out),
                    _ => $($f)::+::<MR>(self, a, p, r0, out),
                }
            };
        }
        match isa {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `Isa::Avx512Vnni` is only chosen when the CPU has these features
            // (`Isa::detect`); callers passing it by hand on other CPUs are a bug.
            Isa::Avx512Vnni => unsafe {
                match self.bits {
                    Bits::Eight => shapes!(vnni8),
                    Bits::Four => shapes!(vnni4),
                }
            },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above, for AVX2 + FMA + AVX-VNNI.
            Isa::AvxVnni => unsafe {
                // Fewer rows, more accumulators each (see `avxvnni_q4`).
                macro_rules! vnni256 {
                    ($f:ident) => {
                        match rows {
                            1 => x86::$f::<1, 4>(self, a, p, r0, out),
                            2 => x86::$f::<2, 2>(self, a, p, r0, out),
                            3 => x86::$f::<3, 1>(self, a, p, r0, out),
                            _ => x86::$f::<MR, 1>(self, a, p, r0, out),
                        }
                    };
                }
                match self.bits {
                    Bits::Eight => vnni256!(avxvnni_q8),
                    Bits::Four => vnni256!(avxvnni_q4),
                }
            },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above, for AVX2 + FMA.
            Isa::Avx2 => unsafe {
                match self.bits {
                    Bits::Eight => by_rows!(x86::avx2_q8),
                    Bits::Four => by_rows!(x86::avx2_q4),
                }
            },
            #[cfg(target_arch = "aarch64")]
            // SAFETY: `Isa::NeonDot` is only chosen when the CPU has the dot-product extension
            // (`Isa::detect`).
            Isa::NeonDot => unsafe { by_rows!(arm::sdot) },
            #[cfg(target_arch = "aarch64")]
            // SAFETY: `Isa::NeonMmla` is only chosen when the CPU has i8mm and dotprod. A lone
            // row has no partner for `smmla`'s row pair and takes `sdot`.
            Isa::NeonMmla => unsafe {
                match rows {
                    1 => arm::sdot::<1>(self, a, p, r0, out),
                    2 => arm::mmla::<2, 1>(self, a, p, r0, out),
                    3 => arm::mmla::<3, 2>(self, a, p, r0, out),
                    _ => arm::mmla::<MR, 2>(self, a, p, r0, out),
                }
            },
            #[cfg(target_arch = "aarch64")]
            // SAFETY: every ARM64 CPU has NEON.
            Isa::Neon => unsafe { by_rows!(arm::smull) },
            _ => self.tile_scalar(a, p, r0, rows, out),
        }
        if took < group {
            let mut rest: Tile = [[0f32; NR * PMAX]; MR];
            self.tile(isa, a, p + took, group - took, r0, rows, &mut rest);
            for (o, r) in out.iter_mut().zip(&rest).take(rows) {
                o[took * NR..group * NR].copy_from_slice(&r[..(group - took) * NR]);
            }
        }
    }

    /// The reference: the same operations, one element at a time, one panel.
    fn tile_scalar(&self, a: &QuantRows, p: usize, r0: usize, rows: usize, out: &mut Tile) {
        for (r, o) in out.iter_mut().enumerate().take(rows) {
            let row = r0 + r;
            for (c, acc) in o.iter_mut().take(NR).enumerate() {
                *acc = 0.0;
                for b in 0..self.kb {
                    let blk = self.block(p * NR + c, b);
                    let qa = &a.q[row * a.stride + b * QK..][..QK];
                    let dot: i32 = (0..QK)
                        .map(|i| i32::from(blk.q[i]) * i32::from(qa[i]))
                        .sum();
                    let da = a.d[row * self.kb + b];
                    *acc = (dot as f32).mul_add(da * blk.d, *acc);
                    if self.bits == Bits::Four {
                        *acc = blk.m.mul_add(a.dsum[row * self.kb + b], *acc);
                    }
                }
            }
        }
    }
}

/// Column ranges per thread that a GEMM is cut into.
const PIECES_PER_THREAD: usize = 4;

/// Most panels one micro-tile covers.
pub(crate) const PMAX: usize = 6;

/// A micro-tile's output: up to [`MR`] rows of up to [`PMAX`] panels.
type Tile = [[f32; NR * PMAX]; MR];

/// A raw output pointer shared by the tasks of one call, each writing its own columns.
struct SendPtr(*mut f32);
// SAFETY: tasks write disjoint elements (see `QWeights::matmul`).
unsafe impl Sync for SendPtr {}
// SAFETY: as for Sync: the pointee outlives the scoped tasks, each writing its own elements.
unsafe impl Send for SendPtr {}

/// Fewest activation rows a thread quantizes (fewer run on the calling thread).
const PAR_QUANT_ROWS: usize = 16;

/// Activations quantized per row and block.
struct QuantRows {
    /// `[m][kb * QK]` int8, zero-padded.
    q: Vec<i8>,
    /// The same plus 128, as unsigned bytes: the left operand of `vpdpbusd` for 8-bit weights
    /// (empty for every other kernel). Offsetting here rather than in the kernel also
    /// sidesteps an LLVM 22 hang: with `target-cpu=native`, a vector xor of a broadcast never
    /// finished instruction selection (`SelectionDAG::Legalize`).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    u: Vec<u8>,
    /// `[m][kb]` scales.
    d: Vec<f32>,
    /// `[m][kb]` `d · Σq` per block: the 4-bit minimum term's row factor, rounded once here.
    dsum: Vec<f32>,
    stride: usize,
}

impl QuantRows {
    /// `offset`: also keep `u`, the activations plus 128 as unsigned bytes.
    fn quantize(x: &[f32], m: usize, k: usize, kb: usize, offset: bool) -> QuantRows {
        let stride = kb * QK;
        let mut q = vec![0i8; m * stride];
        let mut d = vec![0f32; m * kb];
        let mut dsum = vec![0f32; m * kb];
        let mut u = vec![0u8; if offset { m * stride } else { 0 }];
        let row = |r: usize, q: &mut [i8], d: &mut [f32], dsum: &mut [f32]| {
            for b in 0..kb {
                let src = &x[r * k + b * QK..r * k + ((b + 1) * QK).min(k)];
                let blk: &mut [i8; QK] = (&mut q[b * QK..][..QK]).try_into().expect("QK bytes");
                d[b] = quantize_sym(src, blk);
                let sum: i32 = blk.iter().map(|&v| i32::from(v)).sum();
                dsum[b] = d[b] * sum as f32;
            }
        };
        // Rows are independent; a prefill's hundreds of them are worth the threads, a decode
        // step's few run in place (rayon does not split below the minimum length).
        q.par_chunks_mut(stride)
            .zip(d.par_chunks_mut(kb))
            .zip(dsum.par_chunks_mut(kb))
            .enumerate()
            .with_min_len(PAR_QUANT_ROWS)
            .for_each(|(r, ((q, d), s))| row(r, q, d, s));
        if offset {
            for (o, &v) in u.iter_mut().zip(&q) {
                *o = (v as u8) ^ 0x80;
            }
        }
        QuantRows {
            q,
            u,
            d,
            dsum,
            stride,
        }
    }
}

#[cfg(target_arch = "x86_64")]
// Tiles index several register arrays by the same row and panel; iterators would hide that.
#[allow(clippy::needless_range_loop)]
mod x86 {
    use std::arch::x86_64::*;

    use super::{Bits, NR, QK, QWeights, QuantRows, Tile, quant_scale};

    /// [`super::quantize_sym_portable`] in two 512-bit vectors, operation for operation.
    #[target_feature(enable = "avx512f")]
    pub(super) fn quantize_sym(x: &[f32], q: &mut [i8; QK]) -> f32 {
        let n = x.len().min(QK);
        let mask = |lo: usize| -> __mmask16 {
            let k = n.saturating_sub(lo).min(16);
            ((1u32 << k) - 1) as __mmask16
        };
        // SAFETY: masked lanes past `n` are neither read nor faulted on.
        let (a, b) = unsafe {
            (
                _mm512_maskz_loadu_ps(mask(0), x.as_ptr()),
                _mm512_maskz_loadu_ps(mask(16), x.as_ptr().wrapping_add(16)),
            )
        };
        let zero = _mm512_setzero_ps();
        let poison = _mm512_add_ps(_mm512_mul_ps(a, zero), _mm512_mul_ps(b, zero));
        let poisoned = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(poison, poison) != 0;
        let amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
        let Some((d, inv)) = quant_scale(poisoned, amax) else {
            *q = [0; QK];
            return if poisoned { f32::NAN } else { 0.0 };
        };
        let (inv, lo, hi) = (
            _mm512_set1_ps(inv),
            _mm512_set1_ps(-127.0),
            _mm512_set1_ps(127.0),
        );
        for (h, v) in [a, b].into_iter().enumerate() {
            let r = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
                _mm512_mul_ps(v, inv),
            );
            let bytes =
                _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(r, lo), hi)));
            // SAFETY: `q` holds 2 × 16 bytes.
            unsafe { _mm_storeu_si128(q.as_mut_ptr().add(16 * h).cast(), bytes) };
        }
        d
    }

    /// [`super::quantize_sym_portable`] in four 256-bit vectors, operation for operation (the
    /// maximum is exact in any order).
    #[target_feature(enable = "avx2")]
    pub(super) fn quantize_sym_avx2(x: &[f32], q: &mut [i8; QK]) -> f32 {
        let padded = super::padded(x);
        // SAFETY: `padded` holds 4 × 8 floats.
        let v: [__m256; 4] =
            std::array::from_fn(|i| unsafe { _mm256_loadu_ps(padded.as_ptr().add(8 * i)) });
        let zero = _mm256_setzero_ps();
        let poison = v
            .iter()
            .fold(zero, |p, &e| _mm256_add_ps(p, _mm256_mul_ps(e, zero)));
        let poisoned = _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_UNORD_Q>(poison, poison)) != 0;
        let sign = _mm256_set1_ps(-0.0);
        let m = v
            .iter()
            .fold(zero, |m, &e| _mm256_max_ps(m, _mm256_andnot_ps(sign, e)));
        let m = _mm256_max_ps(m, _mm256_permute2f128_ps::<1>(m, m));
        let m = _mm256_max_ps(m, _mm256_permute_ps::<0b01_00_11_10>(m));
        let amax = _mm256_cvtss_f32(_mm256_max_ps(m, _mm256_permute_ps::<0b10_11_00_01>(m)));
        let Some((d, inv)) = quant_scale(poisoned, amax) else {
            *q = [0; QK];
            return if poisoned { f32::NAN } else { 0.0 };
        };
        let (inv, lo, hi) = (
            _mm256_set1_ps(inv),
            _mm256_set1_ps(-127.0),
            _mm256_set1_ps(127.0),
        );
        let ints = v.map(|e| {
            let r = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
                _mm256_mul_ps(e, inv),
            );
            _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi))
        });
        // The packs interleave 128-bit lanes: dwords come out as v0a v1a v2a v3a v0b v1b v2b
        // v3b (a, b: each vector's halves), which the permutation puts back in order.
        let words = (
            _mm256_packs_epi32(ints[0], ints[1]),
            _mm256_packs_epi32(ints[2], ints[3]),
        );
        let bytes = _mm256_permutevar8x32_epi32(
            _mm256_packs_epi16(words.0, words.1),
            _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7),
        );
        // SAFETY: `q` holds 32 bytes.
        unsafe { _mm256_storeu_si256(q.as_mut_ptr().cast(), bytes) };
        d
    }

    /// Four consecutive activation bytes broadcast to every i32 lane.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn four<T>(q: &[T], at: usize) -> __m512i {
        debug_assert!(at + 4 <= q.len() && size_of::<T>() == 1);
        // SAFETY: callers pass `at + 4 <= q.len()` (blocks are zero-padded to QK).
        _mm512_set1_epi32(unsafe { std::ptr::read_unaligned(q.as_ptr().add(at) as *const i32) })
    }

    /// The float steps of one block, shared by both widths: `acc += dot · (da · d)`, then for
    /// 4 bits `acc += m · (da · Σqa)`, each one fused multiply-add.
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn block_epilogue(
        acc: __m512,
        dot: __m512i,
        da: f32,
        scales: __m512,
        mins: Option<(__m512, f32)>,
    ) -> __m512 {
        let s = _mm512_mul_ps(_mm512_set1_ps(da), scales);
        let acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), s, acc);
        match mins {
            Some((m, da_sum)) => _mm512_fmadd_ps(m, _mm512_set1_ps(da_sum), acc),
            None => acc,
        }
    }

    /// Panel blocks ahead of the one being read that [`prefetch_ahead`] fetches.
    const AHEAD_BLOCKS: usize = 4;
    /// Most rows of a product whose kernels prefetch its weights.
    const PREFETCH_ROWS: usize = 8;

    /// Whether the tile of rows from `r0` prefetches: the first of a product of at most
    /// [`PREFETCH_ROWS`] rows (a decode step of a few sequences), which reads each weight for
    /// few rows and waits on memory. Measured on Zen 5: batch-1 decode ~1.05x, batch 8 ~1.19x
    /// (the AVX2 and AVX-VNNI paths there ~1.15x); batch 32 no better and a 512-token prefill
    /// ~3% worse, their panels being reused enough.
    #[inline(always)]
    fn prefetches(w: &QWeights, a: &QuantRows, r0: usize) -> bool {
        r0 == 0 && a.d.len() <= PREFETCH_ROWS * w.kb
    }

    /// Prefetches block `b + AHEAD_BLOCKS` of each of the tile's `panels` panels from `p0`,
    /// its scales and its minimums or sums, or past the panels' last block the next tile's
    /// first. Each panel is a stream of its own a few KiB long, too short for the hardware's
    /// prefetchers to have caught up with before it ends.
    #[inline(always)]
    fn prefetch_ahead(w: &QWeights, p0: usize, panels: usize, b: usize) {
        let ahead = b + AHEAD_BLOCKS;
        let (first, block) = if ahead < w.kb {
            (p0, ahead)
        } else {
            (p0 + panels, ahead - w.kb)
        };
        if block >= w.kb {
            return;
        }
        let pbb = w.bits.panel_block_bytes();
        for j in 0..panels {
            let at = (first + j) * w.kb + block;
            if at * pbb >= w.data.len() {
                return;
            }
            let data = w.data.as_ptr().wrapping_add(at * pbb);
            for line in (0..pbb).step_by(64) {
                crate::kernels::prefetch(data.wrapping_add(line));
            }
            crate::kernels::prefetch(w.scales.as_ptr().wrapping_add(at * NR));
            crate::kernels::prefetch(w.extra.as_ptr().wrapping_add(at * NR));
        }
    }

    /// 8-bit weights, `R` rows × `P` panels. `vpdpbusd` multiplies unsigned by signed bytes, so
    /// activations are offset by 128 and `128 · Σw` is subtracted: the integer dot stays exact.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub(super) unsafe fn vnni8<const R: usize, const P: usize>(
        w: &QWeights,
        a: &QuantRows,
        p0: usize,
        r0: usize,
        out: &mut Tile,
    ) {
        let pbb = Bits::Eight.panel_block_bytes();
        let mut acc = [[_mm512_setzero_ps(); P]; R];
        let prefetch = prefetches(w, a, r0);
        for b in 0..w.kb {
            if prefetch {
                prefetch_ahead(w, p0, P, b);
            }
            let mut dot = [[_mm512_setzero_si512(); P]; R];
            for k4 in 0..QK / 4 {
                let mut wv = [_mm512_setzero_si512(); P];
                for (j, v) in wv.iter_mut().enumerate() {
                    let base = ((p0 + j) * w.kb + b) * pbb;
                    // SAFETY: the panel holds QK * NR bytes per block.
                    *v = unsafe {
                        _mm512_loadu_si512(w.data.as_ptr().add(base + k4 * NR * 4) as *const _)
                    };
                }
                for (r, d) in dot.iter_mut().enumerate() {
                    // SAFETY: inside the row's padded blocks.
                    let av = unsafe { four(&a.u, (r0 + r) * a.stride + b * QK + k4 * 4) };
                    for j in 0..P {
                        d[j] = _mm512_dpbusd_epi32(d[j], av, wv[j]);
                    }
                }
            }
            for j in 0..P {
                let at = ((p0 + j) * w.kb + b) * NR;
                // SAFETY: NR scales and sums per panel block.
                let (ws, sums) = unsafe {
                    (
                        _mm512_loadu_ps(w.scales.as_ptr().add(at)),
                        _mm512_loadu_si512(w.extra.as_ptr().add(at) as *const _),
                    )
                };
                let correction = _mm512_slli_epi32::<7>(sums);
                for r in 0..R {
                    let exact = _mm512_sub_epi32(dot[r][j], correction);
                    let da = a.d[(r0 + r) * w.kb + b];
                    acc[r][j] = block_epilogue(acc[r][j], exact, da, ws, None);
                }
            }
        }
        for r in 0..R {
            for j in 0..P {
                // SAFETY: `out[r]` holds PMAX * NR floats.
                unsafe { _mm512_storeu_ps(out[r].as_mut_ptr().add(j * NR), acc[r][j]) };
            }
        }
    }

    /// 4-bit weights, `R` rows × `P` panels: unsigned nibbles times signed activations is
    /// exactly `vpdpbusd`. Low and high nibbles feed separate accumulators (more in flight).
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub(super) unsafe fn vnni4<const R: usize, const P: usize>(
        w: &QWeights,
        a: &QuantRows,
        p0: usize,
        r0: usize,
        out: &mut Tile,
    ) {
        let low = _mm512_set1_epi8(15);
        let pbb = Bits::Four.panel_block_bytes();
        let mut acc = [[_mm512_setzero_ps(); P]; R];
        let prefetch = prefetches(w, a, r0);
        for b in 0..w.kb {
            if prefetch {
                prefetch_ahead(w, p0, P, b);
            }
            // Low and high nibbles feed the same accumulator: integer sums are exact in any
            // order, and one accumulator per (row, panel) leaves registers for more of them.
            let mut dot = [[_mm512_setzero_si512(); P]; R];
            for q4 in 0..4 {
                let mut lo = [_mm512_setzero_si512(); P];
                let mut hi = [_mm512_setzero_si512(); P];
                for j in 0..P {
                    let base = ((p0 + j) * w.kb + b) * pbb;
                    // SAFETY: the panel holds QK * NR / 2 bytes per block.
                    let packed = unsafe {
                        _mm512_loadu_si512(w.data.as_ptr().add(base + q4 * NR * 4) as *const _)
                    };
                    lo[j] = _mm512_and_si512(packed, low);
                    hi[j] = _mm512_and_si512(_mm512_srli_epi16::<4>(packed), low);
                }
                for r in 0..R {
                    let at = (r0 + r) * a.stride + b * QK + q4 * 4;
                    // SAFETY: `at + 20` is inside the row's padded blocks.
                    let (al, ah) = unsafe { (four(&a.q, at), four(&a.q, at + 16)) };
                    for j in 0..P {
                        dot[r][j] = _mm512_dpbusd_epi32(dot[r][j], lo[j], al);
                        dot[r][j] = _mm512_dpbusd_epi32(dot[r][j], hi[j], ah);
                    }
                }
            }
            for j in 0..P {
                let at = ((p0 + j) * w.kb + b) * NR;
                // SAFETY: NR scales and minimums per panel block.
                let (ws, mins) = unsafe {
                    (
                        _mm512_loadu_ps(w.scales.as_ptr().add(at)),
                        _mm512_loadu_ps(w.extra.as_ptr().add(at) as *const f32),
                    )
                };
                for r in 0..R {
                    let i = (r0 + r) * w.kb + b;
                    let m = Some((mins, a.dsum[i]));
                    acc[r][j] = block_epilogue(acc[r][j], dot[r][j], a.d[i], ws, m);
                }
            }
        }
        for r in 0..R {
            for j in 0..P {
                // SAFETY: `out[r]` holds PMAX * NR floats.
                unsafe { _mm512_storeu_ps(out[r].as_mut_ptr().add(j * NR), acc[r][j]) };
            }
        }
    }

    /// AVX2, 4-bit weights. `vpmaddubsw` multiplies unsigned by signed bytes, which is what the
    /// nibbles (0..=15) and the activations (-127..=127) are, and adds pairs into i16 lanes.
    /// Each lane then collects a whole block's 16 products (16 · 15 · 127 = 30,480 < 2¹⁵) with
    /// plain 16-bit adds before one `vpmaddwd` widens them: exact integers, so the same sums
    /// as the reference, at about half the instructions of widening every step.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn avx2_q4<const R: usize>(
        w: &QWeights,
        a: &QuantRows,
        p: usize,
        r0: usize,
        out: &mut Tile,
    ) {
        let ones = _mm256_set1_epi16(1);
        let low = _mm256_set1_epi8(15);
        let pbb = Bits::Four.panel_block_bytes();
        // The sums wait in `out` between blocks, which leaves the 16 registers to the 2R dot
        // products, one weight pair and a broadcast (R = 4 spilled in the loop otherwise).
        for o in out.iter_mut().take(R) {
            o[..NR].fill(0.0);
        }
        let rows: [usize; R] = std::array::from_fn(|r| (r0 + r) * a.stride);
        let prefetch = prefetches(w, a, r0);
        for b in 0..w.kb {
            if prefetch {
                prefetch_ahead(w, p, 1, b);
            }
            let mut dot = [[_mm256_setzero_si256(); 2]; R];
            // Steps 0..4 take the low nibbles of group `step`, 4..8 the high ones of the same
            // bytes (values 16 apart), reloaded rather than held.
            for step in 0..8 {
                let (g, high) = (step % 4, step >= 4);
                // SAFETY: in bounds of the panel block (QK * NR / 2 bytes): group `g`'s 64
                // bytes, each 32-byte half covering 8 columns.
                let wv = unsafe {
                    let ptr = w.data.as_ptr().add((p * w.kb + b) * pbb + g * NR * 4);
                    [0, 1].map(|h| {
                        let v = _mm256_loadu_si256(ptr.add(32 * h) as *const __m256i);
                        let v = if high { _mm256_srli_epi16::<4>(v) } else { v };
                        _mm256_and_si256(v, low)
                    })
                };
                let k = b * QK + 4 * g + if high { 16 } else { 0 };
                for (d, &row) in dot.iter_mut().zip(&rows) {
                    // SAFETY: `row + k + 4` is inside the row's zero-padded blocks.
                    let av = unsafe { four256(&a.q, row + k) };
                    for h in 0..2 {
                        d[h] = _mm256_add_epi16(d[h], _mm256_maddubs_epi16(wv[h], av));
                    }
                }
            }
            // SAFETY: NR scales and minimums per panel block.
            let (ws, mins) = unsafe { epilogue_operands(w, p, b) };
            for (r, (o, d)) in out.iter_mut().zip(dot).enumerate() {
                let i = (r0 + r) * w.kb + b;
                let dot = d.map(|v| _mm256_madd_epi16(v, ones));
                // SAFETY: `o` holds at least NR = 16 floats.
                unsafe { accumulate_avx2(o, dot, a.d[i], ws, Some((mins, a.dsum[i]))) };
            }
        }
    }

    /// AVX2, 8-bit weights. Both operands are signed, so each product is formed as
    /// |a| × (w · sign a) for `vpmaddubsw`; its pair sums reach 2 · 127² = 32,258, which leaves
    /// no room to add more in 16 bits, so `vpmaddwd` widens every step.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn avx2_q8<const R: usize>(
        w: &QWeights,
        a: &QuantRows,
        p: usize,
        r0: usize,
        out: &mut Tile,
    ) {
        let ones = _mm256_set1_epi16(1);
        let pbb = Bits::Eight.panel_block_bytes();
        let mut acc = [[_mm256_setzero_ps(); 2]; R];
        let prefetch = prefetches(w, a, r0);
        for b in 0..w.kb {
            if prefetch {
                prefetch_ahead(w, p, 1, b);
            }
            let mut dot = [[_mm256_setzero_si256(); 2]; R];
            for k4 in 0..QK / 4 {
                // SAFETY: in bounds of the panel block (QK * NR bytes): step `k4`'s 64 bytes.
                let wv = unsafe {
                    let ptr = w.data.as_ptr().add((p * w.kb + b) * pbb + k4 * NR * 4);
                    [0, 1].map(|h| _mm256_loadu_si256(ptr.add(32 * h) as *const __m256i))
                };
                for (r, d) in dot.iter_mut().enumerate() {
                    let at = (r0 + r) * a.stride + b * QK + k4 * 4;
                    // SAFETY: `at + 4` is inside the row's padded blocks.
                    let av = unsafe { four256(&a.q, at) };
                    let abs = _mm256_sign_epi8(av, av);
                    for h in 0..2 {
                        let pairs = _mm256_maddubs_epi16(abs, _mm256_sign_epi8(wv[h], av));
                        d[h] = _mm256_add_epi32(d[h], _mm256_madd_epi16(pairs, ones));
                    }
                }
            }
            // SAFETY: NR scales per panel block.
            let (ws, _) = unsafe { epilogue_operands(w, p, b) };
            for r in 0..R {
                let da = _mm256_set1_ps(a.d[(r0 + r) * w.kb + b]);
                for h in 0..2 {
                    let s = _mm256_mul_ps(da, ws[h]);
                    acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r][h]), s, acc[r][h]);
                }
            }
        }
        // SAFETY: each `out[r]` holds at least NR = 16 floats.
        unsafe { store_avx2(acc, out) };
    }

    /// AVX-VNNI, 4-bit weights: [`vnni4`]'s `vpdpbusd` (unsigned nibbles times signed
    /// activations, four products summed into each i32 lane) on 256-bit vectors, one panel as
    /// two 8-column halves. Each row's products go to `A` accumulators in turn, added at the
    /// block's end (exact integers, so any `A` gives the same sums): one row alone would
    /// otherwise wait on `vpdpbusd`'s latency at every step, while four rows fill the
    /// registers with one each. The float sums wait in `out` between blocks, as in
    /// [`avx2_q4`].
    #[target_feature(enable = "avx2,fma,avxvnni")]
    pub(super) unsafe fn avxvnni_q4<const R: usize, const A: usize>(
        w: &QWeights,
        a: &QuantRows,
        p: usize,
        r0: usize,
        out: &mut Tile,
    ) {
        let low = _mm256_set1_epi8(15);
        let pbb = Bits::Four.panel_block_bytes();
        for o in out.iter_mut().take(R) {
            o[..NR].fill(0.0);
        }
        let rows: [usize; R] = std::array::from_fn(|r| (r0 + r) * a.stride);
        let prefetch = prefetches(w, a, r0);
        for b in 0..w.kb {
            if prefetch {
                prefetch_ahead(w, p, 1, b);
            }
            let mut dot = [[[_mm256_setzero_si256(); 2]; A]; R];
            for g in 0..4 {
                // SAFETY: in bounds of the panel block (QK * NR / 2 bytes): group `g`'s 64
                // bytes, each 32-byte half covering 8 columns.
                let packed = unsafe {
                    let ptr = w.data.as_ptr().add((p * w.kb + b) * pbb + g * NR * 4);
                    [0, 1].map(|h| _mm256_loadu_si256(ptr.add(32 * h) as *const __m256i))
                };
                let lo = packed.map(|v| _mm256_and_si256(v, low));
                let hi = packed.map(|v| _mm256_and_si256(_mm256_srli_epi16::<4>(v), low));
                for (d, &row) in dot.iter_mut().zip(&rows) {
                    let at = row + b * QK + 4 * g;
                    // SAFETY: `at + 20` is inside the row's zero-padded blocks.
                    let (al, ah) = unsafe { (four256(&a.q, at), four256(&a.q, at + 16)) };
                    let (dl, dh) = ((2 * g) % A, (2 * g + 1) % A);
                    for h in 0..2 {
                        d[dl][h] = _mm256_dpbusd_avx_epi32(d[dl][h], lo[h], al);
                        d[dh][h] = _mm256_dpbusd_avx_epi32(d[dh][h], hi[h], ah);
                    }
                }
            }
            // SAFETY: NR scales and minimums per panel block.
            let (ws, mins) = unsafe { epilogue_operands(w, p, b) };
            for (r, (o, d)) in out.iter_mut().zip(dot).enumerate() {
                let i = (r0 + r) * w.kb + b;
                // SAFETY: `o` holds at least NR = 16 floats.
                unsafe { accumulate_avx2(o, sum_sets(d), a.d[i], ws, Some((mins, a.dsum[i]))) };
            }
        }
    }

    /// AVX-VNNI, 8-bit weights: [`vnni8`]'s offset activations (`vpdpbusd` wants one unsigned
    /// operand) and `128 · Σw` correction, on 256-bit vectors, with [`avxvnni_q4`]'s `A`
    /// accumulators per row.
    #[target_feature(enable = "avx2,fma,avxvnni")]
    pub(super) unsafe fn avxvnni_q8<const R: usize, const A: usize>(
        w: &QWeights,
        a: &QuantRows,
        p: usize,
        r0: usize,
        out: &mut Tile,
    ) {
        let pbb = Bits::Eight.panel_block_bytes();
        for o in out.iter_mut().take(R) {
            o[..NR].fill(0.0);
        }
        let rows: [usize; R] = std::array::from_fn(|r| (r0 + r) * a.stride);
        let prefetch = prefetches(w, a, r0);
        for b in 0..w.kb {
            if prefetch {
                prefetch_ahead(w, p, 1, b);
            }
            let mut dot = [[[_mm256_setzero_si256(); 2]; A]; R];
            for k4 in 0..QK / 4 {
                // SAFETY: in bounds of the panel block (QK * NR bytes): step `k4`'s 64 bytes.
                let wv = unsafe {
                    let ptr = w.data.as_ptr().add((p * w.kb + b) * pbb + k4 * NR * 4);
                    [0, 1].map(|h| _mm256_loadu_si256(ptr.add(32 * h) as *const __m256i))
                };
                for (d, &row) in dot.iter_mut().zip(&rows) {
                    // SAFETY: `row + b * QK + k4 * 4 + 4` is inside the row's padded blocks.
                    let av = unsafe { four256(&a.u, row + b * QK + k4 * 4) };
                    let d = &mut d[k4 % A];
                    for h in 0..2 {
                        d[h] = _mm256_dpbusd_avx_epi32(d[h], av, wv[h]);
                    }
                }
            }
            let at = (p * w.kb + b) * NR;
            // SAFETY: NR scales and column sums per panel block.
            let (ws, _) = unsafe { epilogue_operands(w, p, b) };
            let correction = [0, 1].map(|h| {
                // SAFETY: as above.
                let sums = unsafe { _mm256_loadu_si256(w.extra.as_ptr().add(at + 8 * h).cast()) };
                _mm256_slli_epi32::<7>(sums)
            });
            for (r, (o, d)) in out.iter_mut().zip(dot).enumerate() {
                let d = sum_sets(d);
                let exact = [0, 1].map(|h| _mm256_sub_epi32(d[h], correction[h]));
                // SAFETY: `o` holds at least NR = 16 floats.
                unsafe { accumulate_avx2(o, exact, a.d[(r0 + r) * w.kb + b], ws, None) };
            }
        }
    }

    /// A row's `A` accumulator sets added into one (exact: integers).
    #[target_feature(enable = "avx2")]
    #[inline]
    fn sum_sets<const A: usize>(d: [[__m256i; 2]; A]) -> [__m256i; 2] {
        let mut s = d[0];
        for set in &d[1..] {
            for h in 0..2 {
                s[h] = _mm256_add_epi32(s[h], set[h]);
            }
        }
        s
    }

    /// One block's float steps on a row's 16 sums held in `o`: `o += dot · (da · d)`, then for
    /// 4 bits `o += m · (da · Σqa)`, each a fused multiply-add, as the reference does them.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn accumulate_avx2(
        o: &mut [f32],
        dot: [__m256i; 2],
        da: f32,
        ws: [__m256; 2],
        mins: Option<([__m256; 2], f32)>,
    ) {
        debug_assert!(o.len() >= NR);
        let da = _mm256_set1_ps(da);
        for h in 0..2 {
            // SAFETY: the caller's `o` holds at least NR = 16 floats.
            let at = unsafe { o.as_mut_ptr().add(8 * h) };
            // SAFETY: as above.
            let acc = unsafe { _mm256_loadu_ps(at) };
            let acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[h]), _mm256_mul_ps(da, ws[h]), acc);
            let acc = match mins {
                Some((m, t)) => _mm256_fmadd_ps(m[h], _mm256_set1_ps(t), acc),
                None => acc,
            };
            // SAFETY: as above.
            unsafe { _mm256_storeu_ps(at, acc) };
        }
    }

    /// Four consecutive activation bytes broadcast to every i32 lane of a 256-bit vector.
    #[target_feature(enable = "avx2")]
    #[inline]
    unsafe fn four256<T>(q: &[T], at: usize) -> __m256i {
        debug_assert!(at + 4 <= q.len() && size_of::<T>() == 1);
        // SAFETY: callers pass `at + 4 <= q.len()` (blocks are zero-padded to QK).
        _mm256_set1_epi32(unsafe { std::ptr::read_unaligned(q.as_ptr().add(at) as *const i32) })
    }

    /// Panel block `(p, b)`'s scales and extras (minimums for 4 bits), as two 8-column halves.
    #[target_feature(enable = "avx2")]
    #[inline]
    unsafe fn epilogue_operands(w: &QWeights, p: usize, b: usize) -> ([__m256; 2], [__m256; 2]) {
        let at = (p * w.kb + b) * NR;
        // SAFETY: the caller's block is inside the panel; NR values each.
        unsafe {
            (
                [0, 1].map(|h| _mm256_loadu_ps(w.scales.as_ptr().add(at + 8 * h))),
                [0, 1].map(|h| _mm256_loadu_ps(w.extra.as_ptr().add(at + 8 * h).cast::<f32>())),
            )
        }
    }

    /// The tile's `R` rows of 16 sums into `out`.
    #[target_feature(enable = "avx2")]
    #[inline]
    unsafe fn store_avx2<const R: usize>(acc: [[__m256; 2]; R], out: &mut Tile) {
        for (o, a) in out.iter_mut().zip(acc) {
            for (h, v) in a.into_iter().enumerate() {
                // SAFETY: `o` holds at least NR = 16 floats.
                unsafe { _mm256_storeu_ps(o.as_mut_ptr().add(8 * h), v) };
            }
        }
    }
}

#[cfg(target_arch = "aarch64")]
// Tiles index several register arrays by the same row and column group; iterators would hide it.
#[allow(clippy::needless_range_loop)]
mod arm {
    use std::arch::aarch64::*;

    use super::{Bits, NR, QK, QWeights, QuantRows, Tile, quant_scale};

    /// [`super::quantize_sym_portable`] in eight 128-bit vectors, operation for operation (the
    /// maximum is exact in any order; `fmaxnm`/`fminnm` are `f32::max`/`min`).
    #[target_feature(enable = "neon")]
    pub(super) fn quantize_sym(x: &[f32], q: &mut [i8; QK]) -> f32 {
        let padded = super::padded(x);
        // SAFETY: `padded` holds 8 × 4 floats.
        let v: [float32x4_t; 8] =
            std::array::from_fn(|i| unsafe { vld1q_f32(padded.as_ptr().add(4 * i)) });
        let zero = vdupq_n_f32(0.0);
        let poison = v
            .iter()
            .fold(zero, |p, &e| vaddq_f32(p, vmulq_f32(e, zero)));
        // A lane is NaN exactly when it is not equal to itself.
        let poisoned = vminvq_u32(vceqq_f32(poison, poison)) == 0;
        let amax = vmaxnmvq_f32(v.iter().fold(zero, |m, &e| vmaxnmq_f32(m, vabsq_f32(e))));
        let Some((d, inv)) = quant_scale(poisoned, amax) else {
            *q = [0; QK];
            return if poisoned { f32::NAN } else { 0.0 };
        };
        let (inv, lo, hi) = (vdupq_n_f32(inv), vdupq_n_f32(-127.0), vdupq_n_f32(127.0));
        let ints = v.map(|e| {
            let r = vrndnq_f32(vmulq_f32(e, inv));
            vcvtq_s32_f32(vminnmq_f32(vmaxnmq_f32(r, lo), hi))
        });
        let words: [int16x8_t; 4] = std::array::from_fn(|i| {
            vcombine_s16(vmovn_s32(ints[2 * i]), vmovn_s32(ints[2 * i + 1]))
        });
        for h in 0..2 {
            let bytes = vcombine_s8(vmovn_s16(words[2 * h]), vmovn_s16(words[2 * h + 1]));
            // SAFETY: `q` holds 2 × 16 bytes.
            unsafe { vst1q_s8(q.as_mut_ptr().add(16 * h), bytes) };
        }
        d
    }

    /// Exact integer dot products of four weight columns (16 bytes: each column's 4
    /// consecutive values) with 4 activation bytes repeated across the vector.
    trait Dot4: Copy {
        /// # Safety
        /// The CPU has the implementor's features.
        unsafe fn zero() -> Self;
        /// # Safety
        /// As [`Dot4::zero`].
        unsafe fn add(self, w: int8x16_t, a: int8x16_t) -> Self;
        /// The four columns' sums.
        ///
        /// # Safety
        /// As [`Dot4::zero`].
        unsafe fn sums(self) -> int32x4_t;
    }

    /// `sdot`: each i32 lane gains its column's 4 products.
    #[derive(Clone, Copy)]
    struct Sdot(int32x4_t);

    impl Dot4 for Sdot {
        #[inline]
        #[target_feature(enable = "neon,dotprod")]
        unsafe fn zero() -> Self {
            Sdot(vdupq_n_s32(0))
        }
        #[inline]
        #[target_feature(enable = "neon,dotprod")]
        unsafe fn add(self, w: int8x16_t, a: int8x16_t) -> Self {
            let mut acc = self.0;
            // `vdotq_s32` is not stable Rust yet; the instruction is the same.
            // SAFETY: the caller checked the dot-product extension; registers only.
            unsafe {
                std::arch::asm!(
                    "sdot {acc:v}.4s, {w:v}.16b, {a:v}.16b",
                    acc = inout(vreg) acc,
                    w = in(vreg) w,
                    a = in(vreg) a,
                    options(pure, nomem, nostack),
                )
            };
            Sdot(acc)
        }
        #[inline]
        #[target_feature(enable = "neon,dotprod")]
        unsafe fn sums(self) -> int32x4_t {
            self.0
        }
    }

    /// `smull` + `sadalp`: 16-bit products (|w · a| ≤ 127 · 127), added pairwise into i32
    /// lanes that hold half a column each; [`Dot4::sums`] adds the halves.
    #[derive(Clone, Copy)]
    struct Smull(int32x4_t, int32x4_t);

    impl Dot4 for Smull {
        #[inline]
        #[target_feature(enable = "neon")]
        unsafe fn zero() -> Self {
            Smull(vdupq_n_s32(0), vdupq_n_s32(0))
        }
        #[inline]
        #[target_feature(enable = "neon")]
        unsafe fn add(self, w: int8x16_t, a: int8x16_t) -> Self {
            Smull(
                vpadalq_s16(self.0, vmull_s8(vget_low_s8(w), vget_low_s8(a))),
                vpadalq_s16(self.1, vmull_high_s8(w, a)),
            )
        }
        #[inline]
        #[target_feature(enable = "neon")]
        unsafe fn sums(self) -> int32x4_t {
            vpaddq_s32(self.0, self.1)
        }
    }

    /// Four consecutive activation bytes repeated across a vector.
    ///
    /// # Safety
    /// `at + 4 <= q.len()`.
    #[inline(always)]
    unsafe fn four(q: &[i8], at: usize) -> int8x16_t {
        debug_assert!(at + 4 <= q.len());
        // SAFETY: the caller keeps `at + 4` inside `q` (blocks are zero-padded to QK).
        let v = unsafe { std::ptr::read_unaligned(q.as_ptr().add(at) as *const i32) };
        // SAFETY: NEON is part of every ARM64 CPU.
        unsafe { vreinterpretq_s8_s32(vdupq_n_s32(v)) }
    }

    /// `R` rows × one panel, both widths, with `D`'s integer dot products and the scalar
    /// path's float steps per block: `acc += dot · (da · d)`, then for 4 bits
    /// `acc += m · (da · Σqa)`, each one fused multiply-add.
    ///
    /// # Safety
    /// The CPU has `D`'s features; `p`, `r0` and `R` lie inside `w` and `a`.
    #[inline(always)]
    unsafe fn panel<D: Dot4, const R: usize>(
        w: &QWeights,
        a: &QuantRows,
        p: usize,
        r0: usize,
        out: &mut Tile,
    ) {
        let four_bits = w.bits == Bits::Four;
        let pbb = w.bits.panel_block_bytes();
        // SAFETY: the caller checked `D`'s features. Weight loads stay inside the panel block
        // (QK · NR or QK · NR / 2 bytes), scale loads inside its NR scales and extras, and
        // activation reads inside the rows' zero-padded blocks.
        unsafe {
            let mut acc = [[vdupq_n_f32(0.0); NR / 4]; R];
            let low = vdupq_n_u8(15);
            for b in 0..w.kb {
                let base = w.data.as_ptr().add((p * w.kb + b) * pbb);
                let mut dot = [[D::zero(); NR / 4]; R];
                if four_bits {
                    for q4 in 0..4 {
                        let packed: [uint8x16_t; NR / 4] =
                            std::array::from_fn(|h| vld1q_u8(base.add(q4 * NR * 4 + 16 * h)));
                        let lo = packed.map(|v| vreinterpretq_s8_u8(vandq_u8(v, low)));
                        let hi = packed.map(|v| vreinterpretq_s8_u8(vshrq_n_u8::<4>(v)));
                        for r in 0..R {
                            let at = (r0 + r) * a.stride + b * QK + q4 * 4;
                            let (al, ah) = (four(&a.q, at), four(&a.q, at + 16));
                            for h in 0..NR / 4 {
                                dot[r][h] = dot[r][h].add(lo[h], al).add(hi[h], ah);
                            }
                        }
                    }
                } else {
                    for k4 in 0..QK / 4 {
                        let wv: [int8x16_t; NR / 4] = std::array::from_fn(|h| {
                            vld1q_s8(base.add(k4 * NR * 4 + 16 * h).cast::<i8>())
                        });
                        for r in 0..R {
                            let av = four(&a.q, (r0 + r) * a.stride + b * QK + k4 * 4);
                            for h in 0..NR / 4 {
                                dot[r][h] = dot[r][h].add(wv[h], av);
                            }
                        }
                    }
                }
                for r in 0..R {
                    let sums = dot[r].map(|d| d.sums());
                    block_step(w, a, p, b, r0 + r, sums, &mut acc[r]);
                }
            }
            for r in 0..R {
                for h in 0..NR / 4 {
                    vst1q_f32(out[r].as_mut_ptr().add(4 * h), acc[r][h]);
                }
            }
        }
    }

    /// One block's float steps for row `row`'s 16 sums, as the scalar path does them:
    /// `acc += dot · (da · d)`, then for 4 bits `acc += m · (da · Σqa)`, each one fused
    /// multiply-add.
    ///
    /// # Safety
    /// Block `b` of panel `p` and row `row` lie inside `w` and `a`.
    #[inline(always)]
    unsafe fn block_step(
        w: &QWeights,
        a: &QuantRows,
        p: usize,
        b: usize,
        row: usize,
        sums: [int32x4_t; NR / 4],
        acc: &mut [float32x4_t; NR / 4],
    ) {
        let at = (p * w.kb + b) * NR;
        let i = row * w.kb + b;
        // SAFETY: NR scales and extras per panel block; NEON is part of every ARM64 CPU.
        unsafe {
            let (da, dsum) = (vdupq_n_f32(a.d[i]), vdupq_n_f32(a.dsum[i]));
            for h in 0..NR / 4 {
                let ws = vld1q_f32(w.scales.as_ptr().add(at + 4 * h));
                acc[h] = vfmaq_f32(acc[h], vcvtq_f32_s32(sums[h]), vmulq_f32(da, ws));
                if w.bits == Bits::Four {
                    let mins = vld1q_f32(w.extra.as_ptr().add(at + 4 * h).cast::<f32>());
                    acc[h] = vfmaq_f32(acc[h], mins, dsum);
                }
            }
        }
    }

    /// `smmla`: `acc` (a 2 × 2 i32 tile, row-major) gains `a` (2 rows of 8 bytes) times the
    /// transpose of `b` (2 columns of 8 bytes). `vmmlaq_s32` is not stable Rust yet; the
    /// instruction is the same.
    #[inline]
    #[target_feature(enable = "neon,i8mm")]
    unsafe fn smmla(acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t {
        let mut acc = acc;
        // SAFETY: the caller checked i8mm; registers only.
        unsafe {
            std::arch::asm!(
                "smmla {acc:v}.4s, {a:v}.16b, {b:v}.16b",
                acc = inout(vreg) acc,
                a = in(vreg) a,
                b = in(vreg) b,
                options(pure, nomem, nostack),
            )
        };
        acc
    }

    /// `R` rows (2 to 4, as `PAIRS` row pairs; a missing fourth row multiplies zeros and is not
    /// written) × one panel with `smmla`: each instruction multiplies a row pair's 8
    /// activations by two columns' 8 weights. The panel layout keeps each column's 4
    /// consecutive values per step, so two steps' 16-byte loads interleaved by 32-bit lanes
    /// (`zip1`/`zip2`) give two columns' 8 values each, with no layout of its own. The integer
    /// sums are the same as `sdot`'s, so are the float steps: bitwise the scalar path's.
    ///
    /// # Safety
    /// The CPU has i8mm; `p`, `r0` and `R` lie inside `w` and `a`.
    #[target_feature(enable = "neon,dotprod,i8mm")]
    pub(super) unsafe fn mmla<const R: usize, const PAIRS: usize>(
        w: &QWeights,
        a: &QuantRows,
        p: usize,
        r0: usize,
        out: &mut Tile,
    ) {
        debug_assert!(R <= 2 * PAIRS && R > 2 * (PAIRS - 1));
        let four_bits = w.bits == Bits::Four;
        let pbb = w.bits.panel_block_bytes();
        // Row pair `j`'s 8 activations from `k` of block `b`: the second row's half is zero
        // where there is no such row.
        let pair = |j: usize, k: usize| -> int8x16_t {
            let first = (r0 + 2 * j) * a.stride + k;
            // SAFETY: `k + 8` stays inside the block; rows below `r0 + R` exist in `a`.
            unsafe {
                let lo = vld1_s8(a.q.as_ptr().add(first));
                let hi = if 2 * j + 1 < R {
                    vld1_s8(a.q.as_ptr().add(first + a.stride))
                } else {
                    vdup_n_s8(0)
                };
                vcombine_s8(lo, hi)
            }
        };
        // Two steps' four columns, as the two column pairs' 8 values each.
        let columns = |x: int8x16_t, y: int8x16_t| -> [int8x16_t; 2] {
            let (x, y) = (vreinterpretq_s32_s8(x), vreinterpretq_s32_s8(y));
            [vzip1q_s32(x, y), vzip2q_s32(x, y)].map(|v| vreinterpretq_s8_s32(v))
        };
        // SAFETY: the caller checked the features. Weight loads stay inside the panel block,
        // scale loads inside its NR scales and extras, activation reads inside the rows'
        // zero-padded blocks.
        unsafe {
            let mut acc = [[vdupq_n_f32(0.0); NR / 4]; R];
            let low = vdupq_n_u8(15);
            for b in 0..w.kb {
                let base = w.data.as_ptr().add((p * w.kb + b) * pbb);
                let k0 = b * QK;
                // Per row pair, per column pair: [r·c, r·c', r'·c, r'·c'].
                let mut dot = [[vdupq_n_s32(0); NR / 2]; PAIRS];
                if four_bits {
                    // Steps 2j and 2j+1: low nibbles are k 8j..8j+8, high ones 16 more.
                    for j in 0..2 {
                        for h in 0..NR / 4 {
                            let x = vld1q_u8(base.add(2 * j * NR * 4 + 16 * h));
                            let y = vld1q_u8(base.add((2 * j + 1) * NR * 4 + 16 * h));
                            let nib = |v: uint8x16_t| vreinterpretq_s8_u8(vandq_u8(v, low));
                            let top = |v: uint8x16_t| vreinterpretq_s8_u8(vshrq_n_u8::<4>(v));
                            let lo = columns(nib(x), nib(y));
                            let hi = columns(top(x), top(y));
                            for (jr, d) in dot.iter_mut().enumerate() {
                                let (al, ah) = (pair(jr, k0 + 8 * j), pair(jr, k0 + 16 + 8 * j));
                                for c in 0..2 {
                                    let t = smmla(d[2 * h + c], al, lo[c]);
                                    d[2 * h + c] = smmla(t, ah, hi[c]);
                                }
                            }
                        }
                    }
                } else {
                    for j in 0..QK / 8 {
                        for h in 0..NR / 4 {
                            let x = vld1q_s8(base.add(2 * j * NR * 4 + 16 * h).cast::<i8>());
                            let y = vld1q_s8(base.add((2 * j + 1) * NR * 4 + 16 * h).cast::<i8>());
                            let wv = columns(x, y);
                            for (jr, d) in dot.iter_mut().enumerate() {
                                let av = pair(jr, k0 + 8 * j);
                                for c in 0..2 {
                                    d[2 * h + c] = smmla(d[2 * h + c], av, wv[c]);
                                }
                            }
                        }
                    }
                }
                for (jr, d) in dot.iter().enumerate() {
                    // Two column pairs' tiles make each row's four columns: the low halves
                    // are the pair's first row, the high halves its second.
                    let mut rows = [[vdupq_n_s32(0); NR / 4]; 2];
                    for h in 0..NR / 4 {
                        let t = vreinterpretq_s64_s32(d[2 * h]);
                        let u = vreinterpretq_s64_s32(d[2 * h + 1]);
                        rows[0][h] = vreinterpretq_s32_s64(vzip1q_s64(t, u));
                        rows[1][h] = vreinterpretq_s32_s64(vzip2q_s64(t, u));
                    }
                    for (half, sums) in rows.into_iter().enumerate() {
                        let r = 2 * jr + half;
                        if r < R {
                            block_step(w, a, p, b, r0 + r, sums, &mut acc[r]);
                        }
                    }
                }
            }
            for r in 0..R {
                for h in 0..NR / 4 {
                    vst1q_f32(out[r].as_mut_ptr().add(4 * h), acc[r][h]);
                }
            }
        }
    }

    /// [`panel`] with `sdot`.
    ///
    /// # Safety
    /// The CPU has the dot-product extension; as [`panel`] otherwise.
    #[target_feature(enable = "neon,dotprod")]
    pub(super) unsafe fn sdot<const R: usize>(
        w: &QWeights,
        a: &QuantRows,
        p: usize,
        r0: usize,
        out: &mut Tile,
    ) {
        // SAFETY: as the caller promised.
        unsafe { panel::<Sdot, R>(w, a, p, r0, out) }
    }

    /// [`panel`] with `smull` + `sadalp`.
    ///
    /// # Safety
    /// As [`panel`] (every ARM64 CPU has NEON).
    #[target_feature(enable = "neon")]
    pub(super) unsafe fn smull<const R: usize>(
        w: &QWeights,
        a: &QuantRows,
        p: usize,
        r0: usize,
        out: &mut Tile,
    ) {
        // SAFETY: as the caller promised.
        unsafe { panel::<Smull, R>(w, a, p, r0, out) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn matrix(len: usize, seed: u64) -> Vec<f32> {
        ferrite_testkit::random::values(len, seed, 1.0)
    }

    /// Random 4-bit weights with scales and minimums, like GGUF Q4_1.
    fn four_bit(n: usize, k: usize, seed: u64) -> QWeights {
        let r = matrix(n * k.div_ceil(QK) * (QK + 2), seed);
        QWeights::from_blocks(n, k, Bits::Four, |col, b| {
            let at = (col * k.div_ceil(QK) + b) * (QK + 2);
            let mut q = [0i16; QK];
            for (i, v) in q.iter_mut().enumerate() {
                // Padding values past k must be zero (from_blocks callers pad with zeros).
                if b * QK + i < k {
                    *v = ((r[at + i] + 1.0) * 7.99) as i16;
                }
            }
            Block {
                d: r[at + QK].abs() / 15.0,
                m: r[at + QK + 1] * 0.5,
                q,
            }
        })
        .expect("valid blocks")
    }

    fn run(w: &QWeights, isa: Isa, x: &[f32], m: usize) -> Vec<f32> {
        let mut y = vec![0f32; m * w.rows()];
        w.matmul(isa, x, m, &mut y);
        y
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    #[test]
    fn close_to_the_f32_product() {
        let (n, k, m) = (40, 100, 5);
        let x = matrix(m * k, 2);
        for w in [
            QWeights::quantize(&matrix(n * k, 1), n, k).expect("quantize"),
            four_bit(n, k, 1),
        ] {
            let wf = w.dequantize();
            for isa in Isa::available() {
                let y = run(&w, isa, &x, m);
                for r in 0..m {
                    for c in 0..n {
                        let exact: f32 = (0..k).map(|i| x[r * k + i] * wf[c * k + i]).sum();
                        // Activations rounded to 8 bits: under 1% of the dot's scale.
                        let tol = 0.01 * (k as f32).sqrt();
                        let got = y[r * n + c];
                        assert!(
                            (got - exact).abs() < tol,
                            "{isa:?} {:?} ({r},{c}): {got} vs {exact}",
                            w.bits()
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn eight_bit_quantization_is_close() {
        let (n, k) = (7, 70);
        let wf = matrix(n * k, 9);
        let w = QWeights::quantize(&wf, n, k).expect("quantize");
        for (a, b) in w.dequantize().iter().zip(&wf) {
            assert!((a - b).abs() <= 1.0 / 254.0 + 1e-6, "{a} vs {b}");
        }
    }

    #[test]
    fn out_of_range_blocks_are_refused() {
        let blk = |q: i16| Block {
            d: 1.0,
            m: 0.0,
            q: [q; QK],
        };
        assert!(QWeights::from_blocks(1, 32, Bits::Four, |_, _| blk(16)).is_err());
        assert!(QWeights::from_blocks(1, 32, Bits::Four, |_, _| blk(-1)).is_err());
        assert!(QWeights::from_blocks(1, 32, Bits::Eight, |_, _| blk(-128)).is_err());
        assert!(QWeights::quantize(&[0.0; 5], 2, 3).is_err());
    }

    #[test]
    fn zero_and_non_finite_inputs() {
        let (n, k) = (3, 64);
        let mut wf = matrix(n * k, 3);
        wf[..32].iter_mut().for_each(|v| *v = 0.0);
        let zeros = vec![0f32; k];
        let mut bad = matrix(k, 4);
        bad[5] = f32::INFINITY;
        for w in [
            QWeights::quantize(&wf, n, k).expect("quantize"),
            four_bit(n, k, 3),
        ] {
            for isa in Isa::available() {
                assert!(run(&w, isa, &zeros, 1).iter().all(|&v| v == 0.0), "{isa:?}");
                assert!(
                    run(&w, isa, &bad, 1).iter().all(|v| v.is_nan()),
                    "{isa:?}: inf in, NaN out"
                );
            }
        }
    }

    /// The vector block quantizers give the portable one's bytes and scale: ragged lengths,
    /// ties at .5 after scaling, zeros, infinities and NaN. Each is skipped (one line) where this
    /// CPU lacks it.
    #[test]
    fn vector_quantizers_match_portable() {
        type Quantizer = unsafe fn(&[f32], &mut [i8; QK]) -> f32;
        #[cfg(target_arch = "x86_64")]
        let paths: [(&str, bool, Quantizer); 2] = [
            ("AVX-512F", crate::kernels::has_avx512f(), x86::quantize_sym),
            (
                "AVX2",
                crate::kernels::has_avx2_fma(),
                x86::quantize_sym_avx2,
            ),
        ];
        #[cfg(target_arch = "aarch64")]
        let paths: [(&str, bool, Quantizer); 1] = [("NEON", true, arm::quantize_sym)];
        #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
        let paths: [(&str, bool, Quantizer); 0] = [];
        for (isa, present, quantize) in paths {
            if crate::kernels::isa_or_skip("vector_quantizers_match_portable", isa, present) {
                check_quantizer(quantize);
            }
        }
    }

    /// The int8 GEMM paths this CPU lacks, named (the proptest below runs every one it has).
    #[test]
    fn int8_paths_this_cpu_lacks_are_named() {
        let all: &[Isa] = if cfg!(target_arch = "aarch64") {
            &[Isa::NeonDot, Isa::Neon]
        } else {
            &[Isa::Avx512Vnni, Isa::AvxVnni, Isa::Avx2]
        };
        let have = Isa::available();
        for isa in all {
            let name = format!("{isa:?}");
            crate::kernels::isa_or_skip(
                "every_path_and_batch_gives_the_same_bits",
                &name,
                have.contains(isa),
            );
        }
        assert_eq!(have.last(), Some(&Isa::Scalar));
    }

    fn check_quantizer(quantize: unsafe fn(&[f32], &mut [i8; QK]) -> f32) {
        proptest!(|(
            len in 0usize..=QK,
            scale in prop::sample::select(vec![1e-30f32, 1e-3, 1.0, 254.0, 1e30]),
            special in prop::option::of((0usize..QK, prop::sample::select(vec![
                0.0f32, f32::INFINITY, f32::NEG_INFINITY, f32::NAN, 127.0, -63.5,
            ]))),
            seed in any::<u64>(),
        )| {
            let mut x: Vec<f32> = matrix(len, seed).iter().map(|v| v * scale).collect();
            if let Some((at, v)) = special.filter(|&(at, _)| at < len) {
                x[at] = v;
            }
            let (mut a, mut b) = ([1i8; QK], [2i8; QK]);
            let da = quantize_sym_portable(&x, &mut a);
            // SAFETY: the caller checked that this CPU has the quantizer's features.
            let db = unsafe { quantize(&x, &mut b) };
            prop_assert_eq!(da.to_bits(), db.to_bits());
            prop_assert_eq!(a, b);
        });
    }

    #[test]
    fn stacking_keeps_every_column() {
        for (a, b) in [
            (four_bit(20, 70, 1), four_bit(9, 70, 2)),
            (
                QWeights::quantize(&matrix(16 * 40, 3), 16, 40).expect("quantize"),
                QWeights::quantize(&matrix(5 * 40, 4), 5, 40).expect("quantize"),
            ),
        ] {
            let s = a.stack(&b).expect("same k and bits");
            assert_eq!(s.rows(), a.rows() + b.rows());
            let mut both = a.dequantize();
            both.extend(b.dequantize());
            assert_eq!(bits(&s.dequantize()), bits(&both));
        }
        assert!(four_bit(3, 40, 1).stack(&four_bit(3, 41, 1)).is_none());
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        /// Ragged shapes (k not a multiple of 32, n not of 16, m not of 4), both widths: every
        /// ISA path gives bitwise the scalar reference's result, and a row gives the same bits
        /// alone as inside the batch.
        #[test]
        fn every_path_and_batch_gives_the_same_bits(
            n in 1usize..200,
            k in 1usize..200,
            m in 1usize..11,
            four in any::<bool>(),
            seed in any::<u64>(),
        ) {
            let w = if four {
                four_bit(n, k, seed)
            } else {
                QWeights::quantize(&matrix(n * k, seed), n, k).expect("quantize")
            };
            let x = matrix(m * k, seed ^ 0xabcdef);
            let reference = run(&w, Isa::Scalar, &x, m);
            for isa in Isa::available() {
                let y = run(&w, isa, &x, m);
                prop_assert_eq!(bits(&y), bits(&reference), "{:?}", isa);
                prop_assert_eq!(bits(&w.matmul_vec(isa, &x, m)), bits(&y), "{:?} into a new buffer", isa);
                for r in 0..m {
                    let alone = run(&w, isa, &x[r * k..(r + 1) * k], 1);
                    prop_assert_eq!(
                        bits(&alone),
                        bits(&y[r * n..(r + 1) * n]),
                        "{:?} row {} alone", isa, r
                    );
                }
            }
        }
    }
}

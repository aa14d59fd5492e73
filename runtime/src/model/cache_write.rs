//! A layer's attention inputs from its fused q/k/v projection: the queries and keys rotated by
//! each token's position (RoPE), the keys and values stored into the layer's slot pools. On a
//! GPU one fused kernel (`kernels/fused.cu`, `rope_cache_write_*`) does it all; on the CPU three
//! passes over the token rows do ([`cpu`]: the queries rotated into a new tensor, the keys
//! rotated and the values cast straight into their pools), where candle's ops took a copy, a
//! serial rotation, two casts, two copies and a scatter per pool. Both give bitwise what
//! candle's ops give (the [`CacheWriter::Ops`] path, kept for other devices and as the tests'
//! reference). candle's CUDA scatter,
//! which the kernel replaces, loops over the tokens one after another in each of `kv_dim`
//! threads: a 4,096-token prefill spent about a second of its step there.

use candle_core::{Result, Tensor};

use super::rope::{Rope, RopeAt};

/// The attention heads' shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Heads {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

impl Heads {
    fn q_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }
    fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }
}

/// One step's positions and slots, ready for every layer.
#[derive(Debug)]
pub enum CacheWriter {
    /// The fused kernel: the whole rotation tables, each token's position and slot.
    #[cfg(feature = "cuda")]
    Fused {
        rope: Rope,
        positions: Tensor,
        slots: Tensor,
    },
    /// The CPU passes: the rotation rows of the step's positions, `[tokens][head_dim / 2]`,
    /// and each token's slot.
    Cpu(cpu::Step),
    /// candle's ops: the rotation rows of the step's positions, and the scatter's index (each
    /// token's slot repeated over the row, `[tokens, kv_dim]`), made once per step.
    Ops { rope: RopeAt, rows: Tensor },
}

impl CacheWriter {
    /// `positions` and `slots`: `[tokens]` u32 on the model's device; `block_size`: the pools'
    /// (the CPU's key pools are transposed per block, `kv::layout`).
    pub fn new(
        positions: &Tensor,
        slots: &Tensor,
        rope: &Rope,
        kv_dim: usize,
        block_size: usize,
    ) -> Result<Self> {
        // The fused kernel rotates whole heads; partial rotary embeddings take candle's ops.
        #[cfg(feature = "cuda")]
        if slots.device().is_cuda() && !rope.is_partial() {
            return Ok(Self::Fused {
                rope: rope.clone(),
                positions: positions.clone(),
                slots: slots.clone(),
            });
        }
        if slots.device().is_cpu() {
            return Ok(Self::Cpu(cpu::Step::new(
                positions, slots, rope, block_size,
            )?));
        }
        Self::ops(positions, slots, rope, kv_dim)
    }

    /// The [`CacheWriter::Ops`] writer on any device.
    fn ops(positions: &Tensor, slots: &Tensor, rope: &Rope, kv_dim: usize) -> Result<Self> {
        let n = slots.dim(0)?;
        Ok(Self::Ops {
            rope: rope.at(positions)?,
            rows: slots
                .reshape((n, 1))?
                .broadcast_as((n, kv_dim))?
                .contiguous()?,
        })
    }

    /// From `qkv` (`[tokens, q_dim + 2 kv_dim]` f32: query heads, key heads, value heads):
    /// stores the rotated keys and the values into `k_cache` and `v_cache` (`[slots, kv_dim]`,
    /// the cache type) at the step's slots, and returns the rotated queries, `[tokens, q_dim]`.
    pub fn write(
        &self,
        qkv: &Tensor,
        heads: Heads,
        k_cache: &Tensor,
        v_cache: &Tensor,
    ) -> Result<Tensor> {
        match self {
            Self::Cpu(step) => step.write(qkv, heads, k_cache, v_cache),
            Self::Ops { rope, rows } => {
                let (n, q_dim, kv_dim) = (qkv.dim(0)?, heads.q_dim(), heads.kv_dim());
                // q and k are adjacent columns of the projection: one rotation for both.
                let qk = qkv.narrow(1, 0, q_dim + kv_dim)?.reshape((
                    n,
                    heads.num_heads + heads.num_kv_heads,
                    heads.head_dim,
                ))?;
                let qk = rope.apply(&qk)?.reshape((n, q_dim + kv_dim))?;
                let dtype = k_cache.dtype();
                let k = qk.narrow(1, q_dim, kv_dim)?.to_dtype(dtype)?.contiguous()?;
                let v = qkv.narrow(1, q_dim + kv_dim, kv_dim)?;
                k_cache.scatter_set(rows, &k, 0)?;
                v_cache.scatter_set(rows, &v.to_dtype(dtype)?.contiguous()?, 0)?;
                qk.narrow(1, 0, q_dim)
            }
            #[cfg(feature = "cuda")]
            Self::Fused {
                rope,
                positions,
                slots,
            } => cuda::rope_cache_write(qkv, heads, rope, positions, slots, k_cache, v_cache),
        }
    }
}

/// The CPU write: candle's rotation arithmetic (`x1·cos − x2·sin`, `x1·sin + x2·cos`, each a
/// separate multiply and add) and its rounding into the cache type, so the same bits, in one
/// pass per output over the token rows.
pub(crate) mod cpu {
    use candle_core::backend::BackendStorage;
    use candle_core::{CpuStorage, CustomOp1, InplaceOp2, Layout, Result, Shape, Tensor};
    use half::{bf16, f16};
    use rayon::prelude::*;

    use super::{Heads, Rope};
    use crate::kv::layout::cpu_key_index;
    use crate::model::config::RopeStyle;
    use crate::model::cpu_view::contiguous;

    /// One step's rotation rows and slots.
    #[derive(Debug, Clone)]
    pub struct Step {
        /// `[tokens][half]`: the tables' rows at each token's position.
        cos: Vec<f32>,
        sin: Vec<f32>,
        half: usize,
        style: RopeStyle,
        slots: Vec<u32>,
        block_size: usize,
    }

    impl Step {
        pub(super) fn new(
            positions: &Tensor,
            slots: &Tensor,
            rope: &Rope,
            block_size: usize,
        ) -> Result<Step> {
            let at = rope.at(positions)?;
            let half = rope.cos().dim(1)?;
            if block_size == 0 {
                candle_core::bail!("rope/cache write: blocks of 0 slots");
            }
            Ok(Step {
                cos: at.cos().flatten_all()?.to_vec1()?,
                sin: at.sin().flatten_all()?.to_vec1()?,
                half,
                style: rope.style(),
                slots: slots.to_vec1()?,
                block_size,
            })
        }

        pub(super) fn write(
            &self,
            qkv: &Tensor,
            heads: Heads,
            k_cache: &Tensor,
            v_cache: &Tensor,
        ) -> Result<Tensor> {
            let (n, width) = qkv.dims2()?;
            let (q_dim, kv_dim) = (heads.q_dim(), heads.kv_dim());
            if width != q_dim + 2 * kv_dim || heads.head_dim < 2 * self.half {
                candle_core::bail!("rope/cache write: qkv rows of {width} do not hold {heads:?}");
            }
            if n != self.slots.len() {
                candle_core::bail!("rope/cache write: {n} rows for {} slots", self.slots.len());
            }
            let qkv = qkv.contiguous()?;
            k_cache.inplace_op2(
                &qkv,
                &Pool {
                    step: self,
                    heads,
                    part: Part::Keys,
                },
            )?;
            v_cache.inplace_op2(
                &qkv,
                &Pool {
                    step: self,
                    heads,
                    part: Part::Values,
                },
            )?;
            qkv.apply_op1_no_bwd(&Queries { step: self, heads })
        }

        /// Rotates `x` (one head) by token `t`'s position, handing each output to `out`; past the
        /// tables' `2 · half` dimensions (partial rotary embeddings) values pass as they are.
        #[inline(always)]
        fn rotate(&self, t: usize, x: &[f32], mut out: impl FnMut(usize, f32)) {
            let h = self.half;
            for (i, &v) in x.iter().enumerate().skip(2 * h) {
                out(i, v);
            }
            let (cos, sin) = (&self.cos[t * h..][..h], &self.sin[t * h..][..h]);
            for i in 0..h {
                let (a, b) = match self.style {
                    RopeStyle::Half => (i, i + h),
                    RopeStyle::Interleaved => (2 * i, 2 * i + 1),
                };
                let (x1, x2) = (x[a], x[b]);
                out(a, x1 * cos[i] - x2 * sin[i]);
                out(b, x1 * sin[i] + x2 * cos[i]);
            }
        }
    }

    /// The rotated queries, `[tokens, q_dim]`, tokens split across the pool.
    struct Queries<'a> {
        step: &'a Step,
        heads: Heads,
    }

    impl CustomOp1 for Queries<'_> {
        fn name(&self) -> &'static str {
            "rope-queries"
        }

        fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
            let (q_dim, kv_dim, hd) =
                (self.heads.q_dim(), self.heads.kv_dim(), self.heads.head_dim);
            let width = q_dim + 2 * kv_dim;
            let qkv = contiguous::<f32>(s, l, "rope/cache write: qkv")?;
            let n = qkv.len() / width;
            let mut q = vec![0f32; n * q_dim];
            q.par_chunks_mut(q_dim)
                .zip(qkv.par_chunks(width))
                .enumerate()
                .with_min_len(8)
                .for_each(|(t, (out, row))| {
                    for (o, x) in out.chunks_mut(hd).zip(row[..q_dim].chunks(hd)) {
                        self.step.rotate(t, x, |i, v| o[i] = v);
                    }
                });
            Ok((CpuStorage::F32(q), Shape::from((n, q_dim))))
        }
    }

    /// Which third of a qkv row goes into the pool.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum Part {
        /// Rotated, then rounded to the cache type.
        Keys,
        /// Rounded to the cache type.
        Values,
    }

    /// Stores each token's keys or values at its slot of a `[slots, kv_dim]` pool: values as
    /// rows, keys transposed per block (`kv::layout`).
    struct Pool<'a> {
        step: &'a Step,
        heads: Heads,
        part: Part,
    }

    impl Pool<'_> {
        /// Token after token (a step's rows are at most a few hundred of `kv_dim` values).
        /// `round`: f32 to the cache type, as candle's `to_dtype` rounds (half's `from_f64`
        /// would not do: for bf16 it drops the low mantissa bits before rounding).
        fn store<T>(&self, pool: &mut [T], qkv: &[f32], round: impl Fn(f32) -> T) -> Result<()> {
            let (q_dim, kv_dim, hd) =
                (self.heads.q_dim(), self.heads.kv_dim(), self.heads.head_dim);
            let width = q_dim + 2 * kv_dim;
            let bs = self.step.block_size;
            let slots = pool.len() / kv_dim.max(1);
            if !slots.is_multiple_of(bs) {
                candle_core::bail!("rope/cache write: {slots} slots are not whole blocks of {bs}");
            }
            for (t, (row, &slot)) in qkv.chunks(width).zip(&self.step.slots).enumerate() {
                let slot = slot as usize;
                if slot >= slots {
                    candle_core::bail!("rope/cache write: slot {slot} is outside {slots} slots");
                }
                match self.part {
                    Part::Keys => {
                        let keys = &row[q_dim..q_dim + kv_dim];
                        for (g, x) in keys.chunks(hd).enumerate() {
                            // The head's columns, `bs` apart from its first.
                            let at = cpu_key_index(slot, g * hd, kv_dim, bs);
                            self.step.rotate(t, x, |i, v| pool[at + i * bs] = round(v));
                        }
                    }
                    Part::Values => {
                        let dst = &mut pool[slot * kv_dim..][..kv_dim];
                        for (o, &v) in dst.iter_mut().zip(&row[q_dim + kv_dim..]) {
                            *o = round(v);
                        }
                    }
                }
            }
            Ok(())
        }
    }

    impl InplaceOp2 for Pool<'_> {
        fn name(&self) -> &'static str {
            "rope-cache-write"
        }

        fn cpu_fwd(
            &self,
            pool: &mut CpuStorage,
            pl: &Layout,
            s: &CpuStorage,
            l: &Layout,
        ) -> Result<()> {
            let qkv = contiguous::<f32>(s, l, "rope/cache write: qkv")?;
            let Some((a, b)) = pl.contiguous_offsets() else {
                candle_core::bail!("rope/cache write: the pool is not contiguous");
            };
            match pool {
                CpuStorage::F32(p) => self.store(&mut p[a..b], qkv, |x| x),
                CpuStorage::F16(p) => self.store(&mut p[a..b], qkv, f16::from_f32),
                CpuStorage::BF16(p) => self.store(&mut p[a..b], qkv, bf16::from_f32),
                other => candle_core::bail!("rope/cache write: cache type {:?}", other.dtype()),
            }
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;
        use crate::model::cache_write::CacheWriter;
        use candle_core::{DType, Device};
        use ferrite_testkit::random::values;
        use proptest::prelude::*;

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(32))]
            /// The CPU passes give bitwise candle's ops' queries and pools: both RoPE pairings,
            /// whole or partial rotation (half of each head), grouped heads, every cache type,
            /// slots in any order.
            #[test]
            fn cpu_write_matches_candles_ops(
                tokens in 1usize..12,
                kv_heads in 1usize..4,
                group in 1usize..4,
                head_dim in prop::sample::select(vec![2usize, 8, 64]),
                interleaved in any::<bool>(),
                partial in any::<bool>(),
                dtype in prop::sample::select(vec![DType::F32, DType::F16, DType::BF16]),
                seed in any::<u64>(),
            ) {
                let dev = Device::Cpu;
                let heads = Heads { num_heads: kv_heads * group, num_kv_heads: kv_heads, head_dim };
                let partial = partial && head_dim >= 4;
                let half = if partial { head_dim / 4 } else { head_dim / 2 };
                let max_len = 64;
                let style = if interleaved { RopeStyle::Interleaved } else { RopeStyle::Half };
                let table = |s| Tensor::from_vec(values(max_len * half, s, 1.0), (max_len, half), &dev);
                let rope = Rope::from_tables(table(seed)?, table(seed ^ 1)?, style).for_heads(head_dim);
                prop_assert_eq!(rope.is_partial(), partial);
                let width = heads.q_dim() + 2 * heads.kv_dim();
                let qkv = Tensor::from_vec(values(tokens * width, seed ^ 2, 3.0), (tokens, width), &dev)?;
                let positions: Vec<u32> = (0..tokens).map(|t| ((t * 7 + seed as usize) % max_len) as u32).collect();
                // Whole blocks of 4 slots.
                let bs = 4;
                let pool_slots = (2 * tokens + 3).next_multiple_of(bs);
                // Distinct slots, not in order.
                let slots: Vec<u32> = (0..tokens).map(|t| ((t * 5 + 1) % pool_slots) as u32).collect();
                let positions = Tensor::new(positions.as_slice(), &dev)?;
                let slots = Tensor::new(slots.as_slice(), &dev)?;
                let pool = || -> candle_core::Result<Tensor> {
                    Tensor::from_vec(values(pool_slots * heads.kv_dim(), seed ^ 3, 1.0), (pool_slots, heads.kv_dim()), &dev)?
                        .to_dtype(dtype)
                };
                let mut got = Vec::new();
                for writer in [
                    CacheWriter::new(&positions, &slots, &rope, heads.kv_dim(), bs)?,
                    CacheWriter::ops(&positions, &slots, &rope, heads.kv_dim())?,
                ] {
                    let cpu = matches!(writer, CacheWriter::Cpu(_));
                    // The CPU pool's keys start transposed per block, as it keeps them.
                    let kc = if cpu {
                        let rows = pool()?;
                        let n = pool_slots / bs;
                        rows.reshape((n, bs, heads.kv_dim()))?.transpose(1, 2)?.contiguous()?
                            .reshape((pool_slots, heads.kv_dim()))?
                    } else {
                        pool()?
                    };
                    let vc = pool()?;
                    let q = writer.write(&qkv, heads, &kc, &vc)?;
                    let kc = if cpu { crate::kv::layout::cpu_keys_as_rows(&kc, bs)? } else { kc };
                    let f = |t: &Tensor| t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>();
                    let bits = |v: Vec<f32>| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
                    got.push((bits(f(&q)?), bits(f(&kc)?), bits(f(&vc)?)));
                }
                prop_assert!(matches!(CacheWriter::new(&positions, &slots, &rope, 1, bs)?, CacheWriter::Cpu(_)));
                prop_assert_eq!(&got[0].0, &got[1].0, "queries");
                prop_assert_eq!(&got[0].1, &got[1].1, "key pool");
                prop_assert_eq!(&got[0].2, &got[1].2, "value pool");
            }
        }

        #[test]
        fn a_slot_outside_the_pool_is_an_error() {
            let dev = Device::Cpu;
            let heads = Heads {
                num_heads: 1,
                num_kv_heads: 1,
                head_dim: 2,
            };
            let rope = Rope::from_tables(
                Tensor::ones((4, 1), DType::F32, &dev).expect("cos"),
                Tensor::zeros((4, 1), DType::F32, &dev).expect("sin"),
                RopeStyle::Half,
            );
            let positions = Tensor::new(&[0u32], &dev).expect("positions");
            let slots = Tensor::new(&[9u32], &dev).expect("slots");
            let w = CacheWriter::new(&positions, &slots, &rope, 2, 2).expect("writer");
            let qkv = Tensor::zeros((1, 6), DType::F32, &dev).expect("qkv");
            let pool = Tensor::zeros((4, 2), DType::F16, &dev).expect("pool");
            let err = w
                .write(&qkv, heads, &pool, &pool.clone())
                .expect_err("slot 9 of 4");
            assert!(err.to_string().contains("outside"), "{err}");
        }
    }
}

/// Launches of `kernels/fused.cu`.
#[cfg(feature = "cuda")]
pub(crate) mod cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::WrapErr;
    use candle_core::cuda_backend::cudarc::driver::{CudaView, LaunchConfig, PushKernelArg};
    use candle_core::{CudaStorage, DType, Layout, Result, Shape, Storage, Tensor};

    use super::{Heads, Rope};
    use crate::model::config::RopeStyle;
    use crate::model::cuda_view;

    pub(crate) const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/fused.ptx"));
    pub(crate) const MODULE: &str = "ferrite_fused";

    /// A contiguous tensor's elements on the GPU.
    fn contiguous<'a, T: candle_core::cuda_backend::CudaDType>(
        s: &'a Storage,
        l: &Layout,
        what: &str,
    ) -> Result<CudaView<'a, T>> {
        let what = format!("rope/cache write: {what}");
        cuda_view::contiguous(cuda_view::on_gpu(s, &what)?, l, &what)
    }

    pub(super) fn rope_cache_write(
        qkv: &Tensor,
        heads: Heads,
        rope: &Rope,
        positions: &Tensor,
        slots: &Tensor,
        kc: &Tensor,
        vc: &Tensor,
    ) -> Result<Tensor> {
        let (tokens, width) = qkv.dims2()?;
        let (q_dim, kv_dim) = (heads.q_dim(), heads.kv_dim());
        if width != q_dim + 2 * kv_dim || !heads.head_dim.is_multiple_of(2) {
            candle_core::bail!("rope/cache write: qkv rows of {width} do not hold {heads:?}");
        }
        if positions.dims1()? != tokens || slots.dims1()? != tokens {
            candle_core::bail!("rope/cache write: positions and slots must have {tokens} rows");
        }
        if kc.dims2()?.1 != kv_dim || vc.dims2()? != kc.dims2()? || kc.dtype() != vc.dtype() {
            candle_core::bail!(
                "rope/cache write: pools {:?} and {:?} do not hold rows of {kv_dim}",
                kc.shape(),
                vc.shape()
            );
        }
        let (cos, sin) = (rope.cos(), rope.sin());
        if cos.dims2()?.1 != heads.head_dim / 2 {
            candle_core::bail!("rope/cache write: the tables are for another head size");
        }
        let name = match kc.dtype() {
            DType::F32 => "rope_cache_write_f32",
            DType::F16 => "rope_cache_write_f16",
            DType::BF16 => "rope_cache_write_bf16",
            other => candle_core::bail!("rope/cache write: cache type {other:?}"),
        };
        let qkv = qkv.contiguous()?;
        let (qs, ql) = qkv.storage_and_layout();
        let dev = cuda_view::on_gpu(&qs, "rope/cache write: qkv")?
            .device()
            .clone();
        let func = dev.get_or_load_custom_func(name, MODULE, PTX)?;
        let x = contiguous::<f32>(&qs, ql, "qkv")?;
        let (cs, cl) = cos.storage_and_layout();
        let (ss, sl) = sin.storage_and_layout();
        let (ps, pl) = positions.storage_and_layout();
        let (ts, tl) = slots.storage_and_layout();
        let (kcs, kcl) = kc.storage_and_layout();
        let (vcs, vcl) = vc.storage_and_layout();
        let (cos_v, sin_v) = (
            contiguous::<f32>(&cs, cl, "cos")?,
            contiguous::<f32>(&ss, sl, "sin")?,
        );
        let pos_v = contiguous::<u32>(&ps, pl, "positions")?;
        let slot_v = contiguous::<u32>(&ts, tl, "slots")?;
        // SAFETY: the kernel writes every element of q (each token's query pairs).
        let q = unsafe { dev.alloc::<f32>(tokens * q_dim)? };
        let args = [
            heads.num_heads as u32,
            heads.num_kv_heads as u32,
            heads.head_dim as u32,
            width as u32,
            u32::from(rope.style() == RopeStyle::Interleaved),
        ];
        let pairs = ((heads.num_heads + heads.num_kv_heads) * heads.head_dim / 2).max(kv_dim);
        let cfg = LaunchConfig {
            grid_dim: (tokens.max(1) as u32, 1, 1),
            block_dim: ((pairs as u32).clamp(32, 256).next_multiple_of(32), 1, 1),
            shared_mem_bytes: 0,
        };
        // The pools are written in place: their storage is only ever touched on the device's one
        // stream, in order (`device.rs`), so no other reader sees a half-written row.
        macro_rules! launch {
            ($t:ty) => {{
                let kp = contiguous::<$t>(&kcs, kcl, "the key pool")?;
                let vp = contiguous::<$t>(&vcs, vcl, "the value pool")?;
                let mut b = func.builder();
                b.arg(&q);
                b.arg(&kp);
                b.arg(&vp);
                b.arg(&x);
                b.arg(&cos_v);
                b.arg(&sin_v);
                b.arg(&pos_v);
                b.arg(&slot_v);
                for a in &args {
                    b.arg(a);
                }
                // SAFETY: the argument list is the kernel's signature; positions index the
                // tables (the forward's batch check bounds them by the model's length), slots
                // are rows of the pools (block tables checked against the allocator), and qkv
                // holds `tokens` rows of `width`.
                unsafe { b.launch(cfg) }.w()
            }};
        }
        if tokens > 0 {
            match kc.dtype() {
                DType::F32 => launch!(f32),
                DType::F16 => launch!(half::f16),
                _ => launch!(half::bf16),
            }?;
        }
        let storage = CudaStorage::wrap_cuda_slice(q, dev);
        Ok(Tensor::from_storage(
            Storage::Cuda(storage),
            Shape::from((tokens, q_dim)),
            candle_core::op::BackpropOp::none(),
            false,
        ))
    }
}

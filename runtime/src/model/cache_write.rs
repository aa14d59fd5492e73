//! A layer's attention inputs from its fused q/k/v projection: the queries and keys rotated by
//! each token's position (RoPE), the keys and values stored into the layer's slot pools. On a
//! GPU one fused kernel (`kernels/fused.cu`, `rope_cache_write_*`) does it all; elsewhere
//! candle's ops do (a copy, the rotation, casts, a scatter per pool). candle's CUDA scatter,
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
    /// candle's ops: the rotation rows of the step's positions, and the scatter's index (each
    /// token's slot repeated over the row, `[tokens, kv_dim]`), made once per step.
    Ops { rope: RopeAt, rows: Tensor },
}

impl CacheWriter {
    /// `positions` and `slots`: `[tokens]` u32 on the model's device.
    pub fn new(positions: &Tensor, slots: &Tensor, rope: &Rope, kv_dim: usize) -> Result<Self> {
        #[cfg(feature = "cuda")]
        if slots.device().is_cuda() {
            return Ok(Self::Fused {
                rope: rope.clone(),
                positions: positions.clone(),
                slots: slots.clone(),
            });
        }
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

//! The launch of the CUDA paged-attention kernel (`runtime/kernels/paged_attention.cu`): the
//! flattened block tables it reads, its grid, and its shared memory. The kernel is compiled to
//! PTX by `runtime/build.rs` in the `cuda` build; everything here but the launch itself is plain
//! Rust, so the CPU test that runs the same kernel source (`tests/cuda_kernel_on_cpu.rs`) feeds
//! it exactly what a GPU launch would.

use super::attention_meta::AttnMeta;

/// Threads per block: the keys scored per chunk. A power of two (the block's tree reductions).
pub const THREADS: usize = 128;

/// The shared memory a block may use without opting in to more (every GPU since sm_50). Heads
/// needing more than this take the generic path.
pub const MAX_SHARED_BYTES: usize = 48 * 1024;

/// The kernel's view of a batch: per token its sequence and position, and every sequence's
/// block table back to back with where each starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelTables {
    pub token_seq: Vec<u32>,
    pub token_pos: Vec<u32>,
    pub table_start: Vec<u32>,
    pub tables: Vec<u32>,
}

impl KernelTables {
    pub fn new(meta: &AttnMeta) -> Self {
        let mut table_start = Vec::with_capacity(meta.block_tables.len());
        let mut tables = Vec::with_capacity(meta.block_tables.iter().map(Vec::len).sum());
        for t in &meta.block_tables {
            table_start.push(tables.len() as u32);
            tables.extend_from_slice(t);
        }
        Self {
            token_seq: meta.token_seq.clone(),
            token_pos: meta.token_pos.clone(),
            table_start,
            tables,
        }
    }
}

/// Grid, block and shared memory of one launch, and the scalars the kernel takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaunchShape {
    /// (tokens, kv heads): one block per query token and kv head.
    pub grid: (u32, u32),
    pub threads: u32,
    pub shared_bytes: u32,
    /// The sliding window as the kernel takes it: 0 for none.
    pub window: i32,
}

/// The launch for `meta`, or `None` where the kernel does not apply (a zero-width window, or
/// heads whose rows do not fit the shared memory).
pub fn launch_shape(meta: &AttnMeta) -> Option<LaunchShape> {
    let window = match meta.sliding_window {
        None => 0,
        Some(0) => return None,
        Some(w) => i32::try_from(w).ok()?,
    };
    if meta.num_kv_heads == 0 || !meta.num_heads.is_multiple_of(meta.num_kv_heads) {
        return None;
    }
    let group = meta.num_heads / meta.num_kv_heads;
    let rows = group * meta.head_dim;
    // q and output rows; probabilities and reduction scratch per head and key; running max,
    // sum and rescale per head (f32); one slot per key (i32). Mirrors the kernel's carving.
    let shared = 4 * (2 * rows + 2 * group * THREADS + 3 * group) + 4 * THREADS;
    if shared > MAX_SHARED_BYTES {
        return None;
    }
    Some(LaunchShape {
        grid: (
            u32::try_from(meta.token_seq.len()).ok()?,
            u32::try_from(meta.num_kv_heads).ok()?,
        ),
        threads: THREADS as u32,
        shared_bytes: shared as u32,
        window,
    })
}

#[cfg(feature = "cuda")]
pub(crate) mod cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
    use candle_core::cuda_backend::{CudaDType, WrapErr};
    use candle_core::{CudaStorage, DType, Layout, Result, Shape, Tensor};
    use half::{bf16, f16};

    use super::{AttnMeta, KernelTables, launch_shape};
    use crate::model::attention_meta::PackedTables;
    use crate::model::cuda_view::{contiguous, on_gpu};

    const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/paged_attention.ptx"));
    const MODULE: &str = "ferrite_paged_attention";

    /// One launch's operands: the batch and each tensor's storage with its layout.
    struct Operands<'a> {
        meta: &'a AttnMeta,
        q: (&'a CudaStorage, &'a Layout),
        k: (&'a CudaStorage, &'a Layout),
        v: (&'a CudaStorage, &'a Layout),
    }

    /// Runs the kernel: `q` `[tokens, heads * head_dim]` f32, the caches `[slots, kv_dim]` of
    /// one type (f32, f16 or bf16); returns the attention output, shaped like `q`.
    pub(crate) fn forward(
        meta: &AttnMeta,
        q: &CudaStorage,
        ql: &Layout,
        k: &CudaStorage,
        kl: &Layout,
        v: &CudaStorage,
        vl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let ops = Operands {
            meta,
            q: (q, ql),
            k: (k, kl),
            v: (v, vl),
        };
        match (k.dtype(), v.dtype()) {
            (DType::F32, DType::F32) => run::<f32>(&ops, "paged_attention_f32"),
            (DType::F16, DType::F16) => run::<f16>(&ops, "paged_attention_f16"),
            (DType::BF16, DType::BF16) => run::<bf16>(&ops, "paged_attention_bf16"),
            (kd, vd) => candle_core::bail!(
                "paged-attention: keys {kd:?} and values {vd:?} need one cache type of f32, f16, bf16"
            ),
        }
    }

    /// The tables where the forward packed them, else uploaded once for every layer of the step
    /// (a caller that runs attention alone).
    fn device_tables<'m>(
        meta: &'m AttnMeta,
        dev: &candle_core::CudaDevice,
    ) -> Result<&'m PackedTables> {
        if let Some(t) = meta.device_tables.packed.get() {
            return Ok(t);
        }
        let t = KernelTables::new(meta);
        let (a, b, c) = (t.token_seq.len(), t.token_pos.len(), t.table_start.len());
        let data = [t.token_seq, t.token_pos, t.table_start, t.tables].concat();
        let n = data.len();
        let packed = Tensor::from_vec(data, n, &candle_core::Device::Cuda(dev.clone()))?;
        meta.device_tables.preset(PackedTables {
            packed,
            token_seq: 0..a,
            token_pos: a..a + b,
            table_start: a + b..a + b + c,
            tables: a + b + c..n,
        });
        meta.device_tables
            .packed
            .get()
            .ok_or_else(|| candle_core::Error::Msg("paged-attention: no tables".into()))
    }

    fn run<C: CudaDType>(ops: &Operands, name: &str) -> Result<(CudaStorage, Shape)> {
        let Operands {
            meta,
            q: (q, ql),
            k: (k, kl),
            v: (v, vl),
        } = *ops;
        let dev = q.device().clone();
        let shape = launch_shape(meta).ok_or_else(|| {
            candle_core::Error::Msg("paged-attention: no CUDA launch for these heads".into())
        })?;
        let (nh, kvh, hd) = (meta.num_heads, meta.num_kv_heads, meta.head_dim);
        let tokens = meta.token_seq.len();
        let qv = contiguous::<f32>(q, ql, "paged-attention: q")?;
        let kv = contiguous::<C>(k, kl, "paged-attention: the key cache")?;
        let vv = contiguous::<C>(v, vl, "paged-attention: the value cache")?;
        meta.check_operands(qv.len(), kv.len() / (kvh * hd))?;
        let tables = device_tables(meta, &dev)?;
        let (storage, layout) = tables.packed.storage_and_layout();
        let packed =
            on_gpu(&storage, "paged-attention: the kernel tables")?.as_cuda_slice::<u32>()?;
        let at = |r: &std::ops::Range<usize>| {
            let o = layout.start_offset();
            packed.slice(o + r.start..o + r.end)
        };
        let (token_seq, token_pos) = (at(&tables.token_seq), at(&tables.token_pos));
        let (table_start, flat) = (at(&tables.table_start), at(&tables.tables));
        let func = dev.get_or_load_custom_func(name, MODULE, PTX)?;
        // SAFETY: every element is written by the kernel (each block writes its rows).
        let out = unsafe { dev.alloc::<f32>(tokens * nh * hd)? };
        let (num_heads, num_kv_heads, head_dim, block_size) =
            (nh as i32, kvh as i32, hd as i32, meta.block_size as i32);
        let mut b = func.builder();
        b.arg(&out);
        b.arg(&qv);
        b.arg(&kv);
        b.arg(&vv);
        b.arg(&token_seq);
        b.arg(&token_pos);
        b.arg(&table_start);
        b.arg(&flat);
        b.arg(&num_heads);
        b.arg(&num_kv_heads);
        b.arg(&head_dim);
        b.arg(&block_size);
        b.arg(&meta.scale);
        b.arg(&shape.window);
        let softcap = meta.softcap.unwrap_or(0.0);
        b.arg(&softcap);
        let cfg = LaunchConfig {
            grid_dim: (shape.grid.0, shape.grid.1, 1),
            block_dim: (shape.threads, 1, 1),
            shared_mem_bytes: shape.shared_bytes,
        };
        // SAFETY: the argument list is the kernel's signature; the tables were checked against
        // the pools above, and the output has a row for every token.
        unsafe { b.launch(cfg) }.w()?;
        Ok((
            CudaStorage::wrap_cuda_slice(out, dev),
            Shape::from((tokens, nh * hd)),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(nh: usize, kvh: usize, hd: usize, window: Option<usize>) -> AttnMeta {
        AttnMeta {
            num_heads: nh,
            num_kv_heads: kvh,
            head_dim: hd,
            block_size: 16,
            scale: 0.125,
            sliding_window: window,
            softcap: None,
            token_seq: vec![0, 1, 1],
            token_pos: vec![5, 0, 1],
            block_tables: vec![vec![3], vec![7, 2]],
            device_tables: Default::default(),
        }
    }

    #[test]
    fn tables_are_flattened_with_their_starts() {
        let t = KernelTables::new(&meta(9, 3, 64, None));
        assert_eq!(t.table_start, vec![0, 1]);
        assert_eq!(t.tables, vec![3, 7, 2]);
        assert_eq!(t.token_seq, vec![0, 1, 1]);
        assert_eq!(t.token_pos, vec![5, 0, 1]);
    }

    #[test]
    fn launch_fits_shared_memory_or_declines() {
        // SmolLM2: 9 heads over 3 kv heads of 64.
        let s = launch_shape(&meta(9, 3, 64, None)).expect("fits");
        assert_eq!(s.grid, (3, 3));
        assert_eq!(s.threads, 128);
        assert_eq!(s.shared_bytes, 4 * (2 * 192 + 2 * 3 * 128 + 9) + 4 * 128);
        assert_eq!(s.window, 0);
        assert_eq!(
            launch_shape(&meta(32, 8, 128, Some(4096))).map(|s| s.window),
            Some(4096)
        );
        // 32 query heads per kv head of 256 need ~97 KiB.
        assert_eq!(launch_shape(&meta(32, 1, 256, None)), None);
        assert_eq!(launch_shape(&meta(9, 3, 64, Some(0))), None);
    }
}

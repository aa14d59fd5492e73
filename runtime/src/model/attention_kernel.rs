//! The launch of the CUDA paged-attention kernel (`runtime/kernels/paged_attention.cu`): the
//! flattened block tables it reads, its grid, and its shared memory. The kernel is compiled to
//! PTX by `runtime/build.rs` in the `cuda` build; everything here but the launch itself is plain
//! Rust, so the CPU test that runs the same kernel source (`tests/cuda_kernel_on_cpu.rs`) feeds
//! it exactly what a GPU launch would.

use super::attention_meta::AttnMeta;

/// Threads per block: the keys scored per chunk. A power of two (the block's tree reductions).
pub const THREADS: usize = 128;

/// Most parts a token's keys are cut into (each a run of whole chunks, its own thread block,
/// then folded by the combine kernel): enough to spread one long context over the GPU, few
/// enough that the parts' scratch stays small.
pub const MAX_PARTS: usize = 16;

/// Blocks a launch aims for: fewer (a small decode batch) and each (token, head) spreads its
/// parts over several blocks. About four per SM of an H100.
pub const TARGET_BLOCKS: usize = 512;

/// Most scratch one launch pair uses for the parts' states; a batch that needs more runs as
/// several launch pairs over runs of its tokens.
pub const SCRATCH_BYTES: usize = 64 << 20;

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

/// How many parts the kernel cuts the keys of a token at `pos` into: its visible keys in
/// chunks of `chunk`, the chunks into at most `max_parts` runs of whole chunks. The kernel's
/// `ferrite_parts`; it depends on the token alone, which keeps batches invariant.
pub fn parts(pos: usize, window: usize, chunk: usize, max_parts: usize) -> usize {
    let first = if window > 0 && pos + 1 > window {
        pos + 1 - window
    } else {
        0
    };
    let chunks = (pos + 1 - first).div_ceil(chunk.max(1));
    let per_part = chunks.div_ceil(max_parts.max(1));
    chunks.div_ceil(per_part.max(1))
}

/// What a launch takes besides the operands: its block, shared memory and scalars, and how its
/// tokens are run (`LaunchShape::runs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaunchShape {
    /// Query heads: one block per (token, head), times the blocks its parts spread over
    /// (`LaunchShape::runs`).
    pub heads: u32,
    pub threads: u32,
    pub shared_bytes: u32,
    /// The sliding window as the kernel takes it: 0 for none.
    pub window: i32,
    pub max_parts: u32,
    /// The most parts a token of this launch may have: [`MAX_PARTS`] where the positions are
    /// not known when it is made (a CUDA graph replays it at later positions).
    pub planned_parts: u32,
    /// Tokens per launch pair, so that the parts' scratch stays within [`SCRATCH_BYTES`].
    pub run_tokens: u32,
    pub target_blocks: u32,
}

impl LaunchShape {
    /// Whether some token may have several parts: then each run has scratch and a combine.
    pub fn combines(&self) -> bool {
        self.planned_parts > 1
    }

    /// Scratch floats of a launch over `tokens` (reused by its runs): each (token, head,
    /// part)'s max, sum and row; none where no token has several parts.
    pub fn scratch_floats(&self, tokens: usize, head_dim: usize) -> usize {
        if !self.combines() {
            return 0;
        }
        tokens.min(self.run_tokens as usize)
            * part_states(self.heads as usize, self.max_parts as usize, head_dim)
    }

    /// The launch pairs over `tokens`: (first token, tokens, blocks per (token, head)). A
    /// (token, head) spreads its parts over several blocks only while the run has fewer blocks
    /// than [`LaunchShape::target_blocks`]; that changes which block folds a part, never how.
    pub fn runs(&self, tokens: usize) -> Vec<(u32, u32, u32)> {
        let per = (self.run_tokens as usize).max(1);
        (0..tokens)
            .step_by(per)
            .map(|t0| {
                let n = per.min(tokens - t0);
                let want = (self.target_blocks as usize).div_ceil(n * self.heads as usize);
                let z = want.clamp(1, self.planned_parts.max(1) as usize);
                (t0 as u32, n as u32, z as u32)
            })
            .collect()
    }
}

/// The launch for `meta`'s positions, or `None` where the kernel does not apply (a zero-width
/// window, heads that do not group, or head rows that do not fit the shared memory).
pub fn launch_shape(meta: &AttnMeta) -> Option<LaunchShape> {
    shape(meta, false)
}

/// The launch for a step a CUDA graph captures: its tokens may be at any position when the
/// graph is replayed, so it plans for [`MAX_PARTS`].
pub fn graph_launch_shape(meta: &AttnMeta) -> Option<LaunchShape> {
    shape(meta, true)
}

/// Scratch floats per token: each (head, part)'s max, sum and row.
fn part_states(heads: usize, max_parts: usize, head_dim: usize) -> usize {
    heads * max_parts * (2 + head_dim)
}

fn shape(meta: &AttnMeta, any_position: bool) -> Option<LaunchShape> {
    let window = match meta.sliding_window {
        None => 0,
        Some(0) => return None,
        Some(w) => i32::try_from(w).ok()?,
    };
    if meta.num_kv_heads == 0 || !meta.num_heads.is_multiple_of(meta.num_kv_heads) {
        return None;
    }
    let hd = meta.head_dim;
    // q and output rows; per key a probability (f32) and a slot (i32); reduction scratch of
    // max(keys, head_dim); the part's max and sum. Mirrors the kernel's carving.
    let shared = 4 * (2 * hd + THREADS + THREADS.max(hd) + 2) + 4 * THREADS;
    if shared > MAX_SHARED_BYTES {
        return None;
    }
    let planned = if any_position {
        MAX_PARTS
    } else {
        meta.token_pos
            .iter()
            .map(|&p| parts(p as usize, window as usize, THREADS, MAX_PARTS))
            .max()
            .unwrap_or(1)
    };
    let per_token = 4 * part_states(meta.num_heads, MAX_PARTS, hd);
    let run_tokens = if planned > 1 {
        (SCRATCH_BYTES / per_token.max(1)).max(1)
    } else {
        u32::MAX as usize
    };
    Some(LaunchShape {
        heads: u32::try_from(meta.num_heads).ok()?,
        threads: THREADS as u32,
        shared_bytes: shared as u32,
        window,
        max_parts: MAX_PARTS as u32,
        planned_parts: planned as u32,
        run_tokens: u32::try_from(run_tokens).ok()?,
        target_blocks: TARGET_BLOCKS as u32,
    })
}

#[cfg(feature = "cuda")]
pub(crate) mod cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg, sys};
    use candle_core::cuda_backend::{CudaDType, WrapErr};
    use candle_core::{CudaStorage, DType, Layout, Result, Shape, Tensor};
    use half::{bf16, f16};

    use super::{AttnMeta, KernelTables, graph_launch_shape, launch_shape};
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

    /// Whether the device's stream is capturing a CUDA graph: then the launch must hold for
    /// any position the graph is replayed at.
    fn capturing(dev: &candle_core::CudaDevice) -> Result<bool> {
        let status = dev.cuda_stream().capture_status().w()?;
        Ok(status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
    }

    fn run<C: CudaDType>(ops: &Operands, name: &str) -> Result<(CudaStorage, Shape)> {
        let Operands {
            meta,
            q: (q, ql),
            k: (k, kl),
            v: (v, vl),
        } = *ops;
        let dev = q.device().clone();
        let shape = if capturing(&dev)? {
            graph_launch_shape(meta)
        } else {
            launch_shape(meta)
        }
        .ok_or_else(|| {
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
        let combine = dev.get_or_load_custom_func("paged_attention_combine", MODULE, PTX)?;
        // SAFETY: every element is written: by the block of its (token, head) where the token
        // has one part, else by the combine.
        let out = unsafe { dev.alloc::<f32>(tokens * nh * hd)? };
        // SAFETY: the combine reads only the parts the attention launch wrote (one float where
        // no token has several parts: never read or written).
        let scratch = unsafe { dev.alloc::<f32>(shape.scratch_floats(tokens, hd).max(1))? };
        let (num_heads, num_kv_heads, head_dim, block_size) =
            (nh as i32, kvh as i32, hd as i32, meta.block_size as i32);
        let softcap = meta.softcap.unwrap_or(0.0);
        let (chunk, max_parts) = (shape.threads as i32, shape.max_parts as i32);
        for (token0, n, z) in shape.runs(tokens) {
            let token0 = token0 as i32;
            let mut b = func.builder();
            b.arg(&out);
            b.arg(&scratch);
            b.arg(&qv);
            b.arg(&kv);
            b.arg(&vv);
            b.arg(&token_seq);
            b.arg(&token_pos);
            b.arg(&table_start);
            b.arg(&flat);
            b.arg(&token0);
            b.arg(&num_heads);
            b.arg(&num_kv_heads);
            b.arg(&head_dim);
            b.arg(&block_size);
            b.arg(&meta.scale);
            b.arg(&shape.window);
            b.arg(&softcap);
            b.arg(&max_parts);
            let cfg = LaunchConfig {
                grid_dim: (n, shape.heads, z),
                block_dim: (shape.threads, 1, 1),
                shared_mem_bytes: shape.shared_bytes,
            };
            // SAFETY: the argument list is the kernel's signature; the tables were checked
            // against the pools above, the output has a row for every token, and the scratch
            // holds every part of the run's tokens where any may have several.
            unsafe { b.launch(cfg) }.w()?;
            if !shape.combines() {
                continue;
            }
            let mut c = combine.builder();
            c.arg(&out);
            c.arg(&scratch);
            c.arg(&token_pos);
            c.arg(&token0);
            c.arg(&num_heads);
            c.arg(&head_dim);
            c.arg(&shape.window);
            c.arg(&chunk);
            c.arg(&max_parts);
            let cfg = LaunchConfig {
                grid_dim: (n, shape.heads, 1),
                block_dim: (shape.threads, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: the combine's signature; it reads the scratch the launch above wrote.
            unsafe { c.launch(cfg) }.w()?;
        }
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
        assert_eq!((s.heads, s.threads), (9, 128));
        assert_eq!(s.shared_bytes, 4 * (2 * 64 + 128 + 128 + 2) + 4 * 128);
        assert_eq!(s.window, 0);
        assert_eq!(
            launch_shape(&meta(32, 8, 128, Some(4096))).map(|s| s.window),
            Some(4096)
        );
        // A block holds one head, so wide groups fit; rows past the shared memory do not.
        assert!(launch_shape(&meta(32, 1, 256, None)).is_some());
        assert_eq!(launch_shape(&meta(1, 1, 8192, None)), None);
        assert_eq!(launch_shape(&meta(9, 3, 64, Some(0))), None);
        assert_eq!(launch_shape(&meta(9, 2, 64, None)), None);
    }

    #[test]
    fn a_tokens_parts_follow_its_own_position() {
        assert_eq!(parts(0, 0, 128, 16), 1);
        assert_eq!(parts(127, 0, 128, 16), 1);
        assert_eq!(parts(128, 0, 128, 16), 2);
        assert_eq!(parts(16 * 128 - 1, 0, 128, 16), 16);
        // 17 chunks: parts of two chunks.
        assert_eq!(parts(16 * 128, 0, 128, 16), 9);
        assert_eq!(parts(100_000, 0, 128, 16), 16);
        // A window bounds the keys whatever the position.
        assert_eq!(parts(10_000, 100, 128, 16), 1);
        assert_eq!(parts(10_000, 300, 128, 16), 3);
    }

    #[test]
    fn small_batches_spread_their_parts_and_large_ones_run_in_bounded_scratch() {
        let mut m = meta(9, 3, 64, None);
        // Known short positions: one part each, one run, no combine.
        let s = launch_shape(&m).expect("fits");
        assert!(!s.combines());
        assert_eq!(s.scratch_floats(3, 64), 0);
        assert_eq!(s.runs(3), vec![(0, 3, 1)]);
        // A graph plans for any position: one decode token spreads over every part.
        let g = graph_launch_shape(&m).expect("fits");
        assert!(g.combines());
        assert_eq!(g.runs(1), vec![(0, 1, 16)]);
        assert_eq!(g.runs(8), vec![(0, 8, 8)]);
        assert_eq!(g.runs(256), vec![(0, 256, 1)]);
        // A long prefill: runs of tokens whose scratch fits SCRATCH_BYTES.
        m.token_seq = vec![0; 4096];
        m.token_pos = (0..4096).collect();
        let s = launch_shape(&m).expect("fits");
        assert_eq!(s.planned_parts, 16);
        let per = SCRATCH_BYTES / (9 * 16 * 66 * 4);
        assert_eq!(s.run_tokens as usize, per);
        assert_eq!(s.scratch_floats(4096, 64), per * 9 * 16 * 66);
        let runs = s.runs(4096);
        assert_eq!(runs.len(), 4096usize.div_ceil(per));
        assert!(runs.iter().all(|&(_, _, z)| z == 1));
        assert_eq!(runs.iter().map(|r| r.1 as usize).sum::<usize>(), 4096);
        assert!(s.scratch_floats(4096, 64) * 4 <= SCRATCH_BYTES);
    }
}

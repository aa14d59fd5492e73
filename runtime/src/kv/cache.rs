//! Per-layer block pools on the model's device, and the host swap pool.

use candle_core::{DType, Device, Tensor};

use super::pools::check_held;
use super::{BlockAllocator, BlockCopy, BlockId, BlockPools, KvError};

/// How keys and values are stored (vLLM's `--kv-cache-dtype`). Attention always computes in
/// f32; a 16-bit cache rounds each key and value once, when it is written, which halves the
/// cache's memory and the bytes attention reads per token (llama.cpp's default is f16 too).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum CacheDtype {
    /// `float16`.
    #[default]
    Auto,
    #[value(alias = "half", alias = "fp16")]
    Float16,
    #[value(alias = "bf16")]
    Bfloat16,
    #[value(alias = "float", alias = "fp32")]
    Float32,
}

impl CacheDtype {
    /// The tensor type the pools are allocated in.
    pub fn dtype(self) -> DType {
        match self {
            CacheDtype::Auto | CacheDtype::Float16 => DType::F16,
            CacheDtype::Bfloat16 => DType::BF16,
            CacheDtype::Float32 => DType::F32,
        }
    }
}

/// Shape of the cache. `num_blocks` device blocks are preallocated once, per layer, at start-up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvCacheConfig {
    pub num_layers: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
    pub num_blocks: usize,
    /// Blocks in the host-memory swap pool (0 disables swapping).
    pub num_host_blocks: usize,
    pub dtype: DType,
}

impl KvCacheConfig {
    /// Width of one token's keys (or values) in one layer.
    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// Bytes one block occupies across all layers, keys and values.
    pub fn bytes_per_block(&self) -> usize {
        self.num_layers * 2 * self.block_size * self.kv_dim() * self.dtype.size_in_bytes()
    }

    /// How many blocks fit in `bytes` (the `--kv-cache-memory` knob).
    pub fn blocks_for_bytes(&self, bytes: usize) -> usize {
        bytes / self.bytes_per_block().max(1)
    }
}

/// One pool of blocks: for each layer a key and a value tensor of shape
/// `[num_blocks * block_size, kv_dim]`, i.e. one row per token slot.
#[derive(Debug)]
struct Pool {
    k: Vec<Tensor>,
    v: Vec<Tensor>,
}

impl Pool {
    fn new(cfg: &KvCacheConfig, num_blocks: usize, device: &Device) -> Result<Self, KvError> {
        let shape = (num_blocks * cfg.block_size, cfg.kv_dim());
        let mk = || zeroed(shape, cfg.dtype, device);
        let k = (0..cfg.num_layers)
            .map(|_| mk())
            .collect::<Result<_, _>>()?;
        let v = (0..cfg.num_layers)
            .map(|_| mk())
            .collect::<Result<_, _>>()?;
        Ok(Self { k, v })
    }

    /// Every layer's key and value tensors, viewed as one row per block.
    fn block_views(&self, block_elems: usize) -> Result<Vec<Tensor>, KvError> {
        self.k
            .iter()
            .chain(self.v.iter())
            .map(|t| {
                let rows = t.dim(0)? * t.dim(1)? / block_elems;
                Ok(t.reshape((rows, block_elems))?)
            })
            .collect()
    }
}

/// A zeroed pool tensor. On the CPU its memory comes from a zeroed allocation (`calloc`), whose
/// pages the kernel maps only when a block is first written, so a pool holds resident memory
/// only as it fills: the 4 GiB host swap pool costs nothing until something is swapped out.
/// (candle's `zeros` writes every f16/bf16 element, which made that pool resident at start.)
fn zeroed(shape: (usize, usize), dtype: DType, device: &Device) -> candle_core::Result<Tensor> {
    use half::vec::HalfBitsVecExt;
    let n = shape.0 * shape.1;
    match dtype {
        DType::F32 if device.is_cpu() => Tensor::from_vec(vec![0f32; n], shape, device),
        DType::F16 if device.is_cpu() => {
            Tensor::from_vec(vec![0u16; n].reinterpret_into::<half::f16>(), shape, device)
        }
        DType::BF16 if device.is_cpu() => Tensor::from_vec(
            vec![0u16; n].reinterpret_into::<half::bf16>(),
            shape,
            device,
        ),
        _ => Tensor::zeros(shape, dtype, device),
    }
}

/// The paged KV cache: device pools indexed by per-sequence block tables, and a host pool that
/// preempted sequences are swapped out to. Which blocks are whose is [`BlockPools`]' business;
/// the cache holds the tensors and runs the copies a step's plan names.
#[derive(Debug)]
pub struct KvCache {
    /// Unique per cache made in this process: work captured against one cache's tensors (a
    /// CUDA graph) must not be replayed against another's.
    id: u64,
    cfg: KvCacheConfig,
    device: Device,
    pools: BlockPools,
    gpu: Pool,
    host: Pool,
}

impl KvCache {
    pub fn new(cfg: KvCacheConfig, device: &Device) -> Result<Self, KvError> {
        static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        Ok(Self {
            id: NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            cfg,
            device: device.clone(),
            pools: BlockPools::new(cfg.num_blocks, cfg.num_host_blocks),
            gpu: Pool::new(&cfg, cfg.num_blocks + 1, device)?,
            host: Pool::new(&cfg, cfg.num_host_blocks, &Device::Cpu)?,
        })
    }

    pub fn config(&self) -> &KvCacheConfig {
        &self.cfg
    }

    pub fn id(&self) -> u64 {
        self.id
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Both pools' bookkeeping, which the scheduler plans with.
    pub fn pools(&self) -> &BlockPools {
        &self.pools
    }

    pub fn pools_mut(&mut self) -> &mut BlockPools {
        &mut self.pools
    }

    /// Device-side allocator: used/free counts and allocation for block tables.
    pub fn allocator(&self) -> &BlockAllocator {
        &self.pools.device
    }

    pub fn allocator_mut(&mut self) -> &mut BlockAllocator {
        &mut self.pools.device
    }

    /// Host swap pool allocator (for the `cpu_cache_usage_perc` gauge).
    pub fn host_allocator(&self) -> &BlockAllocator {
        &self.pools.host
    }

    /// Key and value slot tensors of one layer, `[num_slots, kv_dim]`.
    /// A device block past the allocator's, which no sequence ever owns: the padding rows of a
    /// captured decode step (`model::cuda_graph`) write their keys and values there. (On the
    /// CPU it costs nothing: its pages are never touched.)
    pub fn scratch_block(&self) -> BlockId {
        self.cfg.num_blocks as BlockId
    }

    pub fn layer(&self, layer: usize) -> (&Tensor, &Tensor) {
        (&self.gpu.k[layer], &self.gpu.v[layer])
    }

    fn block_elems(&self) -> usize {
        self.cfg.block_size * self.cfg.kv_dim()
    }

    /// Runs a plan's swap-outs: device blocks to host blocks, every layer, keys and values.
    pub fn copy_out(&self, copies: &[BlockCopy]) -> Result<(), KvError> {
        check_held(&self.pools.host, &targets(copies))?;
        copy_blocks(
            &self.gpu,
            &self.host,
            copies,
            self.block_elems(),
            &Device::Cpu,
        )
    }

    /// Runs a plan's swap-ins: host blocks back to device blocks.
    pub fn copy_in(&self, copies: &[BlockCopy]) -> Result<(), KvError> {
        check_held(&self.pools.device, &targets(copies))?;
        copy_blocks(
            &self.host,
            &self.gpu,
            copies,
            self.block_elems(),
            &self.device,
        )
    }

    /// One block's keys and values for one layer, as f32 rows `[block_size][kv_dim]` whatever
    /// the device's layout (for tests and debugging).
    pub fn read_block(
        &self,
        layer: usize,
        block: BlockId,
    ) -> Result<(Vec<f32>, Vec<f32>), KvError> {
        check_held(&self.pools.device, &[block])?;
        let bs = self.cfg.block_size;
        let read = |t: &Tensor, keys: bool| -> Result<Vec<f32>, KvError> {
            let mut b = t.narrow(0, block as usize * bs, bs)?;
            if keys && super::layout::keys_transposed(t.device()) {
                b = super::layout::cpu_keys_as_rows(&b, bs)?;
            }
            Ok(b.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?)
        };
        Ok((
            read(&self.gpu.k[layer], true)?,
            read(&self.gpu.v[layer], false)?,
        ))
    }
}

fn targets(copies: &[BlockCopy]) -> Vec<BlockId> {
    copies.iter().map(|c| c.to).collect()
}

/// Copies block rows `from` of every layer of `src` into rows `to` of `dst`.
fn copy_blocks(
    src: &Pool,
    dst: &Pool,
    copies: &[BlockCopy],
    block_elems: usize,
    dst_device: &Device,
) -> Result<(), KvError> {
    if copies.is_empty() {
        return Ok(());
    }
    let src_views = src.block_views(block_elems)?;
    let dst_views = dst.block_views(block_elems)?;
    let from: Vec<BlockId> = copies.iter().map(|c| c.from).collect();
    let idx = Tensor::from_slice(&from, from.len(), src_views[0].device())?;
    for (s, d) in src_views.iter().zip(dst_views.iter()) {
        let rows = s.index_select(&idx, 0)?.to_device(dst_device)?;
        for (i, c) in copies.iter().enumerate() {
            d.slice_set(&rows.narrow(0, i, 1)?, 0, c.to as usize)?;
        }
    }
    Ok(())
}

/// What the cache needs to know of a model: per layer, how many key/value heads of what width.
/// The model side provides it (`From<&ModelConfig>`), so the cache never imports the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvShape {
    pub num_layers: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

impl KvCacheConfig {
    /// A cache shaped for `model`, in the default type ([`CacheDtype::Auto`]).
    pub fn for_model(
        model: impl Into<KvShape>,
        block_size: usize,
        num_blocks: usize,
        num_host_blocks: usize,
    ) -> Self {
        let shape = model.into();
        Self {
            num_layers: shape.num_layers,
            num_kv_heads: shape.num_kv_heads,
            head_dim: shape.head_dim,
            block_size,
            num_blocks,
            num_host_blocks,
            dtype: CacheDtype::Auto.dtype(),
        }
    }

    /// The same cache storing keys and values as `dtype`.
    pub fn with_dtype(self, dtype: DType) -> Self {
        Self { dtype, ..self }
    }
}

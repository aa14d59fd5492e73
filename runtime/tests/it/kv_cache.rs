//! Block pools and the host swap pool, on synthetic data (no model).

use candle_core::{DType, Device, Tensor};
use ferrite_runtime::kv::{BlockCopy, KvCache, KvCacheConfig, KvError};

fn cfg(num_blocks: usize, host: usize) -> KvCacheConfig {
    KvCacheConfig {
        num_layers: 3,
        num_kv_heads: 2,
        head_dim: 4,
        block_size: 4,
        num_blocks,
        num_host_blocks: host,
        dtype: DType::F32,
    }
}

/// Fills `block` of every layer with values that identify (layer, block, tag).
fn fill(cache: &KvCache, block: u32, tag: f32) {
    let c = *cache.config();
    for l in 0..c.num_layers {
        let (k, v) = cache.layer(l);
        let n = c.block_size * c.kv_dim();
        let vals: Vec<f32> = (0..n)
            .map(|i| tag * 1000.0 + l as f32 * 100.0 + i as f32)
            .collect();
        let t = Tensor::from_vec(vals, (c.block_size, c.kv_dim()), &Device::Cpu).expect("t");
        k.slice_set(&t, 0, block as usize * c.block_size)
            .expect("k");
        v.slice_set(&(t * -1.0).expect("neg"), 0, block as usize * c.block_size)
            .expect("v");
    }
}

fn contents(cache: &KvCache, block: u32) -> Vec<(Vec<f32>, Vec<f32>)> {
    (0..cache.config().num_layers)
        .map(|l| cache.read_block(l, block).expect("read"))
        .collect()
}

#[test]
fn swap_out_and_back_in_preserves_contents() {
    let mut cache = KvCache::new(cfg(4, 4), &Device::Cpu).expect("cache");
    let blocks = cache.allocator_mut().allocate_n(3).expect("alloc");
    for (i, &b) in blocks.iter().enumerate() {
        fill(&cache, b, i as f32 + 1.0);
    }
    let before: Vec<_> = blocks.iter().map(|&b| contents(&cache, b)).collect();

    let out = cache.pools_mut().swap_out(&blocks).expect("swap out");
    cache.copy_out(&out).expect("copy out");
    let host: Vec<u32> = out.iter().map(|c| c.to).collect();
    assert_eq!(
        cache.allocator().num_used(),
        0,
        "swap-out frees device blocks"
    );
    assert_eq!(cache.host_allocator().num_used(), 3);

    // Someone else overwrites the freed device blocks meanwhile.
    let other = cache.allocator_mut().allocate_n(4).expect("reuse");
    for &b in &other {
        fill(&cache, b, 9.0);
    }
    assert!(matches!(
        cache.pools_mut().swap_in(&host),
        Err(KvError::OutOfBlocks { .. })
    ));
    assert_eq!(
        cache.host_allocator().num_used(),
        3,
        "failed swap-in keeps host blocks"
    );
    cache.allocator_mut().free_all(&other).expect("free");

    let back = cache.pools_mut().swap_in(&host).expect("swap in");
    cache.copy_in(&back).expect("copy in");
    assert_eq!(cache.host_allocator().num_used(), 0);
    let after: Vec<_> = back.iter().map(|c| contents(&cache, c.to)).collect();
    assert_eq!(before, after, "contents changed across swap");
}

#[test]
fn swap_out_reports_a_full_host_pool_and_changes_nothing() {
    let mut cache = KvCache::new(cfg(4, 1), &Device::Cpu).expect("cache");
    let blocks = cache.allocator_mut().allocate_n(2).expect("alloc");
    assert_eq!(
        cache.pools_mut().swap_out(&blocks),
        Err(KvError::OutOfSwapBlocks {
            requested: 2,
            free: 1
        })
    );
    assert_eq!(cache.allocator().num_used(), 2);
    assert_eq!(cache.host_allocator().num_used(), 0);
}

#[test]
fn swapping_unallocated_blocks_is_an_error() {
    let mut cache = KvCache::new(cfg(4, 4), &Device::Cpu).expect("cache");
    assert!(matches!(
        cache.pools_mut().swap_out(&[2]),
        Err(KvError::InvalidBlock { id: 2, .. })
    ));
    assert!(matches!(
        cache.pools_mut().swap_in(&[0]),
        Err(KvError::InvalidBlock { id: 0, .. })
    ));
    // A copy into a block nobody holds would write over free (or cached) contents.
    assert!(matches!(
        cache.copy_out(&[BlockCopy { from: 0, to: 1 }]),
        Err(KvError::InvalidBlock { id: 1, .. })
    ));
    assert!(matches!(
        cache.copy_in(&[BlockCopy { from: 0, to: 3 }]),
        Err(KvError::InvalidBlock { id: 3, .. })
    ));
    assert!(matches!(
        cache.read_block(0, 3),
        Err(KvError::InvalidBlock { .. })
    ));
}

#[test]
fn sizes_pools_from_memory() {
    let c = cfg(0, 0);
    // 3 layers * (k+v) * 4 tokens * 8 dims * 4 bytes
    assert_eq!(c.bytes_per_block(), 768);
    assert_eq!(c.blocks_for_bytes(768 * 10 + 5), 10);
}

//! The block operations the scheduler needs, so that it can be driven by the real cache or by
//! pure bookkeeping (the scheduler tests' `CountingBlocks`, in `runtime/tests/it/scheduler.rs`).

use super::{BlockAllocator, BlockId, KvCache, KvError};

/// Device and host block accounting plus the swap moves between them.
pub trait BlockSpace {
    /// The device pool's bookkeeping (allocation, sharing, the prefix cache).
    fn device(&self) -> &BlockAllocator;
    fn device_mut(&mut self) -> &mut BlockAllocator;
    fn host_num_free(&self) -> usize;
    /// Moves device blocks to the host pool; returns host ids.
    fn swap_out(&mut self, ids: &[BlockId]) -> Result<Vec<BlockId>, KvError>;
    /// Moves host blocks back to the device; returns device ids.
    fn swap_in(&mut self, host_ids: &[BlockId]) -> Result<Vec<BlockId>, KvError>;
    fn free_host(&mut self, host_ids: &[BlockId]) -> Result<(), KvError>;

    fn num_free(&self) -> usize {
        self.device().num_free()
    }
    fn num_blocks(&self) -> usize {
        self.device().num_blocks()
    }
    fn allocate_n(&mut self, n: usize) -> Result<Vec<BlockId>, KvError> {
        self.device_mut().allocate_n(n)
    }
    fn free_all(&mut self, ids: &[BlockId]) -> Result<(), KvError> {
        self.device_mut().free_all(ids)
    }
}

impl BlockSpace for KvCache {
    fn device(&self) -> &BlockAllocator {
        self.allocator()
    }
    fn device_mut(&mut self) -> &mut BlockAllocator {
        self.allocator_mut()
    }
    fn host_num_free(&self) -> usize {
        self.host_allocator().num_free()
    }
    fn swap_out(&mut self, ids: &[BlockId]) -> Result<Vec<BlockId>, KvError> {
        KvCache::swap_out(self, ids)
    }
    fn swap_in(&mut self, host_ids: &[BlockId]) -> Result<Vec<BlockId>, KvError> {
        KvCache::swap_in(self, host_ids)
    }
    fn free_host(&mut self, host_ids: &[BlockId]) -> Result<(), KvError> {
        KvCache::free_host(self, host_ids)
    }
}

//! The block operations the scheduler needs, so that it can be driven by the real cache or by
//! pure bookkeeping in tests.

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

/// Bookkeeping-only block space: the same allocation rules as [`KvCache`] without tensors.
#[derive(Debug, Clone)]
pub struct CountingBlocks {
    pub device: BlockAllocator,
    pub host: BlockAllocator,
}

impl CountingBlocks {
    pub fn new(device_blocks: usize, host_blocks: usize) -> Self {
        Self {
            device: BlockAllocator::new(device_blocks),
            host: BlockAllocator::new(host_blocks),
        }
    }
}

impl BlockSpace for CountingBlocks {
    fn device(&self) -> &BlockAllocator {
        &self.device
    }
    fn device_mut(&mut self) -> &mut BlockAllocator {
        &mut self.device
    }
    fn host_num_free(&self) -> usize {
        self.host.num_free()
    }
    fn swap_out(&mut self, ids: &[BlockId]) -> Result<Vec<BlockId>, KvError> {
        if !self.host.can_allocate(ids.len()) {
            return Err(KvError::OutOfSwapBlocks {
                requested: ids.len(),
                free: self.host.num_free(),
            });
        }
        self.device.free_all(ids)?;
        self.host.allocate_n(ids.len())
    }
    fn swap_in(&mut self, host_ids: &[BlockId]) -> Result<Vec<BlockId>, KvError> {
        let ids = self.device.allocate_n(host_ids.len())?;
        if let Err(e) = self.host.free_all(host_ids) {
            self.device.free_all(&ids)?;
            return Err(e);
        }
        Ok(ids)
    }
    fn free_host(&mut self, host_ids: &[BlockId]) -> Result<(), KvError> {
        self.host.free_all(host_ids)
    }
}

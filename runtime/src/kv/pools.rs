//! The bookkeeping of both pools, apart from their tensors: the scheduler plans with it (and
//! its tests drive it on synthetic sequences), and the data moves a plan implies travel in the
//! plan as [`BlockCopy`] lists, which the engine hands to [`super::KvCache`] before the forward.

use super::{BlockAllocator, BlockId, KvError};

/// One block's keys and values, every layer, copied between the pools.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockCopy {
    pub from: BlockId,
    pub to: BlockId,
}

/// Device and host block accounting.
#[derive(Debug, Clone)]
pub struct BlockPools {
    pub device: BlockAllocator,
    /// The host swap pool (no blocks disables swapping).
    pub host: BlockAllocator,
}

impl BlockPools {
    pub fn new(device_blocks: usize, host_blocks: usize) -> Self {
        Self {
            device: BlockAllocator::new(device_blocks),
            host: BlockAllocator::new(host_blocks),
        }
    }

    /// Gives `blocks` back on the device and takes as many host blocks: the copies, in order,
    /// must run before anything writes the freed device blocks. Changes nothing on error.
    pub fn swap_out(&mut self, blocks: &[BlockId]) -> Result<Vec<BlockCopy>, KvError> {
        if !self.host.can_allocate(blocks.len()) {
            return Err(KvError::OutOfSwapBlocks {
                requested: blocks.len(),
                free: self.host.num_free(),
            });
        }
        check_held(&self.device, blocks)?;
        let host = self.host.allocate_n(blocks.len())?;
        self.device.free_all(blocks)?;
        Ok(pair(blocks, &host))
    }

    /// Takes device blocks for `host_blocks` and gives those back on the host. Changes nothing
    /// on error.
    pub fn swap_in(&mut self, host_blocks: &[BlockId]) -> Result<Vec<BlockCopy>, KvError> {
        check_held(&self.host, host_blocks)?;
        let device = self.device.allocate_n(host_blocks.len())?;
        self.host.free_all(host_blocks)?;
        Ok(pair(host_blocks, &device))
    }
}

fn pair(from: &[BlockId], to: &[BlockId]) -> Vec<BlockCopy> {
    from.iter()
        .zip(to)
        .map(|(&from, &to)| BlockCopy { from, to })
        .collect()
}

/// Every id is a block someone holds; checked before anything changes.
pub(super) fn check_held(alloc: &BlockAllocator, blocks: &[BlockId]) -> Result<(), KvError> {
    match blocks.iter().find(|&&id| !alloc.is_used(id)) {
        Some(&id) => Err(KvError::InvalidBlock {
            id,
            num_blocks: alloc.num_blocks(),
        }),
        None => Ok(()),
    }
}

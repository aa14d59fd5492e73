//! The paged KV cache: a block allocator (pure bookkeeping) and the per-layer block pools it
//! indexes, plus a host-memory swap pool used for preemption. Full blocks are shared between
//! requests with the same prefix (automatic prefix caching, see [`BlockAllocator`]).

mod allocator;
mod cache;
pub mod layout;
mod pools;
mod prefix;

pub use allocator::{BlockAllocator, BlockId, blocks_for_tokens};
pub use cache::{CacheDtype, KvCache, KvCacheConfig, KvShape};
pub use pools::{BlockCopy, BlockPools};
pub use prefix::{BlockHash, BlockHasher};

/// Errors of the KV cache. Exhaustion is an ordinary, recoverable condition: the scheduler
/// reacts to it by waiting or preempting.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KvError {
    #[error("out of KV cache blocks: requested {requested}, {free} free")]
    OutOfBlocks { requested: usize, free: usize },
    #[error("out of host swap blocks: requested {requested}, {free} free")]
    OutOfSwapBlocks { requested: usize, free: usize },
    #[error("block {id} freed twice")]
    DoubleFree { id: BlockId },
    #[error("block {id} is not held by anyone")]
    NotHeld { id: BlockId },
    #[error("a prefix block asked for is not cached")]
    NotCached,
    #[error("block {id} does not exist (pool has {num_blocks} blocks)")]
    InvalidBlock { id: BlockId, num_blocks: usize },
    #[error("KV cache tensor operation failed: {0}")]
    Tensor(String),
}

impl From<candle_core::Error> for KvError {
    fn from(e: candle_core::Error) -> Self {
        KvError::Tensor(e.to_string())
    }
}

//! Fixed-size block allocator: the bookkeeping half of the paged KV cache.
//!
//! It knows nothing about tensors, so the scheduler can be tested on synthetic sequences and the
//! same type accounts for both the device pool and the host swap pool.

use super::KvError;

/// Index of a block inside one pool (device or host).
pub type BlockId = u32;

/// Hands out block ids from a fixed pool and takes them back.
///
/// Frees are checked: a double free or an unknown id is an error rather than silent corruption,
/// because a leaked or doubly-owned block would corrupt another request's attention.
#[derive(Debug, Clone)]
pub struct BlockAllocator {
    /// Free ids; popped from the end so recently freed (cache-warm) blocks are reused first.
    free: Vec<BlockId>,
    in_use: Vec<bool>,
}

impl BlockAllocator {
    pub fn new(num_blocks: usize) -> Self {
        // Reverse so that the first allocations get ids 0, 1, 2, ...
        let free = (0..num_blocks as BlockId).rev().collect();
        Self {
            free,
            in_use: vec![false; num_blocks],
        }
    }

    pub fn num_blocks(&self) -> usize {
        self.in_use.len()
    }

    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    pub fn num_used(&self) -> usize {
        self.num_blocks() - self.num_free()
    }

    /// Fraction 0..1 of blocks in use (the `kv_cache_usage_perc` gauge).
    pub fn usage(&self) -> f64 {
        if self.num_blocks() == 0 {
            0.0
        } else {
            self.num_used() as f64 / self.num_blocks() as f64
        }
    }

    pub fn can_allocate(&self, n: usize) -> bool {
        n <= self.free.len()
    }

    pub fn allocate(&mut self) -> Result<BlockId, KvError> {
        let id = self.free.pop().ok_or(KvError::OutOfBlocks {
            requested: 1,
            free: 0,
        })?;
        self.in_use[id as usize] = true;
        Ok(id)
    }

    /// Allocates `n` blocks, all or nothing, so a failed request leaves the pool untouched.
    pub fn allocate_n(&mut self, n: usize) -> Result<Vec<BlockId>, KvError> {
        if n > self.free.len() {
            return Err(KvError::OutOfBlocks {
                requested: n,
                free: self.free.len(),
            });
        }
        let ids = self.free.split_off(self.free.len() - n);
        for &id in &ids {
            self.in_use[id as usize] = true;
        }
        Ok(ids)
    }

    pub fn free(&mut self, id: BlockId) -> Result<(), KvError> {
        match self.in_use.get_mut(id as usize) {
            None => Err(KvError::InvalidBlock {
                id,
                num_blocks: self.in_use.len(),
            }),
            Some(false) => Err(KvError::DoubleFree { id }),
            Some(slot) => {
                *slot = false;
                self.free.push(id);
                Ok(())
            }
        }
    }

    /// Frees every id, checking all of them first so that an error frees nothing.
    pub fn free_all(&mut self, ids: &[BlockId]) -> Result<(), KvError> {
        let mut seen = std::collections::HashSet::with_capacity(ids.len());
        for &id in ids {
            match self.in_use.get(id as usize) {
                None => {
                    return Err(KvError::InvalidBlock {
                        id,
                        num_blocks: self.in_use.len(),
                    });
                }
                Some(false) => return Err(KvError::DoubleFree { id }),
                Some(true) if !seen.insert(id) => return Err(KvError::DoubleFree { id }),
                Some(true) => {}
            }
        }
        for &id in ids {
            self.in_use[id as usize] = false;
            self.free.push(id);
        }
        Ok(())
    }

    pub fn is_used(&self, id: BlockId) -> bool {
        self.in_use.get(id as usize).copied().unwrap_or(false)
    }
}

/// Number of blocks needed to hold `num_tokens` tokens.
pub fn blocks_for_tokens(num_tokens: usize, block_size: usize) -> usize {
    num_tokens.div_ceil(block_size)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocates_distinct_blocks_until_exhausted() {
        let mut a = BlockAllocator::new(4);
        let ids: Vec<_> = (0..4).map(|_| a.allocate().expect("free block")).collect();
        let unique: std::collections::HashSet<_> = ids.iter().collect();
        assert_eq!(unique.len(), 4);
        assert_eq!(a.num_used(), 4);
        assert_eq!(a.usage(), 1.0);
        assert_eq!(
            a.allocate(),
            Err(KvError::OutOfBlocks {
                requested: 1,
                free: 0
            })
        );
    }

    #[test]
    fn allocate_n_is_all_or_nothing() {
        let mut a = BlockAllocator::new(5);
        let first = a.allocate_n(3).expect("3 of 5");
        assert_eq!(first.len(), 3);
        assert_eq!(
            a.allocate_n(3),
            Err(KvError::OutOfBlocks {
                requested: 3,
                free: 2
            })
        );
        assert_eq!(a.num_free(), 2, "a failed allocate_n must not take blocks");
    }

    #[test]
    fn free_rejects_double_free_and_unknown_ids() {
        let mut a = BlockAllocator::new(2);
        let id = a.allocate().expect("free block");
        a.free(id).expect("first free");
        assert_eq!(a.free(id), Err(KvError::DoubleFree { id }));
        assert_eq!(
            a.free(7),
            Err(KvError::InvalidBlock {
                id: 7,
                num_blocks: 2
            })
        );
        let b = a.allocate().expect("block");
        assert_eq!(a.free_all(&[b, b]), Err(KvError::DoubleFree { id: b }));
        assert!(a.is_used(b), "a rejected free_all frees nothing");
    }

    #[test]
    fn blocks_for_tokens_rounds_up() {
        assert_eq!(blocks_for_tokens(0, 16), 0);
        assert_eq!(blocks_for_tokens(1, 16), 1);
        assert_eq!(blocks_for_tokens(16, 16), 1);
        assert_eq!(blocks_for_tokens(17, 16), 2);
    }
}

#[cfg(test)]
mod properties {
    use super::*;
    use proptest::prelude::*;

    #[derive(Debug, Clone)]
    enum Op {
        Alloc(usize),
        FreeSeq(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (1usize..6).prop_map(Op::Alloc),
            (0usize..16).prop_map(Op::FreeSeq)
        ]
    }

    proptest! {
        /// Random allocate/free traffic from many "sequences" never hands one block to two
        /// owners, keeps counts consistent, and leaks nothing once every owner frees.
        #[test]
        fn no_leaks_or_double_ownership(ops in proptest::collection::vec(op(), 1..300), size in 1usize..40) {
            let mut a = BlockAllocator::new(size);
            let mut owners: Vec<Vec<BlockId>> = Vec::new();
            for op in ops {
                match op {
                    Op::Alloc(n) => match a.allocate_n(n) {
                        Ok(ids) => owners.push(ids),
                        Err(KvError::OutOfBlocks { requested, free }) => {
                            prop_assert_eq!(requested, n);
                            prop_assert!(free < n);
                            prop_assert_eq!(free, a.num_free());
                        }
                        Err(e) => prop_assert!(false, "unexpected error {e}"),
                    },
                    Op::FreeSeq(i) if !owners.is_empty() => {
                        let ids = owners.swap_remove(i % owners.len());
                        a.free_all(&ids).expect("owned blocks free cleanly");
                    }
                    Op::FreeSeq(_) => {}
                }
                let owned: Vec<BlockId> = owners.iter().flatten().copied().collect();
                let unique: std::collections::HashSet<_> = owned.iter().collect();
                prop_assert_eq!(unique.len(), owned.len(), "a block has two owners");
                prop_assert_eq!(owned.len(), a.num_used());
                prop_assert!(owned.iter().all(|&b| a.is_used(b)));
            }
            for ids in owners.drain(..) {
                a.free_all(&ids).expect("free");
            }
            prop_assert_eq!(a.num_free(), size);
        }
    }
}

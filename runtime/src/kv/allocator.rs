//! Fixed-size block allocator: the bookkeeping half of the paged KV cache, with automatic
//! prefix caching.
//!
//! It knows nothing about tensors, so the scheduler can be tested on synthetic sequences and the
//! same type accounts for both the device pool and the host swap pool.
//!
//! Blocks are reference-counted: a full block whose contents are named by a [`BlockHash`] can be
//! held by every sequence that shares its prefix. A block whose count drops to zero joins the
//! free queue but keeps its hash, so a later request with the same prefix can take it back
//! (a cache hit); it is evicted, least recently freed first, only when an allocation needs it.
//! Cached-but-free blocks count as free, as in vLLM, so the usage gauge shows what is committed.

use std::collections::HashMap;

use super::KvError;
use super::prefix::BlockHash;

/// Index of a block inside one pool (device or host).
pub type BlockId = u32;

const NIL: u32 = u32::MAX;

/// Hands out block ids from a fixed pool, shares cached prefix blocks, and takes them back.
///
/// Frees are checked: freeing a block nobody holds, or an unknown id, is an error rather than
/// silent corruption, because a leaked or doubly-owned block would corrupt another request's
/// attention.
#[derive(Debug, Clone)]
pub struct BlockAllocator {
    /// Holders of each block; zero means it is in the free queue.
    refs: Vec<u32>,
    /// The prefix each block holds, once registered.
    hash: Vec<Option<BlockHash>>,
    /// Registered blocks by prefix, held or free.
    cached: HashMap<BlockHash, BlockId>,
    /// The free queue as a doubly linked list over block ids: allocation takes from the head.
    /// Blocks without a hash are put at the head (nothing is lost by reusing them, and they are
    /// cache-warm); hashed blocks at the tail, so the least recently freed prefix goes first.
    prev: Vec<u32>,
    next: Vec<u32>,
    head: u32,
    tail: u32,
    num_free: usize,
}

impl BlockAllocator {
    pub fn new(num_blocks: usize) -> Self {
        let mut a = Self {
            refs: vec![0; num_blocks],
            hash: vec![None; num_blocks],
            cached: HashMap::new(),
            prev: vec![NIL; num_blocks],
            next: vec![NIL; num_blocks],
            head: NIL,
            tail: NIL,
            num_free: 0,
        };
        // The first allocations get ids 0, 1, 2, ...
        for id in 0..num_blocks as BlockId {
            a.push_back(id);
        }
        a
    }

    pub fn num_blocks(&self) -> usize {
        self.refs.len()
    }

    /// Blocks an allocation could take, including cached blocks nobody holds.
    pub fn num_free(&self) -> usize {
        self.num_free
    }

    pub fn num_used(&self) -> usize {
        self.num_blocks() - self.num_free()
    }

    /// Blocks that hold a registered prefix, held or free.
    pub fn num_cached(&self) -> usize {
        self.cached.len()
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
        n <= self.num_free
    }

    pub fn allocate(&mut self) -> Result<BlockId, KvError> {
        let mut ids = self.allocate_n(1)?;
        ids.pop().ok_or(KvError::OutOfBlocks {
            requested: 1,
            free: 0,
        })
    }

    /// Allocates `n` blocks, all or nothing, so a failed request leaves the pool untouched.
    /// Cached free blocks taken here lose their hash (eviction).
    pub fn allocate_n(&mut self, n: usize) -> Result<Vec<BlockId>, KvError> {
        if n > self.num_free {
            return Err(KvError::OutOfBlocks {
                requested: n,
                free: self.num_free,
            });
        }
        let mut ids = Vec::with_capacity(n);
        for _ in 0..n {
            let id = self.head;
            self.unlink(id);
            if let Some(h) = self.hash[id as usize].take() {
                self.cached.remove(&h);
            }
            self.refs[id as usize] = 1;
            ids.push(id);
        }
        Ok(ids)
    }

    pub fn free(&mut self, id: BlockId) -> Result<(), KvError> {
        self.free_all(&[id])
    }

    /// Drops one hold on each id, checking all of them first so that an error frees nothing.
    /// Pass a sequence's table in order: the blocks are queued last-first, so a prefix's
    /// leading blocks (the ones other requests share) stay cached longest.
    pub fn free_all(&mut self, ids: &[BlockId]) -> Result<(), KvError> {
        let mut drops: HashMap<BlockId, u32> = HashMap::with_capacity(ids.len());
        for &id in ids {
            let Some(&held) = self.refs.get(id as usize) else {
                return Err(KvError::InvalidBlock {
                    id,
                    num_blocks: self.refs.len(),
                });
            };
            let n = drops.entry(id).or_default();
            *n += 1;
            if *n > held {
                return Err(KvError::DoubleFree { id });
            }
        }
        for &id in ids.iter().rev() {
            let r = &mut self.refs[id as usize];
            *r -= 1;
            if *r == 0 {
                if self.hash[id as usize].is_some() {
                    self.push_back(id);
                } else {
                    self.push_front(id);
                }
            }
        }
        Ok(())
    }

    pub fn is_used(&self, id: BlockId) -> bool {
        self.refs.get(id as usize).is_some_and(|&r| r > 0)
    }

    /// How many sequences hold `id`.
    pub fn ref_count(&self, id: BlockId) -> u32 {
        self.refs.get(id as usize).copied().unwrap_or(0)
    }

    /// The prefix `id` holds, if registered.
    pub fn block_hash(&self, id: BlockId) -> Option<BlockHash> {
        self.hash.get(id as usize).copied().flatten()
    }

    /// How many leading blocks of `hashes` are cached. Looks only; takes nothing.
    pub fn cached_prefix(&self, hashes: &[BlockHash]) -> usize {
        hashes
            .iter()
            .take_while(|h| self.cached.contains_key(h))
            .count()
    }

    /// Of the cached blocks for `hashes` (all of which must be cached), how many nobody holds:
    /// taking them lowers the free count just as fresh allocations do.
    pub fn free_among_cached(&self, hashes: &[BlockHash]) -> usize {
        hashes
            .iter()
            .filter_map(|h| self.cached.get(h))
            .filter(|&&id| self.refs[id as usize] == 0)
            .count()
    }

    /// Takes a hold on the cached blocks for `hashes`, in order. All must be cached (see
    /// [`BlockAllocator::cached_prefix`]); otherwise nothing is taken.
    pub fn take_cached(&mut self, hashes: &[BlockHash]) -> Result<Vec<BlockId>, KvError> {
        let ids: Vec<BlockId> = hashes
            .iter()
            .map(|h| self.cached.get(h).copied().ok_or(KvError::NotCached))
            .collect::<Result<_, _>>()?;
        for &id in &ids {
            if self.refs[id as usize] == 0 {
                self.unlink(id);
            }
            self.refs[id as usize] += 1;
        }
        Ok(ids)
    }

    /// Names a held, full block by the prefix it holds (or will hold once this step's forward
    /// has written it), so later requests can share it. Returns false when another block
    /// already holds that prefix (this one stays private and is reused first once freed) or
    /// this block already holds one.
    pub fn register(&mut self, id: BlockId, hash: BlockHash) -> Result<bool, KvError> {
        match self.refs.get(id as usize) {
            None => Err(KvError::InvalidBlock {
                id,
                num_blocks: self.refs.len(),
            }),
            Some(0) => Err(KvError::NotHeld { id }),
            Some(_) if self.hash[id as usize].is_some() || self.cached.contains_key(&hash) => {
                Ok(false)
            }
            Some(_) => {
                self.hash[id as usize] = Some(hash);
                self.cached.insert(hash, id);
                Ok(true)
            }
        }
    }

    /// Forgets every cached prefix (after a failed forward, whose blocks may hold garbage).
    /// Held blocks stay held.
    pub fn reset_prefix_cache(&mut self) {
        self.cached.clear();
        self.hash.iter_mut().for_each(|h| *h = None);
    }

    /// Free-queue ids from the head (next to be allocated) to the tail.
    pub fn free_queue(&self) -> Vec<BlockId> {
        let mut out = Vec::with_capacity(self.num_free);
        let mut id = self.head;
        while id != NIL {
            out.push(id);
            id = self.next[id as usize];
        }
        out
    }

    fn push_back(&mut self, id: BlockId) {
        self.prev[id as usize] = self.tail;
        self.next[id as usize] = NIL;
        if self.tail == NIL {
            self.head = id;
        } else {
            self.next[self.tail as usize] = id;
        }
        self.tail = id;
        self.num_free += 1;
    }

    fn push_front(&mut self, id: BlockId) {
        self.next[id as usize] = self.head;
        self.prev[id as usize] = NIL;
        if self.head == NIL {
            self.tail = id;
        } else {
            self.prev[self.head as usize] = id;
        }
        self.head = id;
        self.num_free += 1;
    }

    fn unlink(&mut self, id: BlockId) {
        let (p, n) = (self.prev[id as usize], self.next[id as usize]);
        if p == NIL {
            self.head = n;
        } else {
            self.next[p as usize] = n;
        }
        if n == NIL {
            self.tail = p;
        } else {
            self.prev[n as usize] = p;
        }
        self.prev[id as usize] = NIL;
        self.next[id as usize] = NIL;
        self.num_free -= 1;
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
    fn freed_prefix_blocks_stay_cached_until_evicted_oldest_first() {
        let mut a = BlockAllocator::new(4);
        let ids = a.allocate_n(2).expect("2 of 4");
        assert!(a.register(ids[0], 10).expect("held"));
        assert!(a.register(ids[1], 11).expect("held"));
        a.free_all(&ids).expect("free");
        assert_eq!(a.num_free(), 4, "cached-but-free blocks count as free");
        assert_eq!(a.num_cached(), 2);
        assert_eq!(a.cached_prefix(&[10, 11, 12]), 2);
        assert_eq!(a.free_among_cached(&[10, 11]), 2);

        // Unhashed blocks go first; then the cached ones, the sequence's last block first.
        let fresh = a.allocate_n(2).expect("the two never-used blocks");
        assert!(fresh.iter().all(|id| !ids.contains(id)));
        assert_eq!(
            a.num_cached(),
            2,
            "no eviction while unhashed blocks remain"
        );
        let evicted = a.allocate().expect("a cached block");
        assert_eq!(
            evicted, ids[1],
            "the tail of a prefix is evicted before its head"
        );
        assert_eq!(a.cached_prefix(&[10, 11]), 1);
        assert_eq!(a.block_hash(evicted), None);
    }

    #[test]
    fn shared_blocks_are_reference_counted() {
        let mut a = BlockAllocator::new(3);
        let id = a.allocate().expect("block");
        assert!(a.register(id, 7).expect("held"));
        let again = a.take_cached(&[7]).expect("cached");
        assert_eq!(again, vec![id]);
        assert_eq!(a.ref_count(id), 2);
        a.free(id).expect("first holder");
        assert!(a.is_used(id), "still held by the second");
        a.free(id).expect("second holder");
        assert_eq!(a.free(id), Err(KvError::DoubleFree { id }));
        // Taking a free cached block takes it out of the free queue.
        assert_eq!(a.take_cached(&[7]).expect("cached"), vec![id]);
        assert_eq!(a.num_free(), 2);
        assert!(!a.free_queue().contains(&id));
        assert_eq!(a.take_cached(&[8]), Err(KvError::NotCached));
    }

    #[test]
    fn a_prefix_is_registered_once() {
        let mut a = BlockAllocator::new(3);
        let ids = a.allocate_n(2).expect("2");
        assert!(a.register(ids[0], 5).expect("held"));
        assert!(
            !a.register(ids[1], 5).expect("held"),
            "a duplicate stays private"
        );
        assert!(
            !a.register(ids[0], 6).expect("held"),
            "one prefix per block"
        );
        assert_eq!(a.register(2, 9), Err(KvError::NotHeld { id: 2 }));
        a.reset_prefix_cache();
        assert_eq!(a.num_cached(), 0);
        assert_eq!(a.ref_count(ids[0]), 1, "a reset keeps holders");
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

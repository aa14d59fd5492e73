//! Block hashes for automatic prefix caching.
//!
//! A full block is named by the hash of its parent block's hash and its own token ids, so equal
//! hashes mean equal prefixes, not just equal blocks: the keys and values of a position depend
//! on every token before it. Anything else that would change a block's keys and values (a LoRA
//! adapter, later) goes into the root through [`BlockHasher::with_extra`].

use std::hash::{Hash, Hasher};

/// Names the whole prefix up to and including one full block.
///
/// 128 bits, from two independently keyed SipHash passes: a collision would silently hand one
/// request another's keys and values, so the odds must be negligible (about 2^-64 at 2^32
/// cached blocks), not merely small.
pub type BlockHash = u128;

/// Hashes a sequence's tokens block by block as they arrive.
#[derive(Debug, Clone)]
pub struct BlockHasher {
    block_size: usize,
    /// Hashes of the full blocks so far, in order.
    hashes: Vec<BlockHash>,
    /// Tokens after the last full block.
    tail: Vec<u32>,
    root: BlockHash,
}

impl BlockHasher {
    /// A hasher for sequences whose keys and values depend only on their tokens.
    pub fn new(block_size: usize) -> Self {
        Self::with_extra(block_size, 0)
    }

    /// A hasher whose blocks also depend on `extra` (e.g. an adapter id), so that equal tokens
    /// under different adapters never share blocks.
    pub fn with_extra(block_size: usize, extra: u64) -> Self {
        Self {
            block_size: block_size.max(1),
            hashes: Vec::new(),
            tail: Vec::with_capacity(block_size),
            root: hash_parts(0, extra, &[]),
        }
    }

    /// Adds tokens; returns how many full blocks they completed.
    pub fn extend(&mut self, tokens: &[u32]) -> usize {
        let before = self.hashes.len();
        for &t in tokens {
            self.push(t);
        }
        self.hashes.len() - before
    }

    /// Adds one token; returns the new block's hash when it completed one.
    pub fn push(&mut self, token: u32) -> Option<BlockHash> {
        self.tail.push(token);
        if self.tail.len() < self.block_size {
            return None;
        }
        let parent = self.hashes.last().copied().unwrap_or(self.root);
        let h = hash_parts(parent, 1, &self.tail);
        self.tail.clear();
        self.hashes.push(h);
        Some(h)
    }

    /// Hashes of the full blocks so far.
    pub fn hashes(&self) -> &[BlockHash] {
        &self.hashes
    }
}

fn hash_parts(parent: BlockHash, tag: u64, tokens: &[u32]) -> BlockHash {
    let half = |key: u64| {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        key.hash(&mut h);
        parent.hash(&mut h);
        tag.hash(&mut h);
        tokens.hash(&mut h);
        h.finish()
    };
    (u128::from(half(0x9e37_79b9_7f4a_7c15)) << 64) | u128::from(half(0xc2b2_ae3d_27d4_eb4f))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hashes(tokens: &[u32], bs: usize) -> Vec<BlockHash> {
        let mut h = BlockHasher::new(bs);
        h.extend(tokens);
        h.hashes().to_vec()
    }

    #[test]
    fn equal_prefixes_share_hashes_until_they_differ() {
        let a: Vec<u32> = (0..40).collect();
        let mut b = a.clone();
        b[20] = 999; // inside the second block of 16
        let (ha, hb) = (hashes(&a, 16), hashes(&b, 16));
        assert_eq!(ha.len(), 2, "40 tokens hold two full blocks of 16");
        assert_eq!(ha[0], hb[0]);
        assert_ne!(ha[1], hb[1]);
    }

    #[test]
    fn a_block_hash_depends_on_its_parents() {
        // The same second block after a different first block is a different prefix.
        let a: Vec<u32> = (0..8).chain(100..108).collect();
        let b: Vec<u32> = (50..58).chain(100..108).collect();
        assert_ne!(hashes(&a, 8)[1], hashes(&b, 8)[1]);
    }

    #[test]
    fn extra_keys_separate_otherwise_equal_blocks() {
        let t: Vec<u32> = (0..16).collect();
        let mut plain = BlockHasher::new(16);
        let mut adapted = BlockHasher::with_extra(16, 7);
        plain.extend(&t);
        adapted.extend(&t);
        assert_ne!(plain.hashes(), adapted.hashes());
    }

    #[test]
    fn push_reports_the_block_it_completes() {
        let mut h = BlockHasher::new(4);
        assert_eq!(h.extend(&[1, 2, 3]), 0);
        let done = h.push(4).expect("fourth token completes a block");
        assert_eq!(h.hashes(), &[done]);
        assert_eq!(h.push(5), None);
    }
}

//! A sequence swapped out to the host pool mid-generation, with its device blocks reused by
//! someone else meanwhile, resumes from different blocks and produces the same tokens.

use crate::common;

use candle_core::Device;
use ferrite_runtime::kv::{BlockId, KvCache, KvCacheConfig, blocks_for_tokens};
use ferrite_runtime::model::driver::argmax_rows;
use ferrite_runtime::model::{self, LoadOptions, LoadedModel, SeqInput};

const NEW_TOKENS: usize = 20;
const SWAP_AT: usize = 8;

fn step(
    m: &LoadedModel,
    cache: &mut KvCache,
    blocks: &mut Vec<BlockId>,
    tokens: &[u32],
    start: usize,
) -> u32 {
    let need = blocks_for_tokens(start + tokens.len(), cache.config().block_size) - blocks.len();
    blocks.extend(cache.allocator_mut().allocate_n(need).expect("blocks"));
    let input = SeqInput {
        tokens,
        start_pos: start,
        block_table: blocks,
        adapter: None,
    };
    argmax_rows(&m.model.forward(&[input], cache).expect("forward")).expect("argmax")[0]
}

fn generate(m: &LoadedModel, cache: &mut KvCache, prompt: &[u32], swap: bool) -> Vec<u32> {
    let mut blocks = Vec::new();
    let mut out = vec![step(m, cache, &mut blocks, prompt, 0)];
    let mut len = prompt.len();
    while out.len() < NEW_TOKENS {
        if swap && out.len() == SWAP_AT {
            let out = cache.pools_mut().swap_out(&blocks).expect("swap out");
            cache.copy_out(&out).expect("copy out");
            let host: Vec<BlockId> = out.iter().map(|c| c.to).collect();
            // Another sequence takes every free block and writes its own keys and values.
            let mut other = Vec::new();
            let filler: Vec<u32> = (0..(cache.allocator().num_free() * 16) as u32)
                .map(|i| 100 + i % 500)
                .collect();
            step(m, cache, &mut other, &filler, 0);
            assert_eq!(cache.allocator().num_free(), 0);
            // It keeps the blocks the sequence had while the sequence swaps back in, so the
            // sequence must land in other blocks.
            let old = blocks.clone();
            let (kept, rest): (Vec<BlockId>, Vec<BlockId>) =
                other.iter().partition(|b| old.contains(b));
            cache.allocator_mut().free_all(&rest).expect("free");
            let back = cache.pools_mut().swap_in(&host).expect("swap in");
            cache.copy_in(&back).expect("copy in");
            blocks = back.iter().map(|c| c.to).collect();
            cache.allocator_mut().free_all(&kept).expect("free kept");
            assert_ne!(
                blocks, old,
                "resumed in the same blocks; the test would prove nothing"
            );
        }
        let last = *out.last().expect("token");
        out.push(step(m, cache, &mut blocks, &[last], len));
        len += 1;
    }
    cache.allocator_mut().free_all(&blocks).expect("free");
    out
}

#[test]
fn swapped_sequence_resumes_with_identical_output() {
    let m = model::load(&common::default_model(), &LoadOptions::default()).expect("load");
    let prompt = m.tokenizer.encode(common::PROMPT, false).expect("encode");
    let cfg = KvCacheConfig::for_model(m.model.config(), 16, 6, 6);
    let mut cache = KvCache::new(cfg, &Device::Cpu).expect("cache");
    let plain = generate(&m, &mut cache, &prompt, false);
    let swapped = generate(&m, &mut cache, &prompt, true);
    assert_eq!(swapped, plain);
    assert_eq!(cache.allocator().num_used(), 0);
    assert_eq!(cache.host_allocator().num_used(), 0);
}

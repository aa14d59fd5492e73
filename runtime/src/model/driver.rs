//! A minimal greedy driver over the runtime: it owns block tables and steps several sequences
//! through mixed prefill-chunk/decode batches. Benchmarks and runtime tests use it; the serving
//! engine has its own scheduler and sampler.

use std::sync::Arc;

use candle_core::Tensor;

use super::lora::LoraAdapter;
use super::{LlamaModel, ModelError, SeqInput};
use crate::kv::{BlockId, KvCache, blocks_for_tokens};

/// One sequence being generated greedily.
#[derive(Debug, Clone)]
pub struct GreedySeq {
    pub prompt: Vec<u32>,
    pub max_new_tokens: usize,
    pub generated: Vec<u32>,
    /// Tokens already written to the cache.
    pub computed: usize,
    pub blocks: Vec<BlockId>,
    /// Step at which this sequence joins (lets tests mix prefills with running decodes).
    pub start_step: usize,
    /// Next-token logits from the step that finished its prompt (for reference checks).
    pub first_logits: Option<Vec<f32>>,
    /// Keep the logits of every generated token in `all_logits` (batch-invariance checks).
    pub keep_all_logits: bool,
    pub all_logits: Vec<Vec<f32>>,
    /// The LoRA adapter it runs with (`None`: the base model).
    pub adapter: Option<Arc<LoraAdapter>>,
}

impl GreedySeq {
    pub fn new(prompt: Vec<u32>, max_new_tokens: usize) -> Self {
        Self {
            prompt,
            max_new_tokens,
            generated: Vec::new(),
            computed: 0,
            blocks: Vec::new(),
            start_step: 0,
            first_logits: None,
            keep_all_logits: false,
            all_logits: Vec::new(),
            adapter: None,
        }
    }

    pub fn done(&self) -> bool {
        self.generated.len() >= self.max_new_tokens
    }

    fn all_tokens(&self) -> impl Iterator<Item = u32> + '_ {
        self.prompt.iter().chain(self.generated.iter()).copied()
    }
}

/// Runs all sequences to completion. Each step, every active sequence contributes either its
/// next prefill chunk (at most `prefill_chunk` tokens) or one decode token, all in one forward.
pub fn run_greedy(
    model: &LlamaModel,
    cache: &mut KvCache,
    seqs: &mut [GreedySeq],
    prefill_chunk: usize,
) -> Result<usize, ModelError> {
    let bs = cache.config().block_size;
    let mut step = 0;
    let mut forwards = 0;
    while seqs.iter().any(|s| !s.done()) {
        let mut inputs: Vec<(usize, Vec<u32>)> = Vec::new();
        for (i, s) in seqs.iter_mut().enumerate() {
            if s.done() || s.start_step > step {
                continue;
            }
            let total = s.prompt.len() + s.generated.len();
            let n = (total - s.computed).min(prefill_chunk.max(1));
            let need = blocks_for_tokens(s.computed + n, bs).saturating_sub(s.blocks.len());
            let new = cache
                .allocator_mut()
                .allocate_n(need)
                .map_err(|e| ModelError::InvalidBatch(e.to_string()))?;
            s.blocks.extend(new);
            let toks: Vec<u32> = s.all_tokens().skip(s.computed).take(n).collect();
            inputs.push((i, toks));
        }
        step += 1;
        if inputs.is_empty() {
            continue;
        }
        let batch: Vec<SeqInput> = inputs
            .iter()
            .map(|(i, toks)| SeqInput {
                tokens: toks,
                start_pos: seqs[*i].computed,
                block_table: &seqs[*i].blocks,
                adapter: seqs[*i].adapter.as_deref(),
            })
            .collect();
        let logits = model.forward(&batch, cache)?;
        forwards += 1;
        let next = argmax_rows(&logits)?;
        for (row, (i, toks)) in inputs.iter().enumerate() {
            let s = &mut seqs[*i];
            s.computed += toks.len();
            if s.computed == s.prompt.len() + s.generated.len() {
                if s.generated.is_empty() || s.keep_all_logits {
                    let l = logits.get(row)?.to_vec1::<f32>()?;
                    if s.keep_all_logits {
                        s.all_logits.push(l.clone());
                    }
                    if s.generated.is_empty() {
                        s.first_logits = Some(l);
                    }
                }
                s.generated.push(next[row]);
            }
            if s.done() {
                let blocks = std::mem::take(&mut s.blocks);
                cache
                    .allocator_mut()
                    .free_all(&blocks)
                    .map_err(|e| ModelError::InvalidBatch(e.to_string()))?;
            }
        }
    }
    Ok(forwards)
}

/// Index of the largest logit in each row; ties go to the lowest index.
pub fn argmax_rows(logits: &Tensor) -> Result<Vec<u32>, ModelError> {
    Ok(logits
        .to_vec2::<f32>()?
        .iter()
        .map(|row| argmax(row))
        .collect())
}

/// Index of the largest value; ties go to the lowest index, so greedy is deterministic.
pub fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best as u32
}

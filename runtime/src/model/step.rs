//! One forward's inputs as the device reads them. Every per-token and per-sequence index of a
//! batch (token ids, positions, cache slots, the attention kernel's tables, the rows whose
//! logits are wanted) is packed into one u32 vector, so a step makes one host-to-device copy
//! instead of eight, and a captured CUDA graph (`cuda_graph`) finds its inputs at fixed places
//! in one buffer.

use std::ops::Range;

use candle_core::{Device, Result, Tensor};

use super::attention_meta::{AttnMeta, PackedTables};
use super::config::ModelConfig;

/// One sequence's share of a forward pass: the new tokens to run (a whole prompt, a prefill
/// chunk, or one decode token), how many of its tokens are already in the cache, and its block
/// table, which must already cover `start_pos + tokens.len()` positions.
#[derive(Debug, Clone, Copy)]
pub struct SeqInput<'a> {
    pub tokens: &'a [u32],
    pub start_pos: usize,
    pub block_table: &'a [u32],
    /// The LoRA adapter this sequence runs with (`None`: the base model).
    pub adapter: Option<&'a super::lora::LoraAdapter>,
}

/// A batch's inputs, packed: `[ids | positions | slots | token_seq]` with one entry per token,
/// then `[last | table_start]` with one per sequence, then every block table back to back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackedStep {
    pub data: Vec<u32>,
    pub tokens: usize,
    pub seqs: usize,
}

impl PackedStep {
    /// Packs `batch` (already checked: every table covers its tokens). A batch of `n` one-token
    /// sequences always has its regions at the same places, whatever the tables hold, so a
    /// graph captured for `n` rows reads any such batch.
    pub fn new(batch: &[SeqInput], block_size: usize) -> Self {
        let tokens: usize = batch.iter().map(|s| s.tokens.len()).sum();
        let seqs = batch.len();
        let tables: usize = batch.iter().map(|s| s.block_table.len()).sum();
        let mut data = vec![0u32; 4 * tokens + 2 * seqs + tables];
        let (t, s) = (tokens, seqs);
        let (mut tok, mut table_at) = (0, 4 * t + 2 * s);
        for (i, q) in batch.iter().enumerate() {
            for (j, &id) in q.tokens.iter().enumerate() {
                let pos = q.start_pos + j;
                data[tok] = id;
                data[t + tok] = pos as u32;
                data[2 * t + tok] = (q.block_table[pos / block_size] as usize * block_size
                    + pos % block_size) as u32;
                data[3 * t + tok] = i as u32;
                tok += 1;
            }
            data[4 * t + i] = (tok - 1) as u32;
            data[4 * t + s + i] = (table_at - (4 * t + 2 * s)) as u32;
            data[table_at..table_at + q.block_table.len()].copy_from_slice(q.block_table);
            table_at += q.block_table.len();
        }
        Self { data, tokens, seqs }
    }

    pub fn ids(&self) -> Range<usize> {
        0..self.tokens
    }
    pub fn positions(&self) -> Range<usize> {
        self.tokens..2 * self.tokens
    }
    pub fn slots(&self) -> Range<usize> {
        2 * self.tokens..3 * self.tokens
    }
    pub fn token_seq(&self) -> Range<usize> {
        3 * self.tokens..4 * self.tokens
    }
    /// Per sequence: the row of its last token, whose logits the forward returns.
    pub fn last(&self) -> Range<usize> {
        4 * self.tokens..4 * self.tokens + self.seqs
    }
    pub fn table_start(&self) -> Range<usize> {
        let at = 4 * self.tokens + self.seqs;
        at..at + self.seqs
    }
    pub fn tables(&self) -> Range<usize> {
        4 * self.tokens + 2 * self.seqs..self.data.len()
    }

    /// The host-side attention metadata of the packed batch (the CPU kernel, the generic path
    /// and the launch checks read it).
    pub fn meta(&self, cfg: &ModelConfig, block_size: usize) -> AttnMeta {
        let (starts, tables) = (&self.data[self.table_start()], &self.data[self.tables()]);
        let ends = starts.iter().skip(1).copied().chain([tables.len() as u32]);
        let block_tables = starts
            .iter()
            .zip(ends)
            .map(|(&a, b)| tables[a as usize..b as usize].to_vec())
            .collect();
        AttnMeta {
            num_heads: cfg.num_heads,
            num_kv_heads: cfg.num_kv_heads,
            head_dim: cfg.head_dim,
            block_size,
            scale: cfg.score_scale(),
            sliding_window: cfg.sliding_window,
            softcap: cfg.attn_logit_softcap,
            token_seq: self.data[self.token_seq()].to_vec(),
            token_pos: self.data[self.positions()].to_vec(),
            block_tables,
            device_tables: Default::default(),
        }
    }

    /// Copies the packed vector to `device`: one copy.
    pub fn upload(&self, device: &Device) -> Result<Tensor> {
        Tensor::from_slice(&self.data, self.data.len(), device)
    }
}

/// Views of one packed tensor (`PackedStep`'s layout, possibly inside a larger buffer starting
/// at its offset 0) that the layers read.
#[derive(Debug, Clone)]
pub struct StepTensors {
    pub ids: Tensor,
    pub positions: Tensor,
    pub slots: Tensor,
    pub last: Tensor,
}

impl StepTensors {
    /// The views of `packed` for `layout`, and `meta`'s device tables pointed at the same
    /// buffer (the CUDA attention kernel reads them there).
    pub fn new(packed: &Tensor, layout: &PackedStep, meta: &AttnMeta) -> Result<Self> {
        let view = |r: Range<usize>| packed.narrow(0, r.start, r.len());
        meta.device_tables.preset(PackedTables {
            packed: packed.clone(),
            token_seq: layout.token_seq(),
            token_pos: layout.positions(),
            table_start: layout.table_start(),
            tables: layout.tables(),
        });
        Ok(Self {
            ids: view(layout.ids())?,
            positions: view(layout.positions())?,
            slots: view(layout.slots())?,
            last: view(layout.last())?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn regions_hold_the_batch() {
        let (a, b) = ([7, 8, 9], [5]);
        let (ta, tb) = ([4, 2], [6]);
        let batch = [
            SeqInput {
                tokens: &a,
                start_pos: 14,
                block_table: &ta,
                adapter: None,
            },
            SeqInput {
                tokens: &b,
                start_pos: 3,
                block_table: &tb,
                adapter: None,
            },
        ];
        let p = PackedStep::new(&batch, 16);
        assert_eq!((p.tokens, p.seqs), (4, 2));
        assert_eq!(&p.data[p.ids()], &[7, 8, 9, 5]);
        assert_eq!(&p.data[p.positions()], &[14, 15, 16, 3]);
        // Positions 14 and 15 in block 4, 16 in block 2; position 3 in block 6.
        assert_eq!(
            &p.data[p.slots()],
            &[4 * 16 + 14, 4 * 16 + 15, 2 * 16, 6 * 16 + 3]
        );
        assert_eq!(&p.data[p.token_seq()], &[0, 0, 0, 1]);
        assert_eq!(&p.data[p.last()], &[2, 3]);
        assert_eq!(&p.data[p.table_start()], &[0, 2]);
        assert_eq!(&p.data[p.tables()], &[4, 2, 6]);
    }

    #[test]
    fn one_token_batches_of_a_size_share_their_layout() {
        let ids = [1u32];
        let (short, long) = (vec![3u32], vec![9u32, 8, 7, 6]);
        let one = |table: &'static [u32], pos| SeqInput {
            tokens: &ids,
            start_pos: pos,
            block_table: table,
            adapter: None,
        };
        let short: &'static [u32] = Box::leak(short.into_boxed_slice());
        let long: &'static [u32] = Box::leak(long.into_boxed_slice());
        let a = PackedStep::new(&[one(short, 0), one(short, 5)], 16);
        let b = PackedStep::new(&[one(long, 60), one(short, 1)], 16);
        for r in [
            PackedStep::ids,
            PackedStep::positions,
            PackedStep::slots,
            PackedStep::last,
        ] {
            assert_eq!(r(&a), r(&b));
        }
        assert_eq!(a.tables().start, b.tables().start);
        assert_eq!(&b.data[b.table_start()], &[0, 4]);
    }
}

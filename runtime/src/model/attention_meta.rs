//! What every attention implementation reads: where each token of the flattened batch sits
//! (its sequence, its position, the sequence's block table), the heads' shape, and a slot for
//! the CUDA launch's device copy of the tables. A leaf, so the generic path (`attention`) and
//! the CUDA launch (`attention_kernel`) both depend on it and not on each other.

use std::ops::Range;

use candle_core::{Result, Tensor};

/// Where each token of the flattened batch sits: which sequence, which position.
#[derive(Debug, Clone)]
pub struct AttnMeta {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
    pub scale: f32,
    /// Tokens further back than this are not attended (Mistral-style sliding window).
    pub sliding_window: Option<usize>,
    /// Scaled scores become `cap · tanh(score / cap)` before the softmax (Gemma 2).
    pub softcap: Option<f32>,
    /// Per token: index into `seqs`.
    pub token_seq: Vec<u32>,
    /// Per token: absolute position within its sequence.
    pub token_pos: Vec<u32>,
    /// Per sequence: its block table.
    pub block_tables: Vec<Vec<u32>>,
    /// The CUDA kernel's copy of the tables above, made on first use; empty in a clone.
    pub device_tables: DeviceTables,
}

impl AttnMeta {
    /// Cache slot of position `pos` of sequence `seq`.
    #[inline]
    pub fn slot(&self, seq: usize, pos: usize) -> usize {
        self.block_tables[seq][pos / self.block_size] as usize * self.block_size
            + pos % self.block_size
    }

    /// Refuses operands the kernels would read outside of: `q_values` that are not one row per
    /// token, a block past the pool's `num_slots`, or a token past its sequence's table.
    pub(crate) fn check_operands(&self, q_values: usize, num_slots: usize) -> Result<()> {
        let expected = self.token_seq.len() * self.num_heads * self.head_dim;
        if q_values != expected {
            candle_core::bail!("paged-attention: q has {q_values} values, expected {expected}");
        }
        for (s, bt) in self.block_tables.iter().enumerate() {
            if let Some(&b) = bt
                .iter()
                .find(|&&b| (b as usize + 1) * self.block_size > num_slots)
            {
                candle_core::bail!(
                    "paged-attention: sequence {s} references block {b} outside the pool"
                );
            }
        }
        if self.token_pos.len() != self.token_seq.len() {
            candle_core::bail!("paged-attention: token positions and sequences differ in length");
        }
        for (t, (&s, &p)) in self.token_seq.iter().zip(&self.token_pos).enumerate() {
            let held = self.block_tables.get(s as usize).map_or(0, Vec::len) * self.block_size;
            if p as usize >= held {
                candle_core::bail!(
                    "paged-attention: token {t} at position {p} is past its block table"
                );
            }
        }
        Ok(())
    }

    /// The same batch attended with another sliding window (Gemma 3's global layers among its
    /// sliding ones), sharing the device copy of the tables where there is one.
    pub fn with_window(&self, window: Option<usize>) -> AttnMeta {
        let meta = AttnMeta {
            sliding_window: window,
            ..self.clone()
        };
        if let Some(t) = self.device_tables.packed.get() {
            meta.device_tables.preset(t.clone());
        }
        meta
    }

    /// First position a token at `pos` may attend to.
    #[inline]
    pub(crate) fn window_start(&self, pos: usize) -> usize {
        match self.sliding_window {
            Some(w) => (pos + 1).saturating_sub(w),
            None => 0,
        }
    }
}

/// Where a batch's kernel tables (`attention_kernel::KernelTables`) lie on the device: set by
/// the forward to ranges of its packed step inputs (`step::PackedStep`), or uploaded by the
/// first CUDA launch that finds it empty; the other layers of the step reuse it.
#[derive(Default)]
pub struct DeviceTables {
    pub(crate) packed: std::sync::OnceLock<PackedTables>,
}

impl DeviceTables {
    /// Points the tables at `tables` (a second call keeps the first).
    pub fn preset(&self, tables: PackedTables) {
        let _ = self.packed.set(tables);
    }
}

/// A clone starts empty: the clone's tables may be changed before it is used.
impl Clone for DeviceTables {
    fn clone(&self) -> Self {
        Self::default()
    }
}

impl std::fmt::Debug for DeviceTables {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("DeviceTables")
    }
}

/// The kernel's four tables as ranges of one u32 tensor.
#[derive(Debug, Clone)]
pub struct PackedTables {
    pub packed: Tensor,
    pub token_seq: Range<usize>,
    pub token_pos: Range<usize>,
    pub table_start: Range<usize>,
    pub tables: Range<usize>,
}

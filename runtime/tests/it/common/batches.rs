//! Random mixed attention batches for the attention kernels' tests: prefill chunks after cached
//! context, decodes, several sequences, block tables handed out back to front (so not in slot
//! order), sliding windows, soft-capped scores, GQA groups, and a cache type.

use candle_core::{DType, Device, Tensor};
use ferrite_runtime::model::attention::AttnMeta;
use ferrite_testkit::random::values;

/// The shape of a batch: per sequence (cached tokens, new tokens).
#[derive(Debug, Clone)]
pub struct BatchShape {
    pub kv_heads: usize,
    pub group: usize,
    pub head_dim: usize,
    pub block_size: usize,
    pub seqs: Vec<(usize, usize)>,
    pub window: Option<usize>,
    /// Gemma 2's soft-cap of the scores.
    pub softcap: Option<f32>,
    pub cache: DType,
    pub seed: u64,
}

/// A batch ready to run: its metadata, the pools and the query rows.
pub struct Batch {
    pub meta: AttnMeta,
    pub k_cache: Tensor,
    pub v_cache: Tensor,
    pub q: Vec<f32>,
}

impl BatchShape {
    pub fn num_heads(&self) -> usize {
        self.kv_heads * self.group
    }

    /// Values per query row.
    pub fn row(&self) -> usize {
        self.num_heads() * self.head_dim
    }

    fn total_blocks(&self) -> usize {
        self.seqs
            .iter()
            .map(|(c, n)| (c + n).div_ceil(self.block_size))
            .sum::<usize>()
            + 2
    }

    /// The batch with its sequences in `order` (indices into `seqs`). Each sequence keeps its
    /// blocks, pool contents and query rows whatever the order.
    pub fn batch(&self, order: &[usize]) -> Batch {
        let mut free: Vec<u32> = (0..self.total_blocks() as u32).collect();
        let tables: Vec<Vec<u32>> = self
            .seqs
            .iter()
            .map(|&(c, n)| {
                (0..(c + n).div_ceil(self.block_size))
                    .map(|_| free.pop().expect("block"))
                    .collect()
            })
            .collect();
        let (mut token_seq, mut token_pos, mut block_tables, mut q) =
            (vec![], vec![], vec![], vec![]);
        for (i, &s) in order.iter().enumerate() {
            let (cached, new) = self.seqs[s];
            block_tables.push(tables[s].clone());
            for p in cached..cached + new {
                token_seq.push(i as u32);
                token_pos.push(p as u32);
            }
            q.extend(values(
                new * self.row(),
                self.seed ^ (0x5555 + s as u64),
                2.0,
            ));
        }
        let slots = self.total_blocks() * self.block_size;
        let kv_dim = self.kv_heads * self.head_dim;
        let pool = |seed| {
            Tensor::from_vec(
                values(slots * kv_dim, seed, 2.0),
                (slots, kv_dim),
                &Device::Cpu,
            )
            .and_then(|t| t.to_dtype(self.cache))
            .expect("pool")
        };
        Batch {
            meta: AttnMeta {
                num_heads: self.num_heads(),
                num_kv_heads: self.kv_heads,
                head_dim: self.head_dim,
                block_size: self.block_size,
                scale: 1.0 / (self.head_dim as f32).sqrt(),
                sliding_window: self.window,
                softcap: self.softcap,
                token_seq,
                token_pos,
                block_tables,
                device_tables: Default::default(),
            },
            k_cache: pool(self.seed),
            v_cache: pool(!self.seed),
            q,
        }
    }

    /// The batch in the order the sequences were given.
    pub fn in_order(&self) -> Batch {
        self.batch(&(0..self.seqs.len()).collect::<Vec<_>>())
    }

    /// Sequence `s`'s output rows within `out`, a batch's output in `order`.
    pub fn rows_of<'a>(&self, out: &'a [f32], order: &[usize], s: usize) -> &'a [f32] {
        let start: usize = order
            .iter()
            .take_while(|&&x| x != s)
            .map(|&x| self.seqs[x].1)
            .sum();
        &out[start * self.row()..(start + self.seqs[s].1) * self.row()]
    }
}

//! The batched Llama forward over the paged KV cache.

use candle_core::{DType, Device, Tensor};

use super::ModelError;
use super::attention::{AttentionBackend, AttnMeta, paged_attention};
use super::cache_write::{CacheWriter, Heads};
use super::config::ModelConfig;
use super::lora::{LoraStep, Proj};
use super::norm::{residual_norm, rms_norm};
use super::rope::Rope;
pub use super::step::SeqInput;
use super::step::{PackedStep, StepTensors};
use super::weights::{Ffn, LlamaWeights};
use crate::kv::KvCache;

/// A Llama-family model ready to run batches.
#[derive(Debug)]
pub struct LlamaModel {
    cfg: ModelConfig,
    weights: LlamaWeights,
    rope: Rope,
    /// The sliding layers' own RoPE, where it differs from the global layers' (Gemma 3).
    local_rope: Option<Rope>,
    max_len: usize,
    device: Device,
    attention: AttentionBackend,
    /// Most tokens one pass of the layers runs; larger forwards go through in slices.
    max_slice_tokens: usize,
    /// Largest decode batch run from a CUDA graph (`cuda_graph`); 0 runs every step eagerly.
    max_graph_batch: usize,
    #[cfg(feature = "cuda")]
    graphs: std::sync::Mutex<Option<super::cuda_graph::DecodeGraphs>>,
}

/// The largest decode batch a CUDA device replays from a graph by default (vLLM captures up
/// to 512; past 256 rows a step's work outweighs its launches).
pub const DEFAULT_MAX_GRAPH_BATCH: usize = 256;

/// Tokens per slice of a CPU forward. A step of `--max-num-batched-tokens` 2048 would otherwise
/// hold every activation at 2048 rows (the gate/up output alone is 25 MB for the default model),
/// and that peak stays resident. 512 rows still reuse each weight block across a whole tile
/// of rows, so slicing costs only re-reading the weights once per slice. On GPUs the
/// activations live in device memory and large GEMMs are what they are fast at, so their
/// forwards are not sliced.
pub const CPU_SLICE_TOKENS: usize = 512;

impl LlamaModel {
    /// `max_len` bounds positions (the RoPE table size): the server's `--max-model-len`.
    pub fn new(
        cfg: ModelConfig,
        weights: LlamaWeights,
        max_len: usize,
        device: &Device,
    ) -> Result<Self, ModelError> {
        let rope = Rope::new(&cfg, max_len, device)?;
        let local_rope = match cfg.local_layers.as_ref().and_then(|l| l.rope_theta) {
            Some(theta) => {
                let local = ModelConfig {
                    rope_theta: theta,
                    rope_scaling: super::config::RopeScaling::None,
                    ..cfg.clone()
                };
                Some(Rope::new(&local, max_len, device)?)
            }
            None => None,
        };
        Ok(Self {
            cfg,
            weights,
            rope,
            local_rope,
            max_len,
            device: device.clone(),
            attention: AttentionBackend::default(),
            max_slice_tokens: if device.is_cpu() {
                CPU_SLICE_TOKENS
            } else {
                usize::MAX
            },
            max_graph_batch: if device.is_cuda() {
                DEFAULT_MAX_GRAPH_BATCH
            } else {
                0
            },
            #[cfg(feature = "cuda")]
            graphs: Default::default(),
        })
    }

    /// Sets the largest decode batch replayed from a CUDA graph, at most
    /// [`DEFAULT_MAX_GRAPH_BATCH`]; 0 runs every step eagerly (the server's `--enforce-eager`).
    /// Graphs captured so far are kept for when it is raised again.
    pub fn set_max_graph_batch(&mut self, rows: usize) {
        self.max_graph_batch = if self.device.is_cuda() {
            rows.min(DEFAULT_MAX_GRAPH_BATCH)
        } else {
            0
        };
    }

    /// What the decode graphs have done (`None` before the first graph-eligible step, and in a
    /// build without CUDA).
    pub fn graph_stats(&self) -> Option<super::cuda_graph::GraphStats> {
        #[cfg(feature = "cuda")]
        if let Ok(g) = self.graphs.lock() {
            return g.as_ref().map(|g| g.stats().clone());
        }
        None
    }

    /// Sets the most tokens one pass of the layers runs (tests compare slicings; at least 1).
    pub fn set_max_slice_tokens(&mut self, tokens: usize) {
        self.max_slice_tokens = tokens.max(1);
    }

    /// Chooses the attention implementation (tests compare the two).
    pub fn set_attention_backend(&mut self, backend: AttentionBackend) {
        self.attention = backend;
    }

    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    pub fn max_len(&self) -> usize {
        self.max_len
    }

    fn check_batch(&self, batch: &[SeqInput], cache: &KvCache) -> Result<(), ModelError> {
        let bs = cache.config().block_size;
        let bad =
            |i: usize, msg: String| Err(ModelError::InvalidBatch(format!("sequence {i}: {msg}")));
        if batch.is_empty() {
            return Err(ModelError::InvalidBatch("empty batch".into()));
        }
        for (i, s) in batch.iter().enumerate() {
            let end = s.start_pos + s.tokens.len();
            if s.tokens.is_empty() {
                return bad(i, "no tokens".into());
            }
            if end > self.max_len {
                return bad(
                    i,
                    format!("positions up to {end} exceed max length {}", self.max_len),
                );
            }
            if s.block_table.len() * bs < end {
                return bad(
                    i,
                    format!(
                        "block table holds {} slots, needs {end}",
                        s.block_table.len() * bs
                    ),
                );
            }
            if let Some(&b) = s
                .block_table
                .iter()
                .find(|&&b| !cache.allocator().is_used(b))
            {
                return bad(i, format!("block {b} is not allocated"));
            }
            if let Some(a) = s.adapter
                && !a.fits(&self.cfg)
            {
                return bad(
                    i,
                    format!("adapter {} was loaded for another base model", a.name()),
                );
            }
            if let Some(&t) = s
                .tokens
                .iter()
                .find(|&&t| t as usize >= self.cfg.vocab_size)
            {
                return bad(
                    i,
                    format!(
                        "token id {t} is outside the vocabulary ({})",
                        self.cfg.vocab_size
                    ),
                );
            }
        }
        Ok(())
    }

    /// Runs one forward pass over a mixed batch and returns the next-token logits of each
    /// sequence (after its last token), `[batch.len(), vocab]` in f32. Keys and values of every
    /// token are written to the cache.
    pub fn forward(&self, batch: &[SeqInput], cache: &KvCache) -> Result<Tensor, ModelError> {
        Ok(self.forward_with_hidden(batch, cache, &[])?.0)
    }

    /// [`LlamaModel::forward`], and for each sequence `i` the final-normed hidden states of
    /// the rows `hidden[i]` asks for (missing entries ask for none), `[rows, hidden]` in f32,
    /// the last rows of the pass's tokens: what an embedding request pools.
    pub fn forward_with_hidden(
        &self,
        batch: &[SeqInput],
        cache: &KvCache,
        hidden: &[HiddenRows],
    ) -> Result<(Tensor, Vec<Option<Tensor>>), ModelError> {
        self.check_batch(batch, cache)?;
        // Run a CPU pass on a worker of rayon's pool. Each parallel op called from outside the
        // pool sends a job there and puts the caller to sleep until it ends; one forward makes
        // ~150 such calls, and those round trips cost milliseconds per decode step. The other
        // workers poll for the pass's jobs meanwhile rather than sleep between them
        // (`kernels::pool`). A GPU pass only enqueues work, so it stays on the caller's thread.
        if self.device.is_cpu() && rayon::current_thread_index().is_none() {
            return crate::kernels::pool::hot(|| self.forward_on_pool(batch, cache, hidden));
        }
        #[cfg(feature = "cuda")]
        if hidden.iter().all(|h| *h == HiddenRows::None)
            && let Some(logits) = self.decode_from_graph(batch, cache)?
        {
            return Ok((logits, vec![None; batch.len()]));
        }
        self.forward_on_pool(batch, cache, hidden)
    }

    /// A decode step replayed from its CUDA graph, where one takes it.
    #[cfg(feature = "cuda")]
    fn decode_from_graph(
        &self,
        batch: &[SeqInput],
        cache: &KvCache,
    ) -> Result<Option<Tensor>, ModelError> {
        use super::cuda_graph::DecodeGraphs;
        // Graphs are captured with the attention kernel; a model set to the generic path (tests
        // comparing the two) runs eagerly.
        if self.max_graph_batch == 0
            || self.cfg.moe.is_some()
            || self.attention != AttentionBackend::Auto
            || batch.len() > self.max_graph_batch
            || batch.iter().any(|s| s.adapter.is_some())
            || batch.iter().any(|s| s.tokens.len() != 1)
        {
            return Ok(None);
        }
        let mut graphs = self
            .graphs
            .lock()
            .map_err(|_| ModelError::Tensor("the decode graphs' lock is poisoned".into()))?;
        // Graphs hold the cache's tensors: another cache needs its own.
        if graphs.as_ref().is_none_or(|g| g.cache_id() != cache.id()) {
            *graphs = Some(DecodeGraphs::new(self, DEFAULT_MAX_GRAPH_BATCH, cache)?);
        }
        match graphs.as_mut() {
            Some(g) => g.run(self, batch, cache),
            None => Ok(None),
        }
    }

    /// Runs the batch through the layers in slices of at most `max_slice_tokens` tokens, in
    /// order, so a sequence split across slices finds its earlier tokens' keys and values in
    /// the cache, as with chunked prefill. Every op is row-wise (the GEMMs are batch invariant
    /// and attention reads only the cache), so the logits are bitwise those of one pass.
    fn forward_on_pool(
        &self,
        batch: &[SeqInput],
        cache: &KvCache,
        hidden: &[HiddenRows],
    ) -> Result<(Tensor, Vec<Option<Tensor>>), ModelError> {
        let mut last_hidden = Vec::new();
        let mut wanted: Vec<Vec<Tensor>> = vec![Vec::new(); batch.len()];
        for slice in slices(batch, self.max_slice_tokens) {
            let inputs: Vec<SeqInput> = slice.iter().map(|p| p.input).collect();
            let (all, last) = self.layers(&inputs, cache)?;
            let mut row = 0;
            for p in &slice {
                let n = p.input.tokens.len();
                match hidden.get(p.seq) {
                    Some(HiddenRows::All) => wanted[p.seq].push(all.narrow(0, row, n)?),
                    Some(HiddenRows::Last) if p.ends_sequence => {
                        wanted[p.seq].push(all.narrow(0, row + n - 1, 1)?);
                    }
                    _ => {}
                }
                row += n;
            }
            let lasts = all.index_select(&last, 0)?;
            // Rows of the pieces that end their sequence: all of them in an unsliced forward,
            // which keeps its hidden states as they are.
            let ends: Vec<u32> = (0..slice.len() as u32)
                .filter(|&r| slice[r as usize].ends_sequence)
                .collect();
            if ends.len() == slice.len() {
                last_hidden.push(lasts);
            } else if !ends.is_empty() {
                let n = ends.len();
                last_hidden.push(lasts.index_select(&Tensor::from_vec(ends, n, &self.device)?, 0)?);
            }
        }
        let wanted = wanted
            .into_iter()
            .map(|parts| match parts.len() {
                0 => Ok(None),
                _ => Ok(Some(Tensor::cat(&parts, 0)?.to_dtype(DType::F32)?)),
            })
            .collect::<Result<Vec<_>, ModelError>>()?;
        // One tensor (the unsliced case) is returned as it is, without a copy.
        Ok((self.head(&Tensor::cat(&last_hidden, 0)?)?, wanted))
    }

    /// One pass of the embedding and every layer over `batch` (already checked): the
    /// final-normed hidden state of every token, `[tokens, hidden]`, and the index of each
    /// sequence's last row in it.
    fn layers(&self, batch: &[SeqInput], cache: &KvCache) -> Result<(Tensor, Tensor), ModelError> {
        let bs = cache.config().block_size;
        let packed = PackedStep::new(batch, bs);
        let meta = packed.meta(&self.cfg, bs);
        let step = StepTensors::new(&packed.upload(&self.device)?, &packed, &meta)?;
        let lora = LoraStep::new(batch.iter().map(|s| (s.adapter, s.tokens.len())));
        let h = self.run_layers(&step, &meta, cache, &lora)?;
        Ok((h, step.last.clone()))
    }

    /// Every layer over a step's device inputs: the final-normed hidden state of every token
    /// (a row-wise norm, so taking rows after it gives the bits taking them before would).
    /// Nothing here copies from the host, so a CUDA graph can capture it (`cuda_graph`).
    fn run_layers(
        &self,
        step: &StepTensors,
        meta: &AttnMeta,
        cache: &KvCache,
        lora: &LoraStep,
    ) -> Result<Tensor, ModelError> {
        let cfg = &self.cfg;
        let heads = Heads {
            num_heads: cfg.num_heads,
            num_kv_heads: cfg.num_kv_heads,
            head_dim: cfg.head_dim,
        };
        let writer = CacheWriter::new(
            &step.positions,
            &step.slots,
            &self.rope,
            cfg.kv_dim(),
            meta.block_size,
        )?;
        // Gemma 3's sliding layers rotate by their own RoPE; its global ones attend without the
        // window.
        let local_writer = match &self.local_rope {
            Some(rope) => Some(CacheWriter::new(
                &step.positions,
                &step.slots,
                rope,
                cfg.kv_dim(),
                meta.block_size,
            )?),
            None => None,
        };
        let global_meta = cfg.local_layers.is_some().then(|| meta.with_window(None));
        let eps = cfg.rms_norm_eps as f32;

        let layers = &self.weights.layers;
        let mut embedded = self.weights.embed.lookup(&step.ids)?;
        if let Some(scale) = cfg.embedding_scale {
            embedded = (embedded * f64::from(scale))?;
        }
        // Each residual add comes with the norm of the next block's input (the final norm
        // after the last layer), in one op.
        let first = layers.first().map_or(&self.weights.norm, |w| &w.attn_norm);
        let (mut x, mut h) = residual_norm(&embedded, None, first, eps)?;
        for (l, w) in layers.iter().enumerate() {
            let (writer, meta) = if cfg.is_sliding(l) {
                (local_writer.as_ref().unwrap_or(&writer), meta)
            } else {
                (&writer, global_meta.as_ref().unwrap_or(meta))
            };
            let mut qkv = lora.apply(l, Proj::Qkv, &h, w.qkv.forward(&h)?)?;
            if let Some((q_norm, k_norm)) = &w.qk_norm {
                qkv = super::norm::qk_norm(&qkv, heads, q_norm, k_norm, eps)?;
            }
            let (kc, vc) = cache.layer(l);
            let q = writer.write(&qkv, heads, kc, vc)?;
            let attn = paged_attention(&q, kc, vc, meta, self.attention)?;
            let mut o = lora.apply(l, Proj::O, &attn, w.o.forward(&attn)?)?;
            if let Some((after_attn, _)) = &w.post_norms {
                o = rms_norm(&o, after_attn, eps)?;
            }
            (x, h) = residual_norm(&x, Some(&o), &w.ffn_norm, eps)?;
            let mut ffn = match &w.ffn {
                Ffn::Dense { gate_up, down } => {
                    let gate_up = lora.apply(l, Proj::GateUp, &h, gate_up.forward(&h)?)?;
                    let act =
                        super::activation::gated(&gate_up, cfg.intermediate_size, cfg.activation)?;
                    lora.apply(l, Proj::Down, &act, down.forward(&act)?)?
                }
                Ffn::Experts(experts) => match &cfg.moe {
                    Some(moe) => super::moe::forward(experts, moe, &h)?,
                    None => {
                        return Err(ModelError::InvalidConfig(
                            "experts loaded for a model without a mixture of experts".into(),
                        ));
                    }
                },
            };
            if let Some((_, after_ffn)) = &w.post_norms {
                ffn = rms_norm(&ffn, after_ffn, eps)?;
            }
            let next = layers
                .get(l + 1)
                .map_or(&self.weights.norm, |n| &n.attn_norm);
            (x, h) = residual_norm(&x, Some(&ffn), next, eps)?;
        }
        Ok(h)
    }

    /// The output head: `[rows, vocab]` f32 logits of final-normed hidden states `h`.
    fn head(&self, h: &Tensor) -> Result<Tensor, ModelError> {
        let logits = self.weights.lm_head.forward(h)?.to_dtype(DType::F32)?;
        match self.cfg.final_logit_softcap {
            // `cap · tanh(logits / cap)`, vectorized on the CPU.
            Some(cap) if logits.device().is_cpu() => {
                let dims = logits.dims().to_vec();
                let mut v = logits.flatten_all()?.to_vec1::<f32>()?;
                crate::kernels::softcap::softcap_in_place(&mut v, cap);
                Ok(Tensor::from_vec(v, dims, &self.device)?)
            }
            Some(cap) => {
                let cap = f64::from(cap);
                Ok(((logits / cap)?.tanh()? * cap)?)
            }
            None => Ok(logits),
        }
    }
}

/// Which of a sequence's rows' hidden states a forward returns besides its logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HiddenRows {
    #[default]
    None,
    /// The pass's last row of the sequence.
    Last,
    /// Every row of it in the pass.
    All,
}

/// What a captured decode step runs (`cuda_graph`).
impl super::cuda_graph::StepForward for LlamaModel {
    fn device(&self) -> &Device {
        &self.device
    }

    fn vocab_size(&self) -> usize {
        self.cfg.vocab_size
    }

    fn max_len(&self) -> usize {
        self.max_len
    }

    fn meta(&self, packed: &PackedStep, block_size: usize) -> AttnMeta {
        packed.meta(&self.cfg, block_size)
    }

    fn step_logits(
        &self,
        step: &StepTensors,
        meta: &AttnMeta,
        cache: &KvCache,
    ) -> Result<Tensor, ModelError> {
        self.head(&self.run_layers(step, meta, cache, &LoraStep::default())?)
    }
}

/// A run of one sequence's new tokens inside a slice.
#[derive(Debug, Clone, Copy)]
struct Piece<'a> {
    input: SeqInput<'a>,
    /// The index in the batch of the sequence it is part of.
    seq: usize,
    /// The piece holds the sequence's last new token, whose logits the forward returns.
    ends_sequence: bool,
}

/// Cuts `batch` into consecutive slices of at most `max_tokens` tokens (at least 1), splitting
/// a sequence where a slice fills; pieces keep the batch's order.
fn slices<'a>(batch: &[SeqInput<'a>], max_tokens: usize) -> Vec<Vec<Piece<'a>>> {
    let max_tokens = max_tokens.max(1);
    let mut out = vec![Vec::new()];
    let mut room = max_tokens;
    for (seq, s) in batch.iter().enumerate() {
        let mut done = 0;
        while done < s.tokens.len() {
            if room == 0 {
                out.push(Vec::new());
                room = max_tokens;
            }
            let n = room.min(s.tokens.len() - done);
            let piece = Piece {
                input: SeqInput {
                    tokens: &s.tokens[done..done + n],
                    start_pos: s.start_pos + done,
                    block_table: s.block_table,
                    adapter: s.adapter,
                },
                seq,
                ends_sequence: done + n == s.tokens.len(),
            };
            if let Some(slice) = out.last_mut() {
                slice.push(piece);
            }
            done += n;
            room -= n;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seq(tokens: &[u32], start_pos: usize) -> SeqInput<'_> {
        SeqInput {
            tokens,
            start_pos,
            block_table: &[],
            adapter: None,
        }
    }

    /// (tokens, start_pos, ends_sequence) of every piece, slice by slice.
    fn shape(slices: &[Vec<Piece>]) -> Vec<Vec<(Vec<u32>, usize, bool)>> {
        slices
            .iter()
            .map(|s| {
                s.iter()
                    .map(|p| (p.input.tokens.to_vec(), p.input.start_pos, p.ends_sequence))
                    .collect()
            })
            .collect()
    }

    #[test]
    fn a_batch_within_the_limit_is_one_slice() {
        let (a, b) = ([1, 2, 3], [4]);
        let got = shape(&slices(&[seq(&a, 0), seq(&b, 9)], 4));
        assert_eq!(
            got,
            vec![vec![(vec![1, 2, 3], 0, true), (vec![4], 9, true)]]
        );
    }

    #[test]
    fn sequences_split_where_a_slice_fills_and_keep_their_positions() {
        let (a, b, c) = ([1, 2, 3, 4, 5], [6], [7, 8, 9, 10, 11, 12]);
        let got = shape(&slices(&[seq(&a, 10), seq(&b, 3), seq(&c, 0)], 4));
        assert_eq!(
            got,
            vec![
                vec![(vec![1, 2, 3, 4], 10, false)],
                vec![
                    (vec![5], 14, true),
                    (vec![6], 3, true),
                    (vec![7, 8], 0, false)
                ],
                vec![(vec![9, 10, 11, 12], 2, true)],
            ]
        );
    }

    #[test]
    fn every_token_lands_once_in_order_and_no_slice_is_over_the_limit() {
        let toks: Vec<u32> = (0..100).collect();
        for max in [1, 2, 3, 7, 64, 1000] {
            let batch = [
                seq(&toks[..37], 5),
                seq(&toks[37..38], 0),
                seq(&toks[38..], 1),
            ];
            let got = slices(&batch, max);
            let flat: Vec<u32> = got
                .iter()
                .flatten()
                .flat_map(|p| p.input.tokens.iter().copied())
                .collect();
            assert_eq!(flat, toks, "max {max}");
            assert!(got.iter().all(|s| !s.is_empty()), "max {max}");
            assert!(
                got.iter()
                    .all(|s| s.iter().map(|p| p.input.tokens.len()).sum::<usize>() <= max),
                "max {max}"
            );
            let ends: usize = got.iter().flatten().filter(|p| p.ends_sequence).count();
            assert_eq!(ends, batch.len(), "max {max}");
        }
    }
}

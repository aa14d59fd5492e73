//! CUDA graphs for decode steps. A decode step of a small model is a few hundred short kernels
//! (the default model: 30 layers of about 11), and launched one by one from the host each costs
//! more than its work. A graph replays the whole step with one launch: on an H100 a batch-1
//! step of the default model takes 2.3 ms replayed against 3.3 ms launched op by op
//! (docs/benchmarks.md, "On a GPU").
//!
//! As vLLM's graph runner does: a step of `n` one-token sequences runs the graph captured for
//! the smallest size `rows >= n` (1, 2, 4, 8, then steps of 8 to 64 and of 32 to 256), padded
//! with sequences that read and write only the cache's scratch block
//! (`KvCache::scratch_block`), whose rows are dropped. Its inputs sit at fixed places in one
//! device buffer (`step::PackedStep`'s layout for `rows` one-token sequences), which the step
//! overwrites with one copy before the launch; the logits land in a fixed buffer and are copied
//! out. Each size is captured the first time a step needs it: an eager run of the same shapes
//! first (it loads the kernels and fills candle's cache of the small host-to-device uploads its
//! ops make, which a capture cannot), then the capture. Prefill and mixed steps, and steps the
//! graphs cannot take, run eagerly; a failed capture turns the graphs off with a warning and
//! the model goes on eagerly.

/// What a decode graph captures: a model's forward over a step's device inputs. `LlamaModel`
/// implements it, so this module does not depend on the model (the model holds the graphs).
pub trait StepForward {
    fn device(&self) -> &candle_core::Device;
    fn vocab_size(&self) -> usize;
    fn max_len(&self) -> usize;
    /// The host-side metadata of a packed batch for the model's heads.
    fn meta(&self, packed: &step::PackedStep, block_size: usize) -> super::attention::AttnMeta;
    /// `[rows, vocab]` f32 logits of every row of the step; copies nothing from the host.
    fn step_logits(
        &self,
        step: &step::StepTensors,
        meta: &super::attention::AttnMeta,
        cache: &crate::kv::KvCache,
    ) -> Result<candle_core::Tensor, super::ModelError>;
}

use super::step;

/// The batch sizes captured, up to `max_rows`.
pub fn sizes(max_rows: usize) -> Vec<usize> {
    let all = [1, 2, 4]
        .into_iter()
        .chain((8..=64).step_by(8))
        .chain((96..=256).step_by(32));
    all.filter(|&s| s <= max_rows).collect()
}

/// What the graphs have done, for logs, benchmarks and tests.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GraphStats {
    /// Sizes captured so far.
    pub captured: Vec<usize>,
    /// Steps replayed from a graph.
    pub replays: u64,
    /// Why the graphs were turned off, if they were.
    pub failed: Option<String>,
}

#[cfg(feature = "cuda")]
pub use runner::DecodeGraphs;

#[cfg(feature = "cuda")]
mod runner {
    use std::collections::BTreeMap;

    use candle_core::cuda_backend::cudarc::driver::{CudaGraph, sys};
    use candle_core::{DType, Device, Tensor};

    use super::super::ModelError;
    use super::super::attention_kernel::launch_shape;
    use super::super::step::{PackedStep, SeqInput, StepTensors};
    use crate::kv::KvCache;

    use super::{GraphStats, StepForward, sizes};

    /// The captured graphs of one model and cache geometry, and their fixed buffers.
    pub struct DecodeGraphs {
        sizes: Vec<usize>,
        cache_id: u64,
        /// u32: one step's packed inputs for the largest size, every table at its longest.
        inputs: Tensor,
        /// f32 `[largest size, vocab]`: the captured steps' logits.
        logits: Tensor,
        graphs: BTreeMap<usize, CudaGraph>,
        stats: GraphStats,
    }

    impl std::fmt::Debug for DecodeGraphs {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("DecodeGraphs")
                .field("sizes", &self.sizes)
                .field("stats", &self.stats)
                .finish()
        }
    }

    // SAFETY: a CUDA graph may be launched from any thread as long as calls on it are serialised
    // (the CUDA driver API's rule); the model keeps `DecodeGraphs` behind a mutex.
    unsafe impl Send for DecodeGraphs {}

    impl DecodeGraphs {
        /// Buffers for graphs of up to `max_rows` rows over `cache` (captured lazily).
        pub fn new(
            model: &impl StepForward,
            max_rows: usize,
            cache: &KvCache,
        ) -> Result<Self, ModelError> {
            let sizes = sizes(max_rows);
            let rows = sizes.last().copied().unwrap_or(0);
            let max_blocks = model.max_len().div_ceil(cache.config().block_size.max(1));
            let capacity = 6 * rows + rows * max_blocks;
            let device = model.device();
            Ok(Self {
                sizes,
                cache_id: cache.id(),
                inputs: Tensor::zeros(capacity.max(1), DType::U32, device)?,
                logits: Tensor::zeros((rows.max(1), model.vocab_size()), DType::F32, device)?,
                graphs: BTreeMap::new(),
                stats: GraphStats::default(),
            })
        }

        /// The cache whose tensors the graphs read and write.
        pub fn cache_id(&self) -> u64 {
            self.cache_id
        }

        pub fn stats(&self) -> &GraphStats {
            &self.stats
        }

        /// The logits of `batch` from a graph, or `None` where no graph takes it (then the caller
        /// runs it eagerly). The caller has checked the batch, and that every sequence brings one
        /// token to a model on its attention kernel (the graphs are captured with it).
        pub fn run(
            &mut self,
            model: &impl StepForward,
            batch: &[SeqInput],
            cache: &KvCache,
        ) -> Result<Option<Tensor>, ModelError> {
            let n = batch.len();
            let Some(&rows) = self.sizes.iter().find(|&&s| s >= n) else {
                return Ok(None);
            };
            if self.stats.failed.is_some() {
                return Ok(None);
            }
            let scratch = [cache.scratch_block()];
            let mut padded = batch.to_vec();
            padded.resize(rows, pad(&scratch));
            let packed = PackedStep::new(&padded, cache.config().block_size);
            if packed.data.len() > self.inputs.dim(0)? {
                return Ok(None);
            }
            if !self.graphs.contains_key(&rows) {
                let started = std::time::Instant::now();
                match self.capture(model, rows, cache) {
                    Ok(graph) => {
                        self.graphs.insert(rows, graph);
                        self.stats.captured.push(rows);
                        tracing::info!(
                            rows,
                            ms = started.elapsed().as_millis() as u64,
                            "captured a decode step as a CUDA graph"
                        );
                    }
                    Err(e) => {
                        tracing::warn!(rows, error = %e, "CUDA graph capture failed; decode steps run eagerly from now on");
                        self.stats.failed = Some(e.to_string());
                        return Ok(None);
                    }
                }
            }
            let Some(graph) = self.graphs.get(&rows) else {
                return Ok(None);
            };
            self.inputs
                .slice_set(&packed.upload(model.device())?, 0, 0)?;
            graph.launch().map_err(cuda_error)?;
            self.stats.replays += 1;
            // A copy of the n rows alone (the next replay overwrites the buffer). Not
            // `Tensor::copy`: that clones the whole buffer, and reading a view back to the host
            // copies its whole storage too (50 MB for 256 rows of SmolLM2's vocabulary).
            let rows_out = Tensor::zeros((n, self.logits.dim(1)?), DType::F32, model.device())?;
            rows_out.slice_set(&self.logits.narrow(0, 0, n)?, 0, 0)?;
            Ok(Some(rows_out))
        }

        /// Captures a step of `rows` padding sequences (their inputs are the graph's fixed places).
        fn capture(
            &self,
            model: &impl StepForward,
            rows: usize,
            cache: &KvCache,
        ) -> Result<CudaGraph, ModelError> {
            let Device::Cuda(dev) = model.device() else {
                return Err(ModelError::Unsupported(
                    "CUDA graphs need a CUDA device".into(),
                ));
            };
            let scratch = [cache.scratch_block()];
            let pads = vec![pad(&scratch); rows];
            let block_size = cache.config().block_size;
            let packed = PackedStep::new(&pads, block_size);
            let meta = model.meta(&packed, block_size);
            if launch_shape(&meta).is_none() {
                return Err(ModelError::Unsupported(
                    "the paged-attention kernel does not apply to this model".into(),
                ));
            }
            self.inputs
                .slice_set(&packed.upload(model.device())?, 0, 0)?;
            let step = StepTensors::new(&self.inputs, &packed, &meta)?;
            let body = || -> Result<(), ModelError> {
                let logits = model.step_logits(&step, &meta, cache)?;
                Ok(self.logits.slice_set(&logits, 0, 0)?)
            };
            let stream = dev.cuda_stream();
            let _uploads_cached = dev.enable_cuda_graph_htod_cache();
            body()?;
            stream.synchronize().map_err(cuda_error)?;
            stream
                .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
                .map_err(cuda_error)?;
            let captured = body();
            // End the capture whatever happened, so the stream leaves capture mode.
            let graph = stream.end_capture(sys::CUgraphInstantiate_flags(0));
            captured?;
            let graph = graph
                .map_err(cuda_error)?
                .ok_or_else(|| ModelError::Tensor("the captured decode step is empty".into()))?;
            graph.upload().map_err(cuda_error)?;
            Ok(graph)
        }
    }

    /// A padding sequence: token 0 at position 0, on the scratch block.
    fn pad(scratch: &[u32]) -> SeqInput<'_> {
        SeqInput {
            tokens: &[0],
            start_pos: 0,
            block_table: scratch,
            adapter: None,
        }
    }

    fn cuda_error(e: impl std::fmt::Display) -> ModelError {
        ModelError::Tensor(format!("CUDA graph: {e}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_cover_every_batch_up_to_the_largest() {
        assert_eq!(sizes(1), vec![1]);
        assert_eq!(sizes(10), vec![1, 2, 4, 8]);
        let all = sizes(256);
        assert_eq!(all.first(), Some(&1));
        assert_eq!(all.last(), Some(&256));
        assert!(all.windows(2).all(|w| w[0] < w[1]));
        assert!(all.contains(&64) && all.contains(&96) && !all.contains(&72));
    }
}

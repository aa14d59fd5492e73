//! Shared helpers for tests that need the default model.
#![allow(dead_code)]

use candle_core::{DType, Device, Tensor};
use candle_transformers::models::quantized_llama::ModelWeights;
use ferrite_runtime::engine::sampler::argmax;
use ferrite_runtime::kv::{KvCache, KvCacheConfig};
use ferrite_runtime::model::attention::AttentionBackend;
use ferrite_runtime::model::driver::{GreedySeq, run_greedy};
use ferrite_runtime::model::{self, LoadOptions, WeightMode};
pub use ferrite_testkit::model::{default_model, lora_adapter_dir};

pub mod batches;
pub mod tiny;

pub const PROMPT: &str =
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n";
pub const NEW_TOKENS: usize = 32;

/// Greedy tokens and the first-step logits from quantized_llama.
pub fn reference(prompt: &[u32]) -> (Vec<f32>, Vec<u32>) {
    let (mut all, toks) = reference_all(prompt);
    (all.swap_remove(0), toks)
}

/// Greedy tokens and the logits of every step from quantized_llama.
pub fn reference_all(prompt: &[u32]) -> (Vec<Vec<f32>>, Vec<u32>) {
    let path = default_model();
    let mut f = std::fs::File::open(&path).expect("open model");
    let content = candle_core::quantized::gguf_file::Content::read(&mut f).expect("gguf");
    let mut m = ModelWeights::from_gguf(content, &mut f, &Device::Cpu).expect("reference model");
    let input = Tensor::new(prompt, &Device::Cpu)
        .expect("t")
        .unsqueeze(0)
        .expect("u");
    let first = m
        .forward(&input, 0)
        .expect("forward")
        .squeeze(0)
        .expect("s")
        .to_vec1::<f32>()
        .expect("v");
    let mut toks = vec![argmax(&first)];
    let mut all = vec![first];
    let mut pos = prompt.len();
    while toks.len() < NEW_TOKENS {
        let last = *toks.last().expect("token");
        let input = Tensor::new(&[last], &Device::Cpu)
            .expect("t")
            .unsqueeze(0)
            .expect("u");
        let l = m
            .forward(&input, pos)
            .expect("forward")
            .squeeze(0)
            .expect("s")
            .to_vec1::<f32>()
            .expect("v");
        toks.push(argmax(&l));
        all.push(l);
        pos += 1;
    }
    all.pop();
    (all, toks)
}

pub fn diffs(a: &[f32], b: &[f32]) -> (f32, f32) {
    assert_eq!(a.len(), b.len());
    let max = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    let mean = a.iter().zip(b).map(|(x, y)| (x - y).abs()).sum::<f32>() / a.len() as f32;
    (max, mean)
}

/// Greedy-decodes PROMPT with our runtime and a KV cache of type `kv`; chunked prefill
/// (7-token chunks) exercises multi-step prompts through the block tables.
pub fn ours(
    backend: AttentionBackend,
    mode: WeightMode,
    kv: DType,
) -> (Vec<f32>, Vec<u32>, String) {
    let (mut all, toks, text) = ours_all(backend, mode, kv);
    (all.swap_remove(0), toks, text)
}

/// As [`ours`], with the logits of every step.
pub fn ours_all(
    backend: AttentionBackend,
    mode: WeightMode,
    kv: DType,
) -> (Vec<Vec<f32>>, Vec<u32>, String) {
    ours_all_on(&Device::Cpu, backend, mode, kv)
}

/// As [`ours_all`], on `device`.
pub fn ours_all_on(
    device: &Device,
    backend: AttentionBackend,
    mode: WeightMode,
    kv: DType,
) -> (Vec<Vec<f32>>, Vec<u32>, String) {
    ours_all_with(device, backend, mode, kv, None)
}

/// As [`ours_all_on`], with the LoRA adapter at `adapter` (loaded on `device`).
pub fn ours_all_with(
    device: &Device,
    backend: AttentionBackend,
    mode: WeightMode,
    kv: DType,
    adapter: Option<&std::path::Path>,
) -> (Vec<Vec<f32>>, Vec<u32>, String) {
    let opts = LoadOptions {
        device: device.clone(),
        weight_mode: mode,
        ..Default::default()
    };
    let mut loaded = model::load(&default_model(), &opts).expect("load");
    loaded.model.set_attention_backend(backend);
    let prompt = loaded.tokenizer.encode(PROMPT, false).expect("encode");
    let cfg = KvCacheConfig::for_model(loaded.model.config(), 16, 64, 0).with_dtype(kv);
    let mut cache = KvCache::new(cfg, device).expect("cache");
    let mut seqs = vec![GreedySeq::new(prompt, NEW_TOKENS)];
    seqs[0].keep_all_logits = true;
    seqs[0].adapter = adapter.map(|p| {
        let a = ferrite_runtime::model::lora::load(
            "adapter",
            p,
            loaded.model.config(),
            device,
            ferrite_runtime::model::lora::LoraOptions::max_rank(64),
        )
        .unwrap_or_else(|e| panic!("load {}: {e}", p.display()));
        std::sync::Arc::new(a)
    });
    run_greedy(&loaded.model, &mut cache, &mut seqs, 7).expect("run");
    assert_eq!(
        cache.allocator().num_used(),
        0,
        "finished sequence leaked blocks"
    );
    let s = seqs.pop().expect("seq");
    let text = loaded.tokenizer.decode(&s.generated, true).expect("decode");
    (s.all_logits, s.generated, text)
}

pub fn prompt_ids() -> Vec<u32> {
    let loaded = model::load(&default_model(), &LoadOptions::default()).expect("load");
    loaded.tokenizer.encode(PROMPT, false).expect("encode")
}

/// One request decoded alone and inside a busy mixed batch of 16 on `device`: the same greedy
/// tokens, first-step logits within `logit_tolerance`, the requests really batched, and no block
/// left held.
pub fn alone_and_in_a_busy_batch(device: &Device, weight_mode: WeightMode, logit_tolerance: f32) {
    let run = busy_batch(device, weight_mode);
    assert_eq!(
        run.batched, run.alone,
        "target output changed inside the batch"
    );
    let max_diff = run.max_first_logit_diff();
    eprintln!(
        "{weight_mode:?} on {device:?}: max first-token logit difference alone vs batched {max_diff:e}"
    );
    assert!(max_diff <= logit_tolerance, "logits moved by {max_diff}");
    eprintln!("alone and batched agree on {:?}", run.text);
}

/// What [`busy_batch`] saw of its target request.
pub struct BusyBatch {
    /// Greedy tokens and first-step logits alone and inside the batch.
    pub alone: Vec<u32>,
    pub batched: Vec<u32>,
    pub alone_first: Vec<f32>,
    pub batched_first: Vec<f32>,
    /// The tokens alone, as text.
    pub text: String,
}

impl BusyBatch {
    pub fn max_first_logit_diff(&self) -> f32 {
        self.batched_first
            .iter()
            .zip(&self.alone_first)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max)
    }
}

/// Decodes one request alone, then inside a busy mixed batch of 16 on `device`, and checks that
/// the requests really were batched and no block is left held.
pub fn busy_batch(device: &Device, weight_mode: WeightMode) -> BusyBatch {
    const TARGET_TOKENS: usize = 24;
    let opts = LoadOptions {
        device: device.clone(),
        weight_mode,
        ..Default::default()
    };
    let loaded = model::load(&default_model(), &opts).expect("load");
    let tok = &loaded.tokenizer;
    let target_text =
        "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n";
    let target = tok.encode(target_text, false).expect("encode");
    let cfg = KvCacheConfig::for_model(loaded.model.config(), 16, 512, 0);

    let mut cache = KvCache::new(cfg, device).expect("cache");
    let mut alone = vec![GreedySeq::new(target.clone(), TARGET_TOKENS)];
    run_greedy(&loaded.model, &mut cache, &mut alone, 512).expect("alone");

    // 15 other requests with prompts from ~15 to ~160 tokens that join at different steps, and
    // an 8-token prefill chunk, so that the target's prefill chunks share forwards with other
    // sequences' decodes and prefills.
    let mut batch = Vec::new();
    for i in 0..15usize {
        let body = format!(
            "Request {i}: {}",
            "tell me about rust and numbers 12345. ".repeat(1 + i)
        );
        let p = tok.encode(&body, false).expect("encode");
        let mut s = GreedySeq::new(p, 8 + (i % 5) * 4);
        s.start_step = i % 4;
        batch.push(s);
    }
    let mut t = GreedySeq::new(target, TARGET_TOKENS);
    t.start_step = 2;
    batch.insert(7, t);
    assert_eq!(batch.len(), 16);
    let mut cache = KvCache::new(cfg, device).expect("cache");
    let forwards = run_greedy(&loaded.model, &mut cache, &mut batch, 8).expect("batched");
    let total_tokens: usize = batch
        .iter()
        .map(|s| s.prompt.len() + s.generated.len())
        .sum();
    assert!(
        forwards < total_tokens / 4,
        "sequences were not batched: {forwards} forwards"
    );
    assert_eq!(cache.allocator().num_used(), 0);
    let alone = alone.swap_remove(0);
    let batched = batch.swap_remove(7);
    BusyBatch {
        text: tok.decode(&alone.generated, true).expect("decode"),
        alone_first: alone.first_logits.expect("logits"),
        batched_first: batched.first_logits.expect("logits"),
        alone: alone.generated,
        batched: batched.generated,
    }
}

/// First-step logits of `prompt` on the model's `device`, with a KV cache of type `kv`.
pub fn first_logits_on(
    m: &model::LoadedModel,
    device: &Device,
    prompt: &[u32],
    kv: DType,
) -> Vec<f32> {
    let cfg = KvCacheConfig::for_model(m.model.config(), 16, 64, 0).with_dtype(kv);
    let mut cache = KvCache::new(cfg, device).expect("cache");
    let mut seqs = vec![GreedySeq::new(prompt.to_vec(), 1)];
    run_greedy(&m.model, &mut cache, &mut seqs, 64).expect("run");
    seqs[0].first_logits.clone().expect("logits")
}

/// ‖a − b‖ / ‖b‖.
pub fn rel_err(a: &[f32], b: &[f32]) -> f32 {
    let num: f32 = a.iter().zip(b).map(|(x, y)| (x - y).powi(2)).sum();
    let den: f32 = b.iter().map(|y| y * y).sum();
    (num / den).sqrt()
}

/// Top-two logit gap below which 8-bit activation rounding may pick either token (about twice
/// the largest per-logit error measured against f32).
pub const TIE_GAP: f32 = 1.0;

/// How many greedy tokens `got` shares with f32's. They must agree, or part only where f32's
/// two best logits are within rounding noise of each other, after at least 16 tokens.
pub fn agreed(name: &str, got: &[u32], exact_tokens: &[u32], exact: &[Vec<f32>]) -> usize {
    let same = got
        .iter()
        .zip(exact_tokens)
        .take_while(|(a, b)| a == b)
        .count();
    if same < got.len() {
        let mut v = exact[same].clone();
        v.sort_by(|a, b| b.total_cmp(a));
        let gap = v[0] - v[1];
        eprintln!("{name} parts from f32 at token {same}, where f32's top two differ by {gap}");
        assert!(same >= 16, "{name} parts from f32 at token {same}: {got:?}");
        assert!(
            gap < TIE_GAP,
            "{name} parts from f32 at token {same}, gap {gap}"
        );
    }
    same
}

/// What [`forced_logits`] saw: the next-token logits after the prompt and after each fed
/// token, and every position's key row of layer `layer` (as f32), read back from the cache.
pub struct Forced {
    pub logits: Vec<Vec<f32>>,
    pub keys: Vec<Vec<f32>>,
}

/// Teacher forcing: prefills `tokens[..prompt_len]` in chunks of `chunk`, then feeds the rest
/// one token per step, whatever the model predicts, so one wrong step cannot change what the
/// later ones see. Reads back `layer`'s keys of every position at the end.
pub fn forced_logits(
    m: &model::LoadedModel,
    kv: DType,
    tokens: &[u32],
    prompt_len: usize,
    chunk: usize,
    layer: usize,
) -> Forced {
    use ferrite_runtime::kv::blocks_for_tokens;
    use ferrite_runtime::model::SeqInput;
    let bs = 16;
    let cfg = KvCacheConfig::for_model(m.model.config(), bs, 64, 0).with_dtype(kv);
    let mut cache = KvCache::new(cfg, m.model.device()).expect("cache");
    let blocks = cache
        .allocator_mut()
        .allocate_n(blocks_for_tokens(tokens.len(), bs))
        .expect("blocks");
    let mut logits = Vec::new();
    let mut pos = 0;
    while pos < tokens.len() {
        let n = if pos < prompt_len {
            chunk.max(1).min(prompt_len - pos)
        } else {
            1
        };
        let input = SeqInput {
            tokens: &tokens[pos..pos + n],
            start_pos: pos,
            block_table: &blocks,
            adapter: None,
        };
        let out = m.model.forward(&[input], &cache).expect("forward");
        pos += n;
        if pos >= prompt_len {
            logits.push(out.get(0).expect("row").to_vec1::<f32>().expect("logits"));
        }
    }
    let all = cache
        .layer(layer)
        .0
        .to_dtype(DType::F32)
        .expect("f32")
        .to_device(&Device::Cpu)
        .expect("cpu")
        .to_vec2::<f32>()
        .expect("rows");
    let keys = (0..tokens.len())
        .map(|p| all[blocks[p / bs] as usize * bs + p % bs].clone())
        .collect();
    Forced { logits, keys }
}

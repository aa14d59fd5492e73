//! Runtime benchmark: decode tokens/s of the batched paged forward at batch 1, 8 and 32, and
//! prefill tokens/s of a 512-token prompt, on the default model. Batch-1 decode, measured in the
//! same run, is the baseline every figure is printed against.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Parser;
use ferrite_runtime::kv::{BlockId, KvCache, KvCacheConfig, blocks_for_tokens};
use ferrite_runtime::model::driver::argmax_rows;
use ferrite_runtime::model::{self, LoadOptions, SeqInput, WeightMode};

#[derive(Parser, Debug)]
struct Args {
    /// GGUF file or HF folder (default: fetched by scripts/fetch-model.sh).
    #[arg(long)]
    model: Option<PathBuf>,
    #[arg(long, value_enum, default_value_t = WeightMode::Quantized)]
    weights: WeightMode,
    /// Decode steps timed per batch size.
    #[arg(long, default_value_t = 32)]
    steps: usize,
    /// Prompt tokens per sequence before decode starts.
    #[arg(long, default_value_t = 64)]
    context: usize,
    #[arg(long, value_delimiter = ',', default_value = "1,8,32")]
    batches: Vec<usize>,
    #[arg(long, default_value_t = 512)]
    prefill_len: usize,
    /// Repetitions of each measurement; the best is reported.
    #[arg(long, default_value_t = 2)]
    reps: usize,
}

struct Seq {
    blocks: Vec<BlockId>,
    len: usize,
    next: u32,
}

fn grow(cache: &mut KvCache, s: &mut Seq, to: usize) -> Result<()> {
    let need = blocks_for_tokens(to, cache.config().block_size).saturating_sub(s.blocks.len());
    s.blocks.extend(cache.allocator_mut().allocate_n(need)?);
    Ok(())
}

/// Runs `prompt` as one prefill of the empty sequence `s`; returns the greedy next token.
fn prefill(m: &model::LlamaModel, cache: &mut KvCache, s: &mut Seq, prompt: &[u32]) -> Result<u32> {
    grow(cache, s, prompt.len())?;
    let input = SeqInput {
        tokens: prompt,
        start_pos: 0,
        block_table: &s.blocks,
    };
    let out = m.forward(&[input], cache)?;
    s.len = prompt.len();
    Ok(argmax_rows(&out)?[0])
}

/// Decode tokens/s at `batch`: prefill `context` tokens per sequence, then time `steps` steps.
fn decode_rate(
    m: &model::LlamaModel,
    cache: &mut KvCache,
    batch: usize,
    args: &Args,
) -> Result<f64> {
    let vocab = m.config().vocab_size as u32;
    let mut seqs: Vec<Seq> = (0..batch)
        .map(|_| Seq {
            blocks: vec![],
            len: 0,
            next: 0,
        })
        .collect();
    for (i, s) in seqs.iter_mut().enumerate() {
        let prompt: Vec<u32> = (0..args.context)
            .map(|j| ((i * 7919 + j * 104729) as u32) % vocab)
            .collect();
        s.next = prefill(m, cache, s, &prompt)?;
    }
    let start = Instant::now();
    for _ in 0..args.steps {
        for s in seqs.iter_mut() {
            let to = s.len + 1;
            grow(cache, s, to)?;
        }
        let toks: Vec<[u32; 1]> = seqs.iter().map(|s| [s.next]).collect();
        let inputs: Vec<SeqInput> = seqs
            .iter()
            .zip(&toks)
            .map(|(s, t)| SeqInput {
                tokens: t,
                start_pos: s.len,
                block_table: &s.blocks,
            })
            .collect();
        let next = argmax_rows(&m.forward(&inputs, cache)?)?;
        for (s, n) in seqs.iter_mut().zip(next) {
            s.len += 1;
            s.next = n;
        }
    }
    let secs = start.elapsed().as_secs_f64();
    for s in &seqs {
        cache.allocator_mut().free_all(&s.blocks)?;
    }
    Ok((batch * args.steps) as f64 / secs)
}

fn prefill_rate(m: &model::LlamaModel, cache: &mut KvCache, len: usize) -> Result<f64> {
    let vocab = m.config().vocab_size as u32;
    let prompt: Vec<u32> = (0..len)
        .map(|j| ((j * 104729 + 13) as u32) % vocab)
        .collect();
    let mut s = Seq {
        blocks: vec![],
        len: 0,
        next: 0,
    };
    let start = Instant::now();
    prefill(m, cache, &mut s, &prompt)?;
    let secs = start.elapsed().as_secs_f64();
    cache.allocator_mut().free_all(&s.blocks)?;
    Ok(len as f64 / secs)
}

fn best(reps: usize, mut f: impl FnMut() -> Result<f64>) -> Result<f64> {
    let mut b = 0f64;
    for _ in 0..reps.max(1) {
        b = b.max(f()?);
    }
    Ok(b)
}

fn main() -> Result<()> {
    let args = Args::parse();
    let path = match &args.model {
        Some(p) => p.clone(),
        None => ferrite_testkit::model::default_model(),
    };
    let opts = LoadOptions {
        weight_mode: args.weights,
        ..Default::default()
    };
    let loaded =
        model::load(&path, &opts).with_context(|| format!("loading {}", path.display()))?;
    let m = &loaded.model;
    let max_batch = args.batches.iter().copied().max().unwrap_or(1);
    let per_seq = blocks_for_tokens(args.context + args.steps + 1, 16)
        .max(blocks_for_tokens(args.prefill_len, 16));
    let cfg = KvCacheConfig::for_model(m.config(), 16, per_seq * max_batch + 8, 0);
    let mut cache = KvCache::new(cfg, m.device())?;
    // Warm-up: first touches of weights and thread pools.
    decode_rate(
        m,
        &mut cache,
        1,
        &Args {
            steps: 4,
            ..Args::parse_from(["x"])
        },
    )?;

    println!(
        "model: {} ({:?} weights), {} threads",
        path.display(),
        args.weights,
        rayon_threads()
    );
    let mut baseline = None;
    for &b in &args.batches {
        let rate = best(args.reps, || decode_rate(m, &mut cache, b, &args))?;
        let base = *baseline.get_or_insert(rate);
        println!(
            "decode batch {b:>3}: {rate:>8.1} tok/s  ({:.2}x batch-{} decode)",
            rate / base,
            args.batches[0]
        );
    }
    let base = baseline.unwrap_or(1.0);
    let rate = best(args.reps, || prefill_rate(m, &mut cache, args.prefill_len))?;
    println!(
        "prefill {} tokens: {rate:>8.1} tok/s  ({:.2}x batch-{} decode)",
        args.prefill_len,
        rate / base,
        args.batches[0]
    );
    Ok(())
}

fn rayon_threads() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}

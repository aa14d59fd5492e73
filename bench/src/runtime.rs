//! Runtime benchmark: decode tokens/s of the batched paged forward at batch 1, 8 and 32, and
//! prefill tokens/s of a 512-token prompt, on the default model. Batch-1 decode, measured in the
//! same run, is the baseline every figure is printed against.
//!
//! Each line also places itself on the roofline (`roofline.rs`, ceilings measured in the same
//! run): the model's int8 matmul work per second against the int8 dot-product peak, attention's
//! f32 work against the FMA peak, and (decode) the weight bytes a step reads against the read
//! bandwidth. Work is what the model needs, divided by the whole step's time, so each fraction
//! is a lower bound for its kernel.
//!
//! With `--device cuda` (a build with `--features cuda`, scripts/gpu-check.sh) decode is placed
//! against the GPU's memory bandwidth instead, measured in the same run as a device-to-device
//! copy: the bytes a step must read (the weights as they sit on the GPU, and every sequence's
//! keys and values) over the step's time, as a share of that bandwidth.
//!
//! With `--lora PATH` (repeatable; bench/lora.sh's adapters) only the `--mix` runs, twice per
//! repetition in alternating order: every sequence on the base model, and sequence `i` on
//! adapter `i mod n`; it prints both rates and their ratio, the in-process form of
//! bench/lora.sh's throughput figure without the HTTP server's noise.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Parser;
use ferrite_bench::roofline::{self, Peaks};
use ferrite_runtime::kv::{BlockId, KvCache, KvCacheConfig, blocks_for_tokens};
use ferrite_runtime::model::driver::argmax_rows;
use ferrite_runtime::model::lora::{self, LoraAdapter, LoraDtype, LoraOptions};
use ferrite_runtime::model::{self, LoadOptions, ModelConfig, SeqInput, WeightMode};

#[derive(Parser, Debug)]
struct Args {
    /// GGUF file or HF folder (default: fetched by scripts/fetch-model.sh).
    #[arg(long)]
    model: Option<PathBuf>,
    #[arg(long, value_enum, default_value_t = WeightMode::Auto)]
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
    /// Most tokens one pass of the layers runs (default: the model's own,
    /// `model::llama::CPU_SLICE_TOKENS` on CPU); a longer prefill goes through in slices.
    #[arg(long)]
    slice_tokens: Option<usize>,
    /// Repetitions of each measurement; the best is reported.
    #[arg(long, default_value_t = 2)]
    reps: usize,
    /// `cpu`, `cuda` or `cuda:N`.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// `CONCURRENCY,PROMPT,OUTPUT`: also time the token mix of a closed-loop serving level
    /// (bench-serve's) run straight through the model, and print the output tok/s it predicts
    /// for a server (`serve_mix`); `0,0,0` skips it.
    #[arg(long, value_delimiter = ',', default_value = "32,128,128")]
    mix: Vec<usize>,
    /// Most tokens one engine step schedules (the server's `--max-num-batched-tokens`).
    #[arg(long, default_value_t = 2048)]
    max_batched_tokens: usize,
    /// Time only the `--mix` (bench/serve-gap.sh).
    #[arg(long)]
    mix_only: bool,
    /// LoRA adapters (PEFT folders or GGUF files): time the `--mix` on the base model against
    /// sequence `i` on adapter `i mod n` (module docs).
    #[arg(long)]
    lora: Vec<PathBuf>,
    /// What the adapters' factors are kept in (the server's `--lora-dtype`).
    #[arg(long, value_enum, default_value_t = LoraDtype::Float32)]
    lora_dtype: LoraDtype,
}

#[derive(Default)]
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
        adapter: None,
    };
    let out = m.forward(&[input], cache)?;
    s.len = prompt.len();
    Ok(argmax_rows(&out)?[0])
}

/// `n` synthetic prompts of `len` tokens; `salt` keeps one measurement's apart from another's.
fn prompts(n: usize, len: usize, vocab: u32, salt: usize) -> Vec<Vec<u32>> {
    (0..n)
        .map(|i| {
            (0..len)
                .map(|j| ((i * 7919 + j * 104729 + salt) as u32) % vocab)
                .collect()
        })
        .collect()
}

/// Sequence `i`'s adapter: `i mod n` of `lora`, none when it is empty.
fn adapter_of(lora: &[LoraAdapter], i: usize) -> Option<&LoraAdapter> {
    (!lora.is_empty()).then(|| &lora[i % lora.len()])
}

/// One greedy decode step of every sequence in `seqs` (their blocks already hold the token),
/// sequence `i` on [`adapter_of`]`(lora, i)`.
fn decode_step(
    m: &model::LlamaModel,
    cache: &mut KvCache,
    seqs: &mut [Seq],
    lora: &[LoraAdapter],
) -> Result<()> {
    let toks: Vec<[u32; 1]> = seqs.iter().map(|s| [s.next]).collect();
    let inputs: Vec<SeqInput> = seqs
        .iter()
        .zip(&toks)
        .enumerate()
        .map(|(i, (s, t))| SeqInput {
            tokens: t,
            start_pos: s.len,
            block_table: &s.blocks,
            adapter: adapter_of(lora, i),
        })
        .collect();
    let next = argmax_rows(&m.forward(&inputs, cache)?)?;
    for (s, n) in seqs.iter_mut().zip(next) {
        s.len += 1;
        s.next = n;
    }
    Ok(())
}

/// Decode tokens/s at `batch`: prefill `context` tokens per sequence, then time `steps` steps.
fn decode_rate(
    m: &model::LlamaModel,
    cache: &mut KvCache,
    batch: usize,
    args: &Args,
) -> Result<f64> {
    let vocab = m.config().vocab_size as u32;
    let mut seqs: Vec<Seq> = (0..batch).map(|_| Seq::default()).collect();
    for (s, prompt) in seqs.iter_mut().zip(prompts(batch, args.context, vocab, 0)) {
        s.next = prefill(m, cache, s, &prompt)?;
    }
    let start = Instant::now();
    for _ in 0..args.steps {
        for s in seqs.iter_mut() {
            let to = s.len + 1;
            grow(cache, s, to)?;
        }
        decode_step(m, cache, &mut seqs, &[])?;
    }
    let secs = start.elapsed().as_secs_f64();
    for s in &seqs {
        cache.allocator_mut().free_all(&s.blocks)?;
    }
    Ok((batch * args.steps) as f64 / secs)
}

fn prefill_rate(m: &model::LlamaModel, cache: &mut KvCache, len: usize) -> Result<f64> {
    let vocab = m.config().vocab_size as u32;
    let prompt = prompts(1, len, vocab, 13).concat();
    let mut s = Seq::default();
    let start = Instant::now();
    prefill(m, cache, &mut s, &prompt)?;
    let secs = start.elapsed().as_secs_f64();
    cache.allocator_mut().free_all(&s.blocks)?;
    Ok(len as f64 / secs)
}

/// The work one token asks of the model.
struct Work {
    /// Multiply-adds of the layers' linear maps.
    layer_macs: f64,
    /// Multiply-adds of the output head (once per sequence and step).
    head_macs: f64,
    /// Attention f32 operations per key attended (QK and PV, all layers and heads).
    attn_flops_per_key: f64,
}

impl Work {
    fn of(c: &ModelConfig) -> Work {
        let (h, q, kv) = (
            c.hidden_size as f64,
            (c.num_heads * c.head_dim) as f64,
            (c.num_kv_heads * c.head_dim) as f64,
        );
        let layer = h * q + 2.0 * h * kv + q * h + 3.0 * h * c.intermediate_size as f64;
        Work {
            layer_macs: c.num_layers as f64 * layer,
            head_macs: h * c.vocab_size as f64,
            attn_flops_per_key: 4.0 * (c.num_layers * c.num_heads * c.head_dim) as f64,
        }
    }

    /// `int8 ops, attention flops` for `tokens` new tokens of `seqs` sequences attending to
    /// `keys` keys in all.
    fn ops(&self, tokens: f64, seqs: f64, keys: f64) -> (f64, f64) {
        (
            2.0 * (self.layer_macs * tokens + self.head_macs * seqs),
            self.attn_flops_per_key * keys,
        )
    }
}

/// `int8 X GOP/s (P% of peak), attention Y GFLOP/s (Q% of f32 peak)` for work done in `secs`.
fn placed(peaks: &Peaks, (int8, attn): (f64, f64), secs: f64) -> String {
    let int8_rate = int8 / secs;
    let share = |rate: f64, peak: Option<f64>, what: &str| {
        peak.map_or("no peak".to_string(), |p| {
            format!("{:.1}% of the {what} peak", 100.0 * rate / p)
        })
    };
    format!(
        "matmuls {:.1} GOP/s ({}), attention {:.1} GFLOP/s ({})",
        int8_rate / 1e9,
        share(int8_rate, peaks.int8_ops, "int8"),
        attn / secs / 1e9,
        share(attn / secs, Some(peaks.f32_flops), "f32"),
    )
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
    let device = ferrite_runtime::device::parse_device(&args.device)?;
    let opts = LoadOptions {
        device: device.clone(),
        weight_mode: args.weights,
        ..Default::default()
    };
    let mut loaded =
        model::load(&path, &opts).with_context(|| format!("loading {}", path.display()))?;
    if let Some(n) = args.slice_tokens {
        loaded.model.set_max_slice_tokens(n);
    }
    let m = &loaded.model;
    let max_batch = args.batches.iter().copied().max().unwrap_or(1);
    let mix = Mix::parse(&args.mix)?;
    let per_seq = blocks_for_tokens(args.context + args.steps + 1, 16)
        .max(blocks_for_tokens(args.prefill_len, 16));
    let blocks = (per_seq * max_batch)
        .max(mix.map_or(0, |x| x.seqs * blocks_for_tokens(x.prompt + x.output, 16)));
    let cfg = KvCacheConfig::for_model(m.config(), 16, blocks + 8, 0);
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
        "model: {} ({:?} weights), {} threads, device {}",
        path.display(),
        loaded.weight_mode,
        rayon_threads(),
        args.device
    );
    if device.is_cpu() {
        println!("CPU kernels: {}", ferrite_runtime::kernels::cpu_paths());
    }
    if !device.is_cpu() {
        return gpu_decode(&mut loaded, &path, &mut cache, &args);
    }
    if !args.lora.is_empty() {
        let mix = mix.context("--lora needs a --mix")?;
        let opts = LoraOptions {
            max_rank: usize::MAX,
            dtype: args.lora_dtype,
        };
        let adapters = args
            .lora
            .iter()
            .enumerate()
            .map(|(i, p)| {
                lora::load(&format!("a{i}"), p, m.config(), m.device(), opts)
                    .with_context(|| format!("loading {}", p.display()))
            })
            .collect::<Result<Vec<_>>>()?;
        let peaks = peaks_for(&adapters);
        for tokens in [1, mix.prompt] {
            let dtype = args.lora_dtype;
            report_lora_update(m, &adapters, mix.seqs, tokens, dtype, args.reps, &peaks)?;
        }
        return report_lora(m, &mut cache, mix, &args, &adapters);
    }
    if args.mix_only {
        let mix = mix.context("--mix-only needs a --mix")?;
        return report_mix(m, &mut cache, mix, &args);
    }
    // What a decode step reads: the weights, about the GGUF's size.
    let weight_bytes = std::fs::metadata(&path)
        .map(|m| m.len() as f64)
        .unwrap_or(0.0);
    let peaks = roofline::measure(rayon_threads(), weight_bytes as usize);
    println!(
        "ceilings, {} threads: f32 FMA {:.1} GFLOP/s, int8 dot products {}, reading {:.0} MB \
         {:.1} GB/s",
        peaks.threads,
        peaks.f32_flops / 1e9,
        peaks.int8_label(),
        weight_bytes / 1e6,
        peaks.read_bytes / 1e9,
    );
    let work = Work::of(m.config());
    let mut baseline = None;
    for &b in &args.batches {
        let rate = best(args.reps, || decode_rate(m, &mut cache, b, &args))?;
        let base = *baseline.get_or_insert(rate);
        // One second's worth: `rate` tokens, each attending to the mean context of the steps.
        let keys = rate * (args.context as f64 + (args.steps as f64 + 1.0) / 2.0);
        let steps_per_s = rate / b as f64;
        println!(
            "decode batch {b:>3}: {rate:>8.1} tok/s  ({:.2}x batch-{} decode); {}; weights \
             {:.1} GB/s ({:.0}% of read)",
            rate / base,
            args.batches[0],
            placed(&peaks, work.ops(rate, rate, keys), 1.0),
            weight_bytes * steps_per_s / 1e9,
            100.0 * weight_bytes * steps_per_s / peaks.read_bytes,
        );
    }
    let base = baseline.unwrap_or(1.0);
    let rate = best(args.reps, || prefill_rate(m, &mut cache, args.prefill_len))?;
    let n = args.prefill_len as f64;
    println!(
        "prefill {} tokens: {rate:>8.1} tok/s  ({:.2}x batch-{} decode); {}",
        args.prefill_len,
        rate / base,
        args.batches[0],
        placed(&peaks, work.ops(n, 1.0, n * (n + 1.0) / 2.0), n / rate),
    );
    if let Some(mix) = mix {
        report_mix(m, &mut cache, mix, &args)?;
    }
    Ok(())
}

/// Times `mix` (the best of `--reps`) and prints what it predicts for a server.
fn report_mix(m: &model::LlamaModel, cache: &mut KvCache, mix: Mix, args: &Args) -> Result<()> {
    let t = (0..args.reps.max(1))
        .map(|_| serve_mix(m, cache, mix, args.max_batched_tokens, &[]))
        .collect::<Result<Vec<_>>>()?
        .into_iter()
        .min_by(|a, b| a.total().total_cmp(&b.total()))
        .context("no repetitions")?;
    let out = (mix.seqs * mix.output) as f64;
    println!(
        "serving mix, {} sequences x ({} prompt + {} output) tokens: prefill {:.2} s in steps \
         of <= {} tokens, decode {:.2} s ({} steps); predicts {:.1} output tok/s (prefill {:.0}% \
         of the time)",
        mix.seqs,
        mix.prompt,
        mix.output,
        t.prefill,
        args.max_batched_tokens,
        t.decode,
        mix.output.saturating_sub(1),
        out / t.total(),
        100.0 * t.prefill / t.total(),
    );
    Ok(())
}

/// Times `mix` on the base model and with `lora`, alternating which goes first, and prints
/// the best of `--reps` of each and their ratio.
fn report_lora(
    m: &model::LlamaModel,
    cache: &mut KvCache,
    mix: Mix,
    args: &Args,
    lora: &[LoraAdapter],
) -> Result<()> {
    let (mut base, mut adapted): (Option<MixTime>, Option<MixTime>) = (None, None);
    for rep in 0..args.reps.max(1) {
        for adapters in [rep % 2 == 1, rep % 2 == 0] {
            let t = serve_mix(
                m,
                cache,
                mix,
                args.max_batched_tokens,
                if adapters { lora } else { &[] },
            )?;
            let best = if adapters { &mut adapted } else { &mut base };
            if best.as_ref().is_none_or(|b| t.total() < b.total()) {
                *best = Some(t);
            }
        }
    }
    let (base, adapted) = base.zip(adapted).context("no repetitions")?;
    let out = (mix.seqs * mix.output) as f64;
    println!(
        "serving mix, {} sequences x ({} prompt + {} output) tokens, {} adapters of rank {} \
         ({:?}), sequence i on adapter i mod {}: base {:.1} output tok/s (prefill {:.2} s, \
         decode {:.2} s), adapters {:.1} (prefill {:.2} s, decode {:.2} s): {:.3}x",
        mix.seqs,
        mix.prompt,
        mix.output,
        lora.len(),
        lora.iter().map(LoraAdapter::rank).max().unwrap_or(0),
        args.lora_dtype,
        lora.len(),
        out / base.total(),
        base.prefill,
        base.decode,
        out / adapted.total(),
        adapted.prefill,
        adapted.decode,
        base.total() / adapted.total(),
    );
    Ok(())
}

/// The read ceiling over a buffer the size of `adapters`' factors together.
fn peaks_for(adapters: &[LoraAdapter]) -> Peaks {
    let bytes = adapters.iter().map(LoraAdapter::bytes).sum();
    roofline::measure(rayon_threads(), bytes)
}

/// Times the adapters' update alone, as a step of `seqs` sequences of `tokens` tokens each
/// (sequence `i` on adapter `i mod n`) runs it over every layer's projections. A decode step
/// (one token each) is memory-bound: its rate is printed in bytes of factors read per second
/// against the read ceiling; a prefill's in multiply-adds per second.
fn report_lora_update(
    m: &model::LlamaModel,
    adapters: &[LoraAdapter],
    seqs: usize,
    tokens: usize,
    dtype: LoraDtype,
    reps: usize,
    peaks: &Peaks,
) -> Result<()> {
    use candle_core::Tensor;
    use ferrite_runtime::model::lora::{LoraStep, Proj};
    let c = m.config();
    let (h, i) = (c.hidden_size, c.intermediate_size);
    let qkv = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim;
    let shapes = [
        (Proj::Qkv, h, qkv),
        (Proj::O, c.num_heads * c.head_dim, h),
        (Proj::GateUp, h, 2 * i),
        (Proj::Down, i, h),
    ];
    let rows = seqs * tokens;
    let step = LoraStep::new((0..seqs).map(|r| (adapter_of(adapters, r), tokens)));
    let dev = m.device();
    let inputs = shapes
        .iter()
        .map(|&(proj, fan_in, width)| {
            let x = Tensor::ones((rows, fan_in), candle_core::DType::F32, dev)?;
            Ok((proj, x, width))
        })
        .collect::<Result<Vec<_>>>()?;
    // Factors each step reads: every distinct adapter's once.
    let used: std::collections::BTreeSet<usize> = (0..seqs).map(|r| r % adapters.len()).collect();
    let bytes: usize = used.iter().map(|&a| adapters[a].bytes()).sum();
    // Multiply-adds: each row's adapter's factors, element by element, once.
    let elem = match dtype {
        LoraDtype::Float32 => 4,
        LoraDtype::Bfloat16 => 2,
    };
    let per_row = |a: &LoraAdapter| (a.bytes() / elem) as f64;
    let macs: f64 = (0..seqs)
        .map(|r| per_row(&adapters[r % adapters.len()]) * tokens as f64)
        .sum();
    let mut best = f64::INFINITY;
    for _ in 0..reps.max(1) * 10 {
        // As a forward runs it: on the pool, its workers kept awake (`kernels::pool`).
        let secs = ferrite_runtime::kernels::pool::hot(|| -> Result<f64> {
            let start = Instant::now();
            for layer in 0..c.num_layers {
                for (proj, x, width) in &inputs {
                    let y = Tensor::zeros((rows, *width), candle_core::DType::F32, dev)?;
                    step.apply(layer, *proj, x, y)?;
                }
            }
            Ok(start.elapsed().as_secs_f64())
        })?;
        best = best.min(secs);
    }
    if tokens == 1 {
        println!(
            "adapter update alone, a decode step of {seqs} sequences: {:.2} ms, {:.0} MB of \
             factors: {:.1} GB/s ({:.0}% of the {:.1} GB/s read ceiling over that many bytes)",
            best * 1e3,
            bytes as f64 / 1e6,
            bytes as f64 / best / 1e9,
            100.0 * bytes as f64 / best / peaks.read_bytes,
            peaks.read_bytes / 1e9,
        );
    } else {
        println!(
            "adapter update alone, a prefill of {seqs} x {tokens} tokens: {:.2} ms, {:.1} G \
             multiply-adds/s ({:.0}% of the f32 FMA peak; the update multiplies and adds apart)",
            best * 1e3,
            macs / best / 1e9,
            100.0 * 2.0 * macs / best / peaks.f32_flops,
        );
    }
    Ok(())
}

/// A closed-loop serving level's token mix: `seqs` requests at a time, each `prompt` tokens in
/// and `output` tokens out.
#[derive(Clone, Copy)]
struct Mix {
    seqs: usize,
    prompt: usize,
    output: usize,
}

impl Mix {
    fn parse(v: &[usize]) -> Result<Option<Mix>> {
        match *v {
            [0, ..] | [_, 0, _] | [_, _, 0] => Ok(None),
            [seqs, prompt, output] => Ok(Some(Mix {
                seqs,
                prompt,
                output,
            })),
            _ => anyhow::bail!("--mix takes CONCURRENCY,PROMPT,OUTPUT"),
        }
    }
}

/// Seconds the model spends on one wave of a [`Mix`].
struct MixTime {
    prefill: f64,
    decode: f64,
}

impl MixTime {
    fn total(&self) -> f64 {
        self.prefill + self.decode
    }
}

/// One wave of `mix` straight through the model, as an engine with nothing else to do would run
/// it: the prompts prefilled in steps of at most `max_tokens` tokens (whole prompts; the first
/// output token comes from the prefill's logits), then `output - 1` decode steps of the whole
/// batch. Greedy, logits read back every step. This is the engine's rate for the token mix of a
/// bench-serve level at concurrency `seqs`, where every request of a wave arrives together; a
/// server's output tok/s divided by `output · seqs / total()` is the share of the engine's
/// rate it delivers.
/// Sequence `i` runs on [`adapter_of`]`(lora, i)`.
fn serve_mix(
    m: &model::LlamaModel,
    cache: &mut KvCache,
    mix: Mix,
    max_tokens: usize,
    lora: &[LoraAdapter],
) -> Result<MixTime> {
    let vocab = m.config().vocab_size as u32;
    let mut seqs: Vec<Seq> = (0..mix.seqs).map(|_| Seq::default()).collect();
    let prompts = prompts(mix.seqs, mix.prompt, vocab, 17);
    for s in seqs.iter_mut() {
        grow(cache, s, mix.prompt + mix.output)?;
    }
    anyhow::ensure!(
        mix.prompt <= max_tokens,
        "a {}-token prompt does not fit a step of {max_tokens} tokens",
        mix.prompt
    );
    let per_step = max_tokens / mix.prompt;
    let start = Instant::now();
    for (c, (chunk, ps)) in seqs
        .chunks_mut(per_step)
        .zip(prompts.chunks(per_step))
        .enumerate()
    {
        let inputs: Vec<SeqInput> = chunk
            .iter()
            .zip(ps)
            .enumerate()
            .map(|(i, (s, p))| SeqInput {
                tokens: p,
                start_pos: 0,
                block_table: &s.blocks,
                adapter: adapter_of(lora, c * per_step + i),
            })
            .collect();
        let next = argmax_rows(&m.forward(&inputs, cache)?)?;
        for (s, n) in chunk.iter_mut().zip(next) {
            s.len = mix.prompt;
            s.next = n;
        }
    }
    let prefill = start.elapsed().as_secs_f64();
    let start = Instant::now();
    for _ in 1..mix.output {
        decode_step(m, cache, &mut seqs, lora)?;
    }
    let decode = start.elapsed().as_secs_f64();
    for s in &seqs {
        cache.allocator_mut().free_all(&s.blocks)?;
    }
    Ok(MixTime { prefill, decode })
}

/// Decode on a GPU against its memory bandwidth (module docs), each batch size with CUDA graphs
/// and op by op (`--enforce-eager`), alternated; then prefill rates.
fn gpu_decode(
    loaded: &mut model::LoadedModel,
    path: &std::path::Path,
    cache: &mut KvCache,
    args: &Args,
) -> Result<()> {
    let c = loaded.model.config().clone();
    let bandwidth = gpu_copy_bandwidth(loaded.model.device())?;
    println!(
        "ceiling: device-to-device copy {:.0} GB/s (reads plus writes, 1 GiB)",
        bandwidth / 1e9
    );
    // The weights as they sit on the device: dense keeps f32, quantized the GGUF's blocks.
    let work = Work::of(&c);
    let params = work.layer_macs + work.head_macs;
    let weight_bytes = match loaded.weight_mode {
        WeightMode::Quantized => std::fs::metadata(path).map_or(params, |f| f.len() as f64),
        _ => 4.0 * params,
    };
    // Keys and values read per sequence and step, at the mean context of the timed steps.
    let kv_per_token = 2.0
        * (c.num_layers * c.num_kv_heads * c.head_dim) as f64
        * cache.config().dtype.size_in_bytes() as f64;
    let mean_ctx = args.context as f64 + (args.steps as f64 + 1.0) / 2.0;
    let graphs = model::llama::DEFAULT_MAX_GRAPH_BATCH;
    let warm = Args {
        steps: 2,
        ..Args::parse_from(["x"])
    };
    let mut baseline = None;
    for &b in &args.batches {
        // Capture this size's graph before timing.
        loaded.model.set_max_graph_batch(graphs);
        decode_rate(&loaded.model, cache, b, &warm)?;
        let (mut eager, mut graphed) = (0f64, 0f64);
        for _ in 0..args.reps.max(1) {
            loaded.model.set_max_graph_batch(0);
            eager = eager.max(decode_rate(&loaded.model, cache, b, args)?);
            loaded.model.set_max_graph_batch(graphs);
            graphed = graphed.max(decode_rate(&loaded.model, cache, b, args)?);
        }
        let base = *baseline.get_or_insert(graphed);
        let bytes = weight_bytes + b as f64 * mean_ctx * kv_per_token;
        for (what, rate) in [("graphs", graphed), ("eager ", eager)] {
            let step = b as f64 / rate;
            println!(
                "decode batch {b:>3} {what}: {rate:>8.1} tok/s  ({:.2}x batch-{} graphs); step \
                 {:.2} ms reads {:.0} MB: {:.0} GB/s, {:.1}% of the copy bandwidth",
                rate / base,
                args.batches[0],
                step * 1e3,
                bytes / 1e6,
                bytes / step / 1e9,
                100.0 * bytes / step / bandwidth,
            );
        }
        println!("decode batch {b:>3}: graphs {:.2}x eager", graphed / eager);
    }
    match loaded.model.graph_stats() {
        Some(s) => println!(
            "CUDA graphs: captured sizes {:?}, {} steps replayed{}",
            s.captured,
            s.replays,
            s.failed.map_or(String::new(), |e| format!(", FAILED: {e}"))
        ),
        None => println!("CUDA graphs: none (not built with cuda)"),
    }
    let vocab = c.vocab_size as u32;
    for seqs in [1usize, 8, 32] {
        let len = 128;
        let rate = best(args.reps, || {
            prefill_batch(&loaded.model, cache, seqs, len, vocab)
        })?;
        println!(
            "prefill {seqs:>2} x {len} tokens in one forward: {rate:>9.1} tok/s, {:.2} ms",
            1e3 * (seqs * len) as f64 / rate
        );
    }
    Ok(())
}

/// Tokens/s of one forward prefilling `seqs` fresh sequences of `len` tokens each (as a server
/// step admitting that many requests does), logits read back.
fn prefill_batch(
    m: &model::LlamaModel,
    cache: &mut KvCache,
    seqs: usize,
    len: usize,
    vocab: u32,
) -> Result<f64> {
    let prompts = prompts(seqs, len, vocab, 13);
    let mut tables = Vec::new();
    for _ in 0..seqs {
        let mut s = Seq::default();
        grow(cache, &mut s, len)?;
        tables.push(s.blocks);
    }
    let inputs: Vec<SeqInput> = prompts
        .iter()
        .zip(&tables)
        .map(|(p, t)| SeqInput {
            tokens: p,
            start_pos: 0,
            block_table: t,
            adapter: None,
        })
        .collect();
    let start = Instant::now();
    argmax_rows(&m.forward(&inputs, cache)?)?;
    let secs = start.elapsed().as_secs_f64();
    for t in &tables {
        cache.allocator_mut().free_all(t)?;
    }
    Ok((seqs * len) as f64 / secs)
}

/// Bytes per second a device-to-device copy of 1 GiB moves (each byte read once and written
/// once), the best of five after a warm-up.
fn gpu_copy_bandwidth(device: &candle_core::Device) -> Result<f64> {
    let n = 1usize << 28; // f32 values: 1 GiB
    let src = candle_core::Tensor::zeros(n, candle_core::DType::F32, device)?;
    let _ = src.copy()?;
    device.synchronize()?;
    let mut best = 0f64;
    for _ in 0..5 {
        let t = Instant::now();
        let dst = src.copy()?;
        device.synchronize()?;
        best = best.max(2.0 * 4.0 * n as f64 / t.elapsed().as_secs_f64());
        drop(dst);
    }
    Ok(best)
}

fn rayon_threads() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}

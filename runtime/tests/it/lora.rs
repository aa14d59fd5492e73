//! LoRA adapters on the default model: the PEFT and GGUF forms of one adapter are the same
//! adapter, an adapter changes the answers, and a sequence gets the same bits alone and in a
//! batch mixing three adapters and the base model. (Agreement with llama-server's `--lora` is
//! in `llama_server_agreement.rs`.) The adapters are made by `scripts/lora-adapter.py`.

use std::sync::Arc;

use candle_core::Device;
use ferrite_runtime::kv::{KvCache, KvCacheConfig};
use ferrite_runtime::model::driver::{GreedySeq, run_greedy};
use ferrite_runtime::model::lora::{self, LoraAdapter, LoraDtype, LoraError, LoraOptions, Target};
use ferrite_runtime::model::{self, LoadOptions, LoadedModel};
use ferrite_testkit::process::TempDir;

use crate::common;

pub fn load_adapter(loaded: &LoadedModel, name: &str, path: &std::path::Path) -> Arc<LoraAdapter> {
    let adapter = lora::load(
        name,
        path,
        loaded.model.config(),
        &Device::Cpu,
        LoraOptions::max_rank(64),
    )
    .unwrap_or_else(|e| panic!("load {}: {e}", path.display()));
    Arc::new(adapter)
}

fn questions() -> Vec<&'static str> {
    vec![
        "Name three rivers in Africa.",
        "Why is the sky blue?",
        "Translate 'good morning' into Spanish.",
    ]
}

fn prompt(loaded: &LoadedModel, q: &str) -> Vec<u32> {
    let text = format!("<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n");
    loaded.tokenizer.encode(&text, false).expect("encode")
}

/// Greedy answers of `seqs` run together (staggered by `start_step`), with every step's logits.
fn run(loaded: &LoadedModel, seqs: &mut [GreedySeq]) {
    let cfg = KvCacheConfig::for_model(loaded.model.config(), 16, 256, 0);
    let mut cache = KvCache::new(cfg, &Device::Cpu).expect("cache");
    run_greedy(&loaded.model, &mut cache, seqs, 7).expect("run");
}

fn seq(prompt: Vec<u32>, adapter: Option<&Arc<LoraAdapter>>) -> GreedySeq {
    let mut s = GreedySeq::new(prompt, 16);
    s.keep_all_logits = true;
    s.adapter = adapter.cloned();
    s
}

#[test]
fn peft_and_gguf_forms_are_the_same_adapter_and_change_the_answers() {
    let loaded = model::load(&common::default_model(), &LoadOptions::default()).expect("load");
    let dir = common::lora_adapter_dir(1);
    let peft = load_adapter(&loaded, "peft", &dir.join("peft"));
    let gguf = load_adapter(&loaded, "gguf", &dir.join("adapter.gguf"));
    assert_eq!(peft.targets(), Target::ALL.to_vec());
    assert_eq!((peft.rank(), gguf.rank()), (8, 8));
    assert_eq!(peft.bytes(), gguf.bytes());

    let mut changed = 0;
    for q in questions() {
        let p = prompt(&loaded, q);
        let mut seqs = vec![
            seq(p.clone(), Some(&peft)),
            seq(p.clone(), Some(&gguf)),
            seq(p, None),
        ];
        run(&loaded, &mut seqs);
        // The GGUF file stores Q's and K's rows in llama.cpp's order, as the base model does;
        // the PEFT file in Hugging Face's, which the loader permutes: same floats, same bits.
        assert_eq!(seqs[0].generated, seqs[1].generated, "{q}");
        assert_eq!(seqs[0].all_logits, seqs[1].all_logits, "{q}");
        if seqs[0].generated != seqs[2].generated {
            changed += 1;
        }
        let text = |s: &GreedySeq| loaded.tokenizer.decode(&s.generated, true).expect("decode");
        eprintln!(
            "{q:?}\n  adapter: {:?}\n  base:    {:?}",
            text(&seqs[0]),
            text(&seqs[2])
        );
    }
    assert!(changed > 0, "the adapter changed none of the answers");
}

#[test]
fn a_sequence_gets_the_same_bits_alone_and_among_three_adapters_and_the_base() {
    let loaded = model::load(&common::default_model(), &LoadOptions::default()).expect("load");
    let adapters: Vec<Arc<LoraAdapter>> = (1..=3)
        .map(|seed| {
            load_adapter(
                &loaded,
                &format!("seed{seed}"),
                &common::lora_adapter_dir(seed).join("peft"),
            )
        })
        .collect();
    let qs = questions();
    // Four sequences: each adapter and the base, on different prompts, joining at different
    // steps so prefill chunks and decodes of different adapters share forwards.
    let make = |i: usize| {
        let mut s = seq(prompt(&loaded, qs[i % qs.len()]), adapters.get(i));
        s.start_step = i;
        s
    };
    let mut together: Vec<GreedySeq> = (0..4).map(make).collect();
    run(&loaded, &mut together);
    for (i, mixed) in together.iter().enumerate() {
        let mut alone = vec![make(i)];
        alone[0].start_step = 0;
        run(&loaded, &mut alone);
        assert_eq!(mixed.generated, alone[0].generated, "sequence {i}");
        assert_eq!(
            mixed.all_logits, alone[0].all_logits,
            "sequence {i}: logits"
        );
    }
    // The three adapters are different fine-tunes: not all answers coincide.
    let answers: std::collections::HashSet<_> =
        together[..3].iter().map(|s| s.generated.clone()).collect();
    assert!(answers.len() > 1, "three adapters gave identical answers");
}

#[test]
fn bad_adapters_are_refused_with_the_reason() {
    let loaded = model::load(&common::default_model(), &LoadOptions::default()).expect("load");
    let cfg = loaded.model.config();
    let dir = common::lora_adapter_dir(1);
    let err = lora::load(
        "big",
        &dir.join("peft"),
        cfg,
        &Device::Cpu,
        LoraOptions::max_rank(4),
    )
    .expect_err("rank 8 > 4");
    assert!(
        matches!(
            err,
            LoraError::RankTooLarge {
                rank: 8,
                max: 4,
                ..
            }
        ),
        "{err}"
    );

    // An adapter for another base model: one with a narrower MLP.
    let mut other = cfg.clone();
    other.intermediate_size = 1024;
    let err = lora::load(
        "other",
        &dir.join("peft"),
        &other,
        &Device::Cpu,
        LoraOptions::max_rank(64),
    )
    .expect_err("shapes");
    assert!(err.to_string().contains("another base model"), "{err}");

    // Not an adapter at all: the base model's own GGUF, and a folder without adapter files.
    let err = lora::load(
        "base",
        &common::default_model(),
        cfg,
        &Device::Cpu,
        LoraOptions::max_rank(64),
    )
    .expect_err("a model is not an adapter");
    assert!(err.to_string().contains("not a LoRA adapter"), "{err}");
    let empty = TempDir::new("ferrite-lora-test");
    let err = lora::load(
        "empty",
        empty.path(),
        cfg,
        &Device::Cpu,
        LoraOptions::max_rank(64),
    )
    .expect_err("empty folder");
    assert!(err.to_string().contains("adapter_config.json"), "{err}");

    // A PEFT folder whose config asks for DoRA.
    let dora = TempDir::new("ferrite-lora-test");
    std::fs::copy(
        dir.join("peft/adapter_model.safetensors"),
        dora.path().join("adapter_model.safetensors"),
    )
    .expect("copy");
    std::fs::write(
        dora.path().join("adapter_config.json"),
        r#"{"r": 8, "lora_alpha": 16, "use_dora": true}"#,
    )
    .expect("write");
    let err = lora::load(
        "dora",
        dora.path(),
        cfg,
        &Device::Cpu,
        LoraOptions::max_rank(64),
    )
    .expect_err("DoRA");
    assert!(err.to_string().contains("DoRA"), "{err}");
}

/// `--lora-dtype bfloat16`: the factors take half the bytes, each rounded once at load, and the
/// answers follow the f32 adapter's (the same tokens, or parting only where the f32 run's two
/// best logits are within 0.5 of each other). First-step logits within 3e-2 relative: the
/// rounding is ~0.2% of each factor, but the packed weights quantize every projection's input
/// to 8 bits, which turns last-bit changes into whole steps (packed is ~7e-2 from f32 maths).
#[test]
fn bfloat16_factors_take_half_the_memory_and_follow_the_f32_adapter() {
    let loaded = model::load(&common::default_model(), &LoadOptions::default()).expect("load");
    let peft = common::lora_adapter_dir(1).join("peft");
    let f32s = load_adapter(&loaded, "f32", &peft);
    let opts = LoraOptions {
        max_rank: 64,
        dtype: LoraDtype::Bfloat16,
    };
    let bf16s = lora::load("bf16", &peft, loaded.model.config(), &Device::Cpu, opts)
        .map(Arc::new)
        .expect("load as bfloat16");
    assert_eq!(bf16s.bytes() * 2, f32s.bytes());
    for q in questions() {
        let p = prompt(&loaded, q);
        let mut seqs = vec![seq(p.clone(), Some(&f32s)), seq(p, Some(&bf16s))];
        for s in &mut seqs {
            s.max_new_tokens = 24;
        }
        run(&loaded, &mut seqs);
        let err = common::rel_err(&seqs[1].all_logits[0], &seqs[0].all_logits[0]);
        eprintln!("{q:?}: bfloat16 factors, first-step relative logit error {err:.2e}");
        assert!(err < 3e-2, "{q}: {err}");
        let (ours, exact) = (&seqs[1].generated, &seqs[0].generated);
        let same = ours.iter().zip(exact).take_while(|(a, b)| a == b).count();
        if same < exact.len() {
            let mut top = seqs[0].all_logits[same].clone();
            top.sort_by(|a, b| b.total_cmp(a));
            let gap = top[0] - top[1];
            eprintln!("{q:?}: parts at token {same}, where f32's top two are {gap:.3} apart");
            assert!(
                gap < 0.5,
                "{q}: parts at token {same} without a near-tie ({gap})"
            );
        }
    }
}

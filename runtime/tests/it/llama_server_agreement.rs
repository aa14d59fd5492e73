//! The default runtime (packed weights, 16-bit KV cache) against llama.cpp's `llama-server` on
//! the same GGUF: ten chat prompts, greedy. llama-server's answers are recorded once by
//! `scripts/record-llama-greedy.py` (building it takes ~10 minutes), with the gap between its
//! two best log-probabilities at every step.
//!
//! Both quantize activations to 8 bits, but in different places and orders, so exact agreement
//! is not expected everywhere: a prompt must agree for at least [`MIN_AGREED`] tokens, or part
//! only at a near-tie, where either side's two best logits are within [`TIE_GAP`].

use crate::common;

use candle_core::Device;
use ferrite_runtime::kv::{KvCache, KvCacheConfig};
use ferrite_runtime::model::driver::{GreedySeq, run_greedy};
use ferrite_runtime::model::{self, LoadOptions};
use serde_json::Value;

const MIN_AGREED: usize = 16;
/// Top-two gap (in logits, which equals the gap in log-probabilities) below which the two
/// implementations' rounding may pick either token: about what 8-bit activations move a logit
/// by (`runtime_reference.rs` measures max ~1.3 against f32 over a whole answer).
const TIE_GAP: f32 = 1.0;

fn fixture() -> Value {
    let path = ferrite_testkit::kube::workspace_root()
        .join("runtime/tests/fixtures/llama_server_greedy.json");
    let text = std::fs::read_to_string(path).expect("fixture");
    serde_json::from_str(&text).expect("fixture JSON")
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|t| t.as_u64().expect("id") as u32)
        .collect()
}

fn top2_gap(logits: &[f32]) -> f32 {
    let mut v = logits.to_vec();
    v.sort_by(|a, b| b.total_cmp(a));
    v[0] - v[1]
}

#[test]
fn greedy_answers_agree_with_llama_server() {
    let fx = fixture();
    let loaded = model::load(&common::default_model(), &LoadOptions::default()).expect("load");
    let prompts = fx["prompts"].as_array().expect("prompts");
    assert_eq!(prompts.len(), 10);
    let mut seqs: Vec<GreedySeq> = prompts
        .iter()
        .map(|p| {
            let want = ids(&p["ids"]);
            // Our tokenizer must read the chat text as llama.cpp does.
            let ours = loaded
                .tokenizer
                .encode(p["text"].as_str().expect("text"), false)
                .expect("encode");
            assert_eq!(ours, want, "tokens of {:?}", p["text"]);
            let mut s = GreedySeq::new(want, ids(&p["tokens"]).len());
            s.keep_all_logits = true;
            s
        })
        .collect();
    let cfg = KvCacheConfig::for_model(loaded.model.config(), 16, 256, 0);
    let mut cache = KvCache::new(cfg, &Device::Cpu).expect("cache");
    run_greedy(&loaded.model, &mut cache, &mut seqs, 64).expect("run");

    let mut exact = 0;
    for (p, s) in prompts.iter().zip(&seqs) {
        let theirs = ids(&p["tokens"]);
        let same = s
            .generated
            .iter()
            .zip(&theirs)
            .take_while(|(a, b)| a == b)
            .count();
        let question = p["question"].as_str().unwrap_or_default();
        let ours_text = loaded.tokenizer.decode(&s.generated, true).expect("decode");
        if same == theirs.len() {
            exact += 1;
            eprintln!("{question:?}: all {same} tokens agree: {ours_text:?}");
            continue;
        }
        let our_gap = top2_gap(&s.all_logits[same]);
        let their_gap = p["top2_gaps"][same].as_f64().unwrap_or(f64::INFINITY) as f32;
        eprintln!(
            "{question:?}: {same} tokens agree, then top-two gaps ours {our_gap:.3}, \
             llama.cpp's {their_gap:.3}\n  ours:      {ours_text:?}\n  llama.cpp: {:?}",
            p["answer"]
        );
        assert!(
            same >= MIN_AGREED || our_gap.min(their_gap) < TIE_GAP,
            "{question:?} parts from llama.cpp at token {same} where neither side has a \
             near-tie (gaps {our_gap}, {their_gap}): ours {ours_text:?}, llama.cpp's {:?}",
            p["answer"]
        );
    }
    eprintln!("{exact} of 10 answers identical to llama.cpp's");
}

//! llama.cpp's SentencePiece tokenizer (`tokenizer.ggml.model = "llama"`: Llama 2, Mistral 7B,
//! Phi-3, Gemma) as a `tokenizers` BPE. llama.cpp starts from the text's characters and keeps
//! merging the adjacent pair whose concatenation is the vocabulary's highest-scoring piece;
//! a BPE whose merge list is every split of every piece into two pieces, ranked by the merged
//! piece's score, merges in the same order. Characters outside the vocabulary fall back to
//! their `<0xNN>` byte pieces, as llama.cpp does. Spaces are `▁`; with
//! `tokenizer.ggml.add_space_prefix` (default true) every stretch of text gets one in front,
//! as llama.cpp gives one to the text after each special token.

use std::collections::{HashMap, HashSet};

use candle_core::quantized::gguf_file::Value;
use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::models::bpe::BPE;
use tokenizers::normalizers::{Prepend, Replace, Sequence as NormalizerSequence};
use tokenizers::{DecoderWrapper, NormalizerWrapper};

use super::{ModelError, tok_err};

/// SentencePiece's word-boundary mark, standing for a space.
const SPACE: &str = "\u{2581}";

/// GGUF token types that text can be made of (normal, user-defined, byte); control and unused
/// pieces are never the result of a merge.
fn mergeable(ty: i64) -> bool {
    matches!(ty, 1 | 4 | 6)
}

/// The merges that reproduce llama.cpp's order: every split of a normal or user-defined piece
/// into two pieces of the vocabulary, the highest-scoring merged piece first (ties by id).
pub fn merges(tokens: &[&String], types: &[i64], scores: &[f32]) -> Vec<(String, String)> {
    let pieces: HashSet<&str> = tokens
        .iter()
        .enumerate()
        .filter(|(i, _)| mergeable(types.get(*i).copied().unwrap_or(1)))
        .map(|(_, t)| t.as_str())
        .collect();
    let mut ranked: Vec<(f32, usize, &str, &str)> = Vec::new();
    for (id, piece) in tokens.iter().enumerate() {
        if !matches!(types.get(id).copied().unwrap_or(1), 1 | 4) {
            continue;
        }
        for (at, _) in piece.char_indices().skip(1) {
            let (a, b) = piece.split_at(at);
            if pieces.contains(a) && pieces.contains(b) {
                let score = scores.get(id).copied().unwrap_or(0.0);
                ranked.push((score, id, a, b));
            }
        }
    }
    ranked.sort_by(|x, y| y.0.total_cmp(&x.0).then(x.1.cmp(&y.1)));
    ranked
        .into_iter()
        .map(|(_, _, a, b)| (a.to_string(), b.to_string()))
        .collect()
}

pub fn from_gguf(
    md: &HashMap<String, Value>,
    tokens: &[&String],
    types: &[i64],
) -> Result<tokenizers::Tokenizer, ModelError> {
    let scores: Vec<f32> = match md.get("tokenizer.ggml.scores") {
        Some(Value::Array(a)) => a.iter().map(|v| v.to_f32().unwrap_or(0.0)).collect(),
        _ => {
            return Err(ModelError::MissingMetadata(
                "tokenizer.ggml.scores".to_string(),
            ));
        }
    };
    if scores.len() != tokens.len() {
        return Err(ModelError::InvalidMetadata(
            "tokenizer.ggml.scores".to_string(),
        ));
    }
    let vocab: tokenizers::models::bpe::Vocab = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| ((*t).clone(), i as u32))
        .collect();
    let mut bpe = BPE::builder()
        .vocab_and_merges(vocab, merges(tokens, types, &scores))
        .byte_fallback(true);
    let unk = md
        .get("tokenizer.ggml.unknown_token_id")
        .and_then(|v| v.to_u32().ok())
        .and_then(|id| tokens.get(id as usize));
    if let Some(unk) = unk {
        bpe = bpe.unk_token((*unk).clone());
    }
    let mut inner = tokenizers::Tokenizer::new(bpe.build().map_err(tok_err)?);
    let add_space_prefix = md
        .get("tokenizer.ggml.add_space_prefix")
        .and_then(|v| v.to_bool().ok())
        .unwrap_or(true);
    let spaces: NormalizerWrapper = Replace::new(" ", SPACE).map_err(tok_err)?.into();
    let normalizer: NormalizerWrapper = if add_space_prefix {
        NormalizerSequence::new(vec![Prepend::new(SPACE.into()).into(), spaces]).into()
    } else {
        spaces
    };
    inner.with_normalizer(Some(normalizer)).map_err(tok_err)?;
    let mut decoders: Vec<DecoderWrapper> = vec![
        Replace::new(SPACE, " ").map_err(tok_err)?.into(),
        ByteFallback::new().into(),
        Fuse::new().into(),
    ];
    if add_space_prefix {
        decoders.push(Strip::new(' ', 1, 0).into());
    }
    inner.with_decoder(Some(DecoderSequence::new(decoders)));
    Ok(inner)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merges_follow_the_merged_pieces_scores() {
        let pieces = ["a", "b", "c", "ab", "bc", "abc", "<0x61>", "<s>"];
        let tokens: Vec<String> = pieces.iter().map(|s| s.to_string()).collect();
        let refs: Vec<&String> = tokens.iter().collect();
        let types = [1, 1, 1, 1, 1, 1, 6, 3];
        let scores = [0.0, 0.0, 0.0, -3.0, -1.0, -2.0, 0.0, 0.0];
        let got = merges(&refs, &types, &scores);
        let pair = |a: &str, b: &str| (a.to_string(), b.to_string());
        // "bc" scores highest, then "abc" (from "a"+"bc" or "ab"+"c"), then "ab".
        assert_eq!(
            got,
            vec![
                pair("b", "c"),
                pair("a", "bc"),
                pair("ab", "c"),
                pair("a", "b")
            ]
        );
    }
}

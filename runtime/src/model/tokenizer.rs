//! Tokenizer: a Hugging Face `tokenizer.json`, or one rebuilt from GGUF metadata: byte-level
//! BPE (`gpt2`) or SentencePiece (`llama`).

use std::collections::HashMap;
use std::path::Path;

use candle_core::quantized::gguf_file::Value;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, SplitDelimiterBehavior};

use super::ModelError;

mod sentencepiece;

/// Llama 3 / Qwen2 style pre-tokenizer split (contractions, letters, 1-3 digits, punctuation,
/// newlines, spaces).
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Text <-> token ids, plus the special tokens the engine and chat template need.
#[derive(Debug, Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    bos: Option<u32>,
    eos: Vec<u32>,
    add_bos: bool,
}

/// Tokens that end a turn in the chat formats people run, whatever the checkpoint names as its
/// EOS: llama.cpp stops on each of them too (Gemma's GGUFs name `<eos>` and rely on
/// `<end_of_turn>` being found this way; Llama 3's `<|eot_id|>`, ChatML's `<|im_end|>`).
const END_OF_TURN: [&str; 9] = [
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<EOT>",
    "<|end_of_text|>",
    "<end_of_utterance>",
];

fn tok_err(e: impl std::fmt::Display) -> ModelError {
    ModelError::Tokenizer(e.to_string())
}

impl Tokenizer {
    /// Loads `tokenizer.json`. Special-token ids come from the model config, which the caller
    /// passes in (Hugging Face keeps them in `config.json` / `generation_config.json`).
    pub fn from_file(path: &Path, bos: Option<u32>, eos: Vec<u32>) -> Result<Self, ModelError> {
        let inner = tokenizers::Tokenizer::from_file(path)
            .map_err(|e| ModelError::Tokenizer(format!("{}: {e}", path.display())))?;
        Ok(Self {
            inner,
            bos,
            eos,
            // A tokenizer.json carries its own post-processor for BOS.
            add_bos: false,
        }
        .with_end_of_turn_tokens())
    }

    /// Adds the vocabulary's [`END_OF_TURN`] tokens to the ids that end generation.
    fn with_end_of_turn_tokens(mut self) -> Self {
        for text in END_OF_TURN {
            if let Some(id) = self.inner.token_to_id(text)
                && !self.eos.contains(&id)
            {
                self.eos.push(id);
            }
        }
        self
    }

    /// Rebuilds the tokenizer described by GGUF `tokenizer.ggml.*` metadata.
    pub fn from_gguf(md: &HashMap<String, Value>) -> Result<Self, ModelError> {
        let get = |k: &str| {
            md.get(k)
                .ok_or_else(|| ModelError::MissingMetadata(k.to_string()))
        };
        let model = get("tokenizer.ggml.model")?.to_string().map_err(tok_err)?;
        let tokens = get("tokenizer.ggml.tokens")?.to_vec().map_err(tok_err)?;
        let tokens: Vec<&String> = tokens
            .iter()
            .map(|v| v.to_string())
            .collect::<Result<_, _>>()
            .map_err(tok_err)?;
        let types: Vec<i64> = match md.get("tokenizer.ggml.token_type") {
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| v.to_i32().map(i64::from).unwrap_or(1))
                .collect(),
            _ => vec![1; tokens.len()],
        };
        let mut inner = match model.as_str() {
            "gpt2" => byte_level_bpe(md, &tokens)?,
            "llama" => sentencepiece::from_gguf(md, &tokens, &types)?,
            other => {
                return Err(ModelError::Unsupported(format!(
                    "GGUF tokenizer model '{other}' (rebuilt from metadata: byte-level BPE, \
                     'gpt2', and SentencePiece, 'llama'; put a tokenizer.json next to the model \
                     or pass --tokenizer)"
                )));
            }
        };
        // Control (3) and user-defined (4) tokens must never be split by BPE.
        let specials: Vec<AddedToken> = tokens
            .iter()
            .zip(&types)
            .filter(|(_, ty)| matches!(ty, 3 | 4))
            .map(|(t, _)| AddedToken::from((*t).clone(), true))
            .collect();
        inner.add_special_tokens(specials).map_err(tok_err)?;
        let id = |k: &str| md.get(k).and_then(|v| v.to_u32().ok());
        let bos = id("tokenizer.ggml.bos_token_id");
        let mut eos: Vec<u32> = id("tokenizer.ggml.eos_token_id").into_iter().collect();
        if let Some(eot) = id("tokenizer.ggml.eot_token_id")
            && !eos.contains(&eot)
        {
            eos.push(eot);
        }
        let add_bos = md
            .get("tokenizer.ggml.add_bos_token")
            .and_then(|v| v.to_bool().ok())
            .unwrap_or(false);
        Ok(Self {
            inner,
            bos,
            eos,
            add_bos,
        }
        .with_end_of_turn_tokens())
    }

    /// Encodes text. Special-token strings in `text` (e.g. `<|im_start|>`) become their ids,
    /// which is what a rendered chat template needs.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, ModelError> {
        let enc = self
            .inner
            .encode(text, add_special_tokens)
            .map_err(tok_err)?;
        let mut ids = enc.get_ids().to_vec();
        if add_special_tokens
            && self.add_bos
            && let Some(bos) = self.bos
            && ids.first() != Some(&bos)
        {
            ids.insert(0, bos);
        }
        Ok(ids)
    }

    /// Writes the tokenizer as a Hugging Face `tokenizer.json` (e.g. to pair a GGUF's
    /// vocabulary with tools that expect the file).
    pub fn save_json(&self, path: &Path) -> Result<(), ModelError> {
        self.inner.save(path, false).map_err(tok_err)
    }

    /// Every token's bytes, by id, as the grammar engine needs them: byte-level and
    /// SentencePiece pieces turned back into the bytes they stand for, special tokens marked
    /// with a leading 0xFF (llguidance's convention), so no text can spell them.
    pub fn token_bytes(&self) -> Result<Vec<Vec<u8>>, ModelError> {
        let json = serde_json::to_value(&self.inner).map_err(tok_err)?;
        let mut words = llguidance::token_bytes_from_tokenizer_json(&json).map_err(tok_err)?;
        words.resize(self.vocab_size(), Vec::new());
        Ok(words)
    }

    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, ModelError> {
        self.inner.decode(ids, skip_special_tokens).map_err(tok_err)
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    pub fn bos_token_id(&self) -> Option<u32> {
        self.bos
    }

    pub fn eos_token_ids(&self) -> &[u32] {
        &self.eos
    }

    /// Text of a token id, for the chat template's `bos_token` / `eos_token` variables.
    pub fn token_text(&self, id: Option<u32>) -> String {
        id.and_then(|i| self.id_to_token(i)).unwrap_or_default()
    }
}

/// The byte-level BPE of `tokenizer.ggml.model = "gpt2"`: the merges as they are, and the
/// pre-tokenizer `tokenizer.ggml.pre` names.
fn byte_level_bpe(
    md: &HashMap<String, Value>,
    tokens: &[&String],
) -> Result<tokenizers::Tokenizer, ModelError> {
    let merges = md
        .get("tokenizer.ggml.merges")
        .ok_or_else(|| ModelError::MissingMetadata("tokenizer.ggml.merges".into()))?
        .to_vec()
        .map_err(tok_err)?;
    let mut merge_pairs = Vec::with_capacity(merges.len());
    for m in merges {
        let m = m.to_string().map_err(tok_err)?;
        let (a, b) = m
            .split_once(' ')
            .ok_or_else(|| ModelError::Tokenizer(format!("malformed merge '{m}'")))?;
        merge_pairs.push((a.to_string(), b.to_string()));
    }
    let vocab: tokenizers::models::bpe::Vocab = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| ((*t).clone(), i as u32))
        .collect();
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merge_pairs)
        .build()
        .map_err(tok_err)?;
    let mut inner = tokenizers::Tokenizer::new(bpe);
    let byte_level = ByteLevel::new(false, true, true);
    let pre: PreTokenizerWrapper = match md
        .get("tokenizer.ggml.pre")
        .and_then(|v| v.to_string().ok())
        .map(String::as_str)
    {
        Some("smollm") => Sequence::new(vec![Digits::new(true).into(), byte_level.into()]).into(),
        Some("llama-bpe" | "llama3" | "qwen2" | "smaug-bpe" | "dbrx") => {
            let split = Split::new(
                SplitPattern::Regex(LLAMA3_SPLIT.into()),
                SplitDelimiterBehavior::Isolated,
                false,
            )
            .map_err(tok_err)?;
            Sequence::new(vec![
                split.into(),
                ByteLevel::new(false, true, false).into(),
            ])
            .into()
        }
        _ => byte_level.into(),
    };
    inner.with_pre_tokenizer(Some(pre));
    inner.with_decoder(Some(ByteLevelDecoder::default()));
    Ok(inner)
}

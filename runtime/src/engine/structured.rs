//! Structured outputs (constrained decoding): a request may carry a grammar — a JSON schema,
//! any JSON object, a regular expression, a choice of strings or a Lark grammar — and then the
//! sampler only picks tokens that keep the output inside it. The grammar engine is
//! `llguidance` (the one vLLM, SGLang and llama.cpp use); this module adapts it to the
//! tokenizer and keeps each request's work within fixed limits.
//!
//! [`Grammars`] is built once per model (the token trie of the vocabulary); [`Grammars::compile`]
//! turns a [`GrammarSpec`] into a [`Guide`], one per sequence, which the engine asks for a
//! token mask before sampling and tells the sampled token after.

use std::sync::Arc;

use llguidance::api::{ParserLimits, TopLevelGrammar};
use llguidance::toktrie::{self, SimpleVob, TokRxInfo, TokTrie, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};

use crate::model::Tokenizer;

/// What a request constrains its output to.
#[derive(Debug, Clone, PartialEq)]
pub enum GrammarSpec {
    /// A JSON value valid under this JSON schema.
    JsonSchema(serde_json::Value),
    /// Any JSON object (`response_format: {"type": "json_object"}`).
    JsonObject,
    /// Text matching this regular expression, whole.
    Regex(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
    /// A grammar in llguidance's Lark syntax.
    Lark(String),
}

/// Whitespace a JSON output may put between tokens: none, a space, or one line break and up
/// to 20 spaces or tabs of indentation (llama.cpp's JSON grammar allows the same). Unbounded
/// whitespace would let a model pad its output with blank lines until `max_tokens` runs out,
/// leaving invalid JSON.
const JSON_WHITESPACE: &str = r"[ ]?|\n[ \t]{0,20}";

/// Most bytes of text a choice list may hold (with the request body's own limit, this bounds
/// the grammar a choice list becomes).
pub const MAX_CHOICE_BYTES: usize = 64 * 1024;

/// Why a grammar cannot be used; the API answers 400 with the text.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum StructuredError {
    #[error("structured outputs are not available for this model: {0}")]
    Unavailable(String),
    #[error("{0}")]
    Invalid(String),
    #[error("the grammar stopped accepting tokens: {0}")]
    Stuck(String),
}

/// The tokenizer as llguidance sees it: every token's bytes in a trie, and a way to tokenize
/// text (used to turn literal strings of a grammar into tokens).
struct Vocabulary {
    trie: TokTrie,
    tokenizer: Tokenizer,
}

impl TokenizerEnv for Vocabulary {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<toktrie::TokenId> {
        // Bytes that are not whole UTF-8 (a grammar may split a character) go through the
        // trie's greedy split, which any vocabulary with byte tokens can represent.
        std::str::from_utf8(s)
            .ok()
            .and_then(|text| self.tokenizer.encode(text, false).ok())
            .unwrap_or_else(|| self.trie.greedy_tokenize(s))
    }
}

/// The grammar compiler for one model's vocabulary.
pub struct Grammars {
    factory: ParserFactory,
}

impl std::fmt::Debug for Grammars {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammars")
            .field(
                "vocab_size",
                &self.factory.tok_env().tok_trie().vocab_size(),
            )
            .finish()
    }
}

/// Limits on what one request's grammar may cost. llguidance's defaults allow up to 250,000
/// lexer states (~1-2 kB each) per request; a hostile schema could make every request of a
/// full batch hold that, so states are held to 20,000 (tens of MB at most) and each mask to
/// llguidance's default step fuel (a few ms).
fn limits() -> ParserLimits {
    ParserLimits {
        max_lexer_states: 20_000,
        max_grammar_size: 200_000,
        // Errors go back to clients: the grammar and the tokens so far are theirs already,
        // and they would make an error message as large as the schema.
        verbose_errors: false,
        ..ParserLimits::default()
    }
}

impl Grammars {
    /// Builds the trie of `tokenizer`'s vocabulary for logit rows `logits_width` wide (a model
    /// may have more rows than the tokenizer has tokens; those are never allowed). `eos` are the
    /// token ids that end a sequence; a finished grammar allows exactly those.
    pub fn new(
        tokenizer: &Tokenizer,
        logits_width: usize,
        eos: &[u32],
    ) -> Result<Self, StructuredError> {
        let unavailable = |e: &dyn std::fmt::Display| StructuredError::Unavailable(e.to_string());
        let mut words = tokenizer.token_bytes().map_err(|e| unavailable(&e))?;
        words.resize(logits_width, Vec::new());
        let vocab_size = u32::try_from(logits_width).map_err(|e| unavailable(&e))?;
        let eos: Vec<u32> = eos.iter().copied().filter(|&t| t < vocab_size).collect();
        let Some(&first_eos) = eos.first() else {
            return Err(unavailable(&"the model has no end-of-sequence token"));
        };
        let info = TokRxInfo {
            tok_bos: tokenizer.bos_token_id().filter(|&t| t < vocab_size),
            ..TokRxInfo::new(vocab_size, first_eos)
        };
        let trie = TokTrie::from(&info, &words).with_eos_tokens(&eos);
        let env: toktrie::TokEnv = Arc::new(Vocabulary {
            trie,
            tokenizer: tokenizer.clone(),
        });
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| unavailable(&e))?;
        // llguidance logs grammar warnings to stderr by default; errors reach the client.
        factory.quiet();
        *factory.limits_mut() = limits();
        Ok(Self { factory })
    }

    /// Compiles `spec` into a guide for one sequence. Costs up to tens of milliseconds for a
    /// large schema: call it off the engine thread and off the async workers.
    pub fn compile(&self, spec: &GrammarSpec) -> Result<Guide, StructuredError> {
        let grammar = top_level(spec)?;
        let parser = self
            .factory
            .create_parser(grammar)
            .map_err(|e| StructuredError::Invalid(message(e)))?;
        let mut guide = Guide {
            matcher: Matcher::new(Ok(parser)),
        };
        if let Some(e) = guide.matcher.get_error() {
            return Err(StructuredError::Invalid(e));
        }
        // The first mask here, not on the engine thread: a grammar whose lexer blows past the
        // limits usually does so at once, and that is the client's error (400), not a failed
        // generation. The engine's first mask then comes from the parser's cache.
        guide.mask().map_err(|e| {
            StructuredError::Invalid(format!(
                "the grammar cannot start within this server's limits: {e}"
            ))
        })?;
        Ok(guide)
    }
}

/// The llguidance grammar for `spec`.
fn top_level(spec: &GrammarSpec) -> Result<TopLevelGrammar, StructuredError> {
    Ok(match spec {
        GrammarSpec::JsonSchema(schema) => {
            TopLevelGrammar::from_json_schema(with_whitespace(schema))
        }
        GrammarSpec::JsonObject => {
            TopLevelGrammar::from_json_schema(with_whitespace(&serde_json::json!({
                "type": "object"
            })))
        }
        GrammarSpec::Regex(rx) => TopLevelGrammar::from_regex(rx),
        GrammarSpec::Choice(choices) => {
            if choices.is_empty() {
                return Err(StructuredError::Invalid(
                    "the choice list is empty".to_string(),
                ));
            }
            let bytes: usize = choices.iter().map(String::len).sum();
            if bytes > MAX_CHOICE_BYTES {
                return Err(StructuredError::Invalid(format!(
                    "the choices hold {bytes} bytes; at most {MAX_CHOICE_BYTES} are accepted"
                )));
            }
            let alternatives: Vec<String> = choices
                .iter()
                .map(|c| serde_json::Value::String(c.clone()).to_string())
                .collect();
            TopLevelGrammar::from_lark(format!("start: {}", alternatives.join(" | ")))
        }
        GrammarSpec::Lark(grammar) => TopLevelGrammar::from_lark(grammar.clone()),
    })
}

/// The schema with this server's JSON whitespace rule, unless the schema sets its own through
/// llguidance's `x-guidance` options.
fn with_whitespace(schema: &serde_json::Value) -> serde_json::Value {
    let serde_json::Value::Object(fields) = schema else {
        // `true` (anything) is a schema too; llguidance reads it as written.
        return schema.clone();
    };
    let mut fields = fields.clone();
    if !fields.contains_key("x-guidance") {
        fields.insert(
            "x-guidance".to_string(),
            serde_json::json!({ "whitespace_pattern": JSON_WHITESPACE }),
        );
    }
    serde_json::Value::Object(fields)
}

/// One sequence's grammar state.
pub struct Guide {
    matcher: Matcher,
}

/// llguidance's message without the marker it appends when verbose errors are off.
fn message(e: impl std::fmt::Display) -> String {
    e.to_string()
        .replace("\n<non-verbose/>", "")
        .trim_end()
        .to_string()
}

impl std::fmt::Debug for Guide {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Guide")
            .field("stopped", &self.matcher.is_stopped())
            .finish()
    }
}

impl Clone for Guide {
    /// An independent copy (for the `n` choices of one request).
    fn clone(&self) -> Self {
        Self {
            matcher: self.matcher.deep_clone(),
        }
    }
}

/// The tokens a guide allows next.
#[derive(Debug, Clone)]
pub struct TokenMask(SimpleVob);

impl TokenMask {
    /// Sets every logit the mask does not allow (and any past its end) to -inf.
    pub fn apply(&self, logits: &mut [f32]) {
        let allowed = self.0.len().min(logits.len());
        for (i, l) in logits[..allowed].iter_mut().enumerate() {
            if !self.0.is_allowed(i as u32) {
                *l = f32::NEG_INFINITY;
            }
        }
        logits[allowed..].fill(f32::NEG_INFINITY);
    }

    pub fn is_allowed(&self, token: u32) -> bool {
        (token as usize) < self.0.len() && self.0.is_allowed(token)
    }
}

impl Guide {
    /// The tokens that keep the output inside the grammar (the end-of-sequence tokens among
    /// them once the output is complete). Takes up to a few milliseconds.
    pub fn mask(&mut self) -> Result<TokenMask, StructuredError> {
        let mask = self
            .matcher
            .compute_mask_or_eos()
            .map_err(|e| StructuredError::Stuck(message(e)))?;
        if mask.is_zero() {
            return Err(StructuredError::Stuck(
                "no token can continue the output".to_string(),
            ));
        }
        Ok(TokenMask(mask))
    }

    /// Advances past the sampled token.
    pub fn accept(&mut self, token: u32) -> Result<(), StructuredError> {
        self.matcher
            .consume_token(token)
            .map_err(|e| StructuredError::Stuck(message(e)))
    }

    /// Whether the grammar is complete and allows nothing more (the sequence ends here).
    pub fn is_finished(&self) -> bool {
        self.matcher.is_stopped()
    }
}

//! Incremental detokenization: each new token costs a decode of a short window, not of the
//! whole output, and a multi-byte character split across tokens is released only once whole.

use crate::model::{ModelError, Tokenizer};

/// Tracks which output tokens have been turned into text (the prefix/read offsets of vLLM and
/// TGI): decoding a window that starts a few tokens back keeps byte-level merges and leading
/// spaces right.
#[derive(Debug, Clone, Default)]
pub struct IncrementalDecoder {
    prefix: usize,
    read: usize,
}

impl IncrementalDecoder {
    /// Text released by the newest token of `tokens` (the output so far); empty while a
    /// character is incomplete.
    pub fn next(&mut self, tok: &Tokenizer, tokens: &[u32]) -> Result<String, ModelError> {
        let before = tok.decode(&tokens[self.prefix..self.read], true)?;
        let after = tok.decode(&tokens[self.prefix..], true)?;
        if after.len() > before.len()
            && !after.ends_with('\u{FFFD}')
            && let Some(delta) = after.get(before.len()..)
        {
            self.prefix = self.read;
            self.read = tokens.len();
            return Ok(delta.to_string());
        }
        Ok(String::new())
    }
}

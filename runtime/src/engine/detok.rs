//! Incremental detokenization: each new token costs a decode of a short window, not of the
//! whole output, and a multi-byte character split across tokens is released only once whole.

use crate::model::{ModelError, Tokenizer};

/// Most tokens held back waiting for a character to complete. UTF-8 characters are at most
/// four bytes and byte-level tokens at least one, so a real character completes well within
/// this; a model that emits bytes that never form one (a hostile prompt can ask for that) has
/// them released as U+FFFD instead of growing the window, and the cost of every later token.
pub const MAX_HELD_TOKENS: usize = 8;

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
        let waited_enough = tokens.len() - self.read >= MAX_HELD_TOKENS;
        if after.len() > before.len()
            && (!after.ends_with('\u{FFFD}') || waited_enough)
            && let Some(delta) = after.get(before.len()..)
        {
            self.prefix = self.read;
            self.read = tokens.len();
            return Ok(delta.to_string());
        }
        if waited_enough {
            // Nothing new to show (the window decodes to no more text): move on all the same.
            self.prefix = self.read;
            self.read = tokens.len();
        }
        Ok(String::new())
    }
}

//! How much a request asks of a replica, in tokens: what [`crate::load`] weighs open requests
//! by, so that a replica prefilling a 1,000-token prompt does not count the same as one
//! answering a greeting.
//!
//! The router has no tokenizer, so a prompt's tokens are estimated from its characters
//! ([`CHARS_PER_TOKEN`], about right for English under the BPE vocabularies served here);
//! token-id prompts count exactly. The output counts at its most: `max_tokens` (or
//! `max_completion_tokens`) times `n`, or [`DEFAULT_MAX_TOKENS`] when the request does not
//! say. For an event stream, the load bookkeeping (`load::Open`) lets the prompt go once the
//! first token arrives (its prefill is done) and the output go token by token; a response
//! that is not streamed counts in full until it ends.

/// Characters per token when estimating a prompt's length.
pub const CHARS_PER_TOKEN: f64 = 4.0;

/// Output tokens counted for a request that does not set `max_tokens`.
pub const DEFAULT_MAX_TOKENS: f64 = 256.0;

/// Tokens added per chat message for its role and the template's markers.
pub const PER_MESSAGE: f64 = 4.0;

/// A request's estimated work, in tokens.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Work {
    /// Prompt tokens to prefill.
    pub prompt: f64,
    /// The most tokens it may generate, over all its choices.
    pub output: f64,
}

impl Work {
    /// Prompt and output; at least 1.
    pub fn total(self) -> f64 {
        (self.prompt + self.output).max(1.0)
    }
}

/// The estimated tokens of a prompt text.
pub fn text_tokens(s: &str) -> f64 {
    s.chars().count() as f64 / CHARS_PER_TOKEN
}

/// A request's work from its prompt's estimated tokens, `max_tokens` (or
/// `max_completion_tokens`) and `n`, as [`crate::parse`] reads them.
pub fn estimate(prompt: f64, max_tokens: Option<f64>, n: Option<f64>) -> Work {
    let max_tokens = max_tokens
        .filter(|m| m.is_finite() && *m >= 0.0)
        .unwrap_or(DEFAULT_MAX_TOKENS);
    let n = n.filter(|n| n.is_finite() && *n >= 1.0).unwrap_or(1.0);
    Work {
        prompt,
        output: max_tokens * n,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Value, json};

    fn estimate(body: &Value) -> Work {
        crate::parse::parse(body.to_string().as_bytes(), 16)
            .expect("parses")
            .work
    }

    #[test]
    fn a_long_prompt_weighs_more_than_a_short_one() {
        let long = json!({"prompt": "word ".repeat(800), "max_tokens": 128});
        let short = json!({"prompt": "word ".repeat(40), "max_tokens": 32});
        assert_eq!(
            estimate(&long),
            Work {
                prompt: 1000.0,
                output: 128.0
            }
        );
        assert_eq!(estimate(&short).total(), 50.0 + 32.0);
    }

    #[test]
    fn chat_messages_token_ids_and_choices() {
        let chat = json!({
            "messages": [
                {"role": "system", "content": "x".repeat(400)},
                {"role": "user", "content": [{"type": "text", "text": "y".repeat(40)}]},
            ],
            "max_completion_tokens": 10,
            "n": 2,
        });
        assert_eq!(
            estimate(&chat),
            Work {
                prompt: 4.0 + 100.0 + 4.0 + 10.0,
                output: 20.0
            }
        );
        let ids = json!({"prompt": [[1, 2, 3], [4, 5]], "max_tokens": 0});
        assert_eq!(estimate(&ids).total(), 5.0);
        let flat = json!({"prompt": [1, 2, 3, 4]});
        assert_eq!(estimate(&flat).total(), 4.0 + DEFAULT_MAX_TOKENS);
    }

    #[test]
    fn nonsense_still_weighs_something() {
        for body in [
            json!({}),
            json!({"prompt": 7, "max_tokens": -5, "n": "two"}),
            json!({"prompt": "", "max_tokens": 0}),
        ] {
            let w = estimate(&body).total();
            assert!(w.is_finite() && w >= 1.0, "{body}: {w}");
        }
    }
}

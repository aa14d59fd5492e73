//! The prefix key of a request: what [`crate::policy`] hashes so that requests sharing a
//! prompt prefix (a tenant's system prompt, the earlier turns of a conversation) meet on the
//! replica whose prefix cache holds it.
//!
//! The key is the first `chars` characters of the prompt as the server will see it, before
//! tokenization (the router has no tokenizer, and characters are a stable stand-in for
//! tokens): the `prompt` of a completion (the first prompt of a batch; token-id prompts as
//! their numbers), or a chat's messages in order as `role: content` lines, so two
//! conversations with the same system prompt share a key as long as the system prompt is
//! longer than `chars`. [`crate::parse`] reads the body and feeds this builder.

/// A key being built: text is appended until it holds `cap` characters.
#[derive(Debug, Clone)]
pub struct KeyBuilder {
    out: String,
    have: usize,
    cap: usize,
}

impl KeyBuilder {
    pub fn new(cap: usize) -> Self {
        KeyBuilder {
            out: String::new(),
            have: 0,
            cap,
        }
    }

    /// Appends as much of `s` as fits.
    pub fn push(&mut self, s: &str) {
        for c in s.chars().take(self.cap - self.have.min(self.cap)) {
            self.out.push(c);
            self.have += 1;
        }
    }

    /// Appends a token id as its number and a space.
    pub fn push_id(&mut self, id: u64) {
        if !self.is_full() {
            self.push(&id.to_string());
            self.push(" ");
        }
    }

    pub fn is_full(&self) -> bool {
        self.have >= self.cap
    }

    /// The key, or `None` when the request had no prompt to speak of.
    pub fn finish(self) -> Option<String> {
        (!self.out.is_empty()).then_some(self.out)
    }
}

#[cfg(test)]
mod tests {
    use crate::parse::parse;
    use serde_json::{Value, json};

    fn key(body: &Value, chars: usize) -> Option<String> {
        parse(body.to_string().as_bytes(), chars)
            .expect("parses")
            .key
    }

    #[test]
    fn completions_use_the_start_of_the_prompt() {
        let b = json!({"model": "m", "prompt": "Once upon a time, there was"});
        assert_eq!(key(&b, 9).as_deref(), Some("Once upon"));
        assert_eq!(
            key(&b, 1000).as_deref(),
            Some("Once upon a time, there was")
        );
        let batch = json!({"prompt": ["first prompt", "second"]});
        assert_eq!(key(&batch, 5).as_deref(), Some("first"));
        let ids = json!({"prompt": [101, 2023, 2003]});
        assert_eq!(key(&ids, 100).as_deref(), Some("101 2023 2003 "));
        let batch_ids = json!({"prompt": [[7, 8], [9]]});
        assert_eq!(key(&batch_ids, 100).as_deref(), Some("7 8 "));
        let wide = json!({"prompt": "ééééé"});
        assert_eq!(key(&wide, 3).as_deref(), Some("ééé"));
    }

    #[test]
    fn chats_share_a_key_while_the_system_prompt_covers_it() {
        let system = "You are the billing assistant of ACME. ".repeat(10);
        let a = json!({"messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": "Why was I charged twice?"},
        ]});
        let b = json!({"messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": "Cancel my plan"},
        ]});
        assert_eq!(key(&a, 200), key(&b, 200));
        assert_ne!(key(&a, 2000), key(&b, 2000));
        let k = key(&a, 30).expect("key");
        assert!(k.starts_with("system: You are the billing"), "{k}");
        assert_eq!(k.chars().count(), 30);
    }

    #[test]
    fn text_parts_count_and_empty_requests_have_no_key() {
        let parts = json!({"messages": [{"role": "user", "content": [
            {"type": "text", "text": "hello"},
            {"type": "image_url", "image_url": {"url": "x"}},
            {"type": "text", "text": " world"},
        ]}]});
        assert_eq!(key(&parts, 100).as_deref(), Some("user: hello world\n"));
        assert_eq!(key(&json!({"model": "m"}), 100), None);
        assert_eq!(key(&json!({"prompt": ""}), 100), None);
        assert_eq!(key(&json!({"prompt": 5}), 100), None);
    }
}

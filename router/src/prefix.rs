//! The prefix key of a request: what [`crate::policy`] hashes so that requests sharing a
//! prompt prefix (a tenant's system prompt, the earlier turns of a conversation) meet on the
//! replica whose prefix cache holds it.
//!
//! The key is the first `chars` characters of the prompt as the server will see it, before
//! tokenization (the router has no tokenizer, and characters are a stable stand-in for
//! tokens): the `prompt` of a completion (the first prompt of a batch; token-id prompts as
//! their numbers), or a chat's messages in order as `role: content` lines, so two
//! conversations with the same system prompt share a key as long as the system prompt is
//! longer than `chars`.

use serde_json::Value;

/// The key of an OpenAI request body, or `None` when it has no prompt to speak of.
pub fn key(body: &Value, chars: usize) -> Option<String> {
    let mut out = String::new();
    if let Some(messages) = body.get("messages").and_then(Value::as_array) {
        for m in messages {
            let role = m.get("role").and_then(Value::as_str).unwrap_or("");
            push(&mut out, role, chars);
            push(&mut out, ": ", chars);
            for t in texts(m.get("content")) {
                push(&mut out, t, chars);
            }
            push(&mut out, "\n", chars);
            if out.chars().count() >= chars {
                break;
            }
        }
    } else {
        match body.get("prompt") {
            Some(Value::String(s)) => push(&mut out, s, chars),
            Some(Value::Array(items)) => match items.first() {
                Some(Value::String(s)) => push(&mut out, s, chars),
                Some(Value::Number(_)) => tokens(&mut out, items, chars),
                Some(Value::Array(first)) => tokens(&mut out, first, chars),
                _ => {}
            },
            _ => {}
        }
    }
    (!out.is_empty()).then_some(out)
}

/// Appends as much of `s` as fits in `chars` characters in all.
fn push(out: &mut String, s: &str, chars: usize) {
    let have = out.chars().count();
    out.extend(s.chars().take(chars.saturating_sub(have)));
}

/// The text of a message's content: a string, or the text parts of a list of parts. The key
/// and the work estimate (`work`) read a message the same way.
pub fn texts(content: Option<&Value>) -> impl Iterator<Item = &str> {
    let (whole, parts) = match content {
        Some(Value::String(s)) => (Some(s.as_str()), None),
        Some(Value::Array(parts)) => (None, Some(parts)),
        _ => (None, None),
    };
    whole.into_iter().chain(
        parts
            .into_iter()
            .flatten()
            .filter_map(|p| p.get("text").and_then(Value::as_str)),
    )
}

fn tokens(out: &mut String, ids: &[Value], chars: usize) {
    for id in ids {
        push(out, &id.to_string(), chars);
        push(out, " ", chars);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

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
        // Characters, not bytes: a multi-byte prompt is never cut inside a character.
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

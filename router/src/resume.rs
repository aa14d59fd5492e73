//! Resuming a stream whose replica died mid-stream: the router sends the prompt plus the text
//! already streamed to another replica, with the tokens still allowed, and the client reads on
//! as if nothing happened (the new replica's prefix cache, or a short prefill, makes the
//! re-read cheap).
//!
//! **Which streams.** Streamed `/v1/completions` and `/v1/chat/completions` with one choice
//! (`n`, `best_of` 1), no `echo`, `suffix`, `logprobs`/`top_logprobs`, structured output
//! (`response_format` other than text, `guided_*`, `structured_outputs`) or tools, a string
//! `prompt`, and a body of at most [`MAX_BODY`]: a continuation of the text then is what the
//! first replica would have generated next (token for token with greedy sampling, as long as
//! the text re-tokenizes as generated; a fresh draw otherwise). Each event is counted as one
//! token (ferrite-server, and vLLM without speculative decoding, stream one token per event).
//! A chat stream continues the assistant's message (`continue_final_message`, as vLLM and
//! ferrite-server take it). Anything else, a second failure, or a failure before the first
//! token ends the stream with the error event as before.
//!
//! To resume, the router must know where the stream stands: for these streams it passes events
//! on whole (a frame that ends inside an event holds that event back until its end), reading
//! each one's text; events of the resumed stream go on with the first stream's `id`, a chat
//! stream's second role event dropped, and the final `usage` counting the tokens of both.

use bytes::Bytes;
use serde::Deserialize;
use serde_json::Value;
use serde_json::value::RawValue;

/// Largest request body kept for a resume: it stays in memory, and in the router's
/// buffered-bytes budget, until the stream ends.
pub const MAX_BODY: usize = 256 << 10;
/// Largest event held back, and largest text kept: past either the stream is passed on as it
/// comes and can no longer be resumed.
const MAX_HELD: usize = 1 << 20;

/// A generation endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Completion,
    Chat,
}

impl Kind {
    pub fn of_path(path: &str) -> Option<Kind> {
        match path {
            "/v1/completions" => Some(Kind::Completion),
            "/v1/chat/completions" => Some(Kind::Chat),
            _ => None,
        }
    }
}

/// The fields that decide whether a request can be resumed; the rest is skipped.
#[derive(Deserialize)]
struct Check<'a> {
    stream: Option<bool>,
    n: Option<u64>,
    best_of: Option<u64>,
    echo: Option<bool>,
    #[serde(borrow)]
    suffix: Option<&'a RawValue>,
    #[serde(borrow)]
    logprobs: Option<&'a RawValue>,
    #[serde(borrow)]
    top_logprobs: Option<&'a RawValue>,
    #[serde(borrow)]
    response_format: Option<&'a RawValue>,
    #[serde(borrow)]
    guided_json: Option<&'a RawValue>,
    #[serde(borrow)]
    guided_regex: Option<&'a RawValue>,
    #[serde(borrow)]
    guided_choice: Option<&'a RawValue>,
    #[serde(borrow)]
    guided_grammar: Option<&'a RawValue>,
    #[serde(borrow)]
    structured_outputs: Option<&'a RawValue>,
    #[serde(borrow)]
    tools: Option<&'a RawValue>,
    continue_final_message: Option<bool>,
    #[serde(borrow)]
    prompt: Option<&'a RawValue>,
}

/// Whether a request of `kind` with `body` can be resumed on another replica.
pub fn resumable(kind: Kind, body: &[u8]) -> bool {
    if body.len() > MAX_BODY {
        return false;
    }
    let Ok(c) = serde_json::from_slice::<Check>(body) else {
        return false;
    };
    let unset = |v: Option<&RawValue>| v.is_none_or(|v| matches!(v.get(), "null" | "false"));
    let text_format = c.response_format.is_none_or(|v| {
        serde_json::from_str::<Value>(v.get()).is_ok_and(|f| f.is_null() || f["type"] == "text")
    });
    let no_tools = c
        .tools
        .is_none_or(|v| matches!(v.get().trim(), "null" | "[]"));
    let prompt_ok = match kind {
        Kind::Completion => c.prompt.is_some_and(|p| p.get().starts_with('"')),
        Kind::Chat => true,
    };
    c.stream == Some(true)
        && c.n.is_none_or(|n| n == 1)
        && c.best_of.is_none_or(|n| n == 1)
        && c.echo != Some(true)
        && unset(c.suffix)
        && unset(c.logprobs)
        && unset(c.top_logprobs)
        && text_format
        && [
            c.guided_json,
            c.guided_regex,
            c.guided_choice,
            c.guided_grammar,
        ]
        .into_iter()
        .all(unset)
        && unset(c.structured_outputs)
        && no_tools
        && c.continue_final_message != Some(true)
        && prompt_ok
}

/// Where a resumable stream stands, read from its events as they pass.
#[derive(Debug)]
pub struct Transcript {
    kind: Kind,
    /// Bytes of an event not yet ended, held back.
    pending: Vec<u8>,
    /// The choice's text so far.
    text: String,
    /// Token events so far.
    tokens: u64,
    /// The first stream's `id`, which resumed events take.
    id: Option<Value>,
    /// A finish reason was streamed, or `[DONE]`: nothing left to resume.
    ended: bool,
    /// Past a bound: passing events on as they come, not resumable.
    given_up: bool,
    /// Set once resumed: the tokens streamed before.
    resumed_after: Option<u64>,
}

impl Transcript {
    pub fn new(kind: Kind) -> Transcript {
        Transcript {
            kind,
            pending: Vec::new(),
            text: String::new(),
            tokens: 0,
            id: None,
            ended: false,
            given_up: false,
            resumed_after: None,
        }
    }

    /// Tokens streamed so far.
    pub fn tokens(&self) -> u64 {
        self.tokens
    }

    /// Whether a failure now can be resumed: some tokens went out, the stream has not ended,
    /// and it was not resumed before.
    pub fn can_resume(&self) -> bool {
        self.tokens > 0 && !self.ended && !self.given_up && self.resumed_after.is_none()
    }

    /// Takes a frame of the replica's stream; returns the bytes to pass on now: the events it
    /// completes (rewritten, once resumed).
    pub fn pass(&mut self, data: &[u8]) -> Bytes {
        if self.given_up {
            return Bytes::copy_from_slice(data);
        }
        self.pending.extend_from_slice(data);
        let mut out = Vec::new();
        while let Some(end) = find(&self.pending, b"\n\n") {
            let event: Vec<u8> = self.pending.drain(..end + 2).collect();
            self.read(&event, &mut out);
        }
        if self.pending.len() > MAX_HELD || self.text.len() > MAX_HELD {
            self.given_up = true;
            out.append(&mut self.pending);
        }
        Bytes::from(out)
    }

    /// Reads one whole event (with its blank line) and appends what goes on to `out`.
    fn read(&mut self, event: &[u8], out: &mut Vec<u8>) {
        let data = std::str::from_utf8(event)
            .ok()
            .and_then(|e| e.trim_end().strip_prefix("data:"))
            .map(str::trim);
        let Some(data) = data else {
            out.extend_from_slice(event);
            return;
        };
        if data == "[DONE]" {
            self.ended = true;
            out.extend_from_slice(event);
            return;
        }
        let Ok(mut v) = serde_json::from_str::<Value>(data) else {
            out.extend_from_slice(event);
            return;
        };
        let choice = &v["choices"][0];
        let role_only = self.kind == Kind::Chat && !choice["delta"]["role"].is_null();
        let piece = match self.kind {
            Kind::Completion => choice["text"].as_str(),
            Kind::Chat => choice["delta"]["content"].as_str(),
        };
        let finished = !choice["finish_reason"].is_null();
        // A finish event carries a token only when it has text (vLLM's may; ferrite-server's
        // comes on its own, empty).
        let is_token =
            choice.is_object() && !role_only && (!finished || piece.is_some_and(|p| !p.is_empty()));
        if finished {
            self.ended = true;
        }
        match self.resumed_after {
            None => {
                if self.id.is_none() {
                    self.id = v.get("id").cloned();
                }
                if is_token {
                    self.tokens += 1;
                    self.text.push_str(piece.unwrap_or_default());
                }
                out.extend_from_slice(event);
            }
            Some(before) => {
                // The client has had its role event.
                if role_only && piece.is_none_or(str::is_empty) {
                    return;
                }
                if is_token {
                    self.tokens += 1;
                }
                if let (Some(id), Some(obj)) = (&self.id, v.as_object_mut()) {
                    obj.insert("id".into(), id.clone());
                }
                count_earlier_tokens(&mut v["usage"], before);
                out.extend_from_slice(format!("data: {v}\n\n").as_bytes());
            }
        }
    }

    /// The body of the request that continues the stream on another replica: `body` (the
    /// original request) with the text so far after its prompt (a completion) or as the
    /// assistant's open message (a chat), and the tokens still allowed. `None` when none are
    /// left or the body cannot be read.
    pub fn resume_body(&self, body: &[u8]) -> Option<Vec<u8>> {
        let mut v: Value = serde_json::from_slice(body).ok()?;
        let obj = v.as_object_mut()?;
        for key in ["max_tokens", "max_completion_tokens"] {
            if let Some(n) = obj.get(key).and_then(Value::as_u64) {
                let left = n.checked_sub(self.tokens).filter(|l| *l > 0)?;
                obj.insert(key.into(), left.into());
            }
        }
        match self.kind {
            Kind::Completion => {
                let prompt = format!("{}{}", obj.get("prompt")?.as_str()?, self.text);
                obj.insert("prompt".into(), prompt.into());
            }
            Kind::Chat => {
                let messages = obj.get_mut("messages")?.as_array_mut()?;
                messages.push(serde_json::json!({"role": "assistant", "content": self.text}));
                obj.insert("continue_final_message".into(), true.into());
                obj.insert("add_generation_prompt".into(), false.into());
            }
        }
        serde_json::to_vec(&v).ok()
    }

    /// What is held of an event not yet ended (the stream ended without ending it).
    pub fn take_held(&mut self) -> Bytes {
        Bytes::from(std::mem::take(&mut self.pending))
    }

    /// From now on, events come from the resumed stream.
    pub fn resumed(&mut self) {
        self.resumed_after = Some(self.tokens);
        // Whatever was held of the broken stream's last event is gone with it.
        self.pending.clear();
    }
}

/// A resumed stream's `usage` counted from the client's side: the tokens streamed before the
/// failure are completion tokens, which the second replica read as prompt.
fn count_earlier_tokens(usage: &mut Value, before: u64) {
    let Some(u) = usage.as_object_mut() else {
        return;
    };
    if let (Some(p), Some(c)) = (
        u.get("prompt_tokens").and_then(Value::as_u64),
        u.get("completion_tokens").and_then(Value::as_u64),
    ) {
        u.insert("prompt_tokens".into(), p.saturating_sub(before).into());
        u.insert("completion_tokens".into(), (c + before).into());
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn ev(v: Value) -> String {
        format!("data: {v}\n\n")
    }

    #[test]
    fn only_plain_single_choice_streams_are_resumable() {
        let ok = json!({"model": "m", "prompt": "Hi", "stream": true, "max_tokens": 8,
                        "temperature": 0, "logprobs": null, "response_format": {"type": "text"}});
        assert!(resumable(Kind::Completion, ok.to_string().as_bytes()));
        let chat = json!({"model": "m", "messages": [{"role": "user", "content": "Hi"}],
                          "stream": true, "tools": []});
        assert!(resumable(Kind::Chat, chat.to_string().as_bytes()));
        for (k, v) in [
            ("stream", json!(false)),
            ("n", json!(2)),
            ("best_of", json!(3)),
            ("echo", json!(true)),
            ("logprobs", json!(2)),
            ("suffix", json!("end")),
            ("response_format", json!({"type": "json_object"})),
            ("guided_regex", json!("a+")),
            ("structured_outputs", json!({"choice": ["a"]})),
            ("prompt", json!(["a", "b"])),
            ("prompt", json!([1, 2, 3])),
        ] {
            let mut b = ok.clone();
            b[k] = v.clone();
            assert!(
                !resumable(Kind::Completion, b.to_string().as_bytes()),
                "{k}: {v}"
            );
        }
        let mut tools = chat.clone();
        tools["tools"] = json!([{"type": "function", "function": {"name": "f"}}]);
        assert!(!resumable(Kind::Chat, tools.to_string().as_bytes()));
        let mut cont = chat.clone();
        cont["continue_final_message"] = json!(true);
        assert!(!resumable(Kind::Chat, cont.to_string().as_bytes()));
        let big = json!({"prompt": "x".repeat(MAX_BODY), "stream": true});
        assert!(!resumable(Kind::Completion, big.to_string().as_bytes()));
        assert!(!resumable(Kind::Completion, b"not json"));
    }

    #[test]
    fn events_go_on_whole_and_the_text_is_kept() {
        let mut t = Transcript::new(Kind::Completion);
        let a = ev(
            json!({"id": "cmpl-1", "choices": [{"index": 0, "text": "Par", "finish_reason": null}]}),
        );
        let b = ev(
            json!({"id": "cmpl-1", "choices": [{"index": 0, "text": "is", "finish_reason": null}]}),
        );
        // A frame that ends inside the second event holds it back.
        let (head, tail) = b.split_at(10);
        assert_eq!(t.pass(format!("{a}{head}").as_bytes()), a.as_bytes());
        assert!(t.can_resume());
        assert_eq!(t.pass(tail.as_bytes()), b.as_bytes());
        assert_eq!((t.text.as_str(), t.tokens()), ("Paris", 2));
        let body = json!({"model": "m", "prompt": "The capital of France is ", "max_tokens": 8,
                          "stream": true});
        let next: Value =
            serde_json::from_slice(&t.resume_body(body.to_string().as_bytes()).expect("body"))
                .expect("json");
        assert_eq!(next["prompt"], "The capital of France is Paris");
        assert_eq!(next["max_tokens"], 6);
        // The resumed stream's events take the first id; usage counts both streams' tokens.
        t.resumed();
        let c = ev(
            json!({"id": "cmpl-2", "choices": [{"index": 0, "text": ".", "finish_reason": "length"}]}),
        );
        let u = ev(json!({"id": "cmpl-2", "choices": [],
                          "usage": {"prompt_tokens": 9, "completion_tokens": 6, "total_tokens": 15}}));
        let out = t.pass(format!("{c}{u}data: [DONE]\n\n").as_bytes());
        let out = std::str::from_utf8(&out).expect("utf-8");
        assert!(
            out.contains(r#""id":"cmpl-1""#) && !out.contains("cmpl-2"),
            "{out}"
        );
        assert!(
            out.contains(r#""prompt_tokens":7"#) && out.contains(r#""completion_tokens":8"#),
            "{out}"
        );
        assert!(out.ends_with("data: [DONE]\n\n"));
        assert!(!t.can_resume(), "once only, and it ended");
    }

    #[test]
    fn a_chat_stream_continues_the_assistants_message() {
        let mut t = Transcript::new(Kind::Chat);
        let role = ev(
            json!({"id": "c1", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}),
        );
        let tok = ev(
            json!({"id": "c1", "choices": [{"index": 0, "delta": {"content": "Hello"}, "finish_reason": null}]}),
        );
        t.pass(format!("{role}{tok}").as_bytes());
        assert_eq!(t.tokens(), 1, "the role event is no token");
        let body = json!({"model": "m", "messages": [{"role": "user", "content": "Hi"}],
                          "max_completion_tokens": 4, "stream": true});
        let next: Value =
            serde_json::from_slice(&t.resume_body(body.to_string().as_bytes()).expect("body"))
                .expect("json");
        assert_eq!(
            next["messages"][1],
            json!({"role": "assistant", "content": "Hello"})
        );
        assert_eq!(next["continue_final_message"], true);
        assert_eq!(next["add_generation_prompt"], false);
        assert_eq!(next["max_completion_tokens"], 3);
        t.resumed();
        // The resumed stream's role event is not passed on again.
        let role2 = ev(
            json!({"id": "c2", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}),
        );
        assert!(t.pass(role2.as_bytes()).is_empty());
    }

    #[test]
    fn nothing_to_resume_before_the_first_token_after_the_end_or_with_no_tokens_left() {
        let mut t = Transcript::new(Kind::Completion);
        assert!(!t.can_resume());
        t.pass(ev(json!({"choices": [{"text": "a", "finish_reason": null}]})).as_bytes());
        let body = json!({"prompt": "p", "max_tokens": 1, "stream": true}).to_string();
        assert!(t.resume_body(body.as_bytes()).is_none(), "no tokens left");
        t.pass(ev(json!({"choices": [{"text": "", "finish_reason": "stop"}]})).as_bytes());
        assert!(!t.can_resume());
    }

    #[test]
    fn an_event_past_the_bound_gives_up_and_passes_through() {
        let mut t = Transcript::new(Kind::Completion);
        let huge = vec![b'x'; MAX_HELD + 1];
        assert_eq!(t.pass(&huge).len(), huge.len());
        assert!(!t.can_resume());
        assert_eq!(t.pass(b"data: y\n\n"), &b"data: y\n\n"[..]);
    }
}

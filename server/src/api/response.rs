//! OpenAI response bodies and stream chunks as typed structs (vLLM's `protocol.py` shapes), so a
//! field's name and presence are checked by the compiler, not by each endpoint's `json!`.
//! `Option` fields without `skip_serializing_if` are sent as `null`, as OpenAI does.

use std::collections::BTreeMap;

use serde::Serialize;

/// Token counts of a whole request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
    /// OpenAI's breakdown of the prompt: how much of it the prefix cache supplied.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_tokens_details: Option<PromptTokensDetails>,
}

/// `usage.prompt_tokens_details`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct PromptTokensDetails {
    /// Prompt tokens whose keys and values came from the prefix cache.
    pub cached_tokens: usize,
}

impl Usage {
    pub fn new(prompt_tokens: usize, completion_tokens: usize) -> Self {
        Self {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
            prompt_tokens_details: None,
        }
    }
}

/// The envelope every completion response and chunk shares.
#[derive(Debug, Clone, Serialize)]
pub struct Envelope<C> {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<C>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

/// What every response and chunk of one request shares.
#[derive(Debug, Clone)]
pub struct Head {
    pub id: String,
    pub model: String,
    pub created: u64,
}

impl Head {
    /// A fresh id (`{prefix}-…`) and creation time for one response.
    pub fn new(prefix: &str, model: &str) -> Self {
        Self {
            id: format!("{prefix}-{}", super::random_id()),
            model: model.to_string(),
            created: super::now_secs(),
        }
    }

    pub fn wrap<C>(
        &self,
        object: &'static str,
        choices: Vec<C>,
        usage: Option<Usage>,
    ) -> Envelope<C> {
        Envelope {
            id: self.id.clone(),
            object,
            created: self.created,
            model: self.model.clone(),
            choices,
            usage,
        }
    }
}

/// `/v1/completions`: one choice, whole or as a chunk.
#[derive(Debug, Clone, Serialize)]
pub struct CompletionChoice {
    pub index: usize,
    pub text: String,
    pub logprobs: Option<CompletionLogprobs>,
    pub finish_reason: Option<&'static str>,
}

/// The legacy completions `logprobs` object.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct CompletionLogprobs {
    pub text_offset: Vec<usize>,
    pub token_logprobs: Vec<f32>,
    pub tokens: Vec<String>,
    pub top_logprobs: Vec<BTreeMap<String, f32>>,
}

/// `/v1/chat/completions`, whole: one choice.
#[derive(Debug, Clone, Serialize)]
pub struct ChatChoice {
    pub index: usize,
    pub message: ChatMessage,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<&'static str>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ChatMessage {
    pub role: &'static str,
    /// `null` when the reply is only tool calls.
    pub content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallOut>>,
}

/// One tool call of a reply: `{"id", "type": "function", "function": {"name", "arguments"}}`.
#[derive(Debug, Clone, Serialize)]
pub struct ToolCallOut {
    pub id: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub function: FunctionCall,
}

#[derive(Debug, Clone, Serialize)]
pub struct FunctionCall {
    pub name: String,
    pub arguments: String,
}

/// A streamed piece of a tool call: the first of a call has its id, type and name.
#[derive(Debug, Clone, Serialize)]
pub struct ToolCallChunk {
    pub index: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<&'static str>,
    pub function: FunctionChunk,
}

#[derive(Debug, Clone, Serialize)]
pub struct FunctionChunk {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    pub arguments: String,
}

/// `/v1/chat/completions`, streamed: one choice's delta.
#[derive(Debug, Clone, Serialize)]
pub struct ChatChunkChoice {
    pub index: usize,
    pub delta: ChatDelta,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<&'static str>,
}

/// What a chunk adds to the message; empty (`{}`) on a finish without text.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ChatDelta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallChunk>>,
}

/// The chat `logprobs` object: `{"content": [{token, logprob, bytes, top_logprobs}]}`.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct ChatLogprobs {
    pub content: Vec<ChatTokenLogprob>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatTokenLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub top_logprobs: Option<Vec<ChatTokenLogprob>>,
}

/// `GET /version`.
#[derive(Debug, Clone, Serialize)]
pub struct Version {
    pub version: &'static str,
}

/// `GET /v1/models`.
#[derive(Debug, Clone, Serialize)]
pub struct ModelList {
    pub object: &'static str,
    pub data: Vec<ModelCard>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ModelCard {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub owned_by: &'static str,
    pub root: String,
    /// The base model of an adapter (`null` for the base model itself).
    pub parent: Option<String>,
    pub max_model_len: Option<usize>,
}

/// `POST /tokenize`.
#[derive(Debug, Clone, Serialize)]
pub struct Tokenized {
    pub count: usize,
    pub max_model_len: usize,
    pub tokens: Vec<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_strs: Option<Vec<String>>,
}

/// `POST /detokenize`.
#[derive(Debug, Clone, Serialize)]
pub struct Detokenized {
    pub prompt: String,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn chunks_keep_openai_nulls_and_omit_what_openai_omits() {
        let chunk = Envelope {
            id: "chatcmpl-1".into(),
            object: "chat.completion.chunk",
            created: 7,
            model: "m".into(),
            choices: vec![ChatChunkChoice {
                index: 0,
                delta: ChatDelta::default(),
                logprobs: None,
                finish_reason: Some("stop"),
            }],
            usage: None,
        };
        assert_eq!(
            serde_json::to_value(&chunk).expect("json"),
            json!({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 7,
                   "model": "m", "choices": [{"index": 0, "delta": {}, "logprobs": null,
                   "finish_reason": "stop"}]})
        );
        let usage = Envelope::<CompletionChoice> {
            id: "cmpl-1".into(),
            object: "text_completion",
            created: 7,
            model: "m".into(),
            choices: vec![],
            usage: Some(Usage::new(3, 4)),
        };
        assert_eq!(
            serde_json::to_value(&usage).expect("json")["usage"],
            json!({"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7})
        );
    }
}

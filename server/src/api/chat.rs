//! `POST /v1/chat/completions`: messages rendered with the model's own chat template.

use std::sync::Arc;

use axum::extract::State;
use axum::response::{IntoResponse, Json, Response};
use serde_json::{Value, json};

use super::completions::token_text;
use super::error::ApiError;
use super::extract::JsonBody;
use super::generate::{self, Generation, StreamItem, TokenLogprob};
use super::protocol::{ChatCompletionRequest, Content, Message};
use super::state::AppState;
use super::state::Serving;
use crate::model::{ChatMessage, Tokenizer};

pub async fn chat_completions(
    State(state): State<Arc<AppState>>,
    JsonBody(req): JsonBody<ChatCompletionRequest>,
) -> Result<Response, ApiError> {
    let arrival = std::time::Instant::now();
    let serving = state.serving()?;
    state.check_model(req.model.as_deref())?;
    if req.tools.as_ref().is_some_and(|t| !t.is_empty()) {
        return Err(ApiError::invalid_param(
            "tools",
            "tool calling is not supported by this server",
        ));
    }
    if let Some(rf) = &req.response_format
        && rf.get("type").and_then(Value::as_str) != Some("text")
    {
        return Err(ApiError::invalid_param(
            "response_format",
            "only response_format {\"type\": \"text\"} is supported",
        ));
    }
    let want_logprobs = req.logprobs.unwrap_or(false);
    let top = generate::logprobs_count("top_logprobs", req.top_logprobs)?;
    if top.is_some_and(|k| k > 0) && !want_logprobs {
        return Err(ApiError::invalid_param(
            "top_logprobs",
            "top_logprobs requires logprobs to be true",
        ));
    }
    let logprobs = want_logprobs.then(|| top.unwrap_or(0));
    let prompt = chat_prompt(
        serving,
        &req.messages,
        req.add_generation_prompt.unwrap_or(true),
    )?;
    let vocab = serving.tokenizer.vocab_size();
    let requested = req.max_completion_tokens.or(req.max_tokens);
    let max_tokens =
        generate::max_tokens_for(prompt.len(), requested, None, serving.max_model_len)?;
    let (stop, stop_token_ids) = generate::stops(&req.sampling, vocab)?;
    let g = Generation {
        sampling: generate::sampling_params(&req.sampling, logprobs, vocab)?,
        n: generate::choices_per_prompt(&req.sampling)?,
        max_tokens: vec![max_tokens],
        stop,
        stop_token_ids,
        ignore_eos: req.sampling.ignore_eos.unwrap_or(false),
        prompts: vec![prompt],
    };
    generate::admit(&state, serving)?;
    let receivers = generate::submit(serving, &g, arrival)?;
    let id = format!("chatcmpl-{}", super::random_id());
    let model = state.served_model_name.clone();
    let created = super::now_secs();

    if req.sampling.stream.unwrap_or(false) {
        let include_usage = req
            .sampling
            .stream_options
            .as_ref()
            .is_some_and(|o| o.include_usage);
        let st = state.clone();
        let render = move |item: StreamItem| -> Option<Value> {
            let tok = &st.loaded()?.tokenizer;
            let base = |choices: Value| {
                json!({"id": id, "object": "chat.completion.chunk", "created": created,
                       "model": model, "choices": choices})
            };
            match item {
                StreamItem::Start(i) => Some(base(json!([{
                    "index": i, "delta": {"role": "assistant", "content": ""},
                    "logprobs": null, "finish_reason": null}]))),
                StreamItem::Delta {
                    index,
                    text,
                    logprob,
                    finish,
                } => {
                    let delta = if text.is_empty() && finish.is_some() {
                        json!({})
                    } else {
                        json!({ "content": text })
                    };
                    let lp = logprob.map(|l| logprobs_json(tok, &[l]));
                    Some(base(
                        json!([{"index": index, "delta": delta, "logprobs": lp,
                                      "finish_reason": finish.map(|f| f.as_str())}]),
                    ))
                }
                StreamItem::Usage(u) => {
                    let mut v = base(json!([]));
                    v["usage"] = u.to_json();
                    Some(v)
                }
            }
        };
        return Ok(
            generate::sse(receivers, g.n, include_usage, logprobs.is_some(), render)
                .into_response(),
        );
    }

    let (choices, usage) = generate::collect(receivers, g.n).await?;
    let choices: Vec<Value> = choices
        .into_iter()
        .enumerate()
        .map(|(i, c)| {
            json!({
                "index": i,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": logprobs.map(|_| logprobs_json(&serving.tokenizer, &c.logprobs)),
                "finish_reason": c.finish_reason.map(|f| f.as_str()),
            })
        })
        .collect();
    Ok(Json(json!({
        "id": id,
        "object": "chat.completion",
        "created": created,
        "model": state.served_model_name,
        "choices": choices,
        "usage": usage.to_json(),
    }))
    .into_response())
}

/// Messages as the chat template wants them: text content only.
pub fn template_messages(messages: &[Message]) -> Result<Vec<ChatMessage>, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::invalid_param(
            "messages",
            "messages must not be empty",
        ));
    }
    messages
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let content = match &m.content {
                None => String::new(),
                Some(Content::Text(t)) => t.clone(),
                Some(Content::Parts(parts)) => {
                    let mut s = String::new();
                    for p in parts {
                        match (p.kind.as_str(), &p.text) {
                            ("text", Some(t)) => s.push_str(t),
                            (kind, _) => {
                                return Err(ApiError::invalid_param(
                                    &format!("messages[{i}].content"),
                                    format!(
                                        "content part type '{kind}' is not supported by this \
                                         text-only model"
                                    ),
                                ));
                            }
                        }
                    }
                    s
                }
            };
            Ok(ChatMessage {
                role: m.role.clone(),
                content,
            })
        })
        .collect()
}

/// Renders and tokenizes a conversation. The template already writes any BOS it wants, so no
/// special tokens are added on top.
pub fn chat_prompt(
    serving: &Serving,
    messages: &[Message],
    add_generation_prompt: bool,
) -> Result<Vec<u32>, ApiError> {
    let msgs = template_messages(messages)?;
    let template = serving.chat_template.as_ref().ok_or_else(|| {
        ApiError::bad_request("this model has no chat template; use /v1/completions")
    })?;
    let text = template
        .render(&msgs, add_generation_prompt)
        .map_err(|e| ApiError::invalid_param("messages", e.to_string()))?;
    serving
        .tokenizer
        .encode(&text, false)
        .map_err(|e| ApiError::invalid_param("messages", format!("cannot tokenize: {e}")))
}

fn logprob_entry(tok: &Tokenizer, id: u32, lp: f32) -> Value {
    let t = token_text(tok, id);
    json!({"token": t, "logprob": lp, "bytes": t.as_bytes()})
}

/// The chat `logprobs` object: `{"content": [{token, logprob, bytes, top_logprobs}]}`.
fn logprobs_json(tok: &Tokenizer, lps: &[TokenLogprob]) -> Value {
    let content: Vec<Value> = lps
        .iter()
        .map(|l| {
            let mut e = logprob_entry(tok, l.token, l.logprob);
            e["top_logprobs"] = l
                .top
                .iter()
                .map(|&(id, lp)| logprob_entry(tok, id, lp))
                .collect();
            e
        })
        .collect();
    json!({ "content": content })
}

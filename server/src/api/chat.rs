//! `POST /v1/chat/completions`: messages rendered with the model's own chat template.

use std::sync::Arc;

use axum::extract::State;
use axum::response::{IntoResponse, Json, Response};
use ferrite_runtime::engine::FinishReason;
use ferrite_runtime::model::{self, Tokenizer};

use super::completions::token_text;
use super::error::ApiError;
use super::extract::JsonBody;
use super::generate::{self, ChoiceOutput, StreamItem, TokenLogprob};
use super::protocol::{ChatCompletionRequest, Content, Message};
use super::response::{
    ChatChoice, ChatChunkChoice, ChatDelta, ChatLogprobs, ChatMessage, ChatTokenLogprob, Envelope,
    Head,
};
use super::state::{AppState, Serving};
use super::structured;
use super::validate::{self, Generation};

pub async fn chat_completions(
    State(state): State<Arc<AppState>>,
    JsonBody(mut req): JsonBody<ChatCompletionRequest>,
) -> Result<Response, ApiError> {
    let arrival = std::time::Instant::now();
    let serving = state.serving()?;
    let model = state.resolve_generation_model(req.model.as_deref()).await?;
    refuse_unsupported(&req)?;
    let want = wanted_logprobs(&req)?;
    let n = validate::choices_per_prompt(&req.sampling)?;
    let seqs = validate::request_sequences(&state, 1, n)?;
    let messages = std::mem::take(&mut req.messages);
    let add_generation_prompt = req.add_generation_prompt.unwrap_or(true);
    let prompt = state
        .blocking(move |s| chat_prompt(s, &messages, add_generation_prompt))
        .await?;
    let requested = req.max_completion_tokens.or(req.max_tokens);
    let max_tokens =
        validate::max_tokens_for(prompt.len(), requested, None, serving.max_model_len)?;
    let mut g = Generation::new(
        &req.sampling,
        want,
        n,
        vec![prompt],
        vec![max_tokens],
        serving.vocab_size,
    )?;
    g.adapter = model.adapter;
    g.guide = structured::guide(&state, &req.structured).await?;
    generate::admit(&state, serving, seqs)?;
    let receivers = generate::submit(serving, &g, arrival)?;
    let head = Head::new("chatcmpl", &model.name);
    match validate::stream_mode(&req.sampling) {
        Some(include_usage) => {
            let render = chunk_renderer(state.clone(), head);
            let sse = generate::sse(receivers, g.n, include_usage, want.is_some(), render);
            Ok(sse.into_response())
        }
        None => {
            let (choices, usage) = generate::collect(receivers, g.n).await?;
            let choices = whole_choices(&serving.tokenizer, choices, want);
            Ok(Json(head.wrap("chat.completion", choices, Some(usage))).into_response())
        }
    }
}

/// Tools are refused by name rather than ignored.
fn refuse_unsupported(req: &ChatCompletionRequest) -> Result<(), ApiError> {
    if req.tools.as_ref().is_some_and(|t| !t.is_empty()) {
        return Err(ApiError::invalid_param(
            "tools",
            "tool calling is not supported by this server",
        ));
    }
    Ok(())
}

/// `Some(top)` when the client asked for logprobs, with `top` alternatives per token.
fn wanted_logprobs(req: &ChatCompletionRequest) -> Result<Option<usize>, ApiError> {
    let want_logprobs = req.logprobs.unwrap_or(false);
    let top = validate::logprobs_count("top_logprobs", req.top_logprobs)?;
    if top.is_some_and(|k| k > 0) && !want_logprobs {
        return Err(ApiError::invalid_param(
            "top_logprobs",
            "top_logprobs requires logprobs to be true",
        ));
    }
    Ok(want_logprobs.then(|| top.unwrap_or(0)))
}

/// Turns each stream item into a `chat.completion.chunk`: the assistant role first, then the
/// content deltas, then (when asked) the usage.
fn chunk_renderer(
    state: Arc<AppState>,
    head: Head,
) -> impl FnMut(StreamItem) -> Option<Envelope<ChatChunkChoice>> + Send + 'static {
    move |item: StreamItem| {
        let tok = &state.loaded()?.tokenizer;
        let chunk = |choice: Option<ChatChunkChoice>, usage| {
            head.wrap("chat.completion.chunk", choice.into_iter().collect(), usage)
        };
        match item {
            StreamItem::Start(index) => Some(chunk(
                Some(ChatChunkChoice {
                    index,
                    delta: ChatDelta {
                        role: Some("assistant"),
                        content: Some(String::new()),
                    },
                    logprobs: None,
                    finish_reason: None,
                }),
                None,
            )),
            StreamItem::Delta {
                index,
                text,
                logprob,
                finish,
            } => {
                let content = (!text.is_empty() || finish.is_none()).then_some(text);
                Some(chunk(
                    Some(ChatChunkChoice {
                        index,
                        delta: ChatDelta {
                            role: None,
                            content,
                        },
                        logprobs: logprob.map(|l| logprobs(tok, &[l])),
                        finish_reason: finish.map(FinishReason::as_str),
                    }),
                    None,
                ))
            }
            StreamItem::Usage(u) => Some(chunk(None, Some(u))),
        }
    }
}

/// The choices of a whole `chat.completion`.
fn whole_choices(
    tok: &Tokenizer,
    choices: Vec<ChoiceOutput>,
    want: Option<usize>,
) -> Vec<ChatChoice> {
    choices
        .into_iter()
        .enumerate()
        .map(|(i, c)| ChatChoice {
            index: i,
            logprobs: want.map(|_| logprobs(tok, &c.logprobs)),
            message: ChatMessage {
                role: "assistant",
                content: c.text,
            },
            finish_reason: c.finish_reason.map(FinishReason::as_str),
        })
        .collect()
}

/// Messages as the chat template wants them: text content only.
pub fn template_messages(messages: &[Message]) -> Result<Vec<model::ChatMessage>, ApiError> {
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
            Ok(model::ChatMessage {
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

fn logprob_entry(tok: &Tokenizer, id: u32, logprob: f32) -> ChatTokenLogprob {
    let token = token_text(tok, id);
    ChatTokenLogprob {
        bytes: token.as_bytes().to_vec(),
        token,
        logprob,
        top_logprobs: None,
    }
}

/// The chat `logprobs` object: `{"content": [{token, logprob, bytes, top_logprobs}]}`.
fn logprobs(tok: &Tokenizer, lps: &[TokenLogprob]) -> ChatLogprobs {
    let content = lps
        .iter()
        .map(|l| ChatTokenLogprob {
            top_logprobs: Some(
                l.top
                    .iter()
                    .map(|&(id, lp)| logprob_entry(tok, id, lp))
                    .collect(),
            ),
            ..logprob_entry(tok, l.token, l.logprob)
        })
        .collect();
    ChatLogprobs { content }
}

//! `POST /v1/chat/completions`: messages rendered with the model's own chat template.

use std::sync::Arc;

use axum::extract::State;
use axum::response::{IntoResponse, Json, Response};
use ferrite_runtime::engine::FinishReason;
use ferrite_runtime::model::{self, Tokenizer};
use serde_json::Value;

use super::completions::token_text;
use super::error::ApiError;
use super::extract::JsonBody;
use super::generate::{self, ChoiceOutput, StreamItem, TokenLogprob};
use super::protocol::{ChatCompletionRequest, Content, Message};
use super::response::{
    ChatChoice, ChatChunkChoice, ChatDelta, ChatLogprobs, ChatMessage, ChatTokenLogprob, Envelope,
    FunctionCall, Head, ToolCallOut,
};
use super::state::{AppState, Serving};
use super::structured;
use super::tool_parse::CallFormat;
use super::tools::{self, StreamState, ToolUse};
use super::validate::{self, Generation};

pub async fn chat_completions(
    State(state): State<Arc<AppState>>,
    JsonBody(mut req): JsonBody<ChatCompletionRequest>,
) -> Result<Response, ApiError> {
    let arrival = std::time::Instant::now();
    let serving = state.serving()?;
    let model = state.resolve_generation_model(req.model.as_deref()).await?;
    let want = wanted_logprobs(&req)?;
    let n = validate::choices_per_prompt(&req.sampling)?;
    let seqs = validate::request_sequences(&state, 1, n)?;
    let tools = ToolUse::read(
        req.tools.as_deref(),
        req.tool_choice.as_ref(),
        req.parallel_tool_calls,
        call_format(serving),
    )?;
    let messages = std::mem::take(&mut req.messages);
    let ending = Ending::of(req.add_generation_prompt, req.continue_final_message)?;
    let template_tools = tools.as_ref().and_then(ToolUse::template_tools);
    let prompt = state
        .blocking(move |s| chat_prompt(s, &messages, ending, template_tools.as_ref()))
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
    // Refuse an overloaded server's request before compiling its grammar, not after.
    generate::admit(&state, serving, seqs, "n")?;
    g.guide = match tools.as_ref().and_then(ToolUse::grammar) {
        Some(spec) => {
            if structured::requested(&req.structured)?.is_some() {
                return Err(ApiError::invalid_param(
                    "tool_choice",
                    "a forced tool call cannot be combined with a structured output",
                ));
            }
            Some(structured::compile(&state, spec, "tool_choice").await?)
        }
        None => structured::guide(&state, &req.structured).await?,
    };
    let receivers = generate::submit(serving, &g, arrival)?;
    let head = Head::new("chatcmpl", &model.name);
    match validate::stream_mode(&req.sampling) {
        Some(include_usage) => {
            let render = chunk_renderer(state.clone(), head, tools);
            let sse = generate::sse(receivers, g.n, include_usage, want.is_some(), render);
            Ok(sse.into_response())
        }
        None => {
            let (choices, usage) = generate::collect(receivers, g.n).await?;
            let choices = whole_choices(&serving.tokenizer, choices, want, tools.as_ref());
            Ok(Json(head.wrap("chat.completion", choices, Some(usage))).into_response())
        }
    }
}

/// How the model writes tool calls, from its chat template.
fn call_format(serving: &Serving) -> CallFormat {
    serving.tool_format.unwrap_or_else(|| {
        serving
            .chat_template
            .as_ref()
            .map_or(CallFormat::Hermes, |t| CallFormat::detect(t.source()))
    })
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
/// content deltas (and tool-call deltas, when the request has tools), then (when asked) the
/// usage.
fn chunk_renderer(
    state: Arc<AppState>,
    head: Head,
    tools: Option<ToolUse>,
) -> impl FnMut(StreamItem) -> Option<Envelope<ChatChunkChoice>> + Send + 'static {
    let mut streams: Vec<StreamState> = Vec::new();
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
                        tool_calls: None,
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
                let logprobs = logprob.map(|l| logprobs(tok, &[l]));
                let (content, calls, finish_reason) = match &tools {
                    None => (
                        (!text.is_empty() || finish.is_none()).then_some(text),
                        None,
                        finish.map(FinishReason::as_str),
                    ),
                    Some(t) => {
                        if streams.len() <= index {
                            streams.resize_with(index + 1, StreamState::default);
                        }
                        let st = &mut streams[index];
                        let (content, deltas) = t.stream(st, &text, finish.is_some());
                        if content.is_none()
                            && deltas.is_empty()
                            && finish.is_none()
                            && logprobs.is_none()
                        {
                            // Held back: it may be the start of a call.
                            return None;
                        }
                        let calls = (!deltas.is_empty()).then_some(deltas);
                        let reason = finish.map(|r| t.finish_reason(st.called, r.as_str()));
                        (content, calls, reason)
                    }
                };
                Some(chunk(
                    Some(ChatChunkChoice {
                        index,
                        delta: ChatDelta {
                            role: None,
                            content,
                            tool_calls: calls,
                        },
                        logprobs,
                        finish_reason,
                    }),
                    None,
                ))
            }
            StreamItem::Usage(u) => Some(chunk(None, Some(u))),
        }
    }
}

/// The choices of a whole `chat.completion`; with tools, each choice's calls read out of its
/// text.
fn whole_choices(
    tok: &Tokenizer,
    choices: Vec<ChoiceOutput>,
    want: Option<usize>,
    tools: Option<&ToolUse>,
) -> Vec<ChatChoice> {
    choices
        .into_iter()
        .enumerate()
        .map(|(i, c)| {
            let reason = c.finish_reason.map(FinishReason::as_str);
            let (message, finish_reason) = match tools {
                None => (
                    ChatMessage {
                        role: "assistant",
                        content: Some(c.text),
                        tool_calls: None,
                    },
                    reason,
                ),
                Some(t) => {
                    let parsed = t.calls(&c.text);
                    let called = !parsed.calls.is_empty();
                    let calls = called.then(|| {
                        parsed
                            .calls
                            .into_iter()
                            .map(|call| ToolCallOut {
                                id: tools::call_id(),
                                kind: "function",
                                function: FunctionCall {
                                    name: call.name,
                                    arguments: call.arguments,
                                },
                            })
                            .collect()
                    });
                    let message = ChatMessage {
                        role: "assistant",
                        content: parsed.content,
                        tool_calls: calls,
                    };
                    (message, reason.map(|r| t.finish_reason(called, r)))
                }
            };
            ChatChoice {
                index: i,
                logprobs: want.map(|_| logprobs(tok, &c.logprobs)),
                message,
                finish_reason,
            }
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
                tool_calls: m.tool_calls.as_ref().map(|calls| template_calls(calls)),
                tool_call_id: m.tool_call_id.clone(),
                name: m.name.clone(),
            })
        })
        .collect()
}

/// How a rendered conversation ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    /// With the assistant's turn opened, for a reply (`add_generation_prompt`, the default).
    GenerationPrompt,
    /// At the last message's end.
    Closed,
    /// Inside the last (assistant) message, which the reply continues
    /// (`continue_final_message`, as vLLM: with `add_generation_prompt: false`).
    ContinueFinal,
}

impl Ending {
    /// From the request's two flags; both true is refused, as vLLM refuses it.
    pub fn of(
        add_generation_prompt: Option<bool>,
        continue_final: Option<bool>,
    ) -> Result<Ending, ApiError> {
        match (
            add_generation_prompt.unwrap_or(true),
            continue_final.unwrap_or(false),
        ) {
            (true, true) => Err(ApiError::invalid_param(
                "continue_final_message",
                "Cannot set both `continue_final_message` and `add_generation_prompt` to true.",
            )),
            (true, false) => Ok(Ending::GenerationPrompt),
            (false, false) => Ok(Ending::Closed),
            (false, true) => Ok(Ending::ContinueFinal),
        }
    }
}

/// Renders and tokenizes a conversation. The template already writes any BOS it wants, so no
/// special tokens are added on top.
pub fn chat_prompt(
    serving: &Serving,
    messages: &[Message],
    ending: Ending,
    tools: Option<&Value>,
) -> Result<Vec<u32>, ApiError> {
    let msgs = template_messages(messages)?;
    let template = serving.chat_template.as_ref().ok_or_else(|| {
        ApiError::bad_request("this model has no chat template; use /v1/completions")
    })?;
    let mut text = template
        .render_with_tools(&msgs, ending == Ending::GenerationPrompt, tools)
        .map_err(|e| ApiError::invalid_param("messages", e.to_string()))?;
    if ending == Ending::ContinueFinal {
        text = open_final(text, &msgs)?;
    }
    serving
        .tokenizer
        .encode(&text, false)
        .map_err(|e| ApiError::invalid_param("messages", format!("cannot tokenize: {e}")))
}

/// The rendered conversation cut just after the last message's content, so that what the
/// template closes it with (an end-of-turn token) is gone and generation continues the message.
fn open_final(mut text: String, msgs: &[model::ChatMessage]) -> Result<String, ApiError> {
    let last = msgs
        .last()
        .filter(|m| m.role == "assistant")
        .ok_or_else(|| {
            ApiError::invalid_param(
                "continue_final_message",
                "the last message must be the assistant's to continue it",
            )
        })?;
    let end = text
        .rfind(&last.content)
        .map(|at| at + last.content.len())
        .ok_or_else(|| {
            ApiError::invalid_param(
                "continue_final_message",
                "the chat template does not write the last message's content as it is",
            )
        })?;
    text.truncate(end);
    Ok(text)
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

/// An assistant turn's calls as templates expect them: each call's `arguments` an object
/// (clients send the JSON text the API returned), as vLLM hands them to templates.
fn template_calls(calls: &[Value]) -> Value {
    Value::Array(
        calls
            .iter()
            .map(|c| {
                let mut c = c.clone();
                if let Some(args) = c.pointer_mut("/function/arguments")
                    && let Some(parsed) = args
                        .as_str()
                        .and_then(|text| serde_json::from_str::<Value>(text).ok())
                {
                    *args = parsed;
                }
                c
            })
            .collect(),
    )
}

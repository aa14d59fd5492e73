//! `POST /v1/completions`: text or token prompts, one or many, streaming or not.

use std::sync::Arc;

use axum::extract::State;
use axum::response::{IntoResponse, Json, Response};
use ferrite_runtime::engine::FinishReason;
use ferrite_runtime::model::Tokenizer;

use super::error::ApiError;
use super::extract::JsonBody;
use super::generate::{self, ChoiceOutput, StreamItem, TokenLogprob};
use super::protocol::{CompletionRequest, Prompt};
use super::response::{CompletionChoice, CompletionLogprobs, Envelope, Head};
use super::state::AppState;
use super::structured;
use super::validate::{self, Generation};

/// The `object` of completion responses and chunks alike.
const OBJECT: &str = "text_completion";

/// OpenAI's default `max_tokens` for completions (vLLM keeps it).
const DEFAULT_MAX_TOKENS: usize = 16;

pub async fn completions(
    State(state): State<Arc<AppState>>,
    JsonBody(req): JsonBody<CompletionRequest>,
) -> Result<Response, ApiError> {
    let arrival = std::time::Instant::now();
    let serving = state.serving()?;
    let model = state.resolve_generation_model(req.model.as_deref()).await?;
    let want = wanted_logprobs(&req)?;
    let vocab = serving.vocab_size;
    let n = validate::choices_per_prompt(&req.sampling)?;
    let seqs = validate::request_sequences(&state, req.prompt.count(), n)?;
    let prompt = req.prompt;
    let prompts = state
        .blocking(move |s| tokenize_prompts(&s.tokenizer, prompt, vocab))
        .await?;
    let max_tokens = prompts
        .iter()
        .map(|p| {
            let default = Some(DEFAULT_MAX_TOKENS);
            validate::max_tokens_for(p.len(), req.max_tokens, default, serving.max_model_len)
        })
        .collect::<Result<Vec<_>, _>>()?;
    let mut g = Generation::new(&req.sampling, want, n, prompts, max_tokens, vocab)?;
    g.adapter = model.adapter;
    // Refuse an overloaded server's request before compiling its grammar, not after.
    generate::admit(&state, serving, seqs, "n")?;
    g.guide = structured::guide(&state, &req.structured).await?;
    let echoes = echoes(&serving.tokenizer, &g, req.echo.unwrap_or(false));
    let receivers = generate::submit(serving, &g, arrival)?;
    let head = Head::new("cmpl", &model.name);
    match validate::stream_mode(&req.sampling) {
        Some(include_usage) => {
            let render = chunk_renderer(state.clone(), head, echoes, g.n);
            let sse = generate::sse(receivers, g.n, include_usage, want.is_some(), render);
            Ok(sse.into_response())
        }
        None => {
            let (choices, usage) = generate::collect(receivers, g.n).await?;
            let choices = whole_choices(&serving.tokenizer, choices, &echoes, g.n, want);
            Ok(Json(head.wrap(OBJECT, choices, Some(usage))).into_response())
        }
    }
}

/// `Some(top)` when the client asked for logprobs; `suffix` and `echo` with logprobs (prompt
/// logprobs) are refused by name.
fn wanted_logprobs(req: &CompletionRequest) -> Result<Option<usize>, ApiError> {
    if req.suffix.is_some() {
        return Err(ApiError::invalid_param("suffix", "suffix is not supported"));
    }
    let want = validate::logprobs_count("logprobs", req.logprobs)?;
    if req.echo.unwrap_or(false) && want.is_some() {
        return Err(ApiError::invalid_param(
            "echo",
            "echo together with logprobs (prompt logprobs) is not supported",
        ));
    }
    Ok(want)
}

/// With `echo`, each prompt's text, which its choices start with; else nothing.
fn echoes(tok: &Tokenizer, g: &Generation, echo: bool) -> Vec<String> {
    if !echo {
        return Vec::new();
    }
    g.prompts
        .iter()
        .map(|p| tok.decode(p, false).unwrap_or_default())
        .collect()
}

/// Turns each stream item into a `text_completion` chunk: the echoed prompt first (when
/// asked), then the text deltas, then (when asked) the usage. Choice `i` is of prompt `i / n`.
fn chunk_renderer(
    state: Arc<AppState>,
    head: Head,
    echoes: Vec<String>,
    n: usize,
) -> impl FnMut(StreamItem) -> Option<Envelope<CompletionChoice>> + Send + 'static {
    move |item: StreamItem| {
        let tok = &state.loaded()?.tokenizer;
        let choice = |index, text: &str, logprobs, finish: Option<FinishReason>| {
            vec![CompletionChoice {
                index,
                text: text.to_string(),
                logprobs,
                finish_reason: finish.map(FinishReason::as_str),
            }]
        };
        match item {
            StreamItem::Start(i) => {
                let text = echoes.get(i / n)?;
                Some(head.wrap(OBJECT, choice(i, text, None, None), None))
            }
            StreamItem::Delta {
                index,
                text,
                logprob,
                finish,
            } => {
                let lp = logprob.map(|l| logprobs(tok, &[l], 0));
                Some(head.wrap(OBJECT, choice(index, &text, lp, finish), None))
            }
            StreamItem::Usage(u) => Some(head.wrap(OBJECT, Vec::new(), Some(u))),
        }
    }
}

/// The choices of a whole response, each after its prompt's echo.
fn whole_choices(
    tok: &Tokenizer,
    choices: Vec<ChoiceOutput>,
    echoes: &[String],
    n: usize,
    want: Option<usize>,
) -> Vec<CompletionChoice> {
    choices
        .into_iter()
        .enumerate()
        .map(|(i, c)| {
            let text = match echoes.get(i / n) {
                Some(e) => format!("{e}{}", c.text),
                None => c.text,
            };
            CompletionChoice {
                index: i,
                text,
                logprobs: want.map(|_| logprobs(tok, &c.logprobs, 0)),
                finish_reason: c.finish_reason.map(FinishReason::as_str),
            }
        })
        .collect()
}

/// A token as text, for logprobs (undecodable bytes show as U+FFFD, as in OpenAI's API).
pub fn token_text(tok: &Tokenizer, id: u32) -> String {
    tok.decode(&[id], false).unwrap_or_default()
}

/// The legacy completions `logprobs` object; `offset` is where the first token's text starts.
fn logprobs(tok: &Tokenizer, lps: &[TokenLogprob], offset: usize) -> CompletionLogprobs {
    let mut out = CompletionLogprobs::default();
    let mut at = offset;
    for l in lps {
        let t = token_text(tok, l.token);
        out.text_offset.push(at);
        at += t.len();
        out.tokens.push(t);
        out.token_logprobs.push(l.logprob);
        out.top_logprobs.push(
            l.top
                .iter()
                .map(|&(id, lp)| (token_text(tok, id), lp))
                .collect(),
        );
    }
    out
}

/// Every form of `prompt` as token-id lists.
fn tokenize_prompts(tok: &Tokenizer, p: Prompt, vocab: usize) -> Result<Vec<Vec<u32>>, ApiError> {
    prompt_ids(tok, p, vocab, "prompt", true)
}

/// The token ids of each prompt of `p` (texts tokenized with the tokenizer's special tokens
/// when `special`), checked against the vocabulary; errors name `param`.
pub(super) fn prompt_ids(
    tok: &Tokenizer,
    p: Prompt,
    vocab: usize,
    param: &str,
    special: bool,
) -> Result<Vec<Vec<u32>>, ApiError> {
    let encode = |s: &str| {
        tok.encode(s, special)
            .map_err(|e| ApiError::invalid_param(param, format!("cannot tokenize: {e}")))
    };
    let lists = match p {
        Prompt::Text(s) => vec![encode(&s)?],
        Prompt::Texts(v) => v.iter().map(|s| encode(s)).collect::<Result<_, _>>()?,
        Prompt::Tokens(t) => vec![t],
        Prompt::TokenLists(v) => v,
    };
    if lists.is_empty() {
        return Err(ApiError::invalid_param(
            param,
            format!("the {param} list is empty"),
        ));
    }
    if let Some(&bad) = lists.iter().flatten().find(|&&t| t as usize >= vocab) {
        return Err(ApiError::invalid_param(
            param,
            format!("token id {bad} is not below the vocabulary size {vocab}"),
        ));
    }
    Ok(lists)
}

//! `POST /v1/completions`: text or token prompts, one or many, streaming or not.

use std::sync::Arc;

use axum::extract::State;
use axum::response::{IntoResponse, Json, Response};
use serde_json::{Map, Value, json};

use super::error::ApiError;
use super::extract::JsonBody;
use super::generate::{self, ChoiceOutput, Generation, StreamItem, TokenLogprob};
use super::protocol::{CompletionRequest, Prompt};
use super::state::AppState;
use crate::model::Tokenizer;

/// OpenAI's default `max_tokens` for completions (vLLM keeps it).
const DEFAULT_MAX_TOKENS: usize = 16;

pub async fn completions(
    State(state): State<Arc<AppState>>,
    JsonBody(req): JsonBody<CompletionRequest>,
) -> Result<Response, ApiError> {
    let arrival = std::time::Instant::now();
    let serving = state.serving()?;
    state.check_model(req.model.as_deref())?;
    if req.suffix.is_some() {
        return Err(ApiError::invalid_param("suffix", "suffix is not supported"));
    }
    let logprobs = generate::logprobs_count("logprobs", req.logprobs)?;
    let echo = req.echo.unwrap_or(false);
    if echo && logprobs.is_some() {
        return Err(ApiError::invalid_param(
            "echo",
            "echo together with logprobs (prompt logprobs) is not supported",
        ));
    }
    let vocab = serving.tokenizer.vocab_size();
    let prompts = tokenize_prompts(&serving.tokenizer, req.prompt, vocab)?;
    let max_tokens = prompts
        .iter()
        .map(|p| {
            generate::max_tokens_for(
                p.len(),
                req.max_tokens,
                Some(DEFAULT_MAX_TOKENS),
                serving.max_model_len,
            )
        })
        .collect::<Result<Vec<_>, _>>()?;
    let (stop, stop_token_ids) = generate::stops(&req.sampling, vocab)?;
    let g = Generation {
        sampling: generate::sampling_params(&req.sampling, logprobs, vocab)?,
        n: generate::choices_per_prompt(&req.sampling)?,
        max_tokens,
        stop,
        stop_token_ids,
        ignore_eos: req.sampling.ignore_eos.unwrap_or(false),
        prompts,
    };
    generate::admit(&state, serving)?;
    let echoes: Vec<String> = if echo {
        g.prompts
            .iter()
            .map(|p| serving.tokenizer.decode(p, false).unwrap_or_default())
            .collect()
    } else {
        Vec::new()
    };
    let receivers = generate::submit(serving, &g, arrival)?;
    let id = format!("cmpl-{}", super::random_id());
    let model = state.served_model_name.clone();
    let created = super::now_secs();

    if req.sampling.stream.unwrap_or(false) {
        let include_usage = req
            .sampling
            .stream_options
            .as_ref()
            .is_some_and(|o| o.include_usage);
        let st = state.clone();
        let n = g.n;
        let render = move |item: StreamItem| -> Option<Value> {
            let tok = &st.loaded()?.tokenizer;
            let base = |choices: Value| {
                json!({"id": id, "object": "text_completion", "created": created,
                       "model": model, "choices": choices})
            };
            match item {
                StreamItem::Start(i) => {
                    let text = echoes.get(i / n)?;
                    Some(base(json!([{"index": i, "text": text, "logprobs": null,
                                      "finish_reason": null}])))
                }
                StreamItem::Delta {
                    index,
                    text,
                    logprob,
                    finish,
                } => {
                    let lp = logprob.map(|l| logprobs_json(tok, &[l], 0));
                    Some(base(json!([{"index": index, "text": text, "logprobs": lp,
                                      "finish_reason": finish.map(|f| f.as_str())}])))
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
        .map(|(i, c)| choice_json(&serving.tokenizer, i, g.n, &echoes, c, logprobs))
        .collect();
    Ok(Json(json!({
        "id": id,
        "object": "text_completion",
        "created": created,
        "model": state.served_model_name,
        "choices": choices,
        "usage": usage.to_json(),
    }))
    .into_response())
}

fn choice_json(
    tok: &Tokenizer,
    i: usize,
    n: usize,
    echoes: &[String],
    c: ChoiceOutput,
    logprobs: Option<usize>,
) -> Value {
    let text = match echoes.get(i / n) {
        Some(e) => format!("{e}{}", c.text),
        None => c.text,
    };
    json!({
        "index": i,
        "text": text,
        "logprobs": logprobs.map(|_| logprobs_json(tok, &c.logprobs, 0)),
        "finish_reason": c.finish_reason.map(|f| f.as_str()),
    })
}

/// A token as text, for logprobs (undecodable bytes show as U+FFFD, as in OpenAI's API).
pub fn token_text(tok: &Tokenizer, id: u32) -> String {
    tok.decode(&[id], false).unwrap_or_default()
}

/// The legacy completions `logprobs` object; `offset` is where the first token's text starts.
fn logprobs_json(tok: &Tokenizer, lps: &[TokenLogprob], offset: usize) -> Value {
    let mut text_offset = Vec::with_capacity(lps.len());
    let mut tokens = Vec::with_capacity(lps.len());
    let mut at = offset;
    for l in lps {
        let t = token_text(tok, l.token);
        text_offset.push(at);
        at += t.len();
        tokens.push(t);
    }
    let top: Vec<Value> = lps
        .iter()
        .map(|l| {
            let mut m = Map::new();
            for &(id, lp) in &l.top {
                m.insert(token_text(tok, id), json!(lp));
            }
            Value::Object(m)
        })
        .collect();
    json!({
        "text_offset": text_offset,
        "token_logprobs": lps.iter().map(|l| l.logprob).collect::<Vec<_>>(),
        "tokens": tokens,
        "top_logprobs": top,
    })
}

/// Every form of `prompt` as token-id lists.
fn tokenize_prompts(tok: &Tokenizer, p: Prompt, vocab: usize) -> Result<Vec<Vec<u32>>, ApiError> {
    let encode = |s: &str| {
        tok.encode(s, true)
            .map_err(|e| ApiError::invalid_param("prompt", format!("cannot tokenize: {e}")))
    };
    let lists = match p {
        Prompt::Text(s) => vec![encode(&s)?],
        Prompt::Texts(v) => v.iter().map(|s| encode(s)).collect::<Result<_, _>>()?,
        Prompt::Tokens(t) => vec![t],
        Prompt::TokenLists(v) => v,
    };
    if lists.is_empty() {
        return Err(ApiError::invalid_param(
            "prompt",
            "the prompt list is empty",
        ));
    }
    if let Some(&bad) = lists.iter().flatten().find(|&&t| t as usize >= vocab) {
        return Err(ApiError::invalid_param(
            "prompt",
            format!("token id {bad} is not below the vocabulary size {vocab}"),
        ));
    }
    Ok(lists)
}

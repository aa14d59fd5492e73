//! `POST /tokenize` and `POST /detokenize`, as vLLM serves them.

use std::sync::Arc;

use axum::extract::State;
use axum::response::Json;

use super::chat::{Ending, chat_prompt};
use super::completions::token_text;
use super::error::ApiError;
use super::extract::JsonBody;
use super::protocol::{DetokenizeRequest, TokenizeRequest};
use super::response::{Detokenized, Tokenized};
use super::state::{AppState, Serving};

pub async fn tokenize(
    State(state): State<Arc<AppState>>,
    JsonBody(req): JsonBody<TokenizeRequest>,
) -> Result<Json<Tokenized>, ApiError> {
    state.serving()?;
    state.resolve_model(req.model.as_deref())?;
    state
        .blocking(move |serving| tokenized(serving, &req))
        .await
        .map(Json)
}

fn tokenized(serving: &Serving, req: &TokenizeRequest) -> Result<Tokenized, ApiError> {
    let tokens = match (&req.prompt, &req.messages) {
        (Some(p), None) => serving
            .tokenizer
            .encode(p, req.add_special_tokens.unwrap_or(true))
            .map_err(|e| ApiError::invalid_param("prompt", format!("cannot tokenize: {e}")))?,
        (None, Some(m)) => {
            let ending = Ending::of(req.add_generation_prompt, req.continue_final_message)?;
            chat_prompt(serving, m, ending, None)?
        }
        _ => {
            return Err(ApiError::bad_request(
                "give exactly one of `prompt` or `messages`",
            ));
        }
    };
    let token_strs = req.return_token_strs.unwrap_or(false).then(|| {
        tokens
            .iter()
            .map(|&t| token_text(&serving.tokenizer, t))
            .collect()
    });
    Ok(Tokenized {
        count: tokens.len(),
        max_model_len: serving.max_model_len,
        tokens,
        token_strs,
    })
}

pub async fn detokenize(
    State(state): State<Arc<AppState>>,
    JsonBody(req): JsonBody<DetokenizeRequest>,
) -> Result<Json<Detokenized>, ApiError> {
    let serving = state.serving()?;
    state.resolve_model(req.model.as_deref())?;
    let vocab = serving.tokenizer.vocab_size();
    let ids = req
        .tokens
        .iter()
        .map(|&t| {
            u32::try_from(t)
                .ok()
                .filter(|&id| (id as usize) < vocab)
                .ok_or_else(|| {
                    ApiError::invalid_param(
                        "tokens",
                        format!("token id {t} is not below the vocabulary size {vocab}"),
                    )
                })
        })
        .collect::<Result<Vec<u32>, _>>()?;
    let text = state
        .blocking(move |serving| {
            serving
                .tokenizer
                .decode(&ids, false)
                .map_err(|e| ApiError::invalid_param("tokens", e.to_string()))
        })
        .await?;
    Ok(Json(Detokenized { prompt: text }))
}

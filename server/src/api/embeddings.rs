//! `POST /v1/embeddings`: each input's final hidden states pooled into one vector (vLLM's
//! pooling runner for a decoder model: the last token's state, L2-normalised, by default;
//! `--pooler-config` picks the mean). Inputs run through the engine as prompts that end at
//! their last token, batched with generation like any other prefill.

use std::sync::Arc;
use std::time::Instant;

use axum::extract::State;
use axum::response::Json;
use base64::Engine as _;
use ferrite_runtime::engine::{Event, EventReceiver, Request, SamplingParams, event_channel};
use serde::{Deserialize, Serialize};

use super::completions::prompt_ids;
use super::error::ApiError;
use super::extract::JsonBody;
use super::generate;
use super::protocol::Prompt;
use super::response::Usage;
use super::state::{AppState, Serving};
use super::validate;

/// The request, as the `openai` SDK and vLLM send it.
#[derive(Debug, Deserialize)]
pub struct EmbeddingRequest {
    pub model: Option<String>,
    /// A text, texts, token ids, or lists of token ids.
    pub input: Prompt,
    /// `float` (the default) or `base64` (little-endian f32 bytes; the `openai` SDK asks for
    /// it unless told otherwise).
    pub encoding_format: Option<String>,
    /// Output width: only the model's own (it is not a Matryoshka model).
    pub dimensions: Option<i64>,
    /// vLLM's: keep only the last this many tokens of each input.
    pub truncate_prompt_tokens: Option<i64>,
    /// vLLM's: add the tokenizer's special tokens (BOS) to text inputs (default true).
    pub add_special_tokens: Option<bool>,
    /// Accepted and ignored, as OpenAI's.
    #[allow(dead_code)]
    pub user: Option<String>,
}

#[derive(Debug, Serialize)]
pub struct EmbeddingResponse {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub data: Vec<EmbeddingData>,
    pub usage: Usage,
}

#[derive(Debug, Serialize)]
pub struct EmbeddingData {
    pub index: usize,
    pub object: &'static str,
    pub embedding: Vector,
}

/// One embedding as the client asked for it.
#[derive(Debug, Serialize)]
#[serde(untagged)]
pub enum Vector {
    Float(Vec<f32>),
    Base64(String),
}

/// How vectors are written out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Encoding {
    Float,
    Base64,
}

pub async fn embeddings(
    State(state): State<Arc<AppState>>,
    JsonBody(req): JsonBody<EmbeddingRequest>,
) -> Result<Json<EmbeddingResponse>, ApiError> {
    let arrival = Instant::now();
    let serving = state.serving()?;
    let model = state.resolve_generation_model(req.model.as_deref()).await?;
    let encoding = encoding(req.encoding_format.as_deref())?;
    check_dimensions(req.dimensions, serving.hidden_size)?;
    let keep = truncation(req.truncate_prompt_tokens, serving.max_model_len)?;
    let seqs = validate::request_sequences(&state, req.input.count(), 1)?;
    let (input, special, vocab) = (
        req.input,
        req.add_special_tokens.unwrap_or(true),
        serving.vocab_size,
    );
    let prompts = state
        .blocking(move |s| prompt_ids(&s.tokenizer, input, vocab, "input", special))
        .await?;
    let prompts = prompts
        .into_iter()
        .map(|p| fit(p, keep, serving.max_model_len))
        .collect::<Result<Vec<_>, _>>()?;
    generate::admit(&state, serving, seqs, "input")?;
    let receivers = submit(serving, prompts, model.adapter, arrival)?;
    let (vectors, usage) = collect(receivers).await?;
    let data = vectors
        .into_iter()
        .enumerate()
        .map(|(index, v)| EmbeddingData {
            index,
            object: "embedding",
            embedding: write(v, encoding),
        })
        .collect();
    Ok(Json(EmbeddingResponse {
        id: format!("embd-{}", super::random_id()),
        object: "list",
        created: super::now_secs(),
        model: model.name,
        data,
        usage,
    }))
}

fn encoding(v: Option<&str>) -> Result<Encoding, ApiError> {
    match v {
        None | Some("float") => Ok(Encoding::Float),
        Some("base64") => Ok(Encoding::Base64),
        Some(other) => Err(ApiError::invalid_param(
            "encoding_format",
            format!("encoding_format must be `float` or `base64`, not `{other}`"),
        )),
    }
}

/// `dimensions` may only name the model's own width: cutting a vector that was not trained
/// for it (Matryoshka) gives poor embeddings, so vLLM refuses it too.
fn check_dimensions(dimensions: Option<i64>, hidden: usize) -> Result<(), ApiError> {
    match dimensions {
        None => Ok(()),
        Some(d) if d == hidden as i64 => Ok(()),
        Some(d) => Err(ApiError::invalid_param(
            "dimensions",
            format!(
                "this model does not support Matryoshka representation: its embeddings have \
                 {hidden} dimensions, and {d} were asked for"
            ),
        )),
    }
}

/// `truncate_prompt_tokens`: how many trailing tokens of each input to keep (`None`: all).
fn truncation(v: Option<i64>, max_model_len: usize) -> Result<Option<usize>, ApiError> {
    match v {
        None | Some(-1) => Ok(None),
        Some(k) if k >= 1 && k as u64 <= max_model_len as u64 => Ok(Some(k as usize)),
        Some(k) => Err(validate::out_of_range(
            "truncate_prompt_tokens",
            format!(
                "truncate_prompt_tokens must be -1 or between 1 and the model's maximum length \
                 {max_model_len}, not {k}"
            ),
        )),
    }
}

/// One input after `truncate_prompt_tokens`, refused when empty or longer than the model.
fn fit(mut p: Vec<u32>, keep: Option<usize>, max_model_len: usize) -> Result<Vec<u32>, ApiError> {
    if let Some(k) = keep
        && p.len() > k
    {
        p.drain(..p.len() - k);
    }
    if p.is_empty() {
        return Err(ApiError::invalid_param(
            "input",
            "an input is empty: there is nothing to embed",
        ));
    }
    if p.len() > max_model_len {
        return Err(ApiError::invalid_param(
            "input",
            format!(
                "This model's maximum context length is {max_model_len} tokens. However, you \
                 requested {} tokens in the input for embedding generation. Please reduce the \
                 length of the input.",
                p.len()
            ),
        ));
    }
    Ok(p)
}

/// One engine request per input, pooled as the server is configured.
fn submit(
    serving: &Serving,
    prompts: Vec<Vec<u32>>,
    adapter: Option<Arc<ferrite_runtime::model::lora::LoraAdapter>>,
    arrival: Instant,
) -> Result<Vec<EventReceiver>, ApiError> {
    prompts
        .into_iter()
        .map(|prompt| {
            let (tx, rx) = event_channel();
            serving
                .engine
                .submit(Request {
                    prompt,
                    sampling: SamplingParams::default(),
                    max_tokens: 0,
                    stop: Vec::new(),
                    stop_token_ids: Vec::new(),
                    ignore_eos: false,
                    events: tx,
                    arrival,
                    group: None,
                    adapter: adapter.clone(),
                    guide: None,
                    pooling: Some(serving.pooling),
                })
                .map_err(|e| ApiError::unavailable(e.to_string(), 5))?;
            Ok(rx)
        })
        .collect()
}

/// Every input's vector, in input order, and the usage (prompt tokens only).
async fn collect(receivers: Vec<EventReceiver>) -> Result<(Vec<Vec<f32>>, Usage), ApiError> {
    let mut vectors = vec![Vec::new(); receivers.len()];
    let mut usage = Usage::default();
    let mut events = generate::merge(receivers);
    let mut remaining = vectors.len();
    use futures_util::StreamExt;
    while remaining > 0 {
        let Some((i, ev)) = events.next().await else {
            return Err(ApiError::internal(
                "embedding failed: the engine stopped before answering",
            ));
        };
        match ev {
            Event::Embedding {
                values,
                prompt_tokens,
                cached_tokens,
            } => {
                vectors[i] = values;
                usage.prompt_tokens += prompt_tokens;
                usage
                    .prompt_tokens_details
                    .get_or_insert_with(Default::default)
                    .cached_tokens += cached_tokens;
                remaining -= 1;
            }
            Event::Failed(msg) => {
                return Err(ApiError::internal(format!("embedding failed: {msg}")));
            }
            Event::Refused(msg) => return Err(ApiError::bad_request(msg)),
            // An embedding request generates nothing.
            Event::Token { .. } | Event::Finished { .. } => {}
        }
    }
    usage.total_tokens = usage.prompt_tokens;
    Ok((vectors, usage))
}

/// `v` as the client asked for it.
fn write(v: Vec<f32>, encoding: Encoding) -> Vector {
    match encoding {
        Encoding::Float => Vector::Float(v),
        Encoding::Base64 => {
            let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
            Vector::Base64(base64::engine::general_purpose::STANDARD.encode(bytes))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_is_little_endian_f32() {
        let Vector::Base64(s) = write(vec![1.0, -2.5], Encoding::Base64) else {
            panic!("not base64");
        };
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(s)
            .expect("base64");
        assert_eq!(
            bytes,
            [1.0f32.to_le_bytes(), (-2.5f32).to_le_bytes()].concat()
        );
    }

    #[test]
    fn truncation_keeps_the_last_tokens_and_refuses_what_does_not_fit() {
        assert_eq!(fit(vec![1, 2, 3, 4], Some(2), 8), Ok(vec![3, 4]));
        assert_eq!(fit(vec![1, 2], None, 2), Ok(vec![1, 2]));
        let e = fit(vec![1, 2, 3], None, 2).expect_err("too long");
        assert!(
            e.message.contains("maximum context length is 2"),
            "{}",
            e.message
        );
        assert!(fit(Vec::new(), None, 2).is_err());
        assert_eq!(truncation(Some(-1), 8), Ok(None));
        assert!(truncation(Some(0), 8).is_err());
        assert!(truncation(Some(9), 8).is_err());
    }

    #[test]
    fn dimensions_other_than_the_models_are_refused() {
        assert!(check_dimensions(None, 576).is_ok());
        assert!(check_dimensions(Some(576), 576).is_ok());
        let e = check_dimensions(Some(64), 576).expect_err("matryoshka");
        assert_eq!(e.param.as_deref(), Some("dimensions"));
        assert!(encoding(Some("int8")).is_err());
    }
}

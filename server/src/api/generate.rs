//! The part of completions and chat completions that is the same: validating the sampling
//! fields, checking lengths against the context, admitting and submitting one engine request
//! per choice, and gathering or streaming the choices' events.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::time::Instant;

use axum::response::sse::{Event as SseEvent, Sse};
use futures_util::stream::{self, BoxStream, Stream, StreamExt};
use serde::Serialize;
use tokio::sync::mpsc;

use super::error::ApiError;
use super::protocol::SamplingFields;
use super::response::Usage;
use super::state::{AppState, Serving};
use ferrite_runtime::engine::core::{Event, FinishReason, Request, RequestGroup};
use ferrite_runtime::engine::sampler::SamplingParams;

/// Largest `n` accepted, as OpenAI's API.
pub const MAX_N: usize = 128;
/// Largest `logprobs` / `top_logprobs`, as OpenAI's API.
pub const MAX_LOGPROBS: usize = 20;

/// A validated request: everything the engine needs for every choice.
#[derive(Debug, Clone)]
pub struct Generation {
    pub prompts: Vec<Vec<u32>>,
    /// Choices per prompt.
    pub n: usize,
    /// Per prompt, after defaults and the context check.
    pub max_tokens: Vec<usize>,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
}

fn out_of_range(param: &str, msg: String) -> ApiError {
    ApiError::invalid_param(param, msg)
}

/// `Some(include_usage)` when the client asked for a stream (and whether it ends with a usage
/// chunk); `None` for a whole response.
pub fn stream_mode(f: &SamplingFields) -> Option<bool> {
    f.stream
        .unwrap_or(false)
        .then(|| f.stream_options.as_ref().is_some_and(|o| o.include_usage))
}

/// Reads the shared sampling fields into engine parameters, with vLLM's defaults.
pub fn sampling_params(
    f: &SamplingFields,
    logprobs: Option<usize>,
    vocab: usize,
) -> Result<SamplingParams, ApiError> {
    let d = SamplingParams::default();
    let top_k = match f.top_k {
        None | Some(0) | Some(-1) => -1,
        Some(k) => i32::try_from(k).map_err(|_| {
            out_of_range(
                "top_k",
                format!("top_k must be -1 (disable) or at least 1, got {k}"),
            )
        })?,
    };
    let mut logit_bias = Vec::new();
    for (k, &b) in f.logit_bias.iter().flatten() {
        let id = k
            .parse::<u32>()
            .ok()
            .filter(|&id| (id as usize) < vocab)
            .ok_or_else(|| {
                out_of_range(
                    "logit_bias",
                    format!("logit_bias key '{k}' is not a token id below {vocab}"),
                )
            })?;
        logit_bias.push((id, b as f32));
    }
    logit_bias.sort_by_key(|&(id, _)| id);
    let p = SamplingParams {
        temperature: f.temperature.map_or(d.temperature, |v| v as f32),
        top_p: f.top_p.map_or(d.top_p, |v| v as f32),
        top_k,
        min_p: f.min_p.map_or(d.min_p, |v| v as f32),
        presence_penalty: f.presence_penalty.map_or(0.0, |v| v as f32),
        frequency_penalty: f.frequency_penalty.map_or(0.0, |v| v as f32),
        repetition_penalty: f.repetition_penalty.map_or(1.0, |v| v as f32),
        // Any integer is a valid seed; negative ones wrap.
        seed: f.seed.map(|s| s as u64),
        logprobs,
        logit_bias,
    };
    p.validate()
        .map_err(|e| ApiError::invalid_param(e.param(), e.to_string()))?;
    Ok(p)
}

/// `n`, with `best_of` accepted only where it changes nothing.
pub fn choices_per_prompt(f: &SamplingFields) -> Result<usize, ApiError> {
    let n = f.n.unwrap_or(1);
    if n < 1 || n as usize > MAX_N {
        return Err(out_of_range(
            "n",
            format!("n must be between 1 and {MAX_N}, got {n}"),
        ));
    }
    if let Some(b) = f.best_of
        && b != n
    {
        return Err(out_of_range(
            "best_of",
            format!("best_of other than n is not supported (got best_of={b}, n={n})"),
        ));
    }
    Ok(n as usize)
}

pub fn logprobs_count(param: &str, v: Option<i64>) -> Result<Option<usize>, ApiError> {
    match v {
        None => Ok(None),
        Some(k) if (0..=MAX_LOGPROBS as i64).contains(&k) => Ok(Some(k as usize)),
        Some(k) => Err(out_of_range(
            param,
            format!("{param} must be between 0 and {MAX_LOGPROBS}, got {k}"),
        )),
    }
}

/// Checks a prompt against the context and settles `max_tokens` (vLLM's messages).
/// `default` is the completions default (16); chat uses the rest of the context.
pub fn max_tokens_for(
    prompt_len: usize,
    requested: Option<i64>,
    default: Option<usize>,
    max_model_len: usize,
) -> Result<usize, ApiError> {
    if prompt_len == 0 {
        return Err(ApiError::invalid_param("prompt", "the prompt is empty"));
    }
    if prompt_len >= max_model_len {
        return Err(ApiError::invalid_param(
            "prompt",
            format!(
                "This model's maximum context length is {max_model_len} tokens. However, your \
                 request has {prompt_len} input tokens, which leaves no room for output. Please \
                 reduce the length of the input."
            ),
        ));
    }
    let room = max_model_len - prompt_len;
    match requested {
        Some(m) if m < 1 => Err(ApiError::invalid_param(
            "max_tokens",
            format!("max_tokens must be at least 1, got {m}"),
        )),
        Some(m) if m as u64 > room as u64 => Err(ApiError::invalid_param(
            "max_tokens",
            format!(
                "This model's maximum context length is {max_model_len} tokens. However, you \
                 requested {} tokens ({prompt_len} in the input, {m} in the completion). Please \
                 reduce the length of the input or completion.",
                prompt_len as u64 + m as u64
            ),
        )),
        Some(m) => Ok(m as usize),
        None => Ok(default.unwrap_or(room).min(room)),
    }
}

/// Stop token ids and the stop strings, checked.
pub fn stops(f: &SamplingFields, vocab: usize) -> Result<(Vec<String>, Vec<u32>), ApiError> {
    let strings = f.stop.clone().map(|s| s.into_vec()).unwrap_or_default();
    let mut ids = Vec::new();
    for &t in f.stop_token_ids.iter().flatten() {
        if t < 0 || t as usize >= vocab {
            return Err(out_of_range(
                "stop_token_ids",
                format!("stop token id {t} is not below the vocabulary size {vocab}"),
            ));
        }
        ids.push(t as u32);
    }
    Ok((strings, ids))
}

/// Refuses work when the waiting queue is already full, so overload is a fast 503 rather than
/// unbounded latency.
pub fn admit(state: &AppState, serving: &Serving) -> Result<(), ApiError> {
    if let Some(limit) = state.max_queue_len
        && serving.engine.queue_depth() >= limit
    {
        return Err(ApiError::overloaded(1));
    }
    Ok(())
}

/// Sends one engine request per choice; choice `p * n + i` is prompt `p`, sample `i` (with
/// seed `seed + i`, so the choices differ yet each replays).
pub fn submit(
    serving: &Serving,
    g: &Generation,
    arrival: Instant,
) -> Result<Vec<mpsc::UnboundedReceiver<Event>>, ApiError> {
    let mut receivers = Vec::with_capacity(g.prompts.len() * g.n);
    for (prompt, &max_tokens) in g.prompts.iter().zip(&g.max_tokens) {
        let group = RequestGroup::new(g.n, max_tokens);
        for i in 0..g.n {
            let (tx, rx) = mpsc::unbounded_channel();
            let mut sampling = g.sampling.clone();
            sampling.seed = sampling.seed.map(|s| s.wrapping_add(i as u64));
            serving
                .engine
                .submit(Request {
                    prompt: prompt.clone(),
                    sampling,
                    max_tokens,
                    stop: g.stop.clone(),
                    stop_token_ids: g.stop_token_ids.clone(),
                    ignore_eos: g.ignore_eos,
                    events: tx,
                    arrival,
                    group: Some(group.clone()),
                })
                .map_err(|e| ApiError::unavailable(e.to_string(), 5))?;
            receivers.push(rx);
        }
    }
    Ok(receivers)
}

/// All choices' events in arrival order, tagged with the choice index. Dropping the stream
/// drops every receiver, which is how a disconnect aborts the engine requests.
pub fn merge(receivers: Vec<mpsc::UnboundedReceiver<Event>>) -> BoxStream<'static, (usize, Event)> {
    stream::select_all(receivers.into_iter().enumerate().map(|(i, rx)| {
        stream::unfold(rx, move |mut rx| async move {
            rx.recv().await.map(|ev| ((i, ev), rx))
        })
        .boxed()
    }))
    .boxed()
}

/// One sampled token with its log-probabilities.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub token: u32,
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

/// A finished choice.
#[derive(Debug, Clone, Default)]
pub struct ChoiceOutput {
    pub text: String,
    pub logprobs: Vec<TokenLogprob>,
    pub finish_reason: Option<FinishReason>,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
}

/// One finished choice's token counts.
#[derive(Debug, Clone, Copy)]
struct ChoiceTokens {
    prompt: usize,
    completion: usize,
    /// Of the prompt, tokens the prefix cache supplied.
    cached: usize,
}

/// Adds one finished choice to a request's usage; the prompt (and its cached part, as the
/// first choice found it) counts once per prompt (choice `index` of `n` per prompt), not once
/// per choice.
fn add_choice(u: &mut Usage, index: usize, n: usize, t: ChoiceTokens) {
    let (prompt, completion) = (t.prompt, t.completion);
    if index.is_multiple_of(n) {
        u.prompt_tokens += prompt;
        u.prompt_tokens_details
            .get_or_insert_with(Default::default)
            .cached_tokens += t.cached;
    }
    u.completion_tokens += completion;
    u.total_tokens = u.prompt_tokens + u.completion_tokens;
}

fn engine_failed(msg: &str) -> ApiError {
    ApiError::internal(format!("generation failed: {msg}"))
}

/// What a streaming endpoint turns into one chunk.
#[derive(Debug, Clone)]
pub enum StreamItem {
    /// Before any token of a choice (chat sends the assistant role here).
    Start(usize),
    Delta {
        index: usize,
        text: String,
        logprob: Option<TokenLogprob>,
        finish: Option<FinishReason>,
    },
    Usage(Usage),
}

/// The one fold over a request's merged events, for whole and streamed responses alike: it
/// counts usage, knows when every choice has finished, and turns an engine failure into an
/// error. A whole response keeps each choice's output; a stream gets an item per event instead.
#[derive(Debug)]
pub struct Fold {
    n: usize,
    remaining: usize,
    usage: Usage,
    /// `Some` for a whole response: the choices as they grow.
    outputs: Option<Vec<ChoiceOutput>>,
    /// Streaming: whether deltas carry log-probabilities.
    stream_logprobs: bool,
}

impl Fold {
    /// For a whole response over `choices` choices, `n` per prompt.
    pub fn whole(choices: usize, n: usize) -> Self {
        Self {
            n,
            remaining: choices,
            usage: Usage::default(),
            outputs: Some(vec![ChoiceOutput::default(); choices]),
            stream_logprobs: false,
        }
    }

    /// For a stream over `choices` choices, `n` per prompt.
    pub fn stream(choices: usize, n: usize, logprobs: bool) -> Self {
        Self {
            n,
            remaining: choices,
            usage: Usage::default(),
            outputs: None,
            stream_logprobs: logprobs,
        }
    }

    pub fn is_done(&self) -> bool {
        self.remaining == 0
    }

    pub fn usage(&self) -> Usage {
        self.usage
    }

    /// Applies one event of choice `index`; returns what to stream, if anything.
    pub fn apply(&mut self, index: usize, ev: Event) -> Result<Option<StreamItem>, ApiError> {
        match ev {
            Event::Token {
                token,
                text,
                logprob,
                top_logprobs,
            } => {
                let lp = TokenLogprob {
                    token,
                    logprob,
                    top: top_logprobs,
                };
                if let Some(c) = self.outputs.as_mut().and_then(|o| o.get_mut(index)) {
                    c.text.push_str(&text);
                    c.logprobs.push(lp);
                    return Ok(None);
                }
                let logprob = self.stream_logprobs.then_some(lp);
                Ok(
                    (!text.is_empty() || logprob.is_some()).then_some(StreamItem::Delta {
                        index,
                        text,
                        logprob,
                        finish: None,
                    }),
                )
            }
            Event::Finished {
                reason,
                text,
                prompt_tokens,
                completion_tokens,
                cached_tokens,
            } => {
                let tokens = ChoiceTokens {
                    prompt: prompt_tokens,
                    completion: completion_tokens,
                    cached: cached_tokens,
                };
                add_choice(&mut self.usage, index, self.n, tokens);
                self.remaining = self.remaining.saturating_sub(1);
                if let Some(c) = self.outputs.as_mut().and_then(|o| o.get_mut(index)) {
                    c.text.push_str(&text);
                    c.finish_reason = Some(reason);
                    c.prompt_tokens = prompt_tokens;
                    c.completion_tokens = completion_tokens;
                    return Ok(None);
                }
                Ok(Some(StreamItem::Delta {
                    index,
                    text,
                    logprob: None,
                    finish: Some(reason),
                }))
            }
            Event::Failed(msg) => Err(engine_failed(&msg)),
        }
    }
}

/// Waits for every choice to finish (whole responses).
pub async fn collect(
    receivers: Vec<mpsc::UnboundedReceiver<Event>>,
    n: usize,
) -> Result<(Vec<ChoiceOutput>, Usage), ApiError> {
    let mut fold = Fold::whole(receivers.len(), n);
    let mut events = merge(receivers);
    while !fold.is_done() {
        let Some((i, ev)) = events.next().await else {
            return Err(engine_failed("the engine stopped"));
        };
        fold.apply(i, ev)?;
    }
    let usage = fold.usage();
    Ok((fold.outputs.unwrap_or_default(), usage))
}

struct StreamState<F> {
    events: BoxStream<'static, (usize, Event)>,
    fold: Fold,
    render: F,
    queued: VecDeque<String>,
    include_usage: bool,
    done: bool,
}

/// The SSE body of a streaming response: `render` turns each item into one typed chunk (or
/// skips it), an engine failure becomes an error chunk, and `data: [DONE]` ends the stream.
pub fn sse<F, T>(
    receivers: Vec<mpsc::UnboundedReceiver<Event>>,
    n: usize,
    include_usage: bool,
    want_logprobs: bool,
    render: F,
) -> Sse<impl Stream<Item = Result<SseEvent, Infallible>>>
where
    F: FnMut(StreamItem) -> Option<T> + Send + 'static,
    T: Serialize,
{
    let choices = receivers.len();
    let mut state = StreamState {
        fold: Fold::stream(choices, n, want_logprobs),
        events: merge(receivers),
        render,
        queued: VecDeque::new(),
        include_usage,
        done: false,
    };
    for i in 0..choices {
        state.push(StreamItem::Start(i));
    }
    Sse::new(stream::unfold(state, |mut s| async move {
        loop {
            if let Some(chunk) = s.queued.pop_front() {
                return Some((Ok(SseEvent::default().data(chunk)), s));
            }
            if s.done {
                return None;
            }
            s.next_chunks().await;
        }
    }))
}

impl<F, T> StreamState<F>
where
    F: FnMut(StreamItem) -> Option<T>,
    T: Serialize,
{
    fn push(&mut self, item: StreamItem) {
        if let Some(chunk) = (self.render)(item).and_then(|v| serde_json::to_string(&v).ok()) {
            self.queued.push_back(chunk);
        }
    }

    fn end(&mut self) {
        self.queued.push_back("[DONE]".into());
        self.done = true;
    }

    fn fail(&mut self, e: ApiError) {
        self.queued.push_back(e.to_json());
        self.end();
    }

    async fn next_chunks(&mut self) {
        let Some((index, ev)) = self.events.next().await else {
            self.fail(engine_failed("the engine stopped"));
            return;
        };
        match self.fold.apply(index, ev) {
            Err(e) => self.fail(e),
            Ok(item) => {
                if let Some(item) = item {
                    self.push(item);
                }
                if self.fold.is_done() {
                    if self.include_usage {
                        self.push(StreamItem::Usage(self.fold.usage()));
                    }
                    self.end();
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn max_tokens_defaults_and_limits() {
        assert_eq!(max_tokens_for(10, None, Some(16), 100), Ok(16));
        assert_eq!(max_tokens_for(10, None, None, 100), Ok(90));
        assert_eq!(max_tokens_for(95, None, Some(16), 100), Ok(5));
        assert_eq!(max_tokens_for(10, Some(90), None, 100), Ok(90));
        let e = max_tokens_for(10, Some(91), None, 100).expect_err("too many");
        assert!(e.message.contains("101 tokens"), "{}", e.message);
        let e = max_tokens_for(10, Some(0), None, 100).expect_err("zero");
        assert_eq!(e.param.as_deref(), Some("max_tokens"));
        let e = max_tokens_for(100, None, None, 100).expect_err("prompt fills context");
        assert_eq!(e.param.as_deref(), Some("prompt"));
        assert!(max_tokens_for(0, None, None, 100).is_err());
    }

    #[test]
    fn sampling_fields_map_to_engine_params_with_named_errors() {
        let f = SamplingFields {
            temperature: Some(0.0),
            top_k: Some(0),
            seed: Some(-1),
            logit_bias: Some([("5".to_string(), -100.0)].into()),
            ..Default::default()
        };
        let p = sampling_params(&f, Some(2), 10).expect("valid");
        assert_eq!(p.top_k, -1);
        assert_eq!(p.seed, Some(u64::MAX));
        assert_eq!(p.logit_bias, vec![(5, -100.0)]);
        assert_eq!(p.logprobs, Some(2));

        let bad = |f: SamplingFields, param: &str| {
            let e = sampling_params(&f, None, 10).expect_err(param);
            assert_eq!(e.param.as_deref(), Some(param), "{}", e.message);
        };
        bad(
            SamplingFields {
                temperature: Some(3.0),
                ..Default::default()
            },
            "temperature",
        );
        bad(
            SamplingFields {
                top_p: Some(0.0),
                ..Default::default()
            },
            "top_p",
        );
        bad(
            SamplingFields {
                logit_bias: Some([("10".to_string(), 1.0)].into()),
                ..Default::default()
            },
            "logit_bias",
        );
        bad(
            SamplingFields {
                frequency_penalty: Some(-3.0),
                ..Default::default()
            },
            "frequency_penalty",
        );
    }

    #[test]
    fn n_and_best_of() {
        let f = |n, best_of| SamplingFields {
            n,
            best_of,
            ..Default::default()
        };
        assert_eq!(choices_per_prompt(&f(None, None)), Ok(1));
        assert_eq!(choices_per_prompt(&f(Some(3), Some(3))), Ok(3));
        assert!(choices_per_prompt(&f(Some(0), None)).is_err());
        assert!(choices_per_prompt(&f(Some(2), Some(4))).is_err());
    }

    #[test]
    fn usage_counts_each_prompt_once() {
        let mut u = Usage::default();
        for i in 0..4 {
            let t = ChoiceTokens {
                prompt: 10 + i / 2,
                completion: 3,
                cached: i,
            };
            add_choice(&mut u, i, 2, t);
        }
        let mut want = Usage::new(21, 12);
        // Choices 0 and 2 are the first of their prompts.
        want.prompt_tokens_details =
            Some(super::super::response::PromptTokensDetails { cached_tokens: 2 });
        assert_eq!(u, want);
    }
}

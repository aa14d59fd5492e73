//! The part of completions and chat completions that runs a [`Generation`]: admitting and
//! submitting one engine request per choice, and gathering or streaming the choices' events.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::time::Instant;

use axum::response::sse::{Event as SseEvent, Sse};
use futures_util::stream::{self, BoxStream, Stream, StreamExt};
use serde::Serialize;

use super::error::ApiError;
use super::response::Usage;
use super::state::{AppState, Serving};
use super::validate::{Generation, out_of_range};
use ferrite_runtime::engine::{
    Event, EventReceiver, FinishReason, Request, RequestGroup, event_channel,
};

/// Admits a request of `seqs` sequences: with `--max-queue-len`, the queue's depth after
/// adding all of them must stay within it, so overload is a fast 503 rather than unbounded
/// latency (a request that could never fit is a 400 naming `param`, what made it that many).
pub fn admit(
    state: &AppState,
    serving: &Serving,
    seqs: usize,
    param: &str,
) -> Result<(), ApiError> {
    let Some(limit) = state.limits.max_queue_len else {
        return Ok(());
    };
    if seqs > limit {
        return Err(out_of_range(
            param,
            format!(
                "this request adds {seqs} sequences to the queue; this server queues at most \
                 {limit}"
            ),
        ));
    }
    if serving.engine.queue_depth() + seqs > limit {
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
) -> Result<Vec<EventReceiver>, ApiError> {
    let mut receivers = Vec::with_capacity(g.prompts.len() * g.n);
    for (prompt, &max_tokens) in g.prompts.iter().zip(&g.max_tokens) {
        let group = RequestGroup::new(g.n, max_tokens);
        for i in 0..g.n {
            let (tx, rx) = event_channel();
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
                    adapter: g.adapter.clone(),
                    guide: g.guide.clone(),
                    pooling: None,
                })
                .map_err(|e| ApiError::unavailable(e.to_string(), 5))?;
            receivers.push(rx);
        }
    }
    Ok(receivers)
}

/// All choices' events in arrival order, tagged with the choice index. Dropping the stream
/// drops every receiver, which is how a disconnect aborts the engine requests.
pub fn merge(receivers: Vec<EventReceiver>) -> BoxStream<'static, (usize, Event)> {
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
            Event::Refused(msg) => Err(ApiError::bad_request(msg)),
            // Only embedding requests, which do not come here, are pooled.
            Event::Embedding { .. } => Err(engine_failed("the engine pooled a generation")),
        }
    }
}

/// Waits for every choice to finish (whole responses).
pub async fn collect(
    receivers: Vec<EventReceiver>,
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
    receivers: Vec<EventReceiver>,
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

//! The request-side types the engine and its callers share: one sequence to generate, the
//! events it streams back and why it finished. A leaf: the loop (`core`), the output
//! processor and the statistics records all use these, and none of them is used here (vLLM
//! keeps the same in `v1/engine/__init__.py`).

use std::sync::Arc;
use std::sync::atomic::AtomicUsize;
use std::time::Instant;

use tokio::sync::mpsc;

use super::sampler::SamplingParams;
use super::structured::Guide;
use crate::model::lora::LoraAdapter;

/// Events one sequence may have waiting for its reader. A client that reads a stream slower
/// than the engine writes it would otherwise make the server hold every token it has not read
/// yet (with `n` choices and logprobs, megabytes per request); past this many the sequence
/// fails with [`SLOW_READER`] instead.
pub const EVENT_BACKLOG: usize = 512;

/// Why a sequence whose reader fell [`EVENT_BACKLOG`] events behind was ended.
pub const SLOW_READER: &str = "the client did not read the response fast enough";

pub type EventSender = mpsc::Sender<Event>;
pub type EventReceiver = mpsc::Receiver<Event>;

/// The channel a request's events travel on, bounded at [`EVENT_BACKLOG`].
pub fn event_channel() -> (EventSender, EventReceiver) {
    mpsc::channel(EVENT_BACKLOG)
}

/// One sequence to generate.
#[derive(Debug)]
pub struct Request {
    pub prompt: Vec<u32>,
    pub sampling: SamplingParams,
    pub max_tokens: usize,
    pub stop: Vec<String>,
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    /// Dropping the receiver aborts the request within one step.
    pub events: EventSender,
    /// When the API received it: TTFT, queue time and e2e latency count from here.
    pub arrival: Instant,
    /// The API request this sequence is one choice of (`None`: a request of its own).
    pub group: Option<Arc<RequestGroup>>,
    /// The LoRA adapter to run it with (`None`: the base model).
    pub adapter: Option<Arc<LoraAdapter>>,
    /// The grammar its output must follow (structured outputs), compiled by the caller.
    pub guide: Option<Guide>,
    /// An embedding request: the prompt's final hidden states pooled into one vector
    /// ([`Event::Embedding`]) instead of generated tokens.
    pub pooling: Option<Pooling>,
}

/// How an embedding request's final hidden states (after the model's last norm) become one
/// vector, as vLLM's pooler does for a decoder model (`--pooler-config`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pooling {
    pub kind: PoolingKind,
    /// Scale the vector to unit length (L2).
    pub normalize: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PoolingKind {
    /// The last token's state: what a causal model has seen the whole prompt in (vLLM's
    /// default for decoder models).
    #[default]
    Last,
    /// The mean over every prompt token's state. Each token must be computed, so the prefix
    /// cache is not read for it.
    Mean,
}

/// What the `n` sequences of one API request share, so that per-request metrics (`n`,
/// `max_tokens`, the longest generation) are recorded once, when the last one finishes.
#[derive(Debug)]
pub struct RequestGroup {
    pub n: usize,
    pub max_tokens: usize,
    pub(crate) remaining: AtomicUsize,
    pub(crate) max_generated: AtomicUsize,
}

impl RequestGroup {
    pub fn new(n: usize, max_tokens: usize) -> Arc<Self> {
        Arc::new(Self {
            n,
            max_tokens,
            remaining: AtomicUsize::new(n),
            max_generated: AtomicUsize::new(0),
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    Stop,
    Length,
    Abort,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// A generated token and the text it released (possibly empty while a stop string may be
    /// forming or a UTF-8 character is incomplete).
    Token {
        token: u32,
        text: String,
        logprob: f32,
        top_logprobs: Vec<(u32, f32)>,
    },
    Finished {
        reason: FinishReason,
        /// Held-back text released at the end.
        text: String,
        prompt_tokens: usize,
        completion_tokens: usize,
        /// Leading prompt tokens whose keys and values came from the prefix cache.
        cached_tokens: usize,
    },
    /// An embedding request's vector ([`Request::pooling`]): its only event.
    Embedding {
        values: Vec<f32>,
        prompt_tokens: usize,
        cached_tokens: usize,
    },
    /// The engine could not run this request (the text says why).
    Failed(String),
    /// The request itself cannot be carried on: its grammar went past the server's limits
    /// partway (the API answers 400, as for a grammar refused up front).
    Refused(String),
}

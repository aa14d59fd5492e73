//! The serving engine: sequences and their states, the scheduler (a pure decision of what runs
//! each step), the sampler, the output processor, and the statistics records the loop fills.
//! [`start`] is the one way to build and run an engine; the request-side types a caller sends
//! and receives are re-exported here.

pub mod core;
pub mod detok;
mod output;
mod pooler;
pub mod request;
pub mod sampler;
pub mod scheduler;
pub mod start;
pub mod stats;
pub mod stop;
pub mod structured;

pub use core::EngineHandle;
pub use request::{
    Event, EventReceiver, FinishReason, Pooling, PoolingKind, Request, RequestGroup, event_channel,
};
pub use sampler::SamplingParams;
pub use start::{
    Budget, EngineConfig, EngineInfo, KvSizing, Scheduling, StartError, Started, start,
};
pub use structured::{GrammarSpec, Grammars, Guide, StructuredError};

//! The serving engine: sequences and their states, the scheduler (a pure decision of what runs
//! each step), the sampler, the output processor, and the statistics records the loop fills.

pub mod core;
pub mod detok;
mod output;
pub mod request;
pub mod sampler;
pub mod scheduler;
pub mod stats;
pub mod stop;

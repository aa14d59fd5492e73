//! The serving engine: sequences and their states, the scheduler (a pure decision of what runs
//! each step), and the sampler.

pub mod core;
pub mod detok;
pub mod sampler;
pub mod scheduler;
pub mod stop;

//! The OpenAI-compatible HTTP layer. It knows requests, never tensors.

pub mod error;

//! Shared by the bench binaries.

pub mod chat;
pub mod roofline;
pub mod stats;
pub mod text;

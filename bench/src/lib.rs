//! Shared by the bench binaries.

pub mod roofline;
pub mod stats;

//! Shared by the bench binaries.

pub mod stats;

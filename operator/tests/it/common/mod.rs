//! Shared by several test binaries; each uses only part of it.
#![allow(dead_code)]

pub mod apiserver;
pub mod chart;
pub mod e2e;
pub mod servers;
pub mod tls;
pub mod validate;

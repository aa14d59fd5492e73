//! Shared helpers of the server's tests.
#![allow(dead_code)]

pub mod server;

//! ferrite-testkit's own tests, one binary.

mod cluster;
mod layering;
mod ports;
mod supply_chain;

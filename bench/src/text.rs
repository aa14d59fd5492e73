//! Words the bench binaries build prompts from: English words are about one token each with a
//! leading space, so a prompt of N words is about N tokens.

pub const WORDS: &[&str] = &[
    "river", "mountain", "library", "engine", "garden", "harbor", "signal", "lantern", "meadow",
    "compass", "orchard", "glacier", "market", "violin", "canyon", "beacon",
];

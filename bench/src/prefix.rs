//! bench-prefix-cache: a multi-turn chat workload that rewards reusing computed prefixes.
//!
//! 16 conversations share one ~1,000-token system prompt; each has 4 turns, and each turn's
//! prompt holds the earlier turns (the user's questions and the server's own answers), as a
//! chat client sends them. Workers (the concurrency) take conversations from a queue and play
//! their turns in order, streaming `/v1/chat/completions`. Every run starts with a fresh nonce
//! at the head of the system prompt, so nothing is cached from an earlier run.
//!
//! Targets take turns (alternating their order across `--repeat` runs). It reports TTFT p50/p99,
//! output tokens/s and the hit rate the responses' `usage.prompt_tokens_details.cached_tokens`
//! show, then the TTFT ratios of each target against the first (the baseline), per run and as a
//! mean with its 95% interval.

use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow};
use clap::Parser;
use ferrite_bench::chat::{Turn, stream_chat};
use ferrite_bench::stats::{alternating, percentile, ratio_summary};
use ferrite_bench::text::WORDS;
use serde_json::{Value, json};

#[derive(Debug, Parser)]
#[command(about = "Multi-turn chat with a shared system prompt: prefix-cache TTFT")]
struct Args {
    /// `name=http://host:port` (repeatable); the first is the baseline of the ratios.
    #[arg(long = "target", required = true)]
    targets: Vec<String>,
    /// The `model` field to send.
    #[arg(long, default_value = "default")]
    model: String,
    #[arg(long, default_value_t = 16)]
    conversations: usize,
    #[arg(long, default_value_t = 4)]
    turns: usize,
    /// Approximate system-prompt length in tokens.
    #[arg(long, default_value_t = 1000)]
    system_tokens: usize,
    /// Tokens per answer (`ignore_eos`, so every answer has this many).
    #[arg(long, default_value_t = 48)]
    max_tokens: usize,
    #[arg(long, default_value_t = 8)]
    concurrency: usize,
    /// Runs per target, alternating the order of the targets.
    #[arg(long, default_value_t = 1)]
    repeat: usize,
    /// Per-request timeout in seconds.
    #[arg(long, default_value_t = 600)]
    timeout: u64,
}

/// One target's figures over one run.
#[derive(Debug, Clone, Default)]
struct RunResult {
    wall: f64,
    turns: Vec<Turn>,
}

impl RunResult {
    fn ttfts(&self) -> Vec<f64> {
        self.turns.iter().map(|t| t.ttft).collect()
    }
    fn ttft_p50(&self) -> f64 {
        percentile(&self.ttfts(), 50.0)
    }
    fn output_tok_per_s(&self) -> f64 {
        self.turns.iter().map(|t| t.output_tokens).sum::<usize>() as f64 / self.wall
    }
    fn hit_rate(&self) -> f64 {
        let prompt: usize = self.turns.iter().map(|t| t.prompt_tokens).sum();
        let cached: usize = self.turns.iter().map(|t| t.cached_tokens).sum();
        cached as f64 / prompt.max(1) as f64
    }
}

/// About `tokens` tokens of policy text, headed by the run's nonce.
fn system_prompt(nonce: usize, tokens: usize) -> String {
    let mut s = format!("Session {nonce}. You are the assistant of a travel office. Rules:");
    // English words are about one token each with a leading space.
    for k in 0..tokens.saturating_sub(16) {
        if k % 12 == 0 {
            s.push_str(&format!("\n{}.", k / 12 + 1));
        }
        s.push(' ');
        s.push_str(WORDS[(k * 5 + k / 7) % WORDS.len()]);
    }
    s
}

fn question(conversation: usize, turn: usize) -> String {
    let topic = WORDS[(conversation * 3 + turn) % WORDS.len()];
    format!(
        "Traveller {conversation}, question {turn}: what does rule {} say about the {topic}?",
        1 + (conversation * 7 + turn * 3) % 40
    )
}

/// Streams one chat turn; returns what it saw and the answer's text.
fn chat(
    agent: &ureq::Agent,
    base: &str,
    args: &Args,
    messages: &[Value],
) -> Result<(Turn, String)> {
    stream_chat(
        agent,
        base,
        json!({
            "model": args.model,
            "messages": messages,
            "max_tokens": args.max_tokens,
            "temperature": 0,
            "ignore_eos": true,
        }),
    )
}

fn run(base: &str, args: &Args, nonce: usize) -> Result<RunResult> {
    let agent = ureq::AgentBuilder::new()
        .timeout(Duration::from_secs(args.timeout))
        // llama-server closes the connection after each stream; never reuse one.
        .max_idle_connections(0)
        .build();
    let system = system_prompt(nonce, args.system_tokens);
    let next = AtomicUsize::new(0);
    let turns = Mutex::new(Vec::new());
    let started = Instant::now();
    std::thread::scope(|scope| -> Result<()> {
        let workers: Vec<_> = (0..args.concurrency)
            .map(|_| {
                scope.spawn(|| -> Result<()> {
                    loop {
                        let c = next.fetch_add(1, Ordering::SeqCst);
                        if c >= args.conversations {
                            return Ok(());
                        }
                        let mut messages = vec![json!({"role": "system", "content": system})];
                        for t in 0..args.turns {
                            messages.push(json!({"role": "user", "content": question(c, t)}));
                            let (turn, answer) = chat(&agent, base, args, &messages)?;
                            messages.push(json!({"role": "assistant", "content": answer}));
                            turns.lock().map_err(|_| anyhow!("poisoned"))?.push(turn);
                        }
                    }
                })
            })
            .collect();
        for w in workers {
            w.join().map_err(|_| anyhow!("worker panicked"))??;
        }
        Ok(())
    })?;
    let turns = turns.into_inner().map_err(|_| anyhow!("poisoned"))?;
    Ok(RunResult {
        wall: started.elapsed().as_secs_f64(),
        turns,
    })
}

fn print_run(name: &str, r: &RunResult) {
    let t = r.ttfts();
    println!(
        "{name:>16}: {} turns in {:.1} s, TTFT p50 {:.3} s p99 {:.3} s, output {:.1} tok/s, \
         prompt tokens cached {:.1}%",
        r.turns.len(),
        r.wall,
        percentile(&t, 50.0),
        percentile(&t, 99.0),
        r.output_tok_per_s(),
        r.hit_rate() * 100.0
    );
}

fn main() -> Result<()> {
    let args = Args::parse();
    let targets: Vec<(String, String)> = args
        .targets
        .iter()
        .map(|s| {
            s.split_once('=')
                .map(|(n, u)| (n.to_string(), u.trim_end_matches('/').to_string()))
                .ok_or_else(|| anyhow!("--target wants name=url, got {s}"))
        })
        .collect::<Result<_>>()?;
    println!(
        "{} conversations x {} turns, ~{}-token shared system prompt, {} tokens per answer, \
         concurrency {}",
        args.conversations, args.turns, args.system_tokens, args.max_tokens, args.concurrency
    );
    let mut results: Vec<Vec<RunResult>> = vec![Vec::new(); targets.len()];
    for rep in 0..args.repeat.max(1) {
        for ti in alternating(targets.len(), rep) {
            let (name, base) = &targets[ti];
            // A distinct nonce per target and run: no run finds another's prefixes cached.
            let nonce = 1000 * (rep + 1) + ti;
            let r = run(base, &args, nonce).with_context(|| format!("target {name}"))?;
            print_run(name, &r);
            results[ti].push(r);
        }
    }
    println!(
        "\nTTFT p50 ratios against {} (lower is faster):",
        targets[0].0
    );
    for (ti, (name, _)) in targets.iter().enumerate().skip(1) {
        let ratios: Vec<f64> = results[ti]
            .iter()
            .zip(&results[0])
            .map(|(r, base)| r.ttft_p50() / base.ttft_p50())
            .collect();
        println!("{name:>16}: {}", ratio_summary(&ratios));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn system_prompts_differ_only_by_their_nonce() {
        let (a, b) = (system_prompt(1, 1000), system_prompt(2, 1000));
        assert_ne!(a, b);
        assert_eq!(a.split_whitespace().count(), b.split_whitespace().count());
        let words = a.split_whitespace().count();
        assert!((1000..1200).contains(&words), "{words} words");
    }
}

//! The output processor (vLLM v1's `OutputProcessor`): turns each sampled token into what the
//! client sees — detokenized text held back while a stop string may be forming, and the
//! finish decision — and keeps each request's timestamps for the statistics records. It knows
//! requests and text, never the scheduler or tensors.

use std::sync::atomic::Ordering;
use std::time::Instant;

use super::detok::IncrementalDecoder;
use super::request::{Event, FinishReason, Request};
use super::sampler::Sampled;
use super::stats::{FinishedRequest, IterationStats, RequestParams};
use super::stop::{StopChecker, StopUpdate};
use crate::model::{ModelError, Tokenizer};

/// One request's output state.
#[derive(Debug)]
pub(crate) struct RequestOutput {
    decoder: IncrementalDecoder,
    stop: StopChecker,
    /// Whether the prompt's tokens were counted (once per request, however often a preemption
    /// recomputes it).
    prompt_counted: bool,
    /// Leading prompt tokens the prefix cache supplied at its first admission.
    pub(crate) cached_tokens: usize,
    arrival: Instant,
    first_scheduled: Option<Instant>,
    first_token: Option<Instant>,
    last_token: Option<Instant>,
}

impl RequestOutput {
    pub(crate) fn new(req: &Request) -> Self {
        Self {
            decoder: IncrementalDecoder::default(),
            stop: StopChecker::new(req.stop.clone()),
            prompt_counted: false,
            cached_tokens: 0,
            arrival: req.arrival,
            first_scheduled: None,
            first_token: None,
            last_token: None,
        }
    }

    /// The sequence ended: its record, and the event that tells the client.
    pub(crate) fn finished(
        &self,
        req: &Request,
        prompt_len: usize,
        generated: usize,
        reason: FinishReason,
        text: String,
        stats: &mut IterationStats,
    ) -> Event {
        let now = Instant::now();
        if !self.prompt_counted {
            stats.num_prompt_tokens += prompt_len as u64;
        }
        let decode_time = self
            .first_token
            .zip(self.last_token)
            .map(|(first, last)| secs(first, last));
        let request = match &req.group {
            None => Some(RequestParams {
                n: 1,
                max_tokens: req.max_tokens,
                max_generation_tokens: generated,
            }),
            Some(g) => {
                g.max_generated.fetch_max(generated, Ordering::SeqCst);
                (g.remaining.fetch_sub(1, Ordering::SeqCst) == 1).then(|| RequestParams {
                    n: g.n,
                    max_tokens: g.max_tokens,
                    max_generation_tokens: g.max_generated.load(Ordering::SeqCst),
                })
            }
        };
        stats.finished.push(FinishedRequest {
            reason,
            e2e_latency: secs(self.arrival, now),
            inference_time: self.first_scheduled.map(|s| secs(s, now)),
            prefill_time: self
                .first_scheduled
                .zip(self.first_token)
                .map(|(s, f)| secs(s, f)),
            decode_time,
            time_per_output_token: decode_time
                .filter(|_| generated > 1)
                .map(|d| d / (generated - 1) as f64),
            prompt_tokens: prompt_len,
            generation_tokens: generated,
            request,
        });
        Event::Finished {
            reason,
            text,
            prompt_tokens: prompt_len,
            completion_tokens: generated,
            cached_tokens: self.cached_tokens,
        }
    }
}

/// What a sampled token did: the event for the client and, when it ends the sequence, why and
/// the held-back text to release with the finish.
#[derive(Debug)]
pub(crate) struct TokenOutput {
    pub event: Event,
    pub finish: Option<(FinishReason, String)>,
}

/// Shared by all requests: the tokenizer and the model's limits.
#[derive(Debug)]
pub(crate) struct OutputProcessor {
    tokenizer: Tokenizer,
    eos_token_ids: Vec<u32>,
    max_model_len: usize,
}

fn secs(from: Instant, to: Instant) -> f64 {
    to.saturating_duration_since(from).as_secs_f64()
}

impl OutputProcessor {
    pub(crate) fn new(tokenizer: Tokenizer, eos_token_ids: Vec<u32>, max_model_len: usize) -> Self {
        Self {
            tokenizer,
            eos_token_ids,
            max_model_len,
        }
    }

    /// The request was part of a step that started at `at`: its queue time ends there.
    pub(crate) fn scheduled(
        &self,
        out: &mut RequestOutput,
        at: Instant,
        stats: &mut IterationStats,
    ) {
        if out.first_scheduled.is_none() {
            out.first_scheduled = Some(at);
            stats.queue_times.push(secs(out.arrival, at));
        }
    }

    /// Processes the token just appended to `tokens` (prompt and output, `prompt_len` of them
    /// the prompt). `grammar_done`: the request's grammar allows nothing after this token.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn token(
        &self,
        out: &mut RequestOutput,
        req: &Request,
        tokens: &[u32],
        prompt_len: usize,
        sampled: Sampled,
        grammar_done: bool,
        stats: &mut IterationStats,
    ) -> Result<TokenOutput, ModelError> {
        let now = Instant::now();
        stats.num_generation_tokens += 1;
        match out.last_token {
            None => {
                out.first_token = Some(now);
                stats.time_to_first_tokens.push(secs(out.arrival, now));
            }
            Some(prev) => stats.inter_token_latencies.push(secs(prev, now)),
        }
        out.last_token = Some(now);
        if !out.prompt_counted {
            out.prompt_counted = true;
            stats.num_prompt_tokens += prompt_len as u64;
        }
        let token = sampled.token;
        let is_eos = !req.ignore_eos && self.eos_token_ids.contains(&token);
        let is_stop_id = req.stop_token_ids.contains(&token);
        let mut finish = None;
        let mut text = String::new();
        let mut stopped_by_string = false;
        if is_eos || is_stop_id {
            finish = Some(FinishReason::Stop);
        } else {
            let delta = out.decoder.next(&self.tokenizer, &tokens[prompt_len..])?;
            match out.stop.push(&delta) {
                StopUpdate::Delta(t) => text = t,
                StopUpdate::Stopped(t) => {
                    text = t;
                    finish = Some(FinishReason::Stop);
                    stopped_by_string = true;
                }
            }
            if grammar_done {
                finish = Some(FinishReason::Stop);
            }
        }
        let n_out = tokens.len() - prompt_len;
        if finish.is_none() && (n_out >= req.max_tokens || tokens.len() >= self.max_model_len) {
            finish = Some(FinishReason::Length);
        }
        // Text held back for a stop string that never completed belongs to the output, unless a
        // stop string did match.
        let finish = finish.map(|reason| {
            let tail = if stopped_by_string {
                String::new()
            } else {
                out.stop.flush()
            };
            (reason, tail)
        });
        Ok(TokenOutput {
            event: Event::Token {
                token,
                text,
                logprob: sampled.logprob,
                top_logprobs: sampled.top,
            },
            finish,
        })
    }
}

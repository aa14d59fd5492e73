//! Token sampling: penalties, temperature, top-k / top-p / min-p, and a per-request seeded RNG.
//!
//! Everything here works on one request's logit row, so a request's result depends only on its
//! own logits, parameters and RNG state, never on the rest of the batch.

use super::structured::TokenMask;
pub use crate::model::driver::argmax;

/// OpenAI/vLLM sampling parameters of one request.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    pub top_p: f32,
    /// 0 or negative disables top-k (vLLM uses -1).
    pub top_k: i32,
    pub min_p: f32,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    /// 1.0 disables; > 1 discourages tokens already in the prompt or output.
    pub repetition_penalty: f32,
    pub seed: Option<u64>,
    /// Number of top alternatives to report per token (None: no logprobs).
    pub logprobs: Option<usize>,
    /// Added to the logits of these token ids before anything else (OpenAI `logit_bias`).
    pub logit_bias: Vec<(u32, f32)>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_p: 1.0,
            top_k: -1,
            min_p: 0.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            seed: None,
            logprobs: None,
            logit_bias: Vec::new(),
        }
    }
}

/// Why a set of parameters is rejected (the API answers 400 with this text).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SamplingError {
    #[error("temperature must be between 0 and 2, got {0}")]
    Temperature(f32),
    #[error("top_p must be in (0, 1], got {0}")]
    TopP(f32),
    #[error("top_k must be -1 (disable) or at least 1, got {0}")]
    TopK(i32),
    #[error("min_p must be in [0, 1], got {0}")]
    MinP(f32),
    #[error("{name} must be between -2 and 2, got {value}")]
    Penalty { name: &'static str, value: f32 },
    #[error("repetition_penalty must be in (0, 2], got {0}")]
    RepetitionPenalty(f32),
    #[error("logprobs must be between 0 and 20, got {0}")]
    Logprobs(usize),
    #[error("logit_bias values must be between -100 and 100, got {0}")]
    LogitBias(f32),
}

impl SamplingError {
    /// The request field at fault.
    pub fn param(&self) -> &'static str {
        match self {
            SamplingError::Temperature(_) => "temperature",
            SamplingError::TopP(_) => "top_p",
            SamplingError::TopK(_) => "top_k",
            SamplingError::MinP(_) => "min_p",
            SamplingError::Penalty { name, .. } => name,
            SamplingError::RepetitionPenalty(_) => "repetition_penalty",
            SamplingError::Logprobs(_) => "logprobs",
            SamplingError::LogitBias(_) => "logit_bias",
        }
    }
}

impl SamplingParams {
    pub fn validate(&self) -> Result<(), SamplingError> {
        if !(0.0..=2.0).contains(&self.temperature) {
            return Err(SamplingError::Temperature(self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(SamplingError::TopP(self.top_p));
        }
        if self.top_k == 0 || self.top_k < -1 {
            return Err(SamplingError::TopK(self.top_k));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(SamplingError::MinP(self.min_p));
        }
        for (name, value) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if !(-2.0..=2.0).contains(&value) {
                return Err(SamplingError::Penalty { name, value });
            }
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty <= 2.0) {
            return Err(SamplingError::RepetitionPenalty(self.repetition_penalty));
        }
        if let Some(n) = self.logprobs
            && n > 20
        {
            return Err(SamplingError::Logprobs(n));
        }
        if let Some(&(_, b)) = self
            .logit_bias
            .iter()
            .find(|(_, b)| !(-100.0..=100.0).contains(b))
        {
            return Err(SamplingError::LogitBias(b));
        }
        Ok(())
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }
}

/// SplitMix64: tiny, fast, and fully determined by its seed, so a seeded request replays
/// exactly whatever else runs beside it.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    /// A seed from the clock and a counter, for requests without `seed`.
    pub fn from_entropy() -> Self {
        use std::sync::atomic::{AtomicU64, Ordering};
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        Rng(t ^ COUNTER.fetch_add(0x9E37_79B9_7F4A_7C15, Ordering::Relaxed))
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// The chosen token and, when asked for, log-probabilities from the model's distribution.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampled {
    pub token: u32,
    /// Log-probability of `token` under the unmodified model distribution.
    pub logprob: f32,
    /// The `logprobs` most likely tokens with their log-probabilities, best first.
    pub top: Vec<(u32, f32)>,
}

/// Applies OpenAI presence/frequency penalties (over generated tokens) and the
/// HF/vLLM repetition penalty (over prompt and generated tokens) in place.
pub fn apply_penalties(
    logits: &mut [f32],
    params: &SamplingParams,
    prompt: &[u32],
    output: &[u32],
) {
    if params.repetition_penalty != 1.0 {
        let mut seen = std::collections::HashSet::new();
        for &t in prompt.iter().chain(output) {
            if seen.insert(t)
                && let Some(l) = logits.get_mut(t as usize)
            {
                *l = if *l > 0.0 {
                    *l / params.repetition_penalty
                } else {
                    *l * params.repetition_penalty
                };
            }
        }
    }
    if params.presence_penalty != 0.0 || params.frequency_penalty != 0.0 {
        let mut counts: std::collections::HashMap<u32, u32> = std::collections::HashMap::new();
        for &t in output {
            *counts.entry(t).or_default() += 1;
        }
        for (t, c) in counts {
            if let Some(l) = logits.get_mut(t as usize) {
                *l -= params.presence_penalty + params.frequency_penalty * c as f32;
            }
        }
    }
}

fn log_softmax(logits: &[f32]) -> Vec<f32> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let lse = logits
        .iter()
        .map(|&l| ((l - max) as f64).exp())
        .sum::<f64>()
        .ln() as f32
        + max;
    logits.iter().map(|&l| l - lse).collect()
}

/// Picks the next token from one logit row, among the tokens `mask` allows when the request
/// has a grammar.
pub fn sample(
    raw_logits: &[f32],
    params: &SamplingParams,
    prompt: &[u32],
    output: &[u32],
    mask: Option<&TokenMask>,
    rng: &mut Rng,
) -> Sampled {
    let mut logits = raw_logits.to_vec();
    for &(t, b) in &params.logit_bias {
        if let Some(l) = logits.get_mut(t as usize) {
            *l += b;
        }
    }
    if let Some(mask) = mask {
        mask.apply(&mut logits);
    }
    apply_penalties(&mut logits, params, prompt, output);
    let token = if params.is_greedy() {
        argmax(&logits)
    } else {
        sample_filtered(&logits, params, rng)
    };
    let (logprob, top) = match params.logprobs {
        None => (0.0, Vec::new()),
        Some(k) => {
            let lp = log_softmax(raw_logits);
            let mut idx: Vec<u32> = (0..lp.len() as u32).collect();
            let k = k.min(idx.len());
            if k > 0 {
                idx.select_nth_unstable_by(k - 1, |&a, &b| {
                    lp[b as usize].total_cmp(&lp[a as usize])
                });
            }
            idx.truncate(k);
            idx.sort_by(|&a, &b| lp[b as usize].total_cmp(&lp[a as usize]).then(a.cmp(&b)));
            let top = idx.into_iter().map(|i| (i, lp[i as usize])).collect();
            (lp[token as usize], top)
        }
    };
    Sampled {
        token,
        logprob,
        top,
    }
}

/// Temperature, then top-k, top-p and min-p filtering, then one draw.
///
/// Nothing here sorts the vocabulary: at the OpenAI defaults (temperature 1, no filters) a
/// draw is one pass over the weights, and top-k / top-p sort only the few tokens they keep
/// (sorting 49k-150k ids per sampled token cost milliseconds on the engine thread, more than
/// a decode step's forward at small batches).
fn sample_filtered(logits: &[f32], params: &SamplingParams, rng: &mut Rng) -> u32 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    // Unnormalized probabilities; tokens a grammar masked out (-inf) get exactly 0.
    let weights: Vec<f64> = logits
        .iter()
        .map(|&l| (((l - max) / params.temperature) as f64).exp())
        .collect();
    match kept(logits, &weights, params) {
        None => draw(
            (0..logits.len() as u32).filter(|&i| weights[i as usize] > 0.0),
            &weights,
            rng,
        ),
        Some(ids) => draw(ids.into_iter(), &weights, rng),
    }
}

/// The tokens top-k, then top-p (of what top-k kept), then min-p keep; `None` when no filter
/// is set (every token of nonzero weight).
fn kept(logits: &[f32], weights: &[f64], params: &SamplingParams) -> Option<Vec<u32>> {
    if params.top_k <= 0 && params.top_p >= 1.0 && params.min_p <= 0.0 {
        return None;
    }
    let best_first = |a: &u32, b: &u32| {
        logits[*b as usize]
            .total_cmp(&logits[*a as usize])
            .then(a.cmp(b))
    };
    let mut ids: Vec<u32> = (0..logits.len() as u32)
        .filter(|&i| weights[i as usize] > 0.0)
        .collect();
    if params.top_k > 0 && (params.top_k as usize) < ids.len() {
        let k = params.top_k as usize;
        ids.select_nth_unstable_by(k - 1, best_first);
        ids.truncate(k);
    }
    if params.top_p < 1.0 {
        keep_top_p(&mut ids, weights, params.top_p as f64, best_first);
    }
    if params.min_p > 0.0 {
        // Relative to the most likely token, whose weight is 1 (the max was subtracted).
        let floor = params.min_p as f64;
        let best = ids.iter().copied().min_by(best_first);
        ids.retain(|&i| weights[i as usize] >= floor || Some(i) == best);
    }
    Some(ids)
}

/// Keeps the smallest set of most likely `ids` whose mass reaches `top_p` of theirs (at least
/// one), leaving them best first. It sorts only a head of the candidates that already holds
/// that mass: 64 of them, then 8 times as many, until it does.
fn keep_top_p(
    ids: &mut Vec<u32>,
    weights: &[f64],
    top_p: f64,
    best_first: impl Fn(&u32, &u32) -> std::cmp::Ordering + Copy,
) {
    let total: f64 = ids.iter().map(|&i| weights[i as usize]).sum();
    let target = top_p * total;
    let mut head = 64.min(ids.len());
    loop {
        if head < ids.len() {
            ids.select_nth_unstable_by(head - 1, best_first);
        }
        let mass: f64 = ids[..head].iter().map(|&i| weights[i as usize]).sum();
        if mass >= target || head == ids.len() {
            ids[..head].sort_by(best_first);
            let mut acc = 0.0;
            let keep = ids[..head]
                .iter()
                .position(|&i| {
                    acc += weights[i as usize];
                    acc >= target
                })
                .map_or(head, |p| p + 1);
            ids.truncate(keep);
            return;
        }
        head = (head * 8).min(ids.len());
    }
}

/// One draw from `ids` in proportion to their weights.
fn draw(ids: impl Iterator<Item = u32> + Clone, weights: &[f64], rng: &mut Rng) -> u32 {
    let mass: f64 = ids.clone().map(|i| weights[i as usize]).sum();
    let mut r = rng.next_f64() * mass;
    let mut last = 0;
    for i in ids {
        let w = weights[i as usize];
        if r < w {
            return i;
        }
        r -= w;
        last = i;
    }
    // Rounding left a sliver of mass past the last token: it is the draw.
    last
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params() -> SamplingParams {
        SamplingParams::default()
    }

    #[test]
    fn greedy_picks_the_argmax_with_ties_to_the_lowest_id() {
        let p = SamplingParams {
            temperature: 0.0,
            ..params()
        };
        let s = sample(&[1.0, 3.0, 3.0, -1.0], &p, &[], &[], None, &mut Rng::new(1));
        assert_eq!(s.token, 1);
    }

    #[test]
    fn same_seed_same_draws_different_seed_different_draws() {
        let logits: Vec<f32> = (0..100).map(|i| (i as f32 * 0.37).sin()).collect();
        let p = params();
        let draw = |seed| {
            let mut rng = Rng::new(seed);
            (0..50)
                .map(|_| sample(&logits, &p, &[], &[], None, &mut rng).token)
                .collect::<Vec<_>>()
        };
        assert_eq!(draw(7), draw(7));
        assert_ne!(draw(7), draw(8));
    }

    #[test]
    fn sampling_frequencies_follow_the_softmax() {
        let logits = [0.0f32, (2.0f32).ln(), (7.0f32).ln()]; // probabilities 0.1, 0.2, 0.7
        let mut rng = Rng::new(42);
        let mut counts = [0usize; 3];
        let n = 20_000;
        for _ in 0..n {
            counts[sample(&logits, &params(), &[], &[], None, &mut rng).token as usize] += 1;
        }
        for (c, want) in counts.iter().zip([0.1, 0.2, 0.7]) {
            let got = *c as f64 / n as f64;
            assert!((got - want).abs() < 0.015, "{counts:?}");
        }
    }

    #[test]
    fn top_k_top_p_and_min_p_restrict_the_candidates() {
        let logits = [0.0f32, (2.0f32).ln(), (7.0f32).ln()];
        let mut rng = Rng::new(3);
        let only = |p: SamplingParams, rng: &mut Rng| {
            let mut seen = std::collections::BTreeSet::new();
            for _ in 0..2000 {
                seen.insert(sample(&logits, &p, &[], &[], None, rng).token);
            }
            seen.into_iter().collect::<Vec<_>>()
        };
        let cases = [
            (
                SamplingParams {
                    top_k: 1,
                    ..params()
                },
                vec![2],
            ),
            (
                SamplingParams {
                    top_k: 2,
                    ..params()
                },
                vec![1, 2],
            ),
            (
                SamplingParams {
                    top_p: 0.7,
                    ..params()
                },
                vec![2],
            ),
            (
                SamplingParams {
                    top_p: 0.85,
                    ..params()
                },
                vec![1, 2],
            ),
            (
                SamplingParams {
                    min_p: 0.2,
                    ..params()
                },
                vec![1, 2],
            ),
            (
                SamplingParams {
                    min_p: 0.5,
                    ..params()
                },
                vec![2],
            ),
        ];
        for (p, want) in cases {
            assert_eq!(only(p.clone(), &mut rng), want, "{p:?}");
        }
    }

    #[test]
    fn low_temperature_concentrates_mass() {
        let logits = [0.0f32, 1.0, 1.5];
        let mut rng = Rng::new(5);
        let p = SamplingParams {
            temperature: 0.05,
            ..params()
        };
        let hits = (0..1000)
            .filter(|_| sample(&logits, &p, &[], &[], None, &mut rng).token == 2)
            .count();
        assert!(hits > 995, "{hits}");
    }

    #[test]
    fn penalties_follow_openai_and_hf_definitions() {
        let mut l = vec![2.0f32, -2.0, 1.0, 1.0];
        let p = SamplingParams {
            presence_penalty: 0.5,
            frequency_penalty: 0.25,
            ..params()
        };
        apply_penalties(&mut l, &p, &[3], &[2, 2, 0]);
        // token 2 twice: 1 - 0.5 - 0.5; token 0 once: 2 - 0.5 - 0.25; prompt-only token 3 untouched.
        assert_eq!(l, vec![1.25, -2.0, 0.0, 1.0]);
        let mut l = vec![2.0f32, -2.0, 1.0];
        let p = SamplingParams {
            repetition_penalty: 2.0,
            ..params()
        };
        apply_penalties(&mut l, &p, &[0], &[1, 1]);
        assert_eq!(l, vec![1.0, -4.0, 1.0]);
    }

    #[test]
    fn logprobs_come_from_the_raw_distribution() {
        let logits = [0.0f32, (3.0f32).ln()]; // p = 0.25, 0.75
        let p = SamplingParams {
            temperature: 0.0,
            logprobs: Some(2),
            ..params()
        };
        let s = sample(&logits, &p, &[], &[], None, &mut Rng::new(0));
        assert_eq!(s.token, 1);
        assert!((s.logprob - 0.75f32.ln()).abs() < 1e-6);
        assert_eq!(s.top.len(), 2);
        assert_eq!(s.top[0].0, 1);
        assert!((s.top[1].1 - 0.25f32.ln()).abs() < 1e-6);
    }

    /// The filters as first written: sort every token best first, cut top-k, normalize,
    /// take the top-p prefix, then the min-p prefix.
    fn reference_support(logits: &[f32], p: &SamplingParams) -> Vec<u32> {
        let mut idx: Vec<u32> = (0..logits.len() as u32)
            .filter(|&i| logits[i as usize] > f32::NEG_INFINITY)
            .collect();
        idx.sort_by(|&a, &b| {
            logits[b as usize]
                .total_cmp(&logits[a as usize])
                .then(a.cmp(&b))
        });
        if p.top_k > 0 {
            idx.truncate(p.top_k as usize);
        }
        let max = logits[idx[0] as usize];
        let w: Vec<f64> = idx
            .iter()
            .map(|&i| (((logits[i as usize] - max) / p.temperature) as f64).exp())
            .collect();
        let sum: f64 = w.iter().sum();
        let mut keep = idx.len();
        if p.top_p < 1.0 {
            let mut acc = 0.0;
            keep = w
                .iter()
                .position(|x| {
                    acc += x / sum;
                    acc >= p.top_p as f64
                })
                .map_or(keep, |i| i + 1);
        }
        if p.min_p > 0.0 {
            let n = w
                .iter()
                .take_while(|&&x| x >= p.min_p as f64)
                .count()
                .max(1);
            keep = keep.min(n);
        }
        let mut out = idx[..keep].to_vec();
        out.sort_unstable();
        out
    }

    proptest::proptest! {
        #[test]
        fn filters_keep_what_sorting_the_vocabulary_keeps(
            logits in proptest::collection::vec(-8.0f32..8.0, 1..600),
            masked in proptest::collection::vec(proptest::bool::weighted(0.3), 600),
            top_k in proptest::prop_oneof![proptest::strategy::Just(-1), 1..80i32],
            top_p in proptest::prop_oneof![proptest::strategy::Just(1.0f32), 0.05f32..1.0],
            min_p in proptest::prop_oneof![proptest::strategy::Just(0.0f32), 0.0f32..0.9],
            temperature in 0.1f32..2.0,
        ) {
            // Some tokens masked out as a grammar does, never all of them.
            let mut logits = logits;
            for (l, &m) in logits.iter_mut().zip(&masked).skip(1) {
                if m {
                    *l = f32::NEG_INFINITY;
                }
            }
            let p = SamplingParams { top_k, top_p, min_p, temperature, ..params() };
            let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let weights: Vec<f64> = logits
                .iter()
                .map(|&l| (((l - max) / temperature) as f64).exp())
                .collect();
            let mut got = kept(&logits, &weights, &p).unwrap_or_else(|| {
                (0..logits.len() as u32).filter(|&i| weights[i as usize] > 0.0).collect()
            });
            got.sort_unstable();
            let want = reference_support(&logits, &p);
            // Rounding may move the top-p boundary by one token where the mass lands exactly
            // on it; anything else must match.
            proptest::prop_assert!(
                got == want || (top_p < 1.0 && got.len().abs_diff(want.len()) == 1),
                "got {got:?}, want {want:?}"
            );
            let mut rng = Rng::new(7);
            for _ in 0..20 {
                let t = sample(&logits, &p, &[], &[], None, &mut rng).token;
                proptest::prop_assert!(got.contains(&t));
            }
        }
    }

    #[test]
    fn validation_rejects_out_of_range_values() {
        assert!(params().validate().is_ok());
        let bad = [
            SamplingParams {
                temperature: -0.1,
                ..params()
            },
            SamplingParams {
                temperature: 2.5,
                ..params()
            },
            SamplingParams {
                top_p: 0.0,
                ..params()
            },
            SamplingParams {
                top_k: 0,
                ..params()
            },
            SamplingParams {
                top_k: -5,
                ..params()
            },
            SamplingParams {
                min_p: 1.5,
                ..params()
            },
            SamplingParams {
                presence_penalty: 3.0,
                ..params()
            },
            SamplingParams {
                repetition_penalty: 0.0,
                ..params()
            },
            SamplingParams {
                logprobs: Some(21),
                ..params()
            },
        ];
        for b in bad {
            assert!(b.validate().is_err(), "{b:?} accepted");
        }
    }
}

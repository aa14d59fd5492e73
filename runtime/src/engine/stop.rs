//! Stop strings over streamed text: text is released only once no stop string can still begin
//! inside it, so a stop string is never leaked, even when it spans tokens. Matching is
//! incremental (a KMP automaton per stop string, fed each new byte once), so a token costs
//! time in its own text and the stop strings' count, never in the length of the output so far,
//! and the text held back is at most the longest stop string.

/// Watches the output text of one sequence for its stop strings.
#[derive(Debug, Clone, Default)]
pub struct StopChecker {
    stops: Vec<Matcher>,
    /// Text decoded but not yet released to the client.
    pending: String,
}

/// What a new piece of text did to the output.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StopUpdate {
    /// Text that is now safe to send (may be empty while a stop string might be forming).
    Delta(String),
    /// A stop string matched: the final text to send before finishing (stop string excluded).
    Stopped(String),
}

/// One stop string's automaton: `state` bytes of it match the end of the text seen so far.
#[derive(Debug, Clone)]
struct Matcher {
    pattern: Vec<u8>,
    /// `fail[i]`: the longest proper prefix of `pattern[..=i]` that is also its suffix.
    fail: Vec<usize>,
    state: usize,
}

impl Matcher {
    fn new(pattern: &str) -> Self {
        let p = pattern.as_bytes();
        let mut fail = vec![0; p.len()];
        let mut k = 0;
        for i in 1..p.len() {
            while k > 0 && p[i] != p[k] {
                k = fail[k - 1];
            }
            if p[i] == p[k] {
                k += 1;
            }
            fail[i] = k;
        }
        Self {
            pattern: p.to_vec(),
            fail,
            state: 0,
        }
    }

    /// Feeds one byte; true when the whole pattern now ends here.
    fn feed(&mut self, b: u8) -> bool {
        while self.state > 0 && self.pattern[self.state] != b {
            self.state = self.fail[self.state - 1];
        }
        if self.pattern[self.state] == b {
            self.state += 1;
        }
        if self.state == self.pattern.len() {
            self.state = self.fail[self.state - 1];
            return true;
        }
        false
    }
}

impl StopChecker {
    pub fn new(stops: Vec<String>) -> Self {
        let stops = stops
            .iter()
            .filter(|s| !s.is_empty())
            .map(|s| Matcher::new(s))
            .collect();
        Self {
            stops,
            pending: String::new(),
        }
    }

    /// Feeds the text a new token released. The sequence stops at the first byte that
    /// completes any stop string; the output ends where that stop string begins.
    pub fn push(&mut self, delta: &str) -> StopUpdate {
        let base = self.pending.len();
        self.pending.push_str(delta);
        for (i, &b) in delta.as_bytes().iter().enumerate() {
            let end = base + i + 1;
            let mut matched = None;
            for m in &mut self.stops {
                if m.feed(b) {
                    let start = end - m.pattern.len();
                    matched = Some(matched.map_or(start, |s: usize| s.min(start)));
                }
            }
            if let Some(start) = matched {
                let out = self.pending.get(..start).unwrap_or("").to_string();
                self.pending.clear();
                return StopUpdate::Stopped(out);
            }
        }
        // Hold back the longest suffix that could still begin a stop string. It starts where a
        // stop string's first byte matched, so on a character boundary of valid UTF-8.
        let hold = self.stops.iter().map(|m| m.state).max().unwrap_or(0);
        let mut safe = self.pending.len().saturating_sub(hold);
        while !self.pending.is_char_boundary(safe) {
            safe -= 1;
        }
        let rest = self.pending.split_off(safe);
        StopUpdate::Delta(std::mem::replace(&mut self.pending, rest))
    }

    /// Text held back at the end of generation (no stop string matched): release it.
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds `pieces` as successive tokens; returns the concatenated output and whether it stopped.
    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let mut c = StopChecker::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = String::new();
        for p in pieces {
            match c.push(p) {
                StopUpdate::Delta(d) => out.push_str(&d),
                StopUpdate::Stopped(d) => {
                    out.push_str(&d);
                    return (out, true);
                }
            }
        }
        out.push_str(&c.flush());
        (out, false)
    }

    #[test]
    fn stop_string_inside_one_token() {
        assert_eq!(
            run(&["END"], &["hello ", "worldEND", "more"]),
            ("hello world".into(), true)
        );
    }

    #[test]
    fn stop_string_across_tokens_is_never_leaked() {
        let mut c = StopChecker::new(vec!["STOP".into()]);
        assert_eq!(c.push("abc ST"), StopUpdate::Delta("abc ".into()));
        assert_eq!(c.push("O"), StopUpdate::Delta(String::new()));
        assert_eq!(c.push("P and"), StopUpdate::Stopped(String::new()));
    }

    #[test]
    fn held_back_prefix_is_released_when_it_turns_out_not_to_stop() {
        assert_eq!(
            run(&["STOP"], &["a ST", "ART b"]),
            ("a START b".into(), false)
        );
        assert_eq!(run(&["\n\n"], &["x\n", "y"]), ("x\ny".into(), false));
        // A partial match that restarts inside itself (KMP's failure links).
        assert_eq!(run(&["aab"], &["a", "a", "a", "b"]), ("a".into(), true));
        assert_eq!(run(&["abab"], &["aba", "abab"]), ("aba".into(), true));
    }

    #[test]
    fn first_completed_stop_string_wins() {
        assert_eq!(run(&["bb", "a"], &["xxbba"]), ("xx".into(), true));
        // Two complete at the same byte: the output ends at the earlier start.
        assert_eq!(run(&["b", "ab"], &["xab"]), ("x".into(), true));
    }

    #[test]
    fn multibyte_text_and_stops() {
        assert_eq!(run(&["é!"], &["caf", "é", "!", "x"]), ("caf".into(), true));
        assert_eq!(run(&["éa"], &["caf", "é", "b"]), ("caféb".into(), false));
    }

    #[test]
    fn held_back_text_is_bounded_by_the_longest_stop_string() {
        let mut c = StopChecker::new(vec!["xyz".into()]);
        for _ in 0..10_000 {
            assert!(matches!(c.push("xy"), StopUpdate::Delta(_)));
            assert!(c.pending.len() <= 2, "{}", c.pending.len());
        }
    }

    #[test]
    fn no_stops_streams_everything() {
        assert_eq!(run(&[], &["a", "b", "c"]), ("abc".into(), false));
    }
}

//! Incremental detokenization with stop strings: text is released only once no stop string can
//! still begin inside it, so a stop string is never leaked, even when it spans tokens.

/// Turns a growing list of token ids into text deltas.
#[derive(Debug, Clone, Default)]
pub struct StopChecker {
    stops: Vec<String>,
    /// Text decoded from all output tokens so far.
    text: String,
    /// Bytes of `text` already released to the client.
    released: usize,
}

/// What a new token did to the output.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StopUpdate {
    /// Text that is now safe to send (may be empty while a stop string might be forming).
    Delta(String),
    /// A stop string matched: the final text to send before finishing (stop string excluded).
    Stopped(String),
}

impl StopChecker {
    pub fn new(stops: Vec<String>) -> Self {
        let stops = stops.into_iter().filter(|s| !s.is_empty()).collect();
        Self {
            stops,
            ..Default::default()
        }
    }

    /// Feeds the full decoded output text after a new token.
    pub fn update(&mut self, full_text: &str) -> StopUpdate {
        self.text.clear();
        self.text.push_str(full_text);
        // Search from a little before the released point: a stop string may straddle it.
        let max_stop = self.stops.iter().map(|s| s.len()).max().unwrap_or(0);
        let mut from = self.released.saturating_sub(max_stop);
        while !self.text.is_char_boundary(from) {
            from -= 1;
        }
        let first_match = self
            .stops
            .iter()
            .filter_map(|s| self.text[from..].find(s.as_str()).map(|i| from + i))
            .min();
        if let Some(at) = first_match {
            let out = self
                .text
                .get(self.released.min(at)..at)
                .unwrap_or("")
                .to_string();
            self.released = at;
            return StopUpdate::Stopped(out);
        }
        // Hold back an incomplete UTF-8 sequence and any suffix that could start a stop string.
        let mut safe = self.text.trim_end_matches('\u{FFFD}').len();
        for s in &self.stops {
            for k in (1..s.len()).rev() {
                if s.is_char_boundary(k) && self.text.ends_with(&s[..k]) {
                    safe = safe.min(self.text.len() - k);
                    break;
                }
            }
        }
        let safe = safe.max(self.released);
        let out = self.text.get(self.released..safe).unwrap_or("").to_string();
        self.released = safe;
        StopUpdate::Delta(out)
    }

    /// Text held back at the end of generation (no stop string matched): release it.
    pub fn flush(&mut self) -> String {
        let end = self
            .text
            .trim_end_matches('\u{FFFD}')
            .len()
            .max(self.released);
        let out = self.text.get(self.released..end).unwrap_or("").to_string();
        self.released = end;
        out
    }

    /// Everything released so far.
    pub fn released_text(&self) -> &str {
        &self.text[..self.released]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds `pieces` as successive tokens; returns the concatenated output and whether it stopped.
    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let mut c = StopChecker::new(stops.iter().map(|s| s.to_string()).collect());
        let mut full = String::new();
        let mut out = String::new();
        for p in pieces {
            full.push_str(p);
            match c.update(&full) {
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
        assert_eq!(c.update("abc ST"), StopUpdate::Delta("abc ".into()));
        assert_eq!(c.update("abc STO"), StopUpdate::Delta(String::new()));
        assert_eq!(c.update("abc STOP and"), StopUpdate::Stopped(String::new()));
        assert_eq!(c.released_text(), "abc ");
    }

    #[test]
    fn held_back_prefix_is_released_when_it_turns_out_not_to_stop() {
        assert_eq!(
            run(&["STOP"], &["a ST", "ART b"]),
            ("a START b".into(), false)
        );
        assert_eq!(run(&["\n\n"], &["x\n", "y"]), ("x\ny".into(), false));
    }

    #[test]
    fn earliest_of_several_stop_strings_wins() {
        assert_eq!(run(&["bb", "a"], &["xxbba"]), ("xx".into(), true));
    }

    #[test]
    fn incomplete_utf8_is_held_back() {
        let mut c = StopChecker::new(vec![]);
        assert_eq!(c.update("caf\u{FFFD}"), StopUpdate::Delta("caf".into()));
        assert_eq!(c.update("café"), StopUpdate::Delta("é".into()));
    }

    #[test]
    fn no_stops_streams_everything() {
        assert_eq!(run(&[], &["a", "b", "c"]), ("abc".into(), false));
    }
}

//! A parser for the Prometheus text exposition format (0.0.4, and the OpenMetrics `# EOF`
//! trailer), written to the format's grammar: metric names, label sets with escaped values,
//! float values including `NaN` and `±Inf`, optional timestamps, `# HELP` / `# TYPE` comments.
//! Scaling decisions rest on these numbers, so a malformed line is an error, not a guess.

/// One sample line.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: Vec<(String, String)>,
    pub value: f64,
    pub timestamp_ms: Option<i64>,
}

impl Sample {
    pub fn label(&self, key: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("line {line}: {message}")]
pub struct ParseError {
    pub line: usize,
    pub message: String,
}

/// Parses a whole exposition into its samples, in order.
pub fn parse(text: &str) -> Result<Vec<Sample>, ParseError> {
    let mut samples = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        if let Some(sample) = parse_line(raw).map_err(|message| ParseError {
            line: i + 1,
            message,
        })? {
            samples.push(sample);
        }
    }
    Ok(samples)
}

/// One line of an exposition: its sample, or `None` for a blank line or a comment. The
/// streaming scraper reads line by line with this, keeping only the samples it wants.
pub fn parse_line(raw: &str) -> Result<Option<Sample>, String> {
    let line = raw.trim_start_matches([' ', '\t']).trim_end_matches('\r');
    if line.trim().is_empty() {
        return Ok(None);
    }
    if let Some(comment) = line.strip_prefix('#') {
        check_comment(comment)?;
        return Ok(None);
    }
    Cursor::new(line).sample().map(Some)
}

/// `# HELP name text` and `# TYPE name type` must name a valid metric; other comments are free.
fn check_comment(comment: &str) -> Result<(), String> {
    let mut words = comment.split_whitespace();
    match words.next() {
        Some("HELP") => {
            let name = words.next().ok_or("HELP without a metric name")?;
            valid_metric_name(name)
        }
        Some("TYPE") => {
            let name = words.next().ok_or("TYPE without a metric name")?;
            valid_metric_name(name)?;
            match words.next() {
                Some(
                    "counter" | "gauge" | "histogram" | "summary" | "untyped" | "unknown" | "info"
                    | "stateset" | "gaugehistogram",
                ) => Ok(()),
                Some(t) => Err(format!("unknown metric type {t:?}")),
                None => Err("TYPE without a type".into()),
            }
        }
        _ => Ok(()),
    }
}

fn valid_metric_name(name: &str) -> Result<(), String> {
    let mut chars = name.chars();
    let ok = chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == ':')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':');
    if ok {
        Ok(())
    } else {
        Err(format!("invalid metric name {name:?}"))
    }
}

/// A cursor over one sample line.
struct Cursor<'a> {
    s: &'a str,
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn new(s: &'a str) -> Self {
        Self { s, pos: 0 }
    }

    fn peek(&self) -> Option<char> {
        self.s[self.pos..].chars().next()
    }

    fn bump(&mut self) -> Option<char> {
        let c = self.peek()?;
        self.pos += c.len_utf8();
        Some(c)
    }

    fn skip_blanks(&mut self) -> bool {
        let start = self.pos;
        while matches!(self.peek(), Some(' ' | '\t')) {
            self.pos += 1;
        }
        self.pos > start
    }

    fn expect(&mut self, want: char) -> Result<(), String> {
        match self.bump() {
            Some(c) if c == want => Ok(()),
            Some(c) => Err(format!(
                "expected {want:?} at column {}, found {c:?}",
                self.pos
            )),
            None => Err(format!("expected {want:?}, found end of line")),
        }
    }

    /// `[a-zA-Z_:][a-zA-Z0-9_:]*` for metric names; labels exclude ':'.
    fn identifier(&mut self, colon: bool) -> Result<String, String> {
        let start = self.pos;
        while let Some(c) = self.peek() {
            let first = self.pos == start;
            let ok = c.is_ascii_alphabetic()
                || c == '_'
                || (colon && c == ':')
                || (!first && c.is_ascii_digit());
            if !ok {
                break;
            }
            self.pos += 1;
        }
        if self.pos == start {
            return Err(format!("expected a name at column {}", start + 1));
        }
        Ok(self.s[start..self.pos].to_string())
    }

    fn sample(&mut self) -> Result<Sample, String> {
        let name = self.identifier(true)?;
        let mut spaced = self.skip_blanks();
        let labels = if self.peek() == Some('{') {
            let labels = self.labels()?;
            spaced = self.skip_blanks();
            labels
        } else {
            Vec::new()
        };
        if !spaced {
            return Err("expected a space before the value".into());
        }
        let value = self.number()?;
        let timestamp_ms = if self.skip_blanks() && self.peek().is_some() {
            let t = self.word();
            Some(
                t.parse::<i64>()
                    .map_err(|_| format!("invalid timestamp {t:?}"))?,
            )
        } else {
            None
        };
        self.skip_blanks();
        if let Some(c) = self.peek() {
            return Err(format!("unexpected {c:?} after the sample"));
        }
        Ok(Sample {
            name,
            labels,
            value,
            timestamp_ms,
        })
    }

    fn labels(&mut self) -> Result<Vec<(String, String)>, String> {
        self.expect('{')?;
        let mut labels: Vec<(String, String)> = Vec::new();
        loop {
            self.skip_blanks();
            if self.peek() == Some('}') {
                self.bump();
                return Ok(labels);
            }
            let key = self.identifier(false)?;
            self.skip_blanks();
            self.expect('=')?;
            self.skip_blanks();
            let value = self.quoted()?;
            if labels.iter().any(|(k, _)| *k == key) {
                return Err(format!("label {key:?} appears twice"));
            }
            labels.push((key, value));
            self.skip_blanks();
            match self.bump() {
                Some(',') => continue,
                Some('}') => return Ok(labels),
                Some(c) => return Err(format!("expected ',' or '}}' in labels, found {c:?}")),
                None => return Err("unterminated label set".into()),
            }
        }
    }

    /// A double-quoted label value with `\\`, `\"` and `\n` escapes.
    fn quoted(&mut self) -> Result<String, String> {
        self.expect('"')?;
        let mut out = String::new();
        loop {
            match self.bump() {
                Some('"') => return Ok(out),
                Some('\\') => match self.bump() {
                    Some('\\') => out.push('\\'),
                    Some('"') => out.push('"'),
                    Some('n') => out.push('\n'),
                    Some(c) => return Err(format!("invalid escape \\{c} in a label value")),
                    None => return Err("unterminated label value".into()),
                },
                Some(c) => out.push(c),
                None => return Err("unterminated label value".into()),
            }
        }
    }

    fn word(&mut self) -> &'a str {
        let start = self.pos;
        while self.peek().is_some_and(|c| c != ' ' && c != '\t') {
            self.pos += self.peek().map_or(1, char::len_utf8);
        }
        &self.s[start..self.pos]
    }

    fn number(&mut self) -> Result<f64, String> {
        let w = self.word();
        match w {
            "NaN" => Ok(f64::NAN),
            "+Inf" | "Inf" => Ok(f64::INFINITY),
            "-Inf" => Ok(f64::NEG_INFINITY),
            // Rust also accepts "inf"/"nan" spellings the format does not; those are rejected
            // by requiring a digit.
            _ if w.chars().any(|c| c.is_ascii_digit()) => {
                w.parse::<f64>().map_err(|_| format!("invalid value {w:?}"))
            }
            _ => Err(format!("invalid value {w:?}")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_names_labels_values_and_timestamps() {
        let text = "# HELP vllm:num_requests_waiting Number of requests waiting.\n\
                    # TYPE vllm:num_requests_waiting gauge\n\
                    vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 3.0\n\
                    plain 1e3 1700000000000\n\
                    esc{a=\"q\\\"uote\\\\back\\nline\" , b = \"x,y}\"} -Inf\n\
                    nan_one NaN\n\
                    \n# EOF\n";
        let s = parse(text).expect("parses");
        assert_eq!(s.len(), 4);
        assert_eq!(s[0].name, "vllm:num_requests_waiting");
        assert_eq!(s[0].label("model_name"), Some("m"));
        assert_eq!(s[0].value, 3.0);
        assert_eq!(s[1].value, 1000.0);
        assert_eq!(s[1].timestamp_ms, Some(1_700_000_000_000));
        assert_eq!(s[2].label("a"), Some("q\"uote\\back\nline"));
        assert_eq!(s[2].label("b"), Some("x,y}"));
        assert_eq!(s[2].value, f64::NEG_INFINITY);
        assert!(s[3].value.is_nan());
    }

    #[test]
    fn rejects_malformed_lines() {
        for bad in [
            "9metric 1",
            "m{a=\"1\"",
            "m{a=1} 2",
            "m{a=\"1\",a=\"2\"} 3",
            "m{a=\"\\x\"} 1",
            "m 1 2 3",
            "m abc",
            "m inf",
            "m",
            "m{} 1 notatime",
            "# TYPE m flavour",
            "# TYPE 9m gauge",
        ] {
            let err = parse(bad).expect_err(bad);
            assert_eq!(err.line, 1, "{bad}");
        }
    }
}

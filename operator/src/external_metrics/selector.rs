//! Kubernetes label selectors in their string form (`?labelSelector=` on the External Metrics
//! API), parsed and matched the way `k8s.io/apimachinery/pkg/labels` does, so the HPA's
//! `metric.selector` selects the same InferenceServices here as it would in any other adapter.
//!
//! Grammar: comma-separated requirements, all of which must hold:
//! `key`, `!key`, `key=value`, `key==value`, `key!=value`, `key in (a,b)`, `key notin (a,b)`,
//! `key>5`, `key<5`. Keys are qualified names (`prefix/name`), values label values.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

/// A malformed selector; the message names what was wrong and where.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SelectorError {
    #[error("unable to parse requirement: found '{found}', expected: {expected}")]
    Syntax {
        found: String,
        expected: &'static str,
    },
    #[error("invalid label key {key:?}: {reason}")]
    InvalidKey { key: String, reason: String },
    #[error("invalid label value {value:?}: {reason}")]
    InvalidValue { value: String, reason: String },
    #[error("for 'in', 'notin' operators, values set can't be empty (key {0:?})")]
    EmptySet(String),
    #[error("for 'Gt', 'Lt' operators, the value must be an integer, got {0:?}")]
    NotInteger(String),
}

/// How a requirement compares a label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operator {
    Equals,
    NotEquals,
    In,
    NotIn,
    Exists,
    DoesNotExist,
    GreaterThan,
    LessThan,
}

/// One `key op values` term.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Requirement {
    pub key: String,
    pub operator: Operator,
    /// One value for `=`, `!=`, `>` and `<`; at least one for `in`/`notin`; none otherwise.
    pub values: Vec<String>,
}

impl Requirement {
    /// Whether `labels` satisfy this term. As in Kubernetes, `!=` and `notin` also match when
    /// the key is absent.
    pub fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        let value = labels.get(&self.key);
        let contains = |v: &String| self.values.iter().any(|x| x == v);
        match self.operator {
            Operator::Equals | Operator::In => value.is_some_and(contains),
            Operator::NotEquals | Operator::NotIn => !value.is_some_and(contains),
            Operator::Exists => value.is_some(),
            Operator::DoesNotExist => value.is_none(),
            Operator::GreaterThan | Operator::LessThan => {
                let (Some(have), Some(want)) = (
                    value.and_then(|v| v.parse::<i64>().ok()),
                    self.values.first().and_then(|v| v.parse::<i64>().ok()),
                ) else {
                    return false;
                };
                if self.operator == Operator::GreaterThan {
                    have > want
                } else {
                    have < want
                }
            }
        }
    }
}

impl fmt::Display for Requirement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let k = &self.key;
        let first = self.values.first().map_or("", String::as_str);
        match self.operator {
            Operator::Equals => write!(f, "{k}={first}"),
            Operator::NotEquals => write!(f, "{k}!={first}"),
            Operator::GreaterThan => write!(f, "{k}>{first}"),
            Operator::LessThan => write!(f, "{k}<{first}"),
            Operator::Exists => write!(f, "{k}"),
            Operator::DoesNotExist => write!(f, "!{k}"),
            Operator::In => write!(f, "{k} in ({})", self.values.join(",")),
            Operator::NotIn => write!(f, "{k} notin ({})", self.values.join(",")),
        }
    }
}

/// Requirements that must all hold; empty selects everything.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Selector {
    pub requirements: Vec<Requirement>,
}

impl Selector {
    /// Parses the string form; empty or blank selects everything.
    pub fn parse(s: &str) -> Result<Self, SelectorError> {
        Parser::new(s).selector()
    }

    pub fn is_empty(&self) -> bool {
        self.requirements.is_empty()
    }

    pub fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        self.requirements.iter().all(|r| r.matches(labels))
    }
}

impl FromStr for Selector {
    type Err = SelectorError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

impl fmt::Display for Selector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, r) in self.requirements.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{r}")?;
        }
        Ok(())
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Token {
    Ident(String),
    Bang,
    Eq,
    DoubleEq,
    NotEq,
    Gt,
    Lt,
    In,
    NotIn,
    Comma,
    Open,
    Close,
    End,
}

impl Token {
    fn text(&self) -> String {
        match self {
            Token::Ident(s) => s.clone(),
            Token::Bang => "!".into(),
            Token::Eq => "=".into(),
            Token::DoubleEq => "==".into(),
            Token::NotEq => "!=".into(),
            Token::Gt => ">".into(),
            Token::Lt => "<".into(),
            Token::In => "in".into(),
            Token::NotIn => "notin".into(),
            Token::Comma => ",".into(),
            Token::Open => "(".into(),
            Token::Close => ")".into(),
            Token::End => "end of string".into(),
        }
    }
}

/// Characters that end an identifier (Kubernetes' lexer treats these as operators).
fn special(c: char) -> bool {
    matches!(c, '!' | '=' | '>' | '<' | ',' | '(' | ')')
}

fn lex(s: &str) -> Vec<Token> {
    let mut out = Vec::new();
    let mut chars = s.chars().peekable();
    while let Some(&c) = chars.peek() {
        if c.is_whitespace() {
            chars.next();
            continue;
        }
        if special(c) {
            chars.next();
            let next_eq = chars.peek() == Some(&'=');
            let tok = match c {
                '!' if next_eq => Token::NotEq,
                '=' if next_eq => Token::DoubleEq,
                '!' => Token::Bang,
                '=' => Token::Eq,
                '>' => Token::Gt,
                '<' => Token::Lt,
                ',' => Token::Comma,
                '(' => Token::Open,
                _ => Token::Close,
            };
            if matches!(tok, Token::NotEq | Token::DoubleEq) {
                chars.next();
            }
            out.push(tok);
            continue;
        }
        let mut ident = String::new();
        while let Some(&c) = chars.peek() {
            if c.is_whitespace() || special(c) {
                break;
            }
            ident.push(c);
            chars.next();
        }
        out.push(match ident.as_str() {
            "in" => Token::In,
            "notin" => Token::NotIn,
            _ => Token::Ident(ident),
        });
    }
    out.push(Token::End);
    out
}

struct Parser {
    tokens: Vec<Token>,
    pos: usize,
}

impl Parser {
    fn new(s: &str) -> Self {
        Self {
            tokens: lex(s),
            pos: 0,
        }
    }

    fn peek(&self) -> &Token {
        self.tokens.get(self.pos).unwrap_or(&Token::End)
    }

    fn next(&mut self) -> Token {
        let t = self.peek().clone();
        if self.pos < self.tokens.len() {
            self.pos += 1;
        }
        t
    }

    fn syntax(found: &Token, expected: &'static str) -> SelectorError {
        SelectorError::Syntax {
            found: found.text(),
            expected,
        }
    }

    fn selector(&mut self) -> Result<Selector, SelectorError> {
        let mut requirements = Vec::new();
        if *self.peek() == Token::End {
            return Ok(Selector { requirements });
        }
        loop {
            requirements.push(self.requirement()?);
            match self.next() {
                Token::End => return Ok(Selector { requirements }),
                Token::Comma => {}
                t => return Err(Self::syntax(&t, "',' or end of string")),
            }
        }
    }

    fn requirement(&mut self) -> Result<Requirement, SelectorError> {
        let negated = *self.peek() == Token::Bang;
        if negated {
            self.next();
        }
        let key = match self.next() {
            Token::Ident(k) => k,
            t => return Err(Self::syntax(&t, "!, identifier")),
        };
        validate_key(&key)?;
        if negated {
            return Ok(Requirement {
                key,
                operator: Operator::DoesNotExist,
                values: Vec::new(),
            });
        }
        let operator = match self.peek() {
            Token::End | Token::Comma => {
                return Ok(Requirement {
                    key,
                    operator: Operator::Exists,
                    values: Vec::new(),
                });
            }
            Token::Eq | Token::DoubleEq => Operator::Equals,
            Token::NotEq => Operator::NotEquals,
            Token::Gt => Operator::GreaterThan,
            Token::Lt => Operator::LessThan,
            Token::In => Operator::In,
            Token::NotIn => Operator::NotIn,
            t => return Err(Self::syntax(t, "=, ==, !=, >, <, in, notin")),
        };
        self.next();
        let values = match operator {
            Operator::In | Operator::NotIn => self.set()?,
            _ => vec![self.single()?],
        };
        for v in &values {
            validate_value(v)?;
        }
        let first = values.first().map_or("", String::as_str);
        match operator {
            Operator::In | Operator::NotIn if values.is_empty() => {
                return Err(SelectorError::EmptySet(key));
            }
            Operator::GreaterThan | Operator::LessThan if first.parse::<i64>().is_err() => {
                return Err(SelectorError::NotInteger(first.to_string()));
            }
            _ => {}
        }
        Ok(Requirement {
            key,
            operator,
            values,
        })
    }

    /// The value after `=`, `!=`, `>` or `<`; absent means the empty value (`key=`).
    fn single(&mut self) -> Result<String, SelectorError> {
        if matches!(self.peek(), Token::End | Token::Comma) {
            return Ok(String::new());
        }
        let t = self.next();
        value_of(&t).ok_or_else(|| Self::syntax(&t, "identifier"))
    }

    /// `( v1, v2 )`; an element left empty (`(a,)`) is the empty value, as in Kubernetes.
    fn set(&mut self) -> Result<Vec<String>, SelectorError> {
        match self.next() {
            Token::Open => {}
            t => return Err(Self::syntax(&t, "'('")),
        }
        let mut values = Vec::new();
        if *self.peek() == Token::Close {
            self.next();
            return Ok(values);
        }
        loop {
            let t = self.next();
            if let Some(v) = value_of(&t) {
                values.push(v);
                match self.next() {
                    Token::Comma => {}
                    Token::Close => return Ok(values),
                    t => return Err(Self::syntax(&t, "',' or ')'")),
                }
                continue;
            }
            match t {
                Token::Comma => values.push(String::new()),
                Token::Close => {
                    values.push(String::new());
                    return Ok(values);
                }
                t => return Err(Self::syntax(&t, "identifier, ',' or ')'")),
            }
        }
    }
}

/// In value position the keywords are plain words (`a=in` is valid), as in Kubernetes.
fn value_of(t: &Token) -> Option<String> {
    match t {
        Token::Ident(v) => Some(v.clone()),
        Token::In | Token::NotIn => Some(t.text()),
        _ => None,
    }
}

/// `[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?`, at most 63 characters: a label name or value.
fn check_name_part(s: &str) -> Result<(), String> {
    if s.len() > 63 {
        return Err("must be no more than 63 characters".into());
    }
    let ok_inner = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.');
    let first_last_ok = s.chars().next().is_some_and(|c| c.is_ascii_alphanumeric())
        && s.chars().last().is_some_and(|c| c.is_ascii_alphanumeric());
    if !first_last_ok || !s.chars().all(ok_inner) {
        return Err("must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character".into());
    }
    Ok(())
}

/// A DNS-1123 label: lowercase alphanumerics and '-', starting and ending alphanumeric, at
/// most 63 characters. Also the rule for namespace names.
pub fn is_dns1123_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

/// A DNS-1123 subdomain: dot-separated labels, at most 253 characters.
fn is_dns1123_subdomain(s: &str) -> bool {
    s.len() <= 253 && s.split('.').all(is_dns1123_label)
}

fn validate_key(key: &str) -> Result<(), SelectorError> {
    let invalid = |reason: String| SelectorError::InvalidKey {
        key: key.to_string(),
        reason,
    };
    let name = match key.split_once('/') {
        Some((prefix, name)) => {
            if prefix.is_empty() || !is_dns1123_subdomain(prefix) {
                return Err(invalid("prefix must be a DNS-1123 subdomain".into()));
            }
            name
        }
        None => key,
    };
    if name.is_empty() {
        return Err(invalid("name part must be non-empty".into()));
    }
    check_name_part(name).map_err(invalid)
}

fn validate_value(value: &str) -> Result<(), SelectorError> {
    if value.is_empty() {
        return Ok(());
    }
    check_name_part(value).map_err(|reason| SelectorError::InvalidValue {
        value: value.to_string(),
        reason,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn sel(s: &str) -> Selector {
        Selector::parse(s).unwrap_or_else(|e| panic!("{s:?}: {e}"))
    }

    #[test]
    fn selector_empty_selects_everything() {
        for s in ["", "   "] {
            let sel = sel(s);
            assert!(sel.is_empty());
            assert!(sel.matches(&labels(&[])));
            assert!(sel.matches(&labels(&[("a", "b")])));
        }
    }

    #[test]
    fn selector_equality_forms() {
        let l = labels(&[("ferrite.dev/inferenceservice", "chat"), ("tier", "gold")]);
        assert!(sel("ferrite.dev/inferenceservice=chat").matches(&l));
        assert!(sel("ferrite.dev/inferenceservice == chat").matches(&l));
        assert!(!sel("ferrite.dev/inferenceservice=embed").matches(&l));
        assert!(sel("tier!=silver").matches(&l));
        assert!(!sel("tier!=gold").matches(&l));
        // != matches when the key is absent, as in Kubernetes.
        assert!(sel("missing!=x").matches(&l));
        // `key=` is the empty value: matches only a present, empty label.
        assert!(!sel("tier=").matches(&l));
        assert!(sel("tier=").matches(&labels(&[("tier", "")])));
        assert!(sel("tier==").matches(&labels(&[("tier", "")])));
        // Keywords are plain words in value position.
        assert!(sel("op in (in,notin)").matches(&labels(&[("op", "notin")])));
    }

    #[test]
    fn selector_set_based_and_existence() {
        let l = labels(&[("app", "chat"), ("env", "prod")]);
        assert!(sel("app in (chat, embed)").matches(&l));
        assert!(!sel("app in (embed)").matches(&l));
        assert!(sel("app notin (embed,rerank)").matches(&l));
        assert!(!sel("app notin (chat)").matches(&l));
        assert!(sel("other notin (x)").matches(&l));
        assert!(sel("env").matches(&l));
        assert!(!sel("other").matches(&l));
        assert!(sel("!other").matches(&l));
        assert!(!sel("!env").matches(&l));
        assert!(sel("app in (chat),env=prod,!other").matches(&l));
        assert!(!sel("app in (chat),env=dev").matches(&l));
        // A trailing comma in a set is the empty value.
        assert_eq!(sel("a in (x,)").requirements[0].values, vec!["x", ""]);
    }

    #[test]
    fn selector_numeric_comparisons() {
        let l = labels(&[("gpus", "4")]);
        assert!(sel("gpus>2").matches(&l));
        assert!(!sel("gpus>4").matches(&l));
        assert!(sel("gpus<5").matches(&l));
        assert!(!sel("other<5").matches(&l));
        assert!(!sel("gpus>1").matches(&labels(&[("gpus", "many")])));
    }

    #[test]
    fn selector_parses_to_requirements() {
        let s = sel("a=1, b!=2 ,c in (x,y),d notin (z),e,!f");
        let ops: Vec<_> = s.requirements.iter().map(|r| r.operator).collect();
        assert_eq!(
            ops,
            [
                Operator::Equals,
                Operator::NotEquals,
                Operator::In,
                Operator::NotIn,
                Operator::Exists,
                Operator::DoesNotExist
            ]
        );
        assert_eq!(s.requirements[2].values, vec!["x", "y"]);
        assert_eq!(s.to_string(), "a=1,b!=2,c in (x,y),d notin (z),e,!f");
    }

    #[test]
    fn selector_rejects_malformed() {
        for bad in [
            "a=b=c",
            ",a",
            "a,",
            "a b",
            "a in x",
            "a in (x",
            "a in ()",
            "a notin ()",
            "!",
            "!a=b",
            "=b",
            "in=b",
            "a in (x y)",
            "a>b",
            "a<",
            "-a=b",
            "a=-b",
            "a=b_",
            "Prefix.Upper/a=b",
            "/a=b",
            "p/=b",
            "a/b/c=d",
            "a=(b)",
            "a=b)",
        ] {
            assert!(Selector::parse(bad).is_err(), "{bad:?} should be rejected");
        }
        let long = "k".repeat(64);
        assert!(matches!(
            Selector::parse(&long),
            Err(SelectorError::InvalidKey { .. })
        ));
        assert!(matches!(
            Selector::parse(&format!("a={long}")),
            Err(SelectorError::InvalidValue { .. })
        ));
        assert_eq!(
            Selector::parse("a in ()"),
            Err(SelectorError::EmptySet("a".into()))
        );
        assert_eq!(
            Selector::parse("a=b c").map_err(|e| e.to_string()),
            Err("unable to parse requirement: found 'c', expected: ',' or end of string".into())
        );
    }

    #[test]
    fn selector_key_and_value_rules() {
        assert!(Selector::parse("example.com/my-key_1.x=Value.1-a_b").is_ok());
        assert!(Selector::parse(&format!("{}=v", "k".repeat(63))).is_ok());
        assert!(Selector::parse(&format!("{}/k=v", "a".repeat(254))).is_err());
    }

    #[test]
    fn selector_dns1123_label() {
        assert!(is_dns1123_label("ml-prod"));
        assert!(is_dns1123_label("a1"));
        for bad in ["", "ML", "a_b", "-a", "a-", "a.b", &"a".repeat(64)] {
            assert!(!is_dns1123_label(bad), "{bad:?}");
        }
    }

    fn name_part() -> impl Strategy<Value = String> {
        "[a-z0-9]([a-z0-9._-]{0,10}[a-z0-9])?"
    }

    fn requirement() -> impl Strategy<Value = Requirement> {
        let key = (
            proptest::option::of("[a-z]{1,5}(\\.[a-z]{1,5})?"),
            name_part(),
        )
            .prop_map(|(p, n)| p.map_or(n.clone(), |p| format!("{p}/{n}")))
            .prop_filter("keywords lex as operators", |k| k != "in" && k != "notin");
        let values = proptest::collection::vec(name_part(), 1..4);
        (key, 0..6usize, values).prop_map(|(key, op, values)| {
            let (operator, values) = match op {
                0 => (Operator::Equals, values[..1].to_vec()),
                1 => (Operator::NotEquals, values[..1].to_vec()),
                2 => (Operator::In, values),
                3 => (Operator::NotIn, values),
                4 => (Operator::Exists, Vec::new()),
                _ => (Operator::DoesNotExist, Vec::new()),
            };
            Requirement {
                key,
                operator,
                values,
            }
        })
    }

    proptest! {
        #[test]
        fn selector_display_round_trips(reqs in proptest::collection::vec(requirement(), 0..5)) {
            let s = Selector { requirements: reqs };
            prop_assert_eq!(Selector::parse(&s.to_string()), Ok(s));
        }

        #[test]
        fn selector_parse_never_panics(s in ".{0,40}") {
            let _ = Selector::parse(&s);
        }
    }
}

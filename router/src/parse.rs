//! Reads what routing needs from a request body in one pass, without building a JSON tree:
//! the `model`, the prefix-affinity key ([`crate::prefix`]) and the work estimate
//! ([`crate::work`]). Memory stays at the key's few hundred characters whatever the body
//! holds: a `serde_json::Value` of small numbers takes ~16 times its text (a 30 MiB body
//! took the router up by 510 MiB), where this visitor keeps counts.
//!
//! It agrees with the server's parser where the two could disagree about one body (how
//! request smuggling starts): bytes after the JSON value, and a repeated `model`, `prompt` or
//! `messages`, are refused by both.

use std::fmt;

use serde::Deserializer as _;
use serde::de::{self, DeserializeSeed, IgnoredAny, MapAccess, SeqAccess, Visitor};

use crate::prefix::KeyBuilder;
use crate::work::{self, Work};

/// Visitor methods for JSON values a visitor has no use for: each gives `$value`. (A value of
/// an unexpected type is skipped, not refused: the replica's own validation answers for it.)
macro_rules! skip_scalars {
    ($value:expr) => {
        fn visit_u64<E: de::Error>(self, _: u64) -> Result<Self::Value, E> {
            Ok($value)
        }
        fn visit_i64<E: de::Error>(self, _: i64) -> Result<Self::Value, E> {
            Ok($value)
        }
        fn visit_f64<E: de::Error>(self, _: f64) -> Result<Self::Value, E> {
            Ok($value)
        }
        fn visit_bool<E: de::Error>(self, _: bool) -> Result<Self::Value, E> {
            Ok($value)
        }
        fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok($value)
        }
    };
}

macro_rules! skip_str {
    ($value:expr) => {
        fn visit_str<E: de::Error>(self, _: &str) -> Result<Self::Value, E> {
            Ok($value)
        }
    };
}

/// A list skipped element by element (serde_json skips without recursing).
macro_rules! skip_seq {
    ($de:lifetime, $value:expr) => {
        fn visit_seq<A: SeqAccess<$de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
            while seq.next_element::<IgnoredAny>()?.is_some() {}
            Ok($value)
        }
    };
}

macro_rules! skip_map {
    ($de:lifetime, $value:expr) => {
        fn visit_map<A: MapAccess<$de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
            while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
            Ok($value)
        }
    };
}

/// What the router reads from a request body.
#[derive(Debug, Clone, PartialEq)]
pub struct Parsed {
    /// `None` when the body has no `model`.
    pub model: Option<String>,
    /// Where the `model` value's JSON (quotes included) is in the body, as `start..end`: what
    /// a rewrite of the name replaces ([`with_model`]).
    pub model_at: Option<std::ops::Range<usize>>,
    /// The prefix-affinity key; `None` for a request with no prompt text.
    pub key: Option<String>,
    pub work: Work,
}

/// Why a body was refused: the message for the client.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid JSON body: {0}")]
pub struct ParseError(String);

/// What kind of endpoint a body was sent to, which decides what routing reads from it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    /// Completions and chat: a prefix key (the prompt's head) and prompt plus output work.
    Generation,
    /// Embeddings and other pooling endpoints: `input` is prompt work with no output, and no
    /// key (affinity pays where a cached prefix skips prefill before a long generation).
    Pooling,
    /// Anything else that names a `model`: only the model.
    Other,
}

/// Reads a completions or chat `body`, keeping at most `key_chars` characters of its prompt
/// for the key.
pub fn parse(body: &[u8], key_chars: usize) -> Result<Parsed, ParseError> {
    parse_as(body, key_chars, Api::Generation)
}

/// Reads `body` as a request to an endpoint of kind `api`.
pub fn parse_as(body: &[u8], key_chars: usize, api: Api) -> Result<Parsed, ParseError> {
    let mut de = serde_json::Deserializer::from_slice(body);
    let mut scan = Scan::new(key_chars, api, body.as_ptr() as usize);
    (&mut de)
        .deserialize_map(TopVisitor(&mut scan))
        .map_err(|e| ParseError(e.to_string()))?;
    de.end().map_err(|e| ParseError(e.to_string()))?;
    Ok(scan.finish())
}

/// Counts and keys gathered so far. Chat and completions fields are kept apart, since JSON
/// does not order keys; a body with `messages` is a chat.
struct Scan {
    api: Api,
    model: Option<String>,
    model_at: Option<std::ops::Range<usize>>,
    /// The body's address, which borrowed values' offsets are taken from.
    body: usize,
    chars: usize,
    seen_prompt: bool,
    seen_messages: bool,
    prompt_key: KeyBuilder,
    prompt_tokens: f64,
    chat_key: KeyBuilder,
    chat_tokens: f64,
    max_tokens: Option<f64>,
    max_completion_tokens: Option<f64>,
    n: Option<f64>,
}

impl Scan {
    fn new(chars: usize, api: Api, body: usize) -> Self {
        Scan {
            api,
            model: None,
            model_at: None,
            body,
            chars,
            seen_prompt: false,
            seen_messages: false,
            prompt_key: KeyBuilder::new(chars),
            prompt_tokens: 0.0,
            chat_key: KeyBuilder::new(chars),
            chat_tokens: 0.0,
            max_tokens: None,
            max_completion_tokens: None,
            n: None,
        }
    }

    fn finish(self) -> Parsed {
        match self.api {
            Api::Generation => {}
            Api::Pooling => {
                return Parsed {
                    model: self.model,
                    model_at: self.model_at,
                    key: None,
                    work: Work {
                        prompt: self.prompt_tokens,
                        output: 0.0,
                    },
                };
            }
            Api::Other => {
                return Parsed {
                    model: self.model,
                    model_at: self.model_at,
                    key: None,
                    work: Work {
                        prompt: 0.0,
                        output: 0.0,
                    },
                };
            }
        }
        let (key, prompt) = if self.seen_messages {
            (self.chat_key, self.chat_tokens)
        } else {
            (self.prompt_key, self.prompt_tokens)
        };
        Parsed {
            model: self.model,
            model_at: self.model_at,
            key: key.finish(),
            work: work::estimate(
                prompt,
                self.max_tokens.or(self.max_completion_tokens),
                self.n,
            ),
        }
    }
}

/// `body` with its `model` (at `at`, from [`Parsed::model_at`]) replaced by `model`.
pub fn with_model(body: &[u8], at: std::ops::Range<usize>, model: &str) -> Option<Vec<u8>> {
    let value = serde_json::to_vec(model).ok()?;
    let (head, tail) = (body.get(..at.start)?, body.get(at.end..)?);
    Some([head, &value, tail].concat())
}

fn once<E: de::Error>(seen: &mut bool, field: &'static str) -> Result<(), E> {
    if std::mem::replace(seen, true) {
        return Err(E::duplicate_field(field));
    }
    Ok(())
}

struct TopVisitor<'a>(&'a mut Scan);

impl<'de> Visitor<'de> for TopVisitor<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let scan = self.0;
        let mut seen_model = false;
        while let Some(k) = map.next_key::<Key>()? {
            match k.0.as_str() {
                "model" => {
                    once(&mut seen_model, "model")?;
                    // Borrowed from the body, so where it sits is known.
                    let raw: &serde_json::value::RawValue = map.next_value()?;
                    scan.model = serde_json::from_str(raw.get()).map_err(de::Error::custom)?;
                    let start = (raw.get().as_ptr() as usize).wrapping_sub(scan.body);
                    scan.model_at = Some(start..start + raw.get().len());
                }
                "prompt" if scan.api == Api::Generation => {
                    once(&mut scan.seen_prompt, "prompt")?;
                    map.next_value_seed(PromptSeed(scan))?;
                }
                // An embeddings input has a prompt's shapes; only its size is used.
                "input" if scan.api == Api::Pooling => {
                    once(&mut scan.seen_prompt, "input")?;
                    map.next_value_seed(PromptSeed(scan))?;
                }
                "messages" if scan.api == Api::Generation => {
                    once(&mut scan.seen_messages, "messages")?;
                    map.next_value_seed(MessagesSeed(scan))?;
                }
                "max_tokens" => scan.max_tokens = map.next_value_seed(NumberSeed)?,
                "max_completion_tokens" => {
                    scan.max_completion_tokens = map.next_value_seed(NumberSeed)?
                }
                "n" => scan.n = map.next_value_seed(NumberSeed)?,
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(())
    }
}

/// An object key, kept only when it is short enough to be one we read.
struct Key(String);

impl<'de> de::Deserialize<'de> for Key {
    fn deserialize<D: de::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Key;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a key")
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<Key, E> {
                Ok(Key(if s.len() <= 32 {
                    s.to_string()
                } else {
                    String::new()
                }))
            }
        }
        d.deserialize_str(V)
    }
}

/// A number where one is expected; anything else reads as absent (the replica's own
/// validation answers for it).
struct NumberSeed;

impl<'de> DeserializeSeed<'de> for NumberSeed {
    type Value = Option<f64>;
    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<Option<f64>, D::Error> {
        d.deserialize_any(NumberVisitor)
    }
}

struct NumberVisitor;

impl<'de> Visitor<'de> for NumberVisitor {
    type Value = Option<f64>;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a number")
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
        Ok(Some(v as f64))
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
        Ok(Some(v as f64))
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Self::Value, E> {
        Ok(Some(v))
    }
    fn visit_bool<E: de::Error>(self, _: bool) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }
    skip_str!(None);
    skip_seq!('de, None);
    skip_map!('de, None);
}

/// `prompt`: a string, a list of strings, a list of token ids, or a list of such lists. The
/// key is the first string, the flat id list, or the first id list; every one counts as work.
struct PromptSeed<'a>(&'a mut Scan);

impl<'de> DeserializeSeed<'de> for PromptSeed<'_> {
    type Value = ();
    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for PromptSeed<'_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a prompt")
    }
    fn visit_str<E: de::Error>(self, s: &str) -> Result<(), E> {
        self.0.prompt_key.push(s);
        self.0.prompt_tokens += work::text_tokens(s);
        Ok(())
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let scan = self.0;
        let mut first = true;
        let mut flat_ids = false;
        while let Some(item) = seq.next_element::<PromptItem>()? {
            match item {
                PromptItem::Text { chars, head } => {
                    if first {
                        scan.prompt_key.push(&head);
                    }
                    scan.prompt_tokens += chars as f64 / work::CHARS_PER_TOKEN;
                }
                PromptItem::Id(id) => {
                    flat_ids |= first;
                    if flat_ids {
                        scan.prompt_key.push_id(id);
                    }
                    scan.prompt_tokens += 1.0;
                }
                PromptItem::Ids { count, head } => {
                    if first {
                        head.iter().for_each(|&id| scan.prompt_key.push_id(id));
                    }
                    scan.prompt_tokens += count as f64;
                }
                PromptItem::Other => {}
            }
            first = false;
        }
        Ok(())
    }
    skip_scalars!(());
    skip_map!('de, ());
}

/// Most characters or token ids kept from one prompt item for the key; the key itself is
/// capped lower by its builder, this bounds what an item holds before that.
const HEAD: usize = 4096;

/// One element of a `prompt` list, reduced to its size and its head.
enum PromptItem {
    Text { chars: usize, head: String },
    Id(u64),
    Ids { count: usize, head: Vec<u64> },
    Other,
}

impl<'de> de::Deserialize<'de> for PromptItem {
    fn deserialize<D: de::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = PromptItem;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a prompt item")
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<PromptItem, E> {
                Ok(PromptItem::Text {
                    chars: s.chars().count(),
                    head: s.chars().take(HEAD).collect(),
                })
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<PromptItem, E> {
                Ok(PromptItem::Id(v))
            }
            fn visit_i64<E: de::Error>(self, _: i64) -> Result<PromptItem, E> {
                Ok(PromptItem::Other)
            }
            fn visit_f64<E: de::Error>(self, _: f64) -> Result<PromptItem, E> {
                Ok(PromptItem::Other)
            }
            fn visit_bool<E: de::Error>(self, _: bool) -> Result<PromptItem, E> {
                Ok(PromptItem::Other)
            }
            fn visit_unit<E: de::Error>(self) -> Result<PromptItem, E> {
                Ok(PromptItem::Other)
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<PromptItem, A::Error> {
                let mut count = 0;
                let mut head = Vec::new();
                while let Some(v) = seq.next_element::<IgnoredNumber>()? {
                    count += 1;
                    if let (Some(id), true) = (v.0, head.len() < HEAD) {
                        head.push(id);
                    }
                }
                Ok(PromptItem::Ids { count, head })
            }
            skip_map!('de, PromptItem::Other);
        }
        d.deserialize_any(V)
    }
}

/// Any JSON value, kept only when it is a non-negative integer.
struct IgnoredNumber(Option<u64>);

impl<'de> de::Deserialize<'de> for IgnoredNumber {
    fn deserialize<D: de::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let n = d.deserialize_any(NumberVisitor)?;
        Ok(IgnoredNumber(
            n.filter(|v| v.fract() == 0.0 && *v >= 0.0)
                .map(|v| v as u64),
        ))
    }
}

/// `messages`: each adds its role and text to the chat key, and its text to the work.
struct MessagesSeed<'a>(&'a mut Scan);

impl<'de> DeserializeSeed<'de> for MessagesSeed<'_> {
    type Value = ();
    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for MessagesSeed<'_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a list of messages")
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let scan = self.0;
        let cap = scan.chars;
        while let Some(m) = seq.next_element_seed(MessageSeed(cap))? {
            scan.chat_tokens += work::PER_MESSAGE + m.chars as f64 / work::CHARS_PER_TOKEN;
            if !scan.chat_key.is_full() {
                scan.chat_key.push(&m.role);
                scan.chat_key.push(": ");
                scan.chat_key.push(&m.head);
                scan.chat_key.push("\n");
            }
        }
        Ok(())
    }
    fn visit_unit<E: de::Error>(self) -> Result<(), E> {
        Ok(())
    }
    skip_str!(());
    skip_map!('de, ());
}

/// One message, reduced: its role and text heads (each at most the key's length) and how many
/// characters of text it has.
#[derive(Default)]
struct Message {
    role: String,
    head: String,
    chars: usize,
}

impl Message {
    fn text(&mut self, s: &str, cap: usize) {
        self.chars += s.chars().count();
        let have = self.head.chars().count();
        self.head.extend(s.chars().take(cap.saturating_sub(have)));
    }
}

struct MessageSeed(usize);

impl<'de> DeserializeSeed<'de> for MessageSeed {
    type Value = Message;
    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<Message, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for MessageSeed {
    type Value = Message;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a message")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Message, A::Error> {
        let cap = self.0;
        let mut m = Message::default();
        while let Some(k) = map.next_key::<Key>()? {
            match k.0.as_str() {
                "role" => {
                    if let Some(TextHead { head, .. }) = map.next_value_seed(TextSeed(cap))? {
                        m.role = head;
                    }
                }
                "content" => map.next_value_seed(ContentSeed(&mut m, cap))?,
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(m)
    }
    skip_scalars!(Message::default());
    skip_str!(Message::default());
    skip_seq!('de, Message::default());
}

/// A string's head and length; `None` for any other value.
struct TextHead {
    head: String,
    chars: usize,
}

struct TextSeed(usize);

impl<'de> DeserializeSeed<'de> for TextSeed {
    type Value = Option<TextHead>;
    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<Option<TextHead>, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for TextSeed {
    type Value = Option<TextHead>;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a string")
    }
    fn visit_str<E: de::Error>(self, s: &str) -> Result<Self::Value, E> {
        Ok(Some(TextHead {
            head: s.chars().take(self.0).collect(),
            chars: s.chars().count(),
        }))
    }
    skip_scalars!(None);
    skip_seq!('de, None);
    skip_map!('de, None);
}

/// A message's `content`: a string, or a list of parts whose `text` fields count.
struct ContentSeed<'a>(&'a mut Message, usize);

impl<'de> DeserializeSeed<'de> for ContentSeed<'_> {
    type Value = ();
    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for ContentSeed<'_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("message content")
    }
    fn visit_str<E: de::Error>(self, s: &str) -> Result<(), E> {
        self.0.text(s, self.1);
        Ok(())
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while let Some(part) = seq.next_element_seed(PartSeed(self.1))? {
            if let Some(t) = part {
                self.0.chars += t.chars;
                let have = self.0.head.chars().count();
                self.0
                    .head
                    .extend(t.head.chars().take(self.1.saturating_sub(have)));
            }
        }
        Ok(())
    }
    skip_scalars!(());
    skip_map!('de, ());
}

/// One content part: its `text` when it has one.
struct PartSeed(usize);

impl<'de> DeserializeSeed<'de> for PartSeed {
    type Value = Option<TextHead>;
    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for PartSeed {
    type Value = Option<TextHead>;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a content part")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut text = None;
        while let Some(k) = map.next_key::<Key>()? {
            if k.0 == "text" {
                text = map.next_value_seed(TextSeed(self.0))?;
            } else {
                map.next_value::<IgnoredAny>()?;
            }
        }
        Ok(text)
    }
    skip_scalars!(None);
    skip_str!(None);
    skip_seq!('de, None);
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn p(v: serde_json::Value, chars: usize) -> Parsed {
        parse(v.to_string().as_bytes(), chars).expect("parses")
    }

    #[test]
    fn the_model_can_be_rewritten_in_place() {
        let body = br#"{"prompt": "hi", "model" : "chat-default", "max_tokens": 2}"#;
        let parsed = parse(body, 16).expect("parses");
        let at = parsed.model_at.expect("where the model is");
        assert_eq!(&body[at.clone()], br#""chat-default""#);
        let new = with_model(body, at, "chat \"v2\"").expect("rewritten");
        let v: serde_json::Value = serde_json::from_slice(&new).expect("JSON");
        assert_eq!(v["model"], "chat \"v2\"");
        assert_eq!(v["max_tokens"], 2);
        // An escaped name reads as its text, and a null as none.
        let p = parse(br#"{"model": "a\u0062c"}"#, 16).expect("parses");
        assert_eq!(p.model.as_deref(), Some("abc"));
        assert_eq!(
            parse(br#"{"model": null}"#, 16).expect("parses").model,
            None
        );
        assert!(parse(br#"{"model": 5}"#, 16).is_err());
    }

    #[test]
    fn embeddings_count_their_input_as_prompt_work_with_no_key_and_no_output() {
        let as_ = |v: serde_json::Value, api| parse_as(v.to_string().as_bytes(), 64, api);
        let e = as_(
            json!({"model": "m", "input": ["abcdefgh", [1, 2, 3]]}),
            Api::Pooling,
        )
        .expect("parses");
        assert_eq!(e.model.as_deref(), Some("m"));
        assert_eq!(e.key, None);
        assert_eq!(
            e.work,
            Work {
                prompt: 5.0,
                output: 0.0
            }
        );
        // A repeated input is refused, as a repeated prompt is.
        let twice = br#"{"model": "m", "input": "a", "input": "b"}"#;
        assert!(parse_as(twice, 64, Api::Pooling).is_err());
        // Other endpoints: only the model; their fields are not read as a prompt.
        let o = as_(
            json!({"model": "m", "prompt": "long text", "max_tokens": 9}),
            Api::Other,
        )
        .expect("parses");
        assert_eq!(
            (o.model.as_deref(), o.key, o.work.total()),
            (Some("m"), None, 1.0)
        );
        assert!(as_(json!([1]), Api::Other).is_err());
    }

    #[test]
    fn reads_model_key_and_work_of_both_endpoints() {
        let c = p(
            json!({"model": "m", "prompt": "Once upon a time", "max_tokens": 8}),
            9,
        );
        assert_eq!(c.model.as_deref(), Some("m"));
        assert_eq!(c.key.as_deref(), Some("Once upon"));
        assert_eq!(c.work.output, 8.0);
        // Key order does not matter: content before role still keys as role first.
        let chat = p(
            json!({"messages": [{"content": "hi", "role": "user"}], "model": "m"}),
            100,
        );
        assert_eq!(chat.key.as_deref(), Some("user: hi\n"));
        assert_eq!(chat.model.as_deref(), Some("m"));
    }

    #[test]
    fn refuses_what_the_server_refuses() {
        for bad in [
            &br#"{"model": "m"} trailing"#[..],
            br#"{"model": "a", "model": "b"}"#,
            br#"{"prompt": "a", "prompt": "b"}"#,
            br#"[1, 2]"#,
            br#"{"model": 5}"#,
            br#"{"model": "m""#,
        ] {
            assert!(parse(bad, 10).is_err(), "{}", String::from_utf8_lossy(bad));
        }
        assert!(parse(br#"{"model": null}"#, 10).is_ok_and(|p| p.model.is_none()));
    }

    #[test]
    fn deep_nesting_neither_overflows_the_stack_nor_is_kept() {
        // In a field the router skips, serde_json skips it without recursing.
        let deep = format!(r#"{{"x": {}{}}}"#, "[".repeat(100_000), "]".repeat(100_000));
        assert!(parse(deep.as_bytes(), 10).is_ok_and(|p| p.model.is_none()));
        // Where it reads, past the levels it visits (a list of lists of ids) it skips too.
        let deep = format!(
            r#"{{"prompt": {}{}}}"#,
            "[".repeat(100_000),
            "]".repeat(100_000)
        );
        assert!(parse(deep.as_bytes(), 10).is_ok_and(|p| p.key.is_none()));
    }

    #[test]
    fn a_large_body_of_small_numbers_is_counted_not_kept() {
        let ids = vec![vec![7u32]; 200_000];
        let body = json!({"model": "m", "prompt": ids}).to_string();
        let parsed = parse(body.as_bytes(), 8).expect("parses");
        assert_eq!(parsed.work.prompt, 200_000.0);
        assert_eq!(parsed.key.as_deref(), Some("7 "));
    }
}

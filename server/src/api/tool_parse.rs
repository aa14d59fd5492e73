//! Tool calls in model output. Each chat-template family writes calls its own way; this finds
//! them in what the model generated and turns them into OpenAI `tool_calls` (name and JSON
//! arguments), leaving the rest as content:
//! - Hermes / Qwen 2.5-3 (and the templates that copied them): `<tool_call>{"name": ..,
//!   "arguments": {..}}</tool_call>`, one block per call, after optional text;
//! - Llama 3.1-3.3 JSON: the whole reply is `{"name": .., "parameters": {..}}` (optionally
//!   after `<|python_tag|>`, several joined by `;`);
//! - Mistral: `[TOOL_CALLS]` then a JSON list of `{"name", "arguments"}` (v3 tokenizers) or
//!   `name[ARGS]{..}` per call (v11+).

use serde_json::Value;

/// A call found in the output: the function's name and its arguments as JSON text.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    pub name: String,
    pub arguments: String,
}

/// The output split into what the user reads and the calls.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Parsed {
    /// Text outside the calls (`None` when there is none but whitespace).
    pub content: Option<String>,
    pub calls: Vec<ToolCall>,
}

/// How a model family writes tool calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallFormat {
    Hermes,
    Llama3Json,
    Mistral,
}

const HERMES_OPEN: &str = "<tool_call>";
const HERMES_CLOSE: &str = "</tool_call>";
const PYTHON_TAG: &str = "<|python_tag|>";
const MISTRAL_CALLS: &str = "[TOOL_CALLS]";
const MISTRAL_ARGS: &str = "[ARGS]";

impl CallFormat {
    /// The family a chat template writes calls in, from the markers it mentions; Hermes (the
    /// most copied) when it mentions none.
    pub fn detect(template: &str) -> Self {
        if template.contains(MISTRAL_CALLS) {
            CallFormat::Mistral
        } else if template.contains(HERMES_OPEN) {
            CallFormat::Hermes
        } else if template.contains(PYTHON_TAG) || template.contains("Environment: ipython") {
            CallFormat::Llama3Json
        } else {
            CallFormat::Hermes
        }
    }

    /// vLLM's `--tool-call-parser` names for these formats.
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "hermes" | "qwen" | "qwen3" => Some(CallFormat::Hermes),
            "llama3_json" | "llama4_json" => Some(CallFormat::Llama3Json),
            "mistral" => Some(CallFormat::Mistral),
            _ => None,
        }
    }

    /// Finds the calls in `text`. Anything that does not parse as a call stays content, so a
    /// model that merely talks about `<tool_call>` loses no text.
    pub fn parse(self, text: &str) -> Parsed {
        let parsed = match self {
            CallFormat::Hermes => hermes(text),
            CallFormat::Llama3Json => llama3_json(text),
            CallFormat::Mistral => mistral(text),
        };
        parsed.unwrap_or_else(|| Parsed {
            content: content(text),
            calls: Vec::new(),
        })
    }

    /// Where a call may begin in `text`, for a stream that must hold text back from then on:
    /// the byte offset of a marker (or of a prefix of one at the very end).
    pub fn call_start(self, text: &str) -> Option<usize> {
        match self {
            CallFormat::Hermes => marker_start(text, HERMES_OPEN),
            CallFormat::Mistral => marker_start(text, MISTRAL_CALLS),
            // A JSON call is the whole reply: it begins at the first non-space character.
            CallFormat::Llama3Json => {
                let start = text.len() - text.trim_start().len();
                let rest = &text[start..];
                (rest.is_empty()
                    || rest.starts_with('{')
                    || PYTHON_TAG.starts_with(rest)
                    || rest.starts_with(PYTHON_TAG))
                .then_some(start)
            }
        }
    }
}

/// The offset of `marker` in `text`, or of a prefix of it that `text` ends with.
fn marker_start(text: &str, marker: &str) -> Option<usize> {
    if let Some(i) = text.find(marker) {
        return Some(i);
    }
    (1..marker.len())
        .rev()
        .find(|&n| text.ends_with(&marker[..n]))
        .map(|n| text.len() - n)
}

fn content(text: &str) -> Option<String> {
    (!text.trim().is_empty()).then(|| text.to_string())
}

/// One call from a JSON object with a name and its arguments under `args_key` (or the other
/// usual key): the arguments are given back as compact JSON text.
fn call_from(v: &Value) -> Option<ToolCall> {
    let name = v.get("name")?.as_str()?.to_string();
    let args = v
        .get("arguments")
        .or_else(|| v.get("parameters"))
        .cloned()
        .unwrap_or(Value::Object(Default::default()));
    let arguments = match args {
        // Some models write the arguments as a JSON string.
        Value::String(s) => serde_json::from_str::<Value>(&s).ok()?.to_string(),
        Value::Object(_) => args.to_string(),
        _ => return None,
    };
    Some(ToolCall { name, arguments })
}

fn hermes(text: &str) -> Option<Parsed> {
    let first = text.find(HERMES_OPEN)?;
    let mut calls = Vec::new();
    let mut rest = &text[first..];
    while let Some(open) = rest.find(HERMES_OPEN) {
        let body = &rest[open + HERMES_OPEN.len()..];
        // The closing tag may be missing when the model stopped right after the JSON.
        let (json, after) = match body.find(HERMES_CLOSE) {
            Some(close) => (&body[..close], &body[close + HERMES_CLOSE.len()..]),
            None => (body, ""),
        };
        let v: Value = serde_json::from_str(json.trim()).ok()?;
        calls.push(call_from(&v)?);
        rest = after;
    }
    if !rest.trim().is_empty() {
        return None;
    }
    Some(Parsed {
        content: content(&text[..first]),
        calls,
    })
}

fn llama3_json(text: &str) -> Option<Parsed> {
    let body = text.trim_start();
    let mut rest = body.strip_prefix(PYTHON_TAG).unwrap_or(body).trim();
    if !rest.starts_with('{') {
        return None;
    }
    let mut calls = Vec::new();
    // Several calls are objects joined by `;` (which may also sit inside their strings, so
    // each object is read by the JSON reader, not found by splitting).
    while !rest.is_empty() {
        let mut values = serde_json::Deserializer::from_str(rest).into_iter::<Value>();
        let v = values.next()?.ok()?;
        calls.push(call_from(&v)?);
        let after = rest[values.byte_offset()..].trim_start();
        rest = match after.strip_prefix(';') {
            Some(next) => next.trim_start(),
            None if after.is_empty() => after,
            None => return None,
        };
    }
    Some(Parsed {
        content: None,
        calls,
    })
}

fn mistral(text: &str) -> Option<Parsed> {
    let at = text.find(MISTRAL_CALLS)?;
    let body = text[at + MISTRAL_CALLS.len()..].trim();
    let calls = if body.starts_with('[') {
        let v: Value = serde_json::from_str(body).ok()?;
        v.as_array()?
            .iter()
            .map(call_from)
            .collect::<Option<Vec<_>>>()?
    } else {
        // v11+: `name[ARGS]{...}` per call, each after its own [TOOL_CALLS].
        let mut calls = Vec::new();
        for part in body.split(MISTRAL_CALLS) {
            let (name, args) = part.split_once(MISTRAL_ARGS)?;
            let v: Value = serde_json::from_str(args.trim()).ok()?;
            v.is_object().then_some(())?;
            calls.push(ToolCall {
                name: name.trim().to_string(),
                arguments: v.to_string(),
            });
        }
        calls
    };
    (!calls.is_empty()).then(|| Parsed {
        content: content(&text[..at]),
        calls,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(name: &str, args: &str) -> ToolCall {
        ToolCall {
            name: name.into(),
            arguments: args.into(),
        }
    }

    /// Outputs as each family's models write them (the formats of their chat templates and
    /// vLLM's parser tests).
    #[test]
    fn each_family_s_calls_are_found_and_the_rest_is_content() {
        let weather = call("get_weather", r#"{"city":"Paris","unit":"celsius"}"#);
        let time = call("get_time", r#"{"tz":"Europe/Paris"}"#);
        let cases: Vec<(CallFormat, &str, Option<&str>, Vec<ToolCall>)> = vec![
            // Qwen 2.5 / Hermes 2 Pro: one block, then two blocks after some text.
            (
                CallFormat::Hermes,
                "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"celsius\"}}\n</tool_call>",
                None,
                vec![weather.clone()],
            ),
            (
                CallFormat::Hermes,
                "Let me check.\n<tool_call>\n{\"arguments\": {\"city\": \"Paris\", \"unit\": \"celsius\"}, \"name\": \"get_weather\"}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {\"tz\": \"Europe/Paris\"}}\n</tool_call>",
                Some("Let me check.\n"),
                vec![weather.clone(), time.clone()],
            ),
            // Stopped right after the JSON, before the closing tag.
            (
                CallFormat::Hermes,
                "<tool_call>\n{\"name\": \"get_time\", \"arguments\": \"{\\\"tz\\\": \\\"Europe/Paris\\\"}\"}",
                None,
                vec![time.clone()],
            ),
            // Llama 3.1: the reply is the call, `parameters` for the arguments.
            (
                CallFormat::Llama3Json,
                "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\", \"unit\": \"celsius\"}}",
                None,
                vec![weather.clone()],
            ),
            (
                CallFormat::Llama3Json,
                "<|python_tag|>{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\", \"unit\": \"celsius\"}}; {\"name\": \"get_time\", \"parameters\": {\"tz\": \"Europe/Paris\"}}",
                None,
                vec![weather.clone(), time.clone()],
            ),
            // Mistral v3 tokenizers: a JSON list; v11+: name[ARGS]{...}.
            (
                CallFormat::Mistral,
                "[TOOL_CALLS] [{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"celsius\"}}, {\"name\": \"get_time\", \"arguments\": {\"tz\": \"Europe/Paris\"}}]",
                None,
                vec![weather.clone(), time.clone()],
            ),
            (
                CallFormat::Mistral,
                "Sure.[TOOL_CALLS]get_weather[ARGS]{\"city\": \"Paris\", \"unit\": \"celsius\"}[TOOL_CALLS]get_time[ARGS]{\"tz\": \"Europe/Paris\"}",
                Some("Sure."),
                vec![weather.clone(), time.clone()],
            ),
        ];
        for (format, text, content, calls) in cases {
            let got = format.parse(text);
            assert_eq!(got.calls, calls, "{format:?}: {text}");
            assert_eq!(got.content.as_deref(), content, "{format:?}: {text}");
        }
    }

    #[test]
    fn text_that_is_not_a_call_stays_content_whole() {
        let cases = [
            (CallFormat::Hermes, "The weather is fine."),
            (
                CallFormat::Hermes,
                "I would write <tool_call>{not json}</tool_call> here",
            ),
            (
                CallFormat::Hermes,
                "<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call> and more",
            ),
            (CallFormat::Llama3Json, "Paris is sunny."),
            (CallFormat::Llama3Json, "{\"city\": \"Paris\"}"),
            (
                CallFormat::Llama3Json,
                "{\"name\": \"f\", \"parameters\": {}} trailing words",
            ),
            (CallFormat::Mistral, "[TOOL_CALLS] not a list"),
        ];
        for (format, text) in cases {
            let got = format.parse(text);
            assert!(got.calls.is_empty(), "{format:?}: {text}: {got:?}");
            assert_eq!(got.content.as_deref(), Some(text));
        }
    }

    #[test]
    fn a_call_may_start_where_a_marker_or_its_prefix_begins() {
        assert_eq!(CallFormat::Hermes.call_start("Sure. <tool"), Some(6));
        assert_eq!(CallFormat::Hermes.call_start("a <tool_call>{"), Some(2));
        assert_eq!(CallFormat::Hermes.call_start("plain text"), None);
        assert_eq!(CallFormat::Mistral.call_start("x[TOOL_"), Some(1));
        assert_eq!(CallFormat::Llama3Json.call_start("  {\"na"), Some(2));
        assert_eq!(CallFormat::Llama3Json.call_start("<|python"), Some(0));
        assert_eq!(CallFormat::Llama3Json.call_start("Hello"), None);
    }

    #[test]
    fn the_format_is_read_from_the_template() {
        assert_eq!(
            CallFormat::detect("{% if tools %}<tool_call>{% endif %}"),
            CallFormat::Hermes
        );
        assert_eq!(
            CallFormat::detect("[AVAILABLE_TOOLS] [TOOL_CALLS]"),
            CallFormat::Mistral
        );
        assert_eq!(
            CallFormat::detect("Environment: ipython <|python_tag|>"),
            CallFormat::Llama3Json
        );
        assert_eq!(CallFormat::detect("<|im_start|>"), CallFormat::Hermes);
    }
}

//! Tool calling on chat completions: the request's `tools`, `tool_choice` and
//! `parallel_tool_calls` checked and read into a [`ToolUse`], which knows the grammar a forced
//! call imposes and how to read calls back out of the output.
//!
//! As vLLM does it: `"required"` constrains the output to a JSON list of
//! `{"name", "parameters"}` objects, one of the tools each; a named function constrains it to
//! that function's parameters; `"auto"` leaves the model free and finds calls in its own format
//! (`tool_parse`); `"none"` reads no calls.

use serde::Deserialize;
use serde_json::{Value, json};

use super::error::ApiError;
use super::response::{FunctionChunk, ToolCallChunk};
use super::tool_parse::{CallFormat, Parsed, ToolCall};
use ferrite_runtime::engine::GrammarSpec;

/// Most tools one request may declare, as OpenAI's API.
pub const MAX_TOOLS: usize = 128;

/// One entry of `tools`.
#[derive(Debug, Clone, Deserialize)]
pub struct Tool {
    #[serde(rename = "type")]
    pub kind: String,
    pub function: Function,
}

#[derive(Debug, Clone, Deserialize)]
pub struct Function {
    pub name: String,
    pub description: Option<String>,
    /// A JSON schema of the arguments (absent: no arguments).
    pub parameters: Option<Value>,
    pub strict: Option<bool>,
}

/// What `tool_choice` asks for.
#[derive(Debug, Clone, PartialEq)]
pub enum Choice {
    None,
    Auto,
    Required,
    Named(String),
}

/// A request's tools, checked.
#[derive(Debug, Clone)]
pub struct ToolUse {
    pub tools: Vec<Tool>,
    pub choice: Choice,
    pub parallel: bool,
    pub format: CallFormat,
}

fn bad(param: &str, msg: impl Into<String>) -> ApiError {
    ApiError::invalid_param(param, msg.into())
}

impl ToolUse {
    /// Reads `tools`, `tool_choice` and `parallel_tool_calls`; `None` when the request has no
    /// tools (a `tool_choice` other than `none` without tools is a 400, as OpenAI answers).
    pub fn read(
        tools: Option<&[Tool]>,
        choice: Option<&Value>,
        parallel: Option<bool>,
        format: CallFormat,
    ) -> Result<Option<Self>, ApiError> {
        let tools = tools.unwrap_or_default();
        if tools.len() > MAX_TOOLS {
            return Err(bad(
                "tools",
                format!("at most {MAX_TOOLS} tools are accepted"),
            ));
        }
        for (i, t) in tools.iter().enumerate() {
            check_tool(i, t, &tools[..i])?;
        }
        let choice = read_choice(choice, !tools.is_empty())?;
        if let Choice::Named(name) = &choice
            && !tools.iter().any(|t| &t.function.name == name)
        {
            return Err(bad("tool_choice", format!("no tool is named '{name}'")));
        }
        if tools.is_empty() {
            return Ok(None);
        }
        Ok(Some(Self {
            tools: tools.to_vec(),
            choice,
            parallel: parallel.unwrap_or(true),
            format,
        }))
    }

    /// The tools as chat templates take them (`[{"type": "function", "function": {...}}]`);
    /// `None` with `tool_choice: "none"`, so the model is not told of them.
    pub fn template_tools(&self) -> Option<Value> {
        (self.choice != Choice::None).then(|| {
            Value::Array(
                self.tools
                    .iter()
                    .map(|t| {
                        json!({"type": "function", "function": {
                            "name": t.function.name,
                            "description": t.function.description,
                            "parameters": parameters(&t.function),
                        }})
                    })
                    .collect(),
            )
        })
    }

    /// The grammar a forced call imposes on the output.
    pub fn grammar(&self) -> Option<GrammarSpec> {
        match &self.choice {
            Choice::None | Choice::Auto => None,
            Choice::Named(name) => {
                let f = &self
                    .tools
                    .iter()
                    .find(|t| &t.function.name == name)?
                    .function;
                Some(GrammarSpec::JsonSchema(parameters(f)))
            }
            Choice::Required => {
                let each: Vec<Value> = self
                    .tools
                    .iter()
                    .map(|t| {
                        json!({
                            "type": "object",
                            "properties": {
                                "name": {"const": t.function.name},
                                "parameters": parameters(&t.function),
                            },
                            "required": ["name", "parameters"],
                            "additionalProperties": false,
                        })
                    })
                    .collect();
                let mut list = json!({"type": "array", "minItems": 1, "items": {"anyOf": each}});
                if !self.parallel {
                    list["maxItems"] = json!(1);
                }
                Some(GrammarSpec::JsonSchema(list))
            }
        }
    }

    /// The calls in a finished output, and what is left as content.
    pub fn calls(&self, text: &str) -> Parsed {
        let plain = || Parsed {
            content: Some(text.to_string()),
            calls: Vec::new(),
        };
        match &self.choice {
            Choice::None => plain(),
            Choice::Auto => {
                let mut parsed = self.format.parse(text);
                if !self.parallel {
                    parsed.calls.truncate(1);
                }
                parsed
            }
            // The arguments as generated (a stream sends them as they come, so both agree).
            Choice::Named(name) => match serde_json::from_str::<Value>(text) {
                Ok(_) => Parsed {
                    content: None,
                    calls: vec![ToolCall {
                        name: name.clone(),
                        arguments: text.to_string(),
                    }],
                },
                // Cut short by max_tokens or a stop string: the client gets what there is.
                Err(_) => plain(),
            },
            Choice::Required => match serde_json::from_str::<Vec<Value>>(text) {
                Ok(list) => Parsed {
                    content: None,
                    calls: list
                        .iter()
                        .filter_map(|c| {
                            Some(ToolCall {
                                name: c.get("name")?.as_str()?.to_string(),
                                arguments: c.get("parameters")?.to_string(),
                            })
                        })
                        .collect(),
                },
                Err(_) => plain(),
            },
        }
    }
}

/// A function's parameter schema; an object with no properties when it declares none.
fn parameters(f: &Function) -> Value {
    f.parameters
        .clone()
        .unwrap_or_else(|| json!({"type": "object", "properties": {}}))
}

fn check_tool(i: usize, t: &Tool, before: &[Tool]) -> Result<(), ApiError> {
    let param = format!("tools[{i}]");
    if t.kind != "function" {
        return Err(bad(
            &param,
            format!("tool type '{}' is not supported; use function", t.kind),
        ));
    }
    let name = &t.function.name;
    let ok = !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'.');
    if !ok {
        return Err(bad(
            &param,
            format!("function name '{name}' must be 1-64 letters, digits, '_', '-' or '.'"),
        ));
    }
    if before.iter().any(|b| &b.function.name == name) {
        return Err(bad(&param, format!("two tools are named '{name}'")));
    }
    if let Some(p) = &t.function.parameters
        && !p.is_object()
    {
        return Err(bad(
            &param,
            "function parameters must be a JSON schema object",
        ));
    }
    Ok(())
}

fn read_choice(choice: Option<&Value>, have_tools: bool) -> Result<Choice, ApiError> {
    let choice = match choice {
        None => {
            return Ok(if have_tools {
                Choice::Auto
            } else {
                Choice::None
            });
        }
        Some(Value::String(s)) => match s.as_str() {
            "none" => Choice::None,
            "auto" => Choice::Auto,
            "required" => Choice::Required,
            other => {
                return Err(bad(
                    "tool_choice",
                    format!("tool_choice '{other}' is not one of none, auto, required"),
                ));
            }
        },
        Some(v) => {
            let name = v
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .filter(|_| v.get("type").and_then(Value::as_str) == Some("function"))
                .ok_or_else(|| {
                    bad(
                        "tool_choice",
                        "tool_choice must be none, auto, required or {\"type\": \"function\", \
                         \"function\": {\"name\": ...}}",
                    )
                })?;
            Choice::Named(name.to_string())
        }
    };
    if !have_tools && choice != Choice::None {
        return Err(bad("tool_choice", "tool_choice needs tools"));
    }
    Ok(choice)
}

/// A streamed piece of call `index`: the first of a call (`name` given) opens it with a fresh
/// id; later ones carry only more of its arguments.
fn call_chunk(index: usize, name: Option<String>, arguments: String) -> ToolCallChunk {
    let opens = name.is_some();
    ToolCallChunk {
        index,
        id: opens.then(call_id),
        kind: opens.then_some("function"),
        function: FunctionChunk { name, arguments },
    }
}

/// One streamed choice: everything generated so far, and how much of it went out as content.
#[derive(Debug, Default)]
pub struct StreamState {
    text: String,
    sent: usize,
    /// A named function's call has been opened (its id and name sent).
    opened: bool,
    /// Calls were sent: the finish reason says so.
    pub called: bool,
}

/// A fresh id for a tool call.
pub fn call_id() -> String {
    let id = super::random_id();
    format!("call_{}", &id[..id.len().min(24)])
}

impl ToolUse {
    /// What a streamed choice sends for `text` (its next delta; `finished` on the last): the
    /// content it may release and any call deltas. Text that may begin a call is held back
    /// until the call is known or the choice ends.
    pub fn stream(
        &self,
        st: &mut StreamState,
        text: &str,
        finished: bool,
    ) -> (Option<String>, Vec<ToolCallChunk>) {
        st.text.push_str(text);
        match &self.choice {
            Choice::None => (take_rest(st), Vec::new()),
            Choice::Named(name) => {
                let arguments = take_rest(st).unwrap_or_default();
                if st.opened && arguments.is_empty() {
                    return (None, Vec::new());
                }
                let first = !st.opened;
                st.opened = true;
                st.called = true;
                (
                    None,
                    vec![call_chunk(0, first.then(|| name.clone()), arguments)],
                )
            }
            Choice::Required | Choice::Auto => {
                if !finished {
                    return (self.releasable(st), Vec::new());
                }
                let parsed = self.calls(&st.text);
                if parsed.calls.is_empty() {
                    return (take_rest(st), Vec::new());
                }
                st.sent = st.text.len();
                st.called = true;
                let deltas = parsed
                    .calls
                    .into_iter()
                    .enumerate()
                    .map(|(index, c)| call_chunk(index, Some(c.name), c.arguments))
                    .collect();
                (None, deltas)
            }
        }
    }

    /// Content an unfinished choice may send now: with `auto`, the text before anything that
    /// may begin a call; with `required`, nothing (the whole output is the calls).
    fn releasable(&self, st: &mut StreamState) -> Option<String> {
        if self.choice != Choice::Auto {
            return None;
        }
        let end = match self.format {
            // A JSON call is the whole reply: decided by its first characters.
            CallFormat::Llama3Json if st.sent == 0 => match self.format.call_start(&st.text) {
                Some(_) => return None,
                None => st.text.len(),
            },
            CallFormat::Llama3Json => st.text.len(),
            _ => self
                .format
                .call_start(&st.text[st.sent..])
                .map_or(st.text.len(), |i| st.sent + i),
        };
        let out = st.text[st.sent..end].to_string();
        st.sent = end;
        (!out.is_empty()).then_some(out)
    }

    /// The finish reason of a choice whose output held calls: `tool_calls` when the model
    /// chose to call (auto, required), the engine's reason otherwise (a named function's call
    /// ends with `stop`, as OpenAI's API answers).
    pub fn finish_reason(&self, called: bool, engine: &'static str) -> &'static str {
        match self.choice {
            Choice::Auto | Choice::Required if called && engine == "stop" => "tool_calls",
            _ => engine,
        }
    }
}

/// The text not sent yet, as content.
fn take_rest(st: &mut StreamState) -> Option<String> {
    let out = st.text[st.sent..].to_string();
    st.sent = st.text.len();
    (!out.is_empty()).then_some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tools() -> Vec<Tool> {
        serde_json::from_value(json!([
            {"type": "function", "function": {"name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                               "required": ["city"]}}},
            {"type": "function", "function": {"name": "get_time"}}
        ]))
        .expect("tools")
    }

    fn use_with(choice: Value) -> ToolUse {
        ToolUse::read(Some(&tools()), Some(&choice), None, CallFormat::Hermes)
            .expect("accepted")
            .expect("tools")
    }

    #[test]
    fn bad_tools_and_choices_are_refused_naming_the_field() {
        let t = tools();
        let bad_name: Vec<Tool> = serde_json::from_value(
            json!([{"type": "function", "function": {"name": "no spaces"}}]),
        )
        .expect("tools");
        let twice = vec![t[0].clone(), t[0].clone()];
        let many: Vec<Tool> = (0..=MAX_TOOLS)
            .map(|i| {
                serde_json::from_value(
                    json!({"type": "function", "function": {"name": format!("f{i}")}}),
                )
                .expect("tool")
            })
            .collect();
        type Case<'a> = (Option<&'a [Tool]>, Option<Value>, &'a str);
        let cases: Vec<Case> = vec![
            (Some(&bad_name), None, "tools[0]"),
            (Some(&twice), None, "tools[1]"),
            (Some(&many), None, "tools"),
            (Some(&t), Some(json!("sometimes")), "tool_choice"),
            (
                Some(&t),
                Some(json!({"type": "function", "function": {"name": "nope"}})),
                "tool_choice",
            ),
            (Some(&t), Some(json!({"type": "function"})), "tool_choice"),
            (None, Some(json!("required")), "tool_choice"),
        ];
        for (tools, choice, param) in cases {
            let err = ToolUse::read(tools, choice.as_ref(), None, CallFormat::Hermes)
                .expect_err("refused");
            assert_eq!(err.param.as_deref(), Some(param), "{choice:?}");
        }
        assert!(
            ToolUse::read(None, Some(&json!("none")), None, CallFormat::Hermes)
                .expect("none without tools")
                .is_none()
        );
        assert_eq!(use_with(json!("auto")).choice, Choice::Auto);
    }

    #[test]
    fn forced_calls_get_a_grammar_and_are_read_back() {
        let named = use_with(json!({"type": "function", "function": {"name": "get_weather"}}));
        assert_eq!(
            named.grammar(),
            Some(GrammarSpec::JsonSchema(
                tools()[0].function.parameters.clone().expect("p")
            ))
        );
        let got = named.calls(r#"{"city": "Lima"}"#);
        assert_eq!(
            got.calls,
            vec![ToolCall {
                name: "get_weather".into(),
                arguments: r#"{"city": "Lima"}"#.into()
            }]
        );
        assert_eq!(got.content, None);

        let required = use_with(json!("required"));
        let Some(GrammarSpec::JsonSchema(schema)) = required.grammar() else {
            panic!("required has a schema");
        };
        assert_eq!(schema["minItems"], 1);
        assert_eq!(schema["items"]["anyOf"].as_array().map(Vec::len), Some(2));
        let got = required.calls(r#"[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Oslo"}}]"#);
        let names: Vec<&str> = got.calls.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(names, ["get_time", "get_weather"]);
        let one = ToolUse::read(
            Some(&tools()),
            Some(&json!("required")),
            Some(false),
            CallFormat::Hermes,
        )
        .expect("ok")
        .expect("tools");
        let Some(GrammarSpec::JsonSchema(schema)) = one.grammar() else {
            panic!("schema");
        };
        assert_eq!(schema["maxItems"], 1);
        assert_eq!(use_with(json!("auto")).grammar(), None);
        assert_eq!(use_with(json!("none")).template_tools(), None);
    }

    /// Streams `pieces` through `u` and returns the content sent and the reassembled calls.
    fn stream(u: &ToolUse, pieces: &[&str]) -> (String, Vec<(String, String)>, bool) {
        let mut st = StreamState::default();
        let (mut content, mut calls): (String, Vec<(String, String)>) = (String::new(), Vec::new());
        for (i, p) in pieces.iter().enumerate() {
            let (c, deltas) = u.stream(&mut st, p, i + 1 == pieces.len());
            content.push_str(&c.unwrap_or_default());
            for d in deltas {
                if d.index == calls.len() {
                    assert!(
                        d.id.is_some() && d.function.name.is_some(),
                        "a call opens with its id and name"
                    );
                    calls.push((d.function.name.unwrap_or_default(), String::new()));
                }
                calls[d.index].1.push_str(&d.function.arguments);
            }
        }
        (content, calls, st.called)
    }

    #[test]
    fn streamed_calls_reassemble_into_the_whole_responses_calls() {
        let auto = use_with(json!("auto"));
        let out = "Checking.<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
        let pieces = [
            "Check",
            "ing.<to",
            "ol_call>\n{\"name\": \"get_weather\", ",
            "\"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
        ];
        assert_eq!(pieces.concat(), out);
        let (content, calls, called) = stream(&auto, &pieces);
        let whole = auto.calls(out);
        assert_eq!(content, whole.content.unwrap_or_default());
        let want: Vec<(String, String)> = whole
            .calls
            .into_iter()
            .map(|c| (c.name, c.arguments))
            .collect();
        assert_eq!(calls, want);
        assert!(called);
        assert_eq!(auto.finish_reason(called, "stop"), "tool_calls");
        // Text that only looked like a marker's start goes out when it turns out not to be.
        let (content, calls, _) = stream(&auto, &["a <to", "y> b"]);
        assert_eq!((content.as_str(), calls.len()), ("a <toy> b", 0));

        let named = use_with(json!({"type": "function", "function": {"name": "get_weather"}}));
        let (content, calls, called) = stream(&named, &["{\"ci", "ty\": \"Rome\"}"]);
        assert_eq!(content, "");
        assert_eq!(
            calls,
            vec![(
                "get_weather".to_string(),
                "{\"city\": \"Rome\"}".to_string()
            )]
        );
        assert_eq!(named.finish_reason(called, "stop"), "stop");

        let required = use_with(json!("required"));
        let (content, calls, _) = stream(
            &required,
            &["[{\"name\": \"get_time\", ", "\"parameters\": {}}]"],
        );
        assert_eq!(content, "");
        assert_eq!(calls, vec![("get_time".to_string(), "{}".to_string())]);
    }
}

//! Structured outputs as clients ask for them: OpenAI's `response_format` (`json_object`,
//! `json_schema`), vLLM's `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`
//! extensions, and vLLM's newer `structured_outputs` object. Each becomes one
//! [`GrammarSpec`], compiled into a guide the engine follows.

use serde::Deserialize;
use serde_json::Value;

use super::error::ApiError;
use super::state::AppState;
use ferrite_runtime::engine::{GrammarSpec, Guide};

/// The request fields that ask for a structured output (on completions and chat alike, as
/// vLLM reads them).
#[derive(Debug, Clone, Default, Deserialize)]
pub struct StructuredFields {
    pub response_format: Option<Value>,
    /// A JSON schema, as an object or as a string holding one.
    pub guided_json: Option<Value>,
    pub guided_regex: Option<String>,
    pub guided_choice: Option<Vec<String>>,
    /// A grammar in Lark syntax (llguidance's dialect).
    pub guided_grammar: Option<String>,
    pub structured_outputs: Option<StructuredOutputs>,
}

/// vLLM's `structured_outputs` request field.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StructuredOutputs {
    pub json: Option<Value>,
    pub regex: Option<String>,
    pub choice: Option<Vec<String>>,
    pub grammar: Option<String>,
    pub json_object: Option<bool>,
    /// vLLM options this server reads as if unset: whitespace is always bounded (see the
    /// runtime's `structured` module) and there is one backend.
    pub disable_any_whitespace: Option<bool>,
    pub disable_fallback: Option<bool>,
    pub disable_additional_properties: Option<bool>,
    pub whitespace_pattern: Option<String>,
}

/// The grammar a request asks for, and the field that asked (for error messages); `None` for
/// free text.
pub fn requested(f: &StructuredFields) -> Result<Option<(GrammarSpec, &'static str)>, ApiError> {
    let mut found: Vec<(GrammarSpec, &'static str)> = Vec::new();
    if let Some(rf) = &f.response_format {
        found.extend(response_format(rf)?.map(|s| (s, "response_format")));
    }
    if let Some(schema) = &f.guided_json {
        found.push((
            GrammarSpec::JsonSchema(schema_value(schema, "guided_json")?),
            "guided_json",
        ));
    }
    if let Some(rx) = &f.guided_regex {
        found.push((GrammarSpec::Regex(rx.clone()), "guided_regex"));
    }
    if let Some(choice) = &f.guided_choice {
        found.push((GrammarSpec::Choice(choice.clone()), "guided_choice"));
    }
    if let Some(grammar) = &f.guided_grammar {
        found.push((GrammarSpec::Lark(grammar.clone()), "guided_grammar"));
    }
    if let Some(so) = &f.structured_outputs {
        found.extend(structured_outputs(so)?);
    }
    if found.len() > 1 {
        let names: Vec<&str> = found.iter().map(|(_, p)| *p).collect();
        return Err(ApiError::invalid_param(
            names[1],
            format!(
                "only one kind of structured output may be asked for; this request asks for {}",
                names.join(", ")
            ),
        ));
    }
    Ok(found.pop())
}

/// OpenAI's `response_format`.
fn response_format(rf: &Value) -> Result<Option<GrammarSpec>, ApiError> {
    let bad = |msg: &str| ApiError::invalid_param("response_format", msg.to_string());
    match rf.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(GrammarSpec::JsonObject)),
        Some("json_schema") => {
            let schema = rf
                .get("json_schema")
                .and_then(|j| j.get("schema"))
                .ok_or_else(|| bad("response_format json_schema needs json_schema.schema"))?;
            Ok(Some(GrammarSpec::JsonSchema(schema_value(
                schema,
                "response_format",
            )?)))
        }
        Some(other) => Err(bad(&format!(
            "response_format type '{other}' is not supported; use text, json_object or \
             json_schema"
        ))),
        None => Err(bad("response_format needs a type")),
    }
}

/// vLLM's `structured_outputs`: exactly one kind inside it.
fn structured_outputs(
    so: &StructuredOutputs,
) -> Result<Option<(GrammarSpec, &'static str)>, ApiError> {
    const PARAM: &str = "structured_outputs";
    let mut kinds = Vec::new();
    if let Some(schema) = &so.json {
        kinds.push(GrammarSpec::JsonSchema(schema_value(schema, PARAM)?));
    }
    if let Some(rx) = &so.regex {
        kinds.push(GrammarSpec::Regex(rx.clone()));
    }
    if let Some(choice) = &so.choice {
        kinds.push(GrammarSpec::Choice(choice.clone()));
    }
    if let Some(grammar) = &so.grammar {
        kinds.push(GrammarSpec::Lark(grammar.clone()));
    }
    if so.json_object == Some(true) {
        kinds.push(GrammarSpec::JsonObject);
    }
    if kinds.len() > 1 {
        return Err(ApiError::invalid_param(
            PARAM,
            "structured_outputs takes one of json, regex, choice, grammar or json_object"
                .to_string(),
        ));
    }
    Ok(kinds.pop().map(|k| (k, PARAM)))
}

/// A schema given as an object (or `true`/`false`), or as a string holding one.
fn schema_value(v: &Value, param: &str) -> Result<Value, ApiError> {
    let schema = match v {
        Value::String(text) => serde_json::from_str(text).map_err(|e| {
            ApiError::invalid_param(param, format!("the JSON schema does not parse: {e}"))
        })?,
        other => other.clone(),
    };
    match schema {
        Value::Object(_) | Value::Bool(_) => Ok(schema),
        _ => Err(ApiError::invalid_param(
            param,
            "a JSON schema must be an object".to_string(),
        )),
    }
}

/// Compiles what the request asks for on the blocking pool (a large schema takes
/// milliseconds); a grammar that does not compile is the client's error.
pub async fn guide(
    state: &std::sync::Arc<AppState>,
    f: &StructuredFields,
) -> Result<Option<Guide>, ApiError> {
    let Some((spec, param)) = requested(f)? else {
        return Ok(None);
    };
    compile(state, spec, param).await.map(Some)
}

/// Compiles `spec` on the blocking pool; errors are 400s naming `param`.
pub async fn compile(
    state: &std::sync::Arc<AppState>,
    spec: GrammarSpec,
    param: &'static str,
) -> Result<Guide, ApiError> {
    state
        .blocking(move |s| {
            let grammars = s.grammars.as_ref().ok_or_else(|| {
                ApiError::invalid_param(
                    param,
                    "structured outputs are not available for this model's tokenizer".to_string(),
                )
            })?;
            grammars
                .compile(&spec)
                .map_err(|e| ApiError::invalid_param(param, e.to_string()))
        })
        .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn fields(v: Value) -> StructuredFields {
        serde_json::from_value(v).expect("fields")
    }

    #[test]
    fn each_form_reads_as_its_grammar() {
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        let cases = [
            (json!({"response_format": {"type": "text"}}), None),
            (
                json!({"response_format": {"type": "json_object"}}),
                Some(GrammarSpec::JsonObject),
            ),
            (
                json!({"response_format": {"type": "json_schema",
                    "json_schema": {"name": "x", "schema": schema, "strict": true}}}),
                Some(GrammarSpec::JsonSchema(schema.clone())),
            ),
            (
                json!({"guided_json": schema.to_string()}),
                Some(GrammarSpec::JsonSchema(schema.clone())),
            ),
            (
                json!({"guided_regex": "[0-9]+"}),
                Some(GrammarSpec::Regex("[0-9]+".into())),
            ),
            (
                json!({"guided_choice": ["yes", "no"]}),
                Some(GrammarSpec::Choice(vec!["yes".into(), "no".into()])),
            ),
            (
                json!({"guided_grammar": "start: \"a\""}),
                Some(GrammarSpec::Lark("start: \"a\"".into())),
            ),
            (
                json!({"structured_outputs": {"choice": ["a"]}}),
                Some(GrammarSpec::Choice(vec!["a".into()])),
            ),
            (
                json!({"structured_outputs": {"json_object": true}}),
                Some(GrammarSpec::JsonObject),
            ),
            (json!({}), None),
        ];
        for (body, want) in cases {
            let got = requested(&fields(body.clone()))
                .expect("accepted")
                .map(|(s, _)| s);
            assert_eq!(got, want, "{body}");
        }
    }

    #[test]
    fn contradictions_and_unknown_forms_are_refused_naming_the_field() {
        let cases = [
            (
                json!({"response_format": {"type": "json_object"}, "guided_regex": "a"}),
                "guided_regex",
            ),
            (
                json!({"response_format": {"type": "structural_tag"}}),
                "response_format",
            ),
            (
                json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}),
                "response_format",
            ),
            (json!({"response_format": {}}), "response_format"),
            (json!({"guided_json": "{not json"}), "guided_json"),
            (json!({"guided_json": 3}), "guided_json"),
            (
                json!({"structured_outputs": {"regex": "a", "choice": ["a"]}}),
                "structured_outputs",
            ),
        ];
        for (body, param) in cases {
            let err = requested(&fields(body.clone())).expect_err("refused");
            assert_eq!(err.param.as_deref(), Some(param), "{body}");
        }
    }
}

//! Chat templates: the model's own Jinja template rendered by minijinja.

use minijinja::{Environment, ErrorKind, Value};
use serde::Serialize;

use super::ModelError;

/// One chat message as the template sees it.
#[derive(Debug, Clone, Default, Serialize, PartialEq, Eq)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    /// An assistant turn's calls, `[{"id", "type", "function": {"name", "arguments"}}]` with
    /// the arguments as an object (as Hugging Face templates expect them).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<serde_json::Value>,
    /// A `tool` message: the call it answers.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

/// A compiled chat template plus the special-token strings templates commonly reference.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    /// The template's text (tool-call formats are recognised from it).
    source: String,
    bos_token: String,
    eos_token: String,
}

const NAME: &str = "chat";

impl ChatTemplate {
    pub fn new(source: &str, bos_token: String, eos_token: String) -> Result<Self, ModelError> {
        let mut env = Environment::new();
        // Hugging Face templates are written for Python's Jinja: `.strip()`, `.startswith()` etc.
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> Result<Value, minijinja::Error> {
                Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
            },
        );
        env.add_template_owned(NAME, source.to_string())
            .map_err(|e| ModelError::ChatTemplate(format!("template does not compile: {e}")))?;
        Ok(Self {
            env,
            source: source.to_string(),
            bos_token,
            eos_token,
        })
    }

    /// Renders `messages` into the prompt text the model was trained on.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, ModelError> {
        self.render_with_tools(messages, add_generation_prompt, None)
    }

    pub fn source(&self) -> &str {
        &self.source
    }

    /// [`ChatTemplate::render`] with the request's `tools` (the template's `tools` variable,
    /// as Hugging Face's `apply_chat_template(tools=...)` passes them).
    pub fn render_with_tools(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        tools: Option<&serde_json::Value>,
    ) -> Result<String, ModelError> {
        let tmpl = self
            .env
            .get_template(NAME)
            .map_err(|e| ModelError::ChatTemplate(e.to_string()))?;
        tmpl.render(minijinja::context! {
            messages => messages,
            tools => tools,
            add_generation_prompt => add_generation_prompt,
            bos_token => &self.bos_token,
            eos_token => &self.eos_token,
        })
        .map_err(|e| ModelError::ChatTemplate(format!("rendering failed: {e}")))
    }
}

//! One streamed chat completion as a client sees it: time to the first token, and the usage
//! the server reports (prompt, cached and output tokens).

use std::io::{BufRead, BufReader};
use std::time::Instant;

use anyhow::{Context, Result, anyhow, bail};
use serde_json::Value;

/// What one request saw.
#[derive(Debug, Clone, Copy)]
pub struct Turn {
    /// Seconds from sending to the first content.
    pub ttft: f64,
    pub output_tokens: usize,
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
}

/// POSTs `body` (a chat request; `stream` and usage reporting are added) to
/// `base/v1/chat/completions` and reads the stream; returns what it saw and the answer.
pub fn stream_chat(agent: &ureq::Agent, base: &str, mut body: Value) -> Result<(Turn, String)> {
    body["stream"] = Value::Bool(true);
    body["stream_options"] = serde_json::json!({"include_usage": true});
    let started = Instant::now();
    let resp = match agent
        .post(&format!("{base}/v1/chat/completions"))
        .send_json(body)
    {
        Ok(r) => r,
        Err(ureq::Error::Status(code, r)) => {
            bail!("HTTP {code}: {}", r.into_string().unwrap_or_default())
        }
        Err(e) => return Err(e.into()),
    };
    let mut ttft = None;
    let mut text = String::new();
    let mut chunks = 0usize;
    let mut usage = None;
    for line in BufReader::new(resp.into_reader()).lines() {
        let line = line?;
        let Some(payload) = line.strip_prefix("data: ") else {
            continue;
        };
        if payload.trim() == "[DONE]" {
            break;
        }
        let v: Value =
            serde_json::from_str(payload).with_context(|| format!("bad chunk: {payload}"))?;
        if let Some(e) = v.get("error") {
            bail!("{base}: error in the stream: {e}");
        }
        if v["usage"].is_object() {
            usage = Some(v["usage"].clone());
        }
        if let Some(delta) = v["choices"][0]["delta"]["content"].as_str()
            && !delta.is_empty()
        {
            ttft.get_or_insert_with(|| started.elapsed().as_secs_f64());
            text.push_str(delta);
            chunks += 1;
        }
    }
    let usage = usage.ok_or_else(|| anyhow!("{base}: no usage in the stream"))?;
    let count = |v: &Value| v.as_u64().map(|n| n as usize);
    let turn = Turn {
        ttft: ttft.ok_or_else(|| anyhow!("{base}: no content in the stream"))?,
        output_tokens: count(&usage["completion_tokens"]).unwrap_or(chunks),
        prompt_tokens: count(&usage["prompt_tokens"]).unwrap_or(0),
        cached_tokens: count(&usage["prompt_tokens_details"]["cached_tokens"]).unwrap_or(0),
    };
    Ok((turn, text))
}

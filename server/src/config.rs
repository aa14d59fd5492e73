//! Command-line configuration of the server, with vLLM's flag names where they exist.

use std::path::PathBuf;

use clap::Parser;

use ferrite_runtime::device::{DeviceError, parse_device};
use ferrite_runtime::engine::{Budget, EngineConfig, KvSizing, Pooling, PoolingKind, Scheduling};
use ferrite_runtime::kv::CacheDtype;
use ferrite_runtime::model::lora::LoraDtype;
use ferrite_runtime::model::{LoadOptions, WeightMode};

#[derive(Debug, Clone, Parser)]
#[command(
    name = "ferrite-server",
    version,
    about = "OpenAI-compatible LLM server on candle"
)]
pub struct ServerArgs {
    /// The weights: a GGUF file or Hugging Face folder (config.json, *.safetensors,
    /// tokenizer.json) on disk, or a source to download first: `hf://org/name[@revision][/file]`
    /// (HF_TOKEN, HF_ENDPOINT), `s3://bucket/key` (AWS_* variables), `gs://bucket/key`
    /// (GOOGLE_* variables) or an `https://` URL. A key ending in `/` is a folder.
    #[arg(long, env = "FERRITE_MODEL")]
    pub model: String,
    /// The sha256 the weights must have (64 hex digits), for a single-file model (a GGUF):
    /// checked after any download and before loading, on every start. A download that does
    /// not match is removed, so the next start fetches it again.
    #[arg(long, env = "FERRITE_MODEL_SHA256", value_parser = parse_sha256)]
    pub model_sha256: Option<String>,
    /// Where downloads go (default: `$HF_HOME/hub`, else `~/.cache/huggingface/hub`). An
    /// interrupted download resumes from here on the next start.
    #[arg(long, env = "FERRITE_DOWNLOAD_DIR")]
    pub download_dir: Option<PathBuf>,
    /// A file to write the reason into when the server cannot start (Kubernetes shows it as
    /// the container's termination message; the operator sets `/dev/termination-log`).
    #[arg(long, env = "FERRITE_TERMINATION_MESSAGE_PATH")]
    pub termination_message_path: Option<PathBuf>,
    /// Name clients use in the `model` field (default: the repository id for `hf://`, else
    /// the model file or folder name). Several names, as in vLLM: each is accepted, the first
    /// is the one responses and metrics carry (the operator adds `namespace/name`).
    #[arg(long, num_args = 1..)]
    pub served_model_name: Vec<String>,
    #[arg(long, default_value = "0.0.0.0")]
    pub host: String,
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// `cpu`, `cuda` or `cuda:N` (CUDA needs a build with `--features cuda`).
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// How to hold GGUF weights; see `WeightMode`.
    #[arg(long, value_enum, default_value_t = WeightMode::Auto)]
    pub weights: WeightMode,
    /// A tokenizer.json to use instead of the model's own tokenizer.
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Longest prompt + completion, in tokens (default: the model's context length).
    #[arg(long)]
    pub max_model_len: Option<usize>,
    /// Tokens per KV-cache block.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// Memory for the device KV cache, e.g. `512MiB`, `2GiB` or plain bytes. The default holds
    /// as many f16 tokens as 1 GiB held in f32 (23,301 for SmolLM2).
    #[arg(long, default_value = "512MiB", value_parser = parse_bytes)]
    pub kv_cache_memory: usize,
    /// How keys and values are stored: `auto` (float16), float16, bfloat16 or float32.
    #[arg(long, value_enum, default_value_t = CacheDtype::Auto)]
    pub kv_cache_dtype: CacheDtype,
    /// Number of device KV blocks; overrides --kv-cache-memory.
    #[arg(long)]
    pub num_gpu_blocks: Option<usize>,
    /// Host swap space for preempted sequences, in GiB (vLLM's --swap-space).
    #[arg(long, default_value_t = 4.0)]
    pub swap_space: f64,
    /// Most sequences in one batch.
    #[arg(long, default_value_t = 256)]
    pub max_num_seqs: usize,
    /// Most tokens (prompt chunks + decodes) in one engine step.
    #[arg(long, default_value_t = 2048)]
    pub max_num_batched_tokens: usize,
    /// Split long prompts across steps so they do not stall running decodes.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub enable_chunked_prefill: bool,
    /// Reuse the KV cache of prompt prefixes computed before (on unless
    /// `--no-enable-prefix-caching`; the last of the two flags wins, as in vLLM).
    #[arg(long, overrides_with = "no_enable_prefix_caching")]
    pub enable_prefix_caching: bool,
    /// Turn automatic prefix caching off.
    #[arg(long, overrides_with = "enable_prefix_caching")]
    pub no_enable_prefix_caching: bool,
    /// Run every decode step op by op: no CUDA graphs (on a GPU, decode steps of up to 256
    /// sequences are otherwise replayed from graphs captured on first use).
    #[arg(long)]
    pub enforce_eager: bool,
    /// Require `Authorization: Bearer <key>` on /v1/* (as vLLM's --api-key).
    #[arg(long, env = "FERRITE_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Refuse new requests with 503 + Retry-After while this many are already waiting
    /// (default: no limit, as vLLM).
    #[arg(long)]
    pub max_queue_len: Option<usize>,
    /// Most sequences one request may add (prompts × `n`); more is refused with 400. Bounds
    /// the memory and engine work a single request can claim.
    #[arg(long, default_value_t = 1024, value_parser = clap::value_parser!(u64).range(1..))]
    pub max_request_sequences: u64,
    /// Connections open at once; past it the listener stops accepting until one closes.
    #[arg(long, default_value_t = ferrite_net::ListenerLimits::default().max_connections)]
    pub max_connections: usize,
    /// Seconds for a request's head to arrive, and the most a kept-alive connection may idle
    /// (a client trickling its headers, slowloris, is cut off).
    #[arg(long, default_value_t = 30.0, value_parser = parse_interval)]
    pub header_read_timeout: f64,
    /// Seconds for a request's whole body to arrive; slower is a 408.
    #[arg(long, default_value_t = 60.0, value_parser = parse_interval)]
    pub body_read_timeout: f64,
    /// Seconds to finish in-flight requests after SIGTERM before exiting anyway.
    #[arg(long, default_value_t = 30)]
    pub shutdown_timeout: u64,
    /// Seconds between stats log lines (and updates of the average-throughput gauges).
    #[arg(long, default_value_t = 10.0, value_parser = parse_interval)]
    pub log_stats_interval: f64,
    /// Turn off the stats log line and the average-throughput gauges.
    #[arg(long)]
    pub disable_log_stats: bool,
    /// Serve LoRA adapters (vLLM's flag; implied by `--lora-modules`).
    #[arg(long)]
    pub enable_lora: bool,
    /// Adapters to serve from the start, each `name=source` or vLLM's JSON form
    /// `{"name": ..., "path": ...}`: a PEFT folder (adapter_config.json and
    /// adapter_model.safetensors) or a llama.cpp GGUF LoRA file, on disk or at any source
    /// `--model` takes. Requests name an adapter in `model`.
    #[arg(long, num_args = 1.., value_parser = crate::api::adapters::parse_module)]
    pub lora_modules: Vec<(String, String)>,
    /// Most distinct adapters among the running requests; requests for another adapter wait.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
    pub max_loras: u64,
    /// Largest adapter rank accepted: bounds each adapter's memory and per-token work.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u64).range(1..=512))]
    pub max_lora_rank: u64,
    /// What adapters' factors are kept in: `float32` (exact) or `bfloat16` (half the memory
    /// and the bytes each step reads per adapter; each factor rounded once at load).
    #[arg(long, value_enum, default_value_t = LoraDtype::Float32)]
    pub lora_dtype: LoraDtype,
    /// How the model writes tool calls, by vLLM's parser names: `hermes` (also `qwen`,
    /// `qwen3`), `llama3_json` (`llama4_json`), `mistral`. Default: recognised from the chat
    /// template.
    #[arg(long, value_parser = parse_call_format)]
    pub tool_call_parser: Option<crate::api::tool_parse::CallFormat>,
    /// How `/v1/embeddings` pools the final hidden states, as vLLM's flag takes it:
    /// `{"pooling_type": "LAST" | "MEAN", "normalize": true | false}` (default: the last
    /// token's state, normalised, vLLM's default for a decoder model).
    #[arg(long, value_parser = parse_pooler_config, default_value = "{}")]
    pub pooler_config: Pooling,
    /// Accepted for vLLM's command lines: `tool_choice: "auto"` is always served here.
    #[arg(long)]
    pub enable_auto_tool_choice: bool,
    /// Most adapters held in memory (default: the larger of `--max-loras` and the number of
    /// `--lora-modules`); past it the least recently used is dropped and read again from its
    /// file when a request names it, as vLLM pages its CPU cache.
    #[arg(long)]
    pub max_cpu_loras: Option<usize>,
    /// Let `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter` change the adapters
    /// of a running server (vLLM's environment variable; the operator sets it).
    #[arg(long, env = "VLLM_ALLOW_RUNTIME_LORA_UPDATING", value_parser = clap::builder::BoolishValueParser::new(), action = clap::ArgAction::Set, default_value = "false")]
    pub allow_runtime_lora_updating: bool,
    /// How many nice levels the engine and compute threads run below the HTTP threads, so
    /// probes, scrapes and token streams get a core promptly under load (0 turns it off).
    #[arg(long, default_value_t = ferrite_runtime::priority::COMPUTE_NICE, value_parser = clap::value_parser!(i32).range(0..=19))]
    pub compute_nice: i32,
}

/// A positive, finite number of seconds.
impl ServerArgs {
    /// Whether adapters are served (`--enable-lora`, or any `--lora-modules`).
    pub fn lora_enabled(&self) -> bool {
        self.enable_lora || !self.lora_modules.is_empty()
    }

    /// What bounds the adapters, when LoRA is on.
    pub fn lora_settings(&self) -> Option<crate::api::adapters::LoraSettings> {
        self.lora_enabled()
            .then(|| crate::api::adapters::LoraSettings {
                max_rank: self.max_lora_rank as usize,
                dtype: self.lora_dtype,
                max_resident: self
                    .max_cpu_loras
                    .unwrap_or((self.max_loras as usize).max(self.lora_modules.len())),
                allow_runtime_updates: self.allow_runtime_lora_updating,
                download_dir: self
                    .download_dir
                    .clone()
                    .unwrap_or_else(crate::fetch::default_cache_dir),
            })
    }

    /// Whether automatic prefix caching is on.
    pub fn prefix_caching(&self) -> bool {
        !self.no_enable_prefix_caching
    }

    /// What the engine builds itself from, for the weights at `model`.
    pub fn engine_config(&self, model: PathBuf) -> Result<EngineConfig, DeviceError> {
        Ok(EngineConfig {
            model,
            load: LoadOptions {
                device: parse_device(&self.device)?,
                weight_mode: self.weights,
                max_model_len: self.max_model_len,
                tokenizer: self.tokenizer.clone(),
                enforce_eager: self.enforce_eager,
            },
            kv: KvSizing {
                block_size: self.block_size,
                device: self
                    .num_gpu_blocks
                    .map_or(Budget::Bytes(self.kv_cache_memory), Budget::Blocks),
                host: Budget::Bytes((self.swap_space * (1u64 << 30) as f64) as usize),
                dtype: self.kv_cache_dtype,
            },
            scheduling: Scheduling {
                max_num_seqs: self.max_num_seqs,
                max_num_batched_tokens: self.max_num_batched_tokens,
                chunked_prefill: self.enable_chunked_prefill,
                prefix_caching: self.prefix_caching(),
                max_loras: self.max_loras as usize,
            },
            compute_nice: self.compute_nice,
        })
    }

    /// What the listener allows.
    pub fn listener_limits(&self) -> ferrite_net::ListenerLimits {
        ferrite_net::ListenerLimits {
            max_connections: self.max_connections.max(1),
            header_read_timeout: std::time::Duration::from_secs_f64(self.header_read_timeout),
            nodelay: true,
        }
    }
}

/// 64 hex digits, lowercased.
fn parse_sha256(s: &str) -> Result<String, String> {
    if s.len() == 64 && s.bytes().all(|b| b.is_ascii_hexdigit()) {
        Ok(s.to_ascii_lowercase())
    } else {
        Err(format!("{s:?} is not a sha256 (64 hex digits)"))
    }
}

fn parse_interval(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 => Ok(v),
        _ => Err(format!("expected a positive number of seconds, got '{s}'")),
    }
}

/// Parses `123`, `64KiB`, `512MiB`, `2GiB` (also KB/MB/GB as powers of 1000).
pub fn parse_bytes(s: &str) -> Result<usize, String> {
    let s = s.trim();
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let num: f64 = num.parse().map_err(|_| format!("invalid size '{s}'"))?;
    let mult: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kib" => 1024.0,
        "m" | "mib" => 1024.0 * 1024.0,
        "g" | "gib" => 1024.0 * 1024.0 * 1024.0,
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        other => return Err(format!("unknown size unit '{other}' in '{s}'")),
    };
    let bytes = num * mult;
    if !bytes.is_finite() || bytes < 0.0 {
        return Err(format!("invalid size '{s}'"));
    }
    Ok(bytes as usize)
}

/// A `--tool-call-parser` name.
/// `--pooler-config`: vLLM's JSON; unknown keys and pooling types are refused at start rather
/// than ignored.
fn parse_pooler_config(v: &str) -> Result<Pooling, String> {
    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct PoolerConfig {
        pooling_type: Option<String>,
        normalize: Option<bool>,
    }
    let c: PoolerConfig = serde_json::from_str(v).map_err(|e| {
        format!(
            "not a pooler config ({e}); e.g. {{\"pooling_type\": \"MEAN\", \"normalize\": true}}"
        )
    })?;
    let kind = match c
        .pooling_type
        .as_deref()
        .map(str::to_ascii_uppercase)
        .as_deref()
    {
        None | Some("LAST") => PoolingKind::Last,
        Some("MEAN") => PoolingKind::Mean,
        Some(other) => {
            return Err(format!(
                "pooling_type {other} is not served here; use LAST or MEAN"
            ));
        }
    };
    Ok(Pooling {
        kind,
        normalize: c.normalize.unwrap_or(true),
    })
}

fn parse_call_format(v: &str) -> Result<crate::api::tool_parse::CallFormat, String> {
    crate::api::tool_parse::CallFormat::from_name(v).ok_or_else(|| {
        format!("'{v}' is not a tool-call format here; use hermes, llama3_json or mistral")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_sizes() {
        assert_eq!(parse_bytes("1024"), Ok(1024));
        assert_eq!(parse_bytes("2GiB"), Ok(2 << 30));
        assert_eq!(parse_bytes("512MiB"), Ok(512 << 20));
        assert_eq!(parse_bytes("1.5k"), Ok(1536));
        assert_eq!(parse_bytes("1GB"), Ok(1_000_000_000));
        assert!(parse_bytes("12 parsecs").is_err());
        assert!(parse_bytes("lots").is_err());
    }

    #[test]
    fn prefix_caching_is_on_unless_turned_off_last() {
        let parse = |flags: &[&str]| {
            let argv = ["ferrite-server", "--model", "m.gguf"].iter().chain(flags);
            ServerArgs::try_parse_from(argv).map(|a| a.prefix_caching())
        };
        assert_eq!(parse(&[]).ok(), Some(true));
        assert_eq!(parse(&["--no-enable-prefix-caching"]).ok(), Some(false));
        assert_eq!(parse(&["--enable-prefix-caching"]).ok(), Some(true));
        let both = ["--enable-prefix-caching", "--no-enable-prefix-caching"];
        assert_eq!(parse(&both).ok(), Some(false));
        let both = ["--no-enable-prefix-caching", "--enable-prefix-caching"];
        assert_eq!(parse(&both).ok(), Some(true));
    }

    #[test]
    fn lora_dtypes_parse_as_vllm_writes_them() {
        let parse = |v: &str| {
            let argv = ["ferrite-server", "--model", "m.gguf", "--lora-dtype", v];
            ServerArgs::try_parse_from(argv).map(|a| a.lora_dtype)
        };
        assert_eq!(parse("auto").ok(), Some(LoraDtype::Float32));
        assert_eq!(parse("float32").ok(), Some(LoraDtype::Float32));
        assert_eq!(parse("bfloat16").ok(), Some(LoraDtype::Bfloat16));
        // float16 is vLLM's too, but not kept here: refused at start, not read as another.
        assert!(parse("float16").is_err());
    }

    #[test]
    fn pooler_config_takes_vllms_json() {
        let parse = |v: &str| {
            let argv = ["ferrite-server", "--model", "m.gguf", "--pooler-config", v];
            ServerArgs::try_parse_from(argv).map(|a| a.pooler_config)
        };
        let plain = ServerArgs::try_parse_from(["ferrite-server", "--model", "m.gguf"]);
        let last = Pooling {
            kind: PoolingKind::Last,
            normalize: true,
        };
        assert_eq!(plain.map(|a| a.pooler_config).ok(), Some(last));
        let mean = parse(r#"{"pooling_type": "MEAN", "normalize": false}"#);
        assert_eq!(
            mean.ok(),
            Some(Pooling {
                kind: PoolingKind::Mean,
                normalize: false
            })
        );
        assert!(parse(r#"{"pooling_type": "CLS"}"#).is_err());
        assert!(parse(r#"{"pooling": "MEAN"}"#).is_err());
        assert!(parse("MEAN").is_err());
    }

    #[test]
    fn tool_call_parsers_take_vllms_names() {
        use crate::api::tool_parse::CallFormat;
        let parse = |v: &str| {
            let argv = [
                "ferrite-server",
                "--model",
                "m.gguf",
                "--tool-call-parser",
                v,
            ];
            ServerArgs::try_parse_from(argv).map(|a| a.tool_call_parser)
        };
        assert_eq!(parse("hermes").ok(), Some(Some(CallFormat::Hermes)));
        assert_eq!(
            parse("llama3_json").ok(),
            Some(Some(CallFormat::Llama3Json))
        );
        assert_eq!(parse("mistral").ok(), Some(Some(CallFormat::Mistral)));
        let err = parse("pythonic").expect_err("unknown").to_string();
        assert!(err.contains("hermes"), "{err}");
        let argv = [
            "ferrite-server",
            "--model",
            "m.gguf",
            "--enable-auto-tool-choice",
        ];
        assert!(ServerArgs::try_parse_from(argv).is_ok_and(|a| a.tool_call_parser.is_none()));
    }

    #[test]
    fn intervals_must_be_positive() {
        assert_eq!(parse_interval("0.5"), Ok(0.5));
        assert!(parse_interval("0").is_err());
        assert!(parse_interval("-1").is_err());
        assert!(parse_interval("inf").is_err());
        assert!(parse_interval("soon").is_err());
    }
}

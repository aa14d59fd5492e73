//! LoRA adapters: low-rank updates `y += s · B (A x)` to a base model's projections, so that one
//! base model serves many fine-tunes.
//!
//! An adapter is read from a Hugging Face PEFT folder ([`peft`]) or a llama.cpp GGUF LoRA file
//! ([`gguf`]), checked against the base model's shapes, and kept as f32 factors per layer and
//! projection, placed at its columns in the fused projections the model runs (Q/K/V and
//! gate/up are one matrix each here). A forward applies each sequence's own adapter, or none,
//! to its rows ([`LoraStep`]): one batch may mix any number of adapters and the base model,
//! the S-LoRA/Punica idea, never one forward per adapter.

mod apply;
mod gguf;
mod peft;

use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};

pub use apply::LoraStep;

use super::config::{Arch, ModelConfig, RopeStyle};

/// Why an adapter could not be loaded. Messages name the file and tensor at fault.
#[derive(Debug, thiserror::Error)]
pub enum LoraError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: {reason}")]
    Invalid { path: PathBuf, reason: String },
    #[error("{path}: adapter rank {rank} exceeds the limit of {max} (--max-lora-rank)")]
    RankTooLarge {
        path: PathBuf,
        rank: usize,
        max: usize,
    },
    #[error("{0}")]
    Tensor(#[from] candle_core::Error),
}

/// The projections of a Llama block an adapter may change.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Target {
    Q,
    K,
    V,
    O,
    Gate,
    Up,
    Down,
}

impl Target {
    pub const ALL: [Target; 7] = [
        Target::Q,
        Target::K,
        Target::V,
        Target::O,
        Target::Gate,
        Target::Up,
        Target::Down,
    ];

    /// The module's name in a Hugging Face checkpoint (`model.layers.N.<name>`).
    fn hf_name(self) -> &'static str {
        match self {
            Target::Q => "self_attn.q_proj",
            Target::K => "self_attn.k_proj",
            Target::V => "self_attn.v_proj",
            Target::O => "self_attn.o_proj",
            Target::Gate => "mlp.gate_proj",
            Target::Up => "mlp.up_proj",
            Target::Down => "mlp.down_proj",
        }
    }

    /// The tensor's name in a llama.cpp GGUF (`blk.N.<name>.weight`).
    fn gguf_name(self) -> &'static str {
        match self {
            Target::Q => "attn_q",
            Target::K => "attn_k",
            Target::V => "attn_v",
            Target::O => "attn_output",
            Target::Gate => "ffn_gate",
            Target::Up => "ffn_up",
            Target::Down => "ffn_down",
        }
    }

    /// `(in, out)` features of this projection in `cfg`.
    fn dims(self, cfg: &ModelConfig) -> (usize, usize) {
        let q = cfg.num_heads * cfg.head_dim;
        let kv = cfg.num_kv_heads * cfg.head_dim;
        let (h, f) = (cfg.hidden_size, cfg.intermediate_size);
        match self {
            Target::Q => (h, q),
            Target::K | Target::V => (h, kv),
            Target::O => (q, h),
            Target::Gate | Target::Up => (h, f),
            Target::Down => (f, h),
        }
    }

    /// The fused projection this one is part of, and its first column there.
    fn place(self, cfg: &ModelConfig) -> (Proj, usize) {
        let q = cfg.num_heads * cfg.head_dim;
        let kv = cfg.num_kv_heads * cfg.head_dim;
        match self {
            Target::Q => (Proj::Qkv, 0),
            Target::K => (Proj::Qkv, q),
            Target::V => (Proj::Qkv, q + kv),
            Target::O => (Proj::O, 0),
            Target::Gate => (Proj::GateUp, 0),
            Target::Up => (Proj::GateUp, cfg.intermediate_size),
            Target::Down => (Proj::Down, 0),
        }
    }
}

/// The matrices a layer runs (`weights::LayerWeights`): Q/K/V and gate/up fused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Proj {
    Qkv,
    O,
    GateUp,
    Down,
}

impl Proj {
    fn index(self) -> usize {
        self as usize
    }
}

/// Whether a GGUF file of `general.architecture` `file_arch` is made for a base of `arch`
/// (llama.cpp files Mistral models as "llama").
fn fits_base_arch(file_arch: &str, arch: Arch) -> bool {
    match arch {
        Arch::Llama | Arch::Mistral => matches!(file_arch, "llama" | "mistral"),
        other => other.gguf_name() == file_arch,
    }
}

/// Row order of Q's and K's output features in a file. llama.cpp's converter permutes them for
/// Llama and Mistral (its RoPE pairs adjacent dimensions); Hugging Face keeps each head's two
/// halves apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RowOrder {
    Hf,
    LlamaCpp,
}

/// An adapter's update of one fused projection of one layer. The A factors of its targets
/// share the projection's input, so they are stacked and stored transposed, `[in][R]` (`R` the
/// sum of their ranks): `u = A x` is then one pass over `x` that adds whole vectors of `u`.
/// Each B is stored transposed too, `[rank][out]`, so `B u` adds whole vectors of outputs.
/// Neither needs a horizontal sum, which on the CPU cost more than the products themselves.
#[derive(Debug)]
struct Group {
    fan_in: usize,
    /// `R`: the rows of the stacked A.
    rank: usize,
    /// The stacked A, transposed: `[fan_in][rank]`.
    at: Factors,
    /// Its targets, by column.
    pairs: Vec<Pair>,
    /// `at` on the model's device, for non-CPU forwards.
    at_on_device: Option<Tensor>,
}

/// One target's B and where its update goes.
#[derive(Debug)]
struct Pair {
    target: Target,
    /// Its rows of the group's `u`: `u_at..u_at + rank`.
    u_at: usize,
    rank: usize,
    fan_out: usize,
    /// First column of this target in the fused projection's output.
    offset: usize,
    scale: f32,
    /// B transposed: `[rank][fan_out]`.
    bt: Factors,
    /// `bt` on the model's device, for non-CPU forwards.
    bt_on_device: Option<Tensor>,
}

/// A checked pair before it is stacked into its group.
pub(crate) struct Placed {
    target: Target,
    rank: usize,
    fan_in: usize,
    fan_out: usize,
    offset: usize,
    scale: f32,
    /// `[rank, in]`.
    a: Vec<f32>,
    /// `[out, rank]`.
    b: Vec<f32>,
}

/// `m` (`[rows, cols]`, row-major) transposed.
fn transpose(m: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut t = vec![0f32; m.len()];
    for r in 0..rows {
        for c in 0..cols {
            t[c * rows + r] = m[r * cols + c];
        }
    }
    t
}

impl Group {
    /// Stacks `placed` (one fused projection's targets, by column) into a group.
    fn new(
        mut placed: Vec<Placed>,
        device: &Device,
        dtype: LoraDtype,
    ) -> Result<Option<Group>, LoraError> {
        placed.sort_by_key(|p| p.offset);
        let Some(fan_in) = placed.first().map(|p| p.fan_in) else {
            return Ok(None);
        };
        let rank: usize = placed.iter().map(|p| p.rank).sum();
        let mut at = vec![0f32; fan_in * rank];
        let mut pairs = Vec::with_capacity(placed.len());
        let mut u_at = 0;
        for p in placed {
            for j in 0..p.rank {
                for i in 0..fan_in {
                    at[i * rank + u_at + j] = p.a[j * fan_in + i];
                }
            }
            let bt = Factors::new(transpose(&p.b, p.fan_out, p.rank), dtype);
            let bt_on_device = match device.is_cpu() {
                true => None,
                false => Some(Tensor::from_slice(
                    &bt.to_f32(),
                    (p.rank, p.fan_out),
                    device,
                )?),
            };
            pairs.push(Pair {
                target: p.target,
                u_at,
                rank: p.rank,
                fan_out: p.fan_out,
                offset: p.offset,
                scale: p.scale,
                bt,
                bt_on_device,
            });
            u_at += p.rank;
        }
        let at = Factors::new(at, dtype);
        let at_on_device = match device.is_cpu() {
            true => None,
            false => Some(Tensor::from_slice(&at.to_f32(), (fan_in, rank), device)?),
        };
        Ok(Some(Group {
            fan_in,
            rank,
            at,
            pairs,
            at_on_device,
        }))
    }
}

/// A loaded adapter, checked against one base model's shapes.
#[derive(Debug)]
pub struct LoraAdapter {
    /// Unique to this load: equal tokens under two loads (even of the same files) never share
    /// cached keys and values.
    id: u64,
    name: String,
    rank: usize,
    /// `[layer][Proj::index]`: the update of that fused projection, if any.
    layers: Vec<[Option<Group>; 4]>,
    bytes: usize,
    /// The base model's shapes it was checked against.
    base: BaseShape,
}

/// What of a base model an adapter's placement depends on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct BaseShape {
    layers: usize,
    hidden: usize,
    intermediate: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    rope_style: RopeStyle,
}

impl BaseShape {
    fn of(cfg: &ModelConfig) -> Self {
        BaseShape {
            layers: cfg.num_layers,
            hidden: cfg.hidden_size,
            intermediate: cfg.intermediate_size,
            heads: cfg.num_heads,
            kv_heads: cfg.num_kv_heads,
            head_dim: cfg.head_dim,
            rope_style: cfg.rope_style,
        }
    }
}

impl LoraAdapter {
    /// Unique to this load of the adapter (the prefix cache keys blocks by it).
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Whether it was loaded for a base model of `cfg`'s shapes.
    pub fn fits(&self, cfg: &ModelConfig) -> bool {
        self.base == BaseShape::of(cfg)
    }

    /// The name requests use for it.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The largest rank of its pairs.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Bytes its factors take, once per device copy.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// The projections it changes in any layer (for logs and listings).
    pub fn targets(&self) -> Vec<Target> {
        let mut seen: Vec<Target> = self
            .layers
            .iter()
            .flatten()
            .flatten()
            .flat_map(|g| g.pairs.iter().map(|p| p.target))
            .collect();
        seen.sort();
        seen.dedup();
        seen
    }

    fn group(&self, layer: usize, proj: Proj) -> Option<&Group> {
        self.layers.get(layer)?[proj.index()].as_ref()
    }
}

/// One factor pair as a file holds it, before it is checked and placed.
struct RawPair {
    layer: usize,
    target: Target,
    /// `[rank, in]`, row-major.
    a: Vec<f32>,
    a_shape: (usize, usize),
    /// `[out, rank]`, row-major.
    b: Vec<f32>,
    b_shape: (usize, usize),
}

/// What a reader returns: the pairs, how to scale each by its rank, and the file's Q/K order.
struct RawAdapter {
    pairs: Vec<RawPair>,
    /// `scale(rank)`: PEFT's `alpha / r` (rsLoRA `alpha / √r`), llama.cpp's `alpha / r`.
    scale: Box<dyn Fn(usize) -> f32>,
    order: RowOrder,
}

/// A 2-D tensor's values as f32 (any float type) and its shape: what both readers hand over.
fn matrix(t: &Tensor) -> Result<(Vec<f32>, (usize, usize)), candle_core::Error> {
    let shape = t.dims2()?;
    let v = t
        .to_dtype(candle_core::DType::F32)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    Ok((v, shape))
}

/// Where the adapter's files are and which reader they need.
fn format_of(path: &Path) -> Result<Format, LoraError> {
    let io = |source| LoraError::Io {
        path: path.to_path_buf(),
        source,
    };
    let meta = std::fs::metadata(path).map_err(io)?;
    if meta.is_dir() {
        return Ok(Format::Peft(path.to_path_buf()));
    }
    let mut magic = [0u8; 4];
    use std::io::Read;
    std::fs::File::open(path)
        .and_then(|mut f| f.read_exact(&mut magic))
        .map_err(io)?;
    if &magic == b"GGUF" {
        return Ok(Format::Gguf(path.to_path_buf()));
    }
    if path
        .file_name()
        .is_some_and(|n| n == "adapter_model.safetensors")
        && let Some(dir) = path.parent()
    {
        return Ok(Format::Peft(dir.to_path_buf()));
    }
    Err(LoraError::Invalid {
        path: path.to_path_buf(),
        reason: "not a PEFT adapter folder (adapter_config.json and \
                 adapter_model.safetensors) nor a GGUF LoRA file"
            .into(),
    })
}

enum Format {
    Peft(PathBuf),
    Gguf(PathBuf),
}

/// What the factors are kept in (vLLM's `--lora-dtype`): f32 keeps any file's values exactly;
/// bfloat16 halves the memory and the bytes a step reads per adapter, each factor rounded
/// once at load (to nearest, ties to even) and widened exactly as the kernels read it.
/// vLLM's default, `auto` (the base model's dtype), is f32 here, what the CPU computes in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum LoraDtype {
    #[default]
    #[value(alias = "auto")]
    Float32,
    Bfloat16,
}

/// How an adapter is loaded.
#[derive(Debug, Clone, Copy)]
pub struct LoraOptions {
    /// Larger ranks are refused (`--max-lora-rank`).
    pub max_rank: usize,
    pub dtype: LoraDtype,
}

impl LoraOptions {
    /// f32 factors, ranks up to `max_rank`.
    pub fn max_rank(max_rank: usize) -> Self {
        Self {
            max_rank,
            dtype: LoraDtype::Float32,
        }
    }
}

/// Reads the adapter at `path` (a PEFT folder, its `adapter_model.safetensors`, or a GGUF
/// LoRA file) for a base model of `cfg` on `device`.
pub fn load(
    name: &str,
    path: &Path,
    cfg: &ModelConfig,
    device: &Device,
    opts: LoraOptions,
) -> Result<LoraAdapter, LoraError> {
    let raw = match format_of(path)? {
        Format::Peft(dir) => peft::read(&dir)?,
        Format::Gguf(file) => gguf::read(&file, cfg)?,
    };
    build(name, path, raw, cfg, device, opts)
}

/// Stored factors.
#[derive(Debug)]
enum Factors {
    F32(Vec<f32>),
    Bf16(Vec<half::bf16>),
}

impl Factors {
    fn new(v: Vec<f32>, dtype: LoraDtype) -> Self {
        match dtype {
            LoraDtype::Float32 => Factors::F32(v),
            LoraDtype::Bfloat16 => Factors::Bf16(v.into_iter().map(half::bf16::from_f32).collect()),
        }
    }

    fn bytes(&self) -> usize {
        match self {
            Factors::F32(v) => v.len() * size_of::<f32>(),
            Factors::Bf16(v) => v.len() * size_of::<half::bf16>(),
        }
    }

    /// The values as f32 (a copy for bfloat16).
    fn to_f32(&self) -> std::borrow::Cow<'_, [f32]> {
        match self {
            Factors::F32(v) => std::borrow::Cow::Borrowed(v),
            Factors::Bf16(v) => std::borrow::Cow::Owned(v.iter().map(|b| b.to_f32()).collect()),
        }
    }
}

/// Checks every pair against the base model's shapes and places it in its fused projection.
fn build(
    name: &str,
    path: &Path,
    raw: RawAdapter,
    cfg: &ModelConfig,
    device: &Device,
    opts: LoraOptions,
) -> Result<LoraAdapter, LoraError> {
    let max_rank = opts.max_rank;
    let invalid = |reason: String| LoraError::Invalid {
        path: path.to_path_buf(),
        reason,
    };
    if raw.pairs.is_empty() {
        return Err(invalid("the adapter holds no LoRA weights".into()));
    }
    // The base's own Q/K order: a GGUF Llama is permuted (interleaved RoPE), a Hugging Face one
    // is not; the GGUF files of rotate-half families (Qwen, Phi-3) are not permuted either.
    let base_order = match (cfg.rope_style, cfg.arch) {
        (RopeStyle::Interleaved, _) => RowOrder::LlamaCpp,
        _ => RowOrder::Hf,
    };
    let file_order = match (raw.order, cfg.arch) {
        (RowOrder::LlamaCpp, a) if a.gguf_rope_style() == RopeStyle::Half => RowOrder::Hf,
        (o, _) => o,
    };
    let mut placed: Vec<[Vec<Placed>; 4]> =
        (0..cfg.num_layers).map(|_| Default::default()).collect();
    let mut seen = std::collections::HashSet::new();
    let mut rank = 0;
    for p in raw.pairs {
        let what = format!("layer {} {:?}", p.layer, p.target);
        if p.layer >= cfg.num_layers {
            return Err(invalid(format!(
                "{what}: the base model has {} layers",
                cfg.num_layers
            )));
        }
        if !seen.insert((p.layer, p.target)) {
            return Err(invalid(format!("{what} appears twice")));
        }
        if cfg.moe.is_some() && matches!(p.target, Target::Gate | Target::Up | Target::Down) {
            return Err(invalid(format!(
                "{what}: adapters of a mixture of experts' FFN are not supported (only \
                 q/k/v/o)"
            )));
        }
        let (fan_in, fan_out) = p.target.dims(cfg);
        let r = p.a_shape.0;
        if p.a_shape != (r, fan_in) || p.b_shape != (fan_out, r) || r == 0 {
            return Err(invalid(format!(
                "{what}: A is {:?} and B {:?}, expected [r, {fan_in}] and [{fan_out}, r] \
                 (an adapter for another base model?)",
                p.a_shape, p.b_shape
            )));
        }
        if r > max_rank {
            return Err(LoraError::RankTooLarge {
                path: path.to_path_buf(),
                rank: r,
                max: max_rank,
            });
        }
        if p.a.iter().chain(&p.b).any(|v| !v.is_finite()) {
            return Err(invalid(format!("{what} holds a NaN or infinite value")));
        }
        let mut b = p.b;
        if matches!(p.target, Target::Q | Target::K) && file_order != base_order {
            let heads = if p.target == Target::Q {
                cfg.num_heads
            } else {
                cfg.num_kv_heads
            };
            b = reorder_rows(&b, heads, cfg.head_dim, r, base_order);
        }
        let (proj, offset) = p.target.place(cfg);
        rank = rank.max(r);
        placed[p.layer][proj.index()].push(Placed {
            target: p.target,
            rank: r,
            fan_in,
            fan_out,
            offset,
            scale: (raw.scale)(r),
            a: p.a,
            b,
        });
    }
    let mut layers = Vec::with_capacity(placed.len());
    for layer in placed {
        let [a, b, c, d] = layer.map(|p| Group::new(p, device, opts.dtype));
        layers.push([a?, b?, c?, d?]);
    }
    let bytes = layers
        .iter()
        .flatten()
        .flatten()
        .map(|g| g.at.bytes() + g.pairs.iter().map(|p| p.bt.bytes()).sum::<usize>())
        .sum();
    static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    Ok(LoraAdapter {
        id: NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
        name: name.to_string(),
        rank,
        layers,
        bytes,
        base: BaseShape::of(cfg),
    })
}

/// B's rows (one per output feature, `rank` wide) from one Q/K order into `to`: per head of
/// `head_dim` rows, Hugging Face row `t · head_dim/2 + j` is llama.cpp row `2j + t`.
fn reorder_rows(b: &[f32], heads: usize, head_dim: usize, rank: usize, to: RowOrder) -> Vec<f32> {
    let half = head_dim / 2;
    let mut out = vec![0f32; b.len()];
    for h in 0..heads {
        for j in 0..half {
            for t in 0..2 {
                let hf = h * head_dim + t * half + j;
                let cpp = h * head_dim + 2 * j + t;
                let (from, into) = match to {
                    RowOrder::LlamaCpp => (hf, cpp),
                    RowOrder::Hf => (cpp, hf),
                };
                out[into * rank..][..rank].copy_from_slice(&b[from * rank..][..rank]);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn row_orders_are_inverse_permutations() {
        let (heads, hd, rank) = (3, 8, 2);
        let b: Vec<f32> = (0..heads * hd * rank).map(|v| v as f32).collect();
        let cpp = reorder_rows(&b, heads, hd, rank, RowOrder::LlamaCpp);
        assert_ne!(cpp, b);
        // Head 0's rows 0..4 (the first half) go to even rows.
        assert_eq!(&cpp[2 * rank..3 * rank], &b[rank..2 * rank]);
        assert_eq!(&cpp[rank..2 * rank], &b[4 * rank..5 * rank]);
        assert_eq!(reorder_rows(&cpp, heads, hd, rank, RowOrder::Hf), b);
    }
}

//! Applying adapters in a batched forward: each token row gets its own sequence's adapter, or
//! none, added to a fused projection's output.
//!
//! On the CPU each row's update is computed in a fixed order of operations whatever rows are
//! beside it (`kernels::lora`, which takes the rows of one adapter together to load its
//! factors once for several), so the forward stays bitwise batch invariant with adapters
//! mixed in. Elsewhere the rows of each adapter are gathered and
//! multiplied as small matrix products.

use candle_core::{CpuStorage, DType, InplaceOp2, Layout, Result, Tensor};
use rayon::prelude::*;

use super::{Factors, Group, LoraAdapter, Proj};
use crate::kernels::lora;
use crate::model::cpu_view::contiguous;

/// No adapter for this row.
const NONE: u32 = u32::MAX;

/// Which adapter each token row of one forward uses.
#[derive(Debug, Default)]
pub struct LoraStep<'a> {
    /// The step's distinct adapters.
    adapters: Vec<&'a LoraAdapter>,
    /// Per token row: its index in `adapters`, or [`NONE`].
    rows: Vec<u32>,
}

/// Most rows of one adapter a CPU task updates: its rows follow each other through the same
/// factors (a rank-16 adapter's are ~650 KB per layer for the default model), which stay in
/// the core's caches between them, and a long prefill still splits across the threads.
const ROWS_PER_TASK: usize = 16;

impl<'a> LoraStep<'a> {
    /// A step whose sequences, in order, have `tokens` rows each under `adapter`.
    pub fn new(seqs: impl IntoIterator<Item = (Option<&'a LoraAdapter>, usize)>) -> Self {
        let mut step = LoraStep::default();
        for (adapter, tokens) in seqs {
            let index = match adapter {
                None => NONE,
                Some(a) => match step.adapters.iter().position(|b| std::ptr::eq(*b, a)) {
                    Some(i) => i as u32,
                    None => {
                        step.adapters.push(a);
                        (step.adapters.len() - 1) as u32
                    }
                },
            };
            step.rows.extend(std::iter::repeat_n(index, tokens));
        }
        if step.adapters.is_empty() {
            step.rows.clear();
        }
        step
    }

    /// The adapters this step uses.
    pub fn adapters(&self) -> &[&'a LoraAdapter] {
        &self.adapters
    }

    /// `y` (the output of `proj` in `layer` for inputs `x`, `[tokens, in]`) with each row's
    /// adapter update added; `y` itself when no row has one. On the CPU `y` is updated in
    /// place, so it must be a tensor no other holds (the projection's own new output, as the
    /// forward passes it); a test that keeps its input passes a `copy()`.
    pub fn apply(&self, layer: usize, proj: Proj, x: &Tensor, y: Tensor) -> Result<Tensor> {
        if self.adapters.iter().all(|a| a.group(layer, proj).is_none()) {
            return Ok(y);
        }
        if x.device().is_cpu() && x.dtype() == DType::F32 && y.dtype() == DType::F32 {
            let x = x.contiguous()?;
            // `y` is the projection's own new output (the callers pass it by value), so it is
            // updated where it is rather than copied.
            let y = y.contiguous()?;
            y.inplace_op2(
                &x,
                &RowUpdate {
                    step: self,
                    layer,
                    proj,
                },
            )?;
            return Ok(y);
        }
        self.apply_gathered(layer, proj, x, y)
    }

    /// The update as matrix products over each adapter's gathered rows (any device).
    pub(crate) fn apply_gathered(
        &self,
        layer: usize,
        proj: Proj,
        x: &Tensor,
        mut y: Tensor,
    ) -> Result<Tensor> {
        let (dev, width) = (x.device().clone(), y.dim(1)?);
        for (i, adapter) in self.adapters.iter().enumerate() {
            let rows: Vec<u32> = (0..self.rows.len() as u32)
                .filter(|&t| self.rows[t as usize] == i as u32)
                .collect();
            let Some(g) = adapter.group(layer, proj).filter(|_| !rows.is_empty()) else {
                continue;
            };
            let n = rows.len();
            let idx = Tensor::from_vec(rows, n, &dev)?;
            let xs = x.index_select(&idx, 0)?.to_dtype(DType::F32)?;
            let at = match &g.at_on_device {
                Some(t) => t.clone(),
                None => Tensor::from_slice(&g.at.to_f32(), (g.fan_in, g.rank), &dev)?,
            };
            let u = xs.matmul(&at)?;
            let mut parts = Vec::new();
            let mut col = 0;
            for p in &g.pairs {
                let bt = match &p.bt_on_device {
                    Some(t) => t.clone(),
                    None => Tensor::from_slice(&p.bt.to_f32(), (p.rank, p.fan_out), &dev)?,
                };
                if p.offset > col {
                    parts.push(Tensor::zeros((n, p.offset - col), DType::F32, &dev)?);
                }
                let up = u.narrow(1, p.u_at, p.rank)?.contiguous()?;
                parts.push((up.matmul(&bt)? * f64::from(p.scale))?);
                col = p.offset + p.fan_out;
            }
            if col < width {
                parts.push(Tensor::zeros((n, width - col), DType::F32, &dev)?);
            }
            let delta = Tensor::cat(&parts, 1)?.to_dtype(y.dtype())?;
            y = y.index_add(&idx, &delta, 0)?;
        }
        Ok(y)
    }
}

/// The CPU update: every adapted row of `y` gets its update, in place.
struct RowUpdate<'s, 'a> {
    step: &'s LoraStep<'a>,
    layer: usize,
    proj: Proj,
}

impl InplaceOp2 for RowUpdate<'_, '_> {
    fn name(&self) -> &'static str {
        "lora-rows"
    }

    fn cpu_fwd(
        &self,
        ys: &mut CpuStorage,
        yl: &Layout,
        xs: &CpuStorage,
        xl: &Layout,
    ) -> Result<()> {
        let x = contiguous::<f32>(xs, xl, "lora: the input")?;
        let (tokens, fan_in) = xl.shape().dims2()?;
        let (y_tokens, width) = yl.shape().dims2()?;
        let Some((start, end)) = yl.contiguous_offsets() else {
            candle_core::bail!("lora: the projection is strided");
        };
        let CpuStorage::F32(y) = ys else {
            candle_core::bail!("lora: the projection is not f32");
        };
        if tokens != y_tokens || tokens != self.step.rows.len() {
            candle_core::bail!(
                "lora: {tokens} input rows, {y_tokens} output rows, {} rows assigned",
                self.step.rows.len()
            );
        }
        for a in &self.step.adapters {
            let Some(g) = a.group(self.layer, self.proj) else {
                continue;
            };
            if g.fan_in != fan_in || g.pairs.iter().any(|p| p.offset + p.fan_out > width) {
                candle_core::bail!(
                    "lora: adapter {} does not fit a projection of {fan_in} inputs and {width} \
                     outputs",
                    a.name
                );
            }
        }
        // Tasks of up to ROWS_PER_TASK rows of one adapter, each holding its rows' outputs.
        let mut rows: Vec<Option<&mut [f32]>> = y[start..end].chunks_mut(width).map(Some).collect();
        let mut tasks = Vec::new();
        for (i, adapter) in self.step.adapters.iter().enumerate() {
            let Some(g) = adapter.group(self.layer, self.proj) else {
                continue;
            };
            let mine: Vec<usize> = (0..tokens)
                .filter(|&t| self.step.rows[t] == i as u32)
                .collect();
            for chunk in mine.chunks(ROWS_PER_TASK) {
                let xs: Vec<&[f32]> = chunk.iter().map(|&t| &x[t * fan_in..][..fan_in]).collect();
                let ys: Vec<&mut [f32]> = chunk.iter().filter_map(|&t| rows[t].take()).collect();
                tasks.push((g, xs, ys));
            }
        }
        tasks
            .into_par_iter()
            .for_each(|(g, xs, ys)| update_rows(g, &xs, ys));
        Ok(())
    }
}

/// `y += s · B (A x)` for each of the group's targets, on rows of one adapter
/// (`kernels::lora`, which gives each row the bits it would get alone).
fn update_rows(g: &Group, xs: &[&[f32]], mut ys: Vec<&mut [f32]>) {
    let mut us = vec![0f32; xs.len() * g.rank];
    match &g.at {
        Factors::F32(at) => lora::shrink_rows(at, g.rank, xs, &mut us),
        Factors::Bf16(at) => lora::shrink_rows(at, g.rank, xs, &mut us),
    }
    for p in &g.pairs {
        let u: Vec<&[f32]> = us
            .chunks_exact(g.rank)
            .map(|u| &u[p.u_at..p.u_at + p.rank])
            .collect();
        let mut out: Vec<&mut [f32]> = ys
            .iter_mut()
            .map(|y| &mut y[p.offset..][..p.fan_out])
            .collect();
        match &p.bt {
            Factors::F32(bt) => lora::expand_rows(bt, &u, p.scale, &mut out),
            Factors::Bf16(bt) => lora::expand_rows(bt, &u, p.scale, &mut out),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::lora::{BaseShape, LoraDtype, Placed, Target};
    use candle_core::Device;

    /// A one-layer adapter updating columns 0..5 and 7..10 of an 11-wide projection of 12
    /// inputs, and its pairs as plain `(offset, rank, A [rank][12], B [out][rank])`.
    fn adapter(name: &str, seed: u64, rank: usize) -> (LoraAdapter, Vec<Reference>) {
        let mut s = seed;
        let mut next = move || {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) - 0.5
        };
        let mut refs = Vec::new();
        let placed: Vec<Placed> = [(0, 5), (7, 3)]
            .into_iter()
            .map(|(offset, fan_out)| {
                let a: Vec<f32> = (0..rank * 12).map(|_| next()).collect();
                let b: Vec<f32> = (0..fan_out * rank).map(|_| next()).collect();
                refs.push(Reference {
                    offset,
                    rank,
                    fan_out,
                    a: a.clone(),
                    b: b.clone(),
                });
                Placed {
                    target: Target::Q,
                    rank,
                    fan_in: 12,
                    fan_out,
                    offset,
                    scale: 0.5,
                    a,
                    b,
                }
            })
            .collect();
        let group = Group::new(placed, &Device::Cpu, LoraDtype::Float32).expect("group");
        let adapter = LoraAdapter {
            id: seed,
            name: name.into(),
            rank,
            layers: vec![[group, None, None, None]],
            bytes: 0,
            base: BaseShape {
                layers: 1,
                hidden: 12,
                intermediate: 0,
                heads: 1,
                kv_heads: 1,
                head_dim: 12,
                rope_style: crate::model::RopeStyle::Half,
            },
        };
        (adapter, refs)
    }

    struct Reference {
        offset: usize,
        rank: usize,
        fan_out: usize,
        a: Vec<f32>,
        b: Vec<f32>,
    }

    fn input(tokens: usize, width: usize, seed: f32) -> Tensor {
        let v: Vec<f32> = (0..tokens * width)
            .map(|i| ((i as f32 + seed) * 0.37).sin())
            .collect();
        Tensor::from_vec(v, (tokens, width), &Device::Cpu).expect("tensor")
    }

    #[test]
    fn rows_match_a_plain_computation_and_skip_the_base_rows() {
        let ((a, ra), (b, rb)) = (adapter("a", 1, 4), adapter("b", 2, 3));
        let step = LoraStep::new([(Some(&a), 2), (None, 1), (Some(&b), 1), (Some(&a), 1)]);
        assert_eq!(step.adapters().len(), 2);
        let (x, y) = (input(5, 12, 0.0), input(5, 11, 9.0));
        let got = step
            .apply(0, Proj::Qkv, &x, y.copy().expect("copy"))
            .expect("apply")
            .to_vec2::<f32>()
            .expect("rows");
        let (xv, yv) = (
            x.to_vec2::<f32>().expect("tensor"),
            y.to_vec2::<f32>().expect("tensor"),
        );
        let owner = [Some(&ra), Some(&ra), None, Some(&rb), Some(&ra)];
        for (t, who) in owner.iter().enumerate() {
            let mut want = yv[t].clone();
            for p in who.map_or(&[][..], |w| w.as_slice()) {
                let u: Vec<f64> = (0..p.rank)
                    .map(|j| (0..12).map(|i| f64::from(p.a[j * 12 + i] * xv[t][i])).sum())
                    .collect();
                for o in 0..p.fan_out {
                    let d: f64 = (0..p.rank)
                        .map(|j| f64::from(p.b[o * p.rank + j]) * u[j])
                        .sum();
                    want[p.offset + o] += (0.5 * d) as f32;
                }
            }
            for (g, w) in got[t].iter().zip(&want) {
                assert!((g - w).abs() < 1e-5, "row {t}: {g} vs {w}");
            }
            if who.is_none() {
                assert_eq!(got[t], yv[t], "a base row is left exactly as it was");
            }
        }
        // Columns 5 and 6 sit between the two pairs and no row's update touches them.
        for t in 0..5 {
            assert_eq!(got[t][5..7], yv[t][5..7]);
        }
        // The gathered (non-CPU) form computes the same update.
        let gathered = step
            .apply_gathered(0, Proj::Qkv, &x, y)
            .expect("gathered")
            .to_vec2::<f32>()
            .expect("tensor");
        for (g, w) in gathered.iter().flatten().zip(got.iter().flatten()) {
            assert!((g - w).abs() < 1e-5, "{g} vs {w}");
        }
    }

    #[test]
    fn a_row_gets_the_same_bits_alone_and_in_any_batch() {
        let ((a, _), (b, _)) = (adapter("a", 3, 5), adapter("b", 4, 2));
        let x = input(9, 12, 1.0);
        let y = input(9, 11, 2.0);
        let batch = LoraStep::new([(Some(&b), 4), (Some(&a), 1), (None, 4)]);
        let all = batch
            .apply(0, Proj::Qkv, &x, y.copy().expect("copy"))
            .expect("tensor");
        let alone = LoraStep::new([(Some(&a), 1)]);
        let one = alone
            .apply(
                0,
                Proj::Qkv,
                &x.narrow(0, 4, 1).expect("tensor"),
                y.narrow(0, 4, 1).and_then(|t| t.copy()).expect("tensor"),
            )
            .expect("tensor");
        assert_eq!(
            all.narrow(0, 4, 1)
                .expect("tensor")
                .to_vec2::<f32>()
                .expect("tensor"),
            one.to_vec2::<f32>().expect("tensor")
        );
    }

    #[test]
    fn without_adapters_the_projection_is_returned_as_it_is() {
        let (a, _) = adapter("a", 5, 2);
        let y = input(3, 11, 0.0);
        let x = input(3, 12, 0.0);
        let none = LoraStep::new([(None, 3)]);
        assert!(none.adapters().is_empty());
        let same = none.apply(0, Proj::Qkv, &x, y.clone()).expect("tensor");
        assert_eq!(same.id(), y.id());
        // An adapter with no pairs for this projection leaves it alone too.
        let step = LoraStep::new([(Some(&a), 3)]);
        assert_eq!(
            step.apply(0, Proj::Down, &x, y.clone())
                .expect("tensor")
                .id(),
            y.id()
        );
    }
}

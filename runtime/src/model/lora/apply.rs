//! Applying adapters in a batched forward: each token row gets its own sequence's adapter, or
//! none, added to a fused projection's output.
//!
//! On the CPU each row is updated alone, in a fixed order of operations (`u = A x`, then
//! `y += s · (B u)` per output), so a row's result does not depend on the rows beside it and
//! the forward stays bitwise batch invariant with adapters mixed in. Elsewhere the rows of
//! each adapter are gathered and multiplied as two small matrix products.

use candle_core::{CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use super::{LoraAdapter, Pair, Proj};
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

/// Rows a CPU task updates at least (fewer run on the calling thread).
const MIN_ROWS_PER_TASK: usize = 8;

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
    /// adapter update added; `y` itself when no row has one.
    pub fn apply(&self, layer: usize, proj: Proj, x: &Tensor, y: Tensor) -> Result<Tensor> {
        if self
            .adapters
            .iter()
            .all(|a| a.pairs(layer, proj).is_empty())
        {
            return Ok(y);
        }
        if x.device().is_cpu() && x.dtype() == DType::F32 && y.dtype() == DType::F32 {
            let x = x.contiguous()?;
            let y = y.contiguous()?;
            return x.apply_op2_no_bwd(
                &y,
                &RowUpdate {
                    step: self,
                    layer,
                    proj,
                },
            );
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
            let pairs = adapter.pairs(layer, proj);
            let rows: Vec<u32> = (0..self.rows.len() as u32)
                .filter(|&t| self.rows[t as usize] == i as u32)
                .collect();
            if pairs.is_empty() || rows.is_empty() {
                continue;
            }
            let n = rows.len();
            let idx = Tensor::from_vec(rows, n, &dev)?;
            let xs = x.index_select(&idx, 0)?.to_dtype(DType::F32)?;
            let mut parts = Vec::new();
            let mut at = 0;
            for p in pairs {
                let (a, b) = match &p.on_device {
                    Some((a, b)) => (a.clone(), b.clone()),
                    None => (
                        Tensor::from_slice(&p.a, (p.rank, p.fan_in), &dev)?,
                        Tensor::from_slice(&p.b, (p.fan_out, p.rank), &dev)?,
                    ),
                };
                if p.offset > at {
                    parts.push(Tensor::zeros((n, p.offset - at), DType::F32, &dev)?);
                }
                let u = xs.matmul(&a.t()?)?;
                parts.push((u.matmul(&b.t()?)? * f64::from(p.scale))?);
                at = p.offset + p.fan_out;
            }
            if at < width {
                parts.push(Tensor::zeros((n, width - at), DType::F32, &dev)?);
            }
            let delta = Tensor::cat(&parts, 1)?.to_dtype(y.dtype())?;
            y = y.index_add(&idx, &delta, 0)?;
        }
        Ok(y)
    }
}

/// The CPU update: `y` with every adapted row's update added, one row at a time.
struct RowUpdate<'s, 'a> {
    step: &'s LoraStep<'a>,
    layer: usize,
    proj: Proj,
}

impl CustomOp2 for RowUpdate<'_, '_> {
    fn name(&self) -> &'static str {
        "lora-rows"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        ys: &CpuStorage,
        yl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let x = contiguous::<f32>(xs, xl, "lora: the input")?;
        let y = contiguous::<f32>(ys, yl, "lora: the projection")?;
        let (tokens, fan_in) = xl.shape().dims2()?;
        let (y_tokens, width) = yl.shape().dims2()?;
        if tokens != y_tokens || tokens != self.step.rows.len() {
            candle_core::bail!(
                "lora: {tokens} input rows, {y_tokens} output rows, {} rows assigned",
                self.step.rows.len()
            );
        }
        for a in &self.step.adapters {
            if let Some(p) = a
                .pairs(self.layer, self.proj)
                .iter()
                .find(|p| p.fan_in != fan_in || p.offset + p.fan_out > width)
            {
                candle_core::bail!(
                    "lora: adapter {} expects {} inputs and {} outputs at {}, the projection \
                     has {fan_in} and {width}",
                    a.name,
                    p.fan_in,
                    p.fan_out,
                    p.offset
                );
            }
        }
        let mut out = y.to_vec();
        out.par_chunks_mut(width)
            .zip(x.par_chunks(fan_in))
            .zip(&self.step.rows)
            .with_min_len(MIN_ROWS_PER_TASK)
            .for_each(|((y, x), &r)| {
                if let Some(a) = self.step.adapters.get(r as usize) {
                    update_row(a.pairs(self.layer, self.proj), x, y);
                }
            });
        Ok((CpuStorage::F32(out), Shape::from((tokens, width))))
    }
}

/// `y += s · B (A x)` for each pair, on one row.
fn update_row(pairs: &[Pair], x: &[f32], y: &mut [f32]) {
    let mut u = Vec::new();
    for p in pairs {
        u.clear();
        u.extend(p.a.chunks_exact(p.fan_in).map(|a| dot(a, x)));
        for (yo, b) in y[p.offset..][..p.fan_out]
            .iter_mut()
            .zip(p.b.chunks_exact(p.rank))
        {
            *yo += p.scale * dot(b, &u);
        }
    }
}

/// A dot product in a fixed order: eight running sums, a fixed tree, then the tail. The same
/// on every CPU (vectorized or not, the compiler may not reorder float adds).
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .fold(0.0, |s, v| s + v);
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::lora::Target;
    use candle_core::Device;

    fn adapter(name: &str, seed: u64, rank: usize) -> LoraAdapter {
        let mut s = seed;
        let mut next = move || {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) - 0.5
        };
        let pair = |offset, fan_in, fan_out, next: &mut dyn FnMut() -> f32| Pair {
            target: Target::Q,
            a: (0..rank * fan_in).map(|_| next()).collect(),
            b: (0..fan_out * rank).map(|_| next()).collect(),
            rank,
            fan_in,
            fan_out,
            offset,
            scale: 0.5,
            on_device: None,
        };
        let mut layer: [Vec<Pair>; 4] = Default::default();
        layer[Proj::Qkv.index()] = vec![pair(0, 12, 5, &mut next), pair(7, 12, 3, &mut next)];
        LoraAdapter {
            id: seed,
            name: name.into(),
            rank,
            layers: vec![layer],
            bytes: 0,
            base: crate::model::lora::BaseShape {
                layers: 1,
                hidden: 12,
                intermediate: 0,
                heads: 1,
                kv_heads: 1,
                head_dim: 12,
                rope_style: crate::model::RopeStyle::Half,
            },
        }
    }

    fn input(tokens: usize, width: usize, seed: f32) -> Tensor {
        let v: Vec<f32> = (0..tokens * width)
            .map(|i| ((i as f32 + seed) * 0.37).sin())
            .collect();
        Tensor::from_vec(v, (tokens, width), &Device::Cpu).expect("tensor")
    }

    #[test]
    fn rows_match_a_plain_computation_and_skip_the_base_rows() {
        let (a, b) = (adapter("a", 1, 4), adapter("b", 2, 3));
        let step = LoraStep::new([(Some(&a), 2), (None, 1), (Some(&b), 1), (Some(&a), 1)]);
        assert_eq!(step.adapters().len(), 2);
        let (x, y) = (input(5, 12, 0.0), input(5, 11, 9.0));
        let got = step
            .apply(0, Proj::Qkv, &x, y.clone())
            .expect("apply")
            .to_vec2::<f32>()
            .expect("rows");
        let (xv, yv) = (
            x.to_vec2::<f32>().expect("tensor"),
            y.to_vec2::<f32>().expect("tensor"),
        );
        let owner = [Some(&a), Some(&a), None, Some(&b), Some(&a)];
        for (t, who) in owner.iter().enumerate() {
            let mut want = yv[t].clone();
            for p in who.map_or(&[][..], |w| w.pairs(0, Proj::Qkv)) {
                let u: Vec<f64> = (0..p.rank)
                    .map(|j| (0..12).map(|i| f64::from(p.a[j * 12 + i] * xv[t][i])).sum())
                    .collect();
                for o in 0..p.fan_out {
                    let d: f64 = (0..p.rank)
                        .map(|j| f64::from(p.b[o * p.rank + j]) * u[j])
                        .sum();
                    want[p.offset + o] += (f64::from(p.scale) * d) as f32;
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
        let (a, b) = (adapter("a", 3, 5), adapter("b", 4, 2));
        let x = input(9, 12, 1.0);
        let y = input(9, 11, 2.0);
        let batch = LoraStep::new([(Some(&b), 4), (Some(&a), 1), (None, 4)]);
        let all = batch.apply(0, Proj::Qkv, &x, y.clone()).expect("tensor");
        let alone = LoraStep::new([(Some(&a), 1)]);
        let one = alone
            .apply(
                0,
                Proj::Qkv,
                &x.narrow(0, 4, 1).expect("tensor"),
                y.narrow(0, 4, 1).expect("tensor"),
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
        let a = adapter("a", 5, 2);
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

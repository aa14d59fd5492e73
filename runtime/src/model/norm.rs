//! The residual stream's add and the RMS norm after it as one op on f32 CPU tensors
//! ([`crate::kernels::norm`]: candle's results, on the compute pool); candle's two ops on other
//! devices and types.

use candle_core::{CpuStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor};

use super::cpu_view::contiguous;
use crate::kernels::norm::residual_rms_norm;

/// `(x + y, rms_norm(x + y) · w)`, or `(x, rms_norm(x) · w)` without `y`, for `[rows, hidden]`
/// hidden states.
pub fn residual_norm(
    x: &Tensor,
    y: Option<&Tensor>,
    w: &Tensor,
    eps: f32,
) -> Result<(Tensor, Tensor)> {
    let fused = x.device().is_cpu()
        && [Some(x), y, Some(w)]
            .iter()
            .flatten()
            .all(|t| t.dtype() == DType::F32);
    if !fused {
        let x = match y {
            Some(y) => (x + y)?,
            None => x.clone(),
        };
        let h = candle_nn::ops::rms_norm(&x, w, eps)?;
        return Ok((x, h));
    }
    let (x, w) = (x.contiguous()?, w.contiguous()?);
    match y {
        Some(y) => {
            // `[2, rows, hidden]`: the sum, then its norm; both halves are contiguous views.
            let both = x.apply_op3_no_bwd(&y.contiguous()?, &w, &AddNorm(eps))?;
            Ok((both.get(0)?, both.get(1)?))
        }
        None => {
            let h = x.apply_op2_no_bwd(&w, &Norm(eps))?;
            Ok((x, h))
        }
    }
}

/// `rms_norm(x) · w` of `[rows, hidden]` states (Gemma's norms of a block's output).
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f32) -> Result<Tensor> {
    Ok(residual_norm(x, None, w, eps)?.1)
}

/// Qwen3's per-head RMS norms of a fused `[tokens, q_dim + 2 * kv_dim]` projection: each head
/// of q normed with `q_w`, each head of k with `k_w` (`[head_dim]` each), v as it is.
pub fn qk_norm(
    qkv: &Tensor,
    heads: super::cache_write::Heads,
    q_w: &Tensor,
    k_w: &Tensor,
    eps: f32,
) -> Result<Tensor> {
    let tokens = qkv.dim(0)?;
    let d = heads.head_dim;
    let (q_dim, kv_dim) = (heads.num_heads * d, heads.num_kv_heads * d);
    let per_head = |x: Tensor, w: &Tensor, width: usize| -> Result<Tensor> {
        let rows = x.contiguous()?.reshape((tokens * width / d, d))?;
        let (_, normed) = residual_norm(&rows, None, w, eps)?;
        normed.reshape((tokens, width))
    };
    let q = per_head(qkv.narrow(1, 0, q_dim)?, q_w, q_dim)?;
    let k = per_head(qkv.narrow(1, q_dim, kv_dim)?, k_w, kv_dim)?;
    let v = qkv.narrow(1, q_dim + kv_dim, kv_dim)?;
    Tensor::cat(&[q, k, v], 1)
}

/// The rows' width, checked against the norm's weights.
fn width(l: &Layout, w: &Layout) -> Result<(usize, usize)> {
    let (rows, hidden) = l.shape().dims2()?;
    if w.shape().elem_count() != hidden {
        candle_core::bail!(
            "rms norm: {} weights for rows of {hidden}",
            w.shape().elem_count()
        );
    }
    Ok((rows, hidden))
}

struct Norm(f32);

impl CustomOp2 for Norm {
    fn name(&self) -> &'static str {
        "rms-norm"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        ws: &CpuStorage,
        wl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (rows, hidden) = width(xl, wl)?;
        let x = contiguous::<f32>(xs, xl, "rms norm: the input")?;
        let w = contiguous::<f32>(ws, wl, "rms norm: the weights")?;
        let h = residual_rms_norm(x, None, w, self.0);
        Ok((CpuStorage::F32(h), Shape::from((rows, hidden))))
    }
}

struct AddNorm(f32);

impl CustomOp3 for AddNorm {
    fn name(&self) -> &'static str {
        "add-rms-norm"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        ys: &CpuStorage,
        yl: &Layout,
        ws: &CpuStorage,
        wl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (rows, hidden) = width(xl, wl)?;
        if yl.shape() != xl.shape() {
            candle_core::bail!("residual add: {:?} and {:?} differ", xl.shape(), yl.shape());
        }
        let x = contiguous::<f32>(xs, xl, "residual add: the stream")?;
        let y = contiguous::<f32>(ys, yl, "residual add: the update")?;
        let w = contiguous::<f32>(ws, wl, "rms norm: the weights")?;
        let both = residual_rms_norm(x, Some(y), w, self.0);
        Ok((CpuStorage::F32(both), Shape::from((2, rows, hidden))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn matches_candles_add_and_rms_norm() -> Result<()> {
        let (rows, hidden, eps) = (7, 64, 1e-5);
        let t = |seed, n: usize, scale| {
            Tensor::from_vec(
                ferrite_testkit::random::values(n, seed, scale),
                n,
                &Device::Cpu,
            )
        };
        let x = t(1, rows * hidden, 3.0)?.reshape((rows, hidden))?;
        let y = t(2, rows * hidden, 3.0)?.reshape((rows, hidden))?;
        let w = t(3, hidden, 1.5)?;
        let (sum, h) = residual_norm(&x, Some(&y), &w, eps)?;
        let want_sum = (&x + &y)?;
        assert_eq!(sum.to_vec2::<f32>()?, want_sum.to_vec2::<f32>()?);
        let want = candle_nn::ops::rms_norm(&want_sum, &w, eps)?;
        assert_eq!(h.to_vec2::<f32>()?, want.to_vec2::<f32>()?);
        // Without the add: the stream as it is and its norm.
        let (same, h2) = residual_norm(&sum, None, &w, eps)?;
        assert_eq!(same.to_vec2::<f32>()?, want_sum.to_vec2::<f32>()?);
        assert_eq!(h2.to_vec2::<f32>()?, h.to_vec2::<f32>()?);
        // Shapes that do not match are errors, not misreads.
        assert!(residual_norm(&x, Some(&y.narrow(0, 0, 3)?), &w, eps).is_err());
        assert!(residual_norm(&x, None, &w.narrow(0, 0, 10)?, eps).is_err());
        Ok(())
    }
}

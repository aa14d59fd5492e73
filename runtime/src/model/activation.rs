//! The MLP's gated activation as a tensor op: [`crate::kernels::swiglu`] on CPU f32 tensors,
//! candle's ops elsewhere (CUDA, other dtypes).

use candle_core::{CpuStorage, CustomOp1, Layout, Result, Shape, Tensor};

use crate::kernels::swiglu;

/// `silu(gate) · up` of a fused `[tokens, 2·ffn]` gate/up projection, gate columns first.
pub fn swiglu(gate_up: &Tensor, ffn: usize) -> Result<Tensor> {
    if gate_up.device().is_cpu() && gate_up.dtype() == candle_core::DType::F32 {
        return gate_up.contiguous()?.apply_op1_no_bwd(&SwiGlu(ffn));
    }
    candle_nn::ops::silu(&gate_up.narrow(1, 0, ffn)?)? * gate_up.narrow(1, ffn, ffn)?
}

struct SwiGlu(usize);

impl CustomOp1 for SwiGlu {
    fn name(&self) -> &'static str {
        "swiglu"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let ffn = self.0;
        let (tokens, width) = l.shape().dims2()?;
        if width != 2 * ffn {
            candle_core::bail!("swiglu: input has {width} columns, not 2 x {ffn}");
        }
        let x = match (s, l.contiguous_offsets()) {
            (CpuStorage::F32(v), Some((a, b))) => &v[a..b],
            _ => candle_core::bail!("swiglu needs a contiguous f32 input"),
        };
        let out = swiglu::swiglu(x, ffn);
        Ok((CpuStorage::F32(out), Shape::from((tokens, ffn))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn matches_candle_silu_times_up() -> Result<()> {
        let ffn = 40;
        let v = ferrite_testkit::random::values(5 * 2 * ffn, 3, 6.0);
        let gate_up = Tensor::from_vec(v, (5, 2 * ffn), &Device::Cpu)?;
        let got = swiglu(&gate_up, ffn)?;
        let want =
            (candle_nn::ops::silu(&gate_up.narrow(1, 0, ffn)?)? * gate_up.narrow(1, ffn, ffn)?)?;
        assert_eq!(got.dims(), &[5, ffn]);
        let diff = (&got - &want)?.abs()?.max_all()?.to_scalar::<f32>()?;
        let scale = want.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(
            diff <= 1e-5 * scale,
            "max difference {diff} against {scale}"
        );
        // A strided view is read as the values it shows.
        let wide = Tensor::cat(&[&gate_up, &gate_up.zeros_like()?], 1)?;
        let view = swiglu(&wide.narrow(1, 0, 2 * ffn)?, ffn)?;
        assert_eq!(view.to_vec2::<f32>()?, got.to_vec2::<f32>()?);
        // A width that is not 2 x ffn is an error, not a misread.
        assert!(swiglu(&gate_up.narrow(1, 0, 2 * ffn - 2)?, ffn).is_err());
        Ok(())
    }
}

//! The MLP's gated activation as one tensor op on f32: [`crate::kernels::swiglu`] on the CPU
//! (SwiGLU and GeGLU), `kernels/fused.cu`'s `swiglu_f32` on a GPU; candle's ops for other types
//! and for GeGLU on a GPU.

use candle_core::{CpuStorage, CustomOp1, Layout, Result, Shape, Tensor};

use super::config::Activation;
use crate::kernels::swiglu;

/// `silu(gate) · up` of a fused `[tokens, 2·ffn]` gate/up projection, gate columns first.
pub fn swiglu(gate_up: &Tensor, ffn: usize) -> Result<Tensor> {
    gated(gate_up, ffn, Activation::Silu)
}

/// `act(gate) · up` of a fused `[tokens, 2·ffn]` gate/up projection, gate columns first.
pub fn gated(gate_up: &Tensor, ffn: usize, act: Activation) -> Result<Tensor> {
    let f32 = gate_up.dtype() == candle_core::DType::F32;
    let cuda = cfg!(feature = "cuda") && gate_up.device().is_cuda() && act == Activation::Silu;
    if f32 && (gate_up.device().is_cpu() || cuda) {
        return gate_up.contiguous()?.apply_op1_no_bwd(&Gated { ffn, act });
    }
    let (gate, up) = (gate_up.narrow(1, 0, ffn)?, gate_up.narrow(1, ffn, ffn)?);
    match act {
        Activation::Silu => candle_nn::ops::silu(&gate)? * up,
        // candle's `gelu` is the tanh approximation.
        Activation::GeluTanh => gate.gelu()? * up,
    }
}

struct Gated {
    ffn: usize,
    act: Activation,
}

impl CustomOp1 for Gated {
    fn name(&self) -> &'static str {
        "gated-ffn"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let ffn = self.ffn;
        let (tokens, width) = l.shape().dims2()?;
        if width != 2 * ffn {
            candle_core::bail!("gated ffn: input has {width} columns, not 2 x {ffn}");
        }
        let x = super::cpu_view::contiguous::<f32>(s, l, "gated ffn: the input")?;
        let out = swiglu::gated(self.act, x, ffn);
        Ok((CpuStorage::F32(out), Shape::from((tokens, ffn))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        use candle_core::cuda_backend::WrapErr;
        use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};

        use super::cache_write::cuda::{MODULE, PTX};
        let ffn = self.ffn;
        if self.act != Activation::Silu {
            candle_core::bail!("gated ffn: only SwiGLU has a CUDA kernel");
        }
        let (tokens, width) = l.shape().dims2()?;
        if width != 2 * ffn {
            candle_core::bail!("swiglu: input has {width} columns, not 2 x {ffn}");
        }
        let x = super::cuda_view::contiguous::<f32>(s, l, "swiglu: the input")?;
        let dev = s.device().clone();
        let func = dev.get_or_load_custom_func("swiglu_f32", MODULE, PTX)?;
        let n = tokens * ffn;
        // SAFETY: the kernel writes every one of the n outputs.
        let out = unsafe { dev.alloc::<f32>(n)? };
        let (t, f, stride) = (tokens as u32, ffn as u32, width as u32);
        let mut builder = func.builder();
        builder.arg(&out);
        builder.arg(&x);
        builder.arg(&t);
        builder.arg(&f);
        builder.arg(&stride);
        let cfg = LaunchConfig {
            grid_dim: (n.div_ceil(256).clamp(1, 65_535) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the argument list is the kernel's signature; x holds tokens rows of 2 * ffn.
        unsafe { builder.launch(cfg) }.w()?;
        Ok((
            candle_core::CudaStorage::wrap_cuda_slice(out, dev),
            Shape::from((tokens, ffn)),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// GeGLU against candle's tanh-approximated GELU.
    #[test]
    fn geglu_matches_candle_gelu_times_up() -> Result<()> {
        let ffn = 24;
        let v = ferrite_testkit::random::values(4 * 2 * ffn, 5, 6.0);
        let gate_up = Tensor::from_vec(v, (4, 2 * ffn), &Device::Cpu)?;
        let got = gated(&gate_up, ffn, Activation::GeluTanh)?;
        let want = (gate_up.narrow(1, 0, ffn)?.gelu()? * gate_up.narrow(1, ffn, ffn)?)?;
        let diff = (&got - &want)?.abs()?.max_all()?.to_scalar::<f32>()?;
        let scale = want.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(
            diff <= 1e-5 * scale,
            "max difference {diff} against {scale}"
        );
        Ok(())
    }

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

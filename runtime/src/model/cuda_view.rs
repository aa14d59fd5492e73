//! The one way ferrite's CUDA launches read a tensor's elements: a view of its storage from
//! its layout's offsets, refused when the layout is strided or the storage is not on the GPU.

use candle_core::cuda_backend::CudaDType;
use candle_core::cuda_backend::cudarc::driver::CudaView;
use candle_core::{CudaStorage, Layout, Result, Storage};

/// The elements of a contiguous `l` over `s`; `what` names the operand in the error.
pub(crate) fn contiguous<'a, T: CudaDType>(
    s: &'a CudaStorage,
    l: &Layout,
    what: &str,
) -> Result<CudaView<'a, T>> {
    let (start, end) = l
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg(format!("{what} is strided")))?;
    Ok(s.as_cuda_slice::<T>()?.slice(start..end))
}

/// `s` as GPU storage; `what` names the operand in the error.
pub(crate) fn on_gpu<'a>(s: &'a Storage, what: &str) -> Result<&'a CudaStorage> {
    match s {
        Storage::Cuda(s) => Ok(s),
        _ => candle_core::bail!("{what} is not on the GPU"),
    }
}

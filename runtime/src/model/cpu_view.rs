//! The one way ferrite's CPU ops read a tensor's elements: a slice of its storage from its
//! layout's offsets, refused when the layout is strided or the storage holds another type
//! (the CPU twin of `cuda_view`).

use candle_core::{CpuStorage, Layout, Result, WithDType};

/// The elements of a contiguous `l` over `s`; `what` names the operand in the error.
pub(crate) fn contiguous<'a, T: WithDType>(
    s: &'a CpuStorage,
    l: &Layout,
    what: &str,
) -> Result<&'a [T]> {
    let (start, end) = l
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg(format!("{what} is strided")))?;
    Ok(&s.as_slice::<T>()?[start..end])
}

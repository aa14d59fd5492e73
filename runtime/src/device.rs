//! `--device` parsing. CUDA is compiled in only with the `cuda` cargo feature.

pub use candle_core::Device;

#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    #[error("invalid device '{0}': expected 'cpu', 'cuda' or 'cuda:N'")]
    Invalid(String),
    #[error("device '{0}' needs a build with `--features cuda`")]
    CudaNotBuilt(String),
    #[error("cannot open device '{0}': {1}")]
    Open(String, String),
}

pub fn parse_device(spec: &str) -> Result<Device, DeviceError> {
    let spec = spec.trim();
    if spec.eq_ignore_ascii_case("cpu") {
        return Ok(Device::Cpu);
    }
    let ordinal = match spec.strip_prefix("cuda") {
        Some("") => 0,
        Some(rest) => rest
            .strip_prefix(':')
            .and_then(|n| n.parse::<usize>().ok())
            .ok_or_else(|| DeviceError::Invalid(spec.to_string()))?,
        None => return Err(DeviceError::Invalid(spec.to_string())),
    };
    open_cuda(spec, ordinal)
}

/// One CUDA stream that every thread submits to. `Device::new_cuda` gives candle the
/// per-thread default stream, so work from two threads (a forward on one thread, its logits
/// read on another, the next forward on a third) lands on streams that do not wait for each
/// other: on an H100 a step then read keys and values the step before had not yet written,
/// now and then (greedy tokens repeated, runs differing from run to run). Event tracking is
/// off: it only orders work across streams, and with one stream it would cost two events per
/// allocation and a record and wait per kernel argument.
#[cfg(feature = "cuda")]
fn open_cuda(spec: &str, ordinal: usize) -> Result<Device, DeviceError> {
    let device = Device::new_cuda_with_stream(ordinal)
        .map_err(|e| DeviceError::Open(spec.to_string(), e.to_string()))?;
    if let Device::Cuda(cuda) = &device {
        // SAFETY: every tensor of this device lives and is used on its one stream, so nothing
        // needs cross-stream ordering (candle's conditions for turning tracking off).
        unsafe { cuda.disable_event_tracking() };
        if let Err(e) = keep_freed_memory(cuda) {
            tracing::warn!(error = %e, "could not raise the CUDA memory pool's release threshold");
        }
    }
    Ok(device)
}

/// Keeps the memory a step frees in the device's stream-ordered pool for the next step. Every
/// tensor is allocated from that pool (`cuMemAllocAsync`), and by default the pool hands its
/// free memory back to the driver at each synchronisation, which every step makes when it
/// reads its logits: the next step's allocations would then map fresh memory again.
#[cfg(feature = "cuda")]
fn keep_freed_memory(cuda: &candle_core::CudaDevice) -> Result<(), String> {
    use candle_core::cuda_backend::cudarc::driver::sys;
    let stream = cuda.cuda_stream();
    let ctx = stream.context();
    ctx.bind_to_thread().map_err(|e| e.to_string())?;
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    let mut keep = u64::MAX;
    // SAFETY: the out-pointer and the attribute's value (a u64 for the release threshold) are
    // valid for the calls; the device is the context's own.
    unsafe {
        sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device())
            .result()
            .map_err(|e| e.to_string())?;
        sys::cuMemPoolSetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut keep as *mut u64).cast(),
        )
        .result()
        .map_err(|e| e.to_string())
    }
}

#[cfg(not(feature = "cuda"))]
fn open_cuda(spec: &str, _ordinal: usize) -> Result<Device, DeviceError> {
    Err(DeviceError::CudaNotBuilt(spec.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_cpu_and_rejects_garbage() {
        assert!(parse_device("cpu").expect("cpu").is_cpu());
        assert!(matches!(parse_device("tpu"), Err(DeviceError::Invalid(_))));
        assert!(matches!(
            parse_device("cuda:x"),
            Err(DeviceError::Invalid(_))
        ));
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn cuda_without_feature_is_a_clear_error() {
        let e = parse_device("cuda:0").expect_err("no cuda in this build");
        assert!(e.to_string().contains("--features cuda"), "{e}");
    }
}

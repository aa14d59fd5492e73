//! How a pool lays out a block's keys. On CUDA every pool is `[slots][kv_dim]`. On the CPU the
//! key pools keep each block transposed, `[kv_dim][block_size]` inside the block's same
//! `block_size · kv_dim` elements: the attention kernel reads a chunk of consecutive positions
//! of one dimension as one contiguous run, where with rows it had to transpose every cached key
//! at every step (13.8% of a batch-32 decode step with 64 to 128 tokens of context, growing with
//! the context). Values stay rows everywhere: the kernel reads them by position. Blocks are
//! copied whole (swaps, the host pool), so a copy keeps whatever layout its source had.

use candle_core::{Device, Result, Tensor};

/// Where key element `col` of slot `slot` sits in a CPU key pool of `kv_dim` columns. A slot's
/// columns are `block_size` apart: column `col` is `cpu_key_index(slot, 0, …) + col · block_size`,
/// which is how the writer and the attention tile walk a head's columns.
#[inline]
pub fn cpu_key_index(slot: usize, col: usize, kv_dim: usize, block_size: usize) -> usize {
    (slot / block_size) * block_size * kv_dim + col * block_size + slot % block_size
}

/// Whether the key pools on `device` keep their blocks transposed ([`cpu_key_index`]).
pub fn keys_transposed(device: &Device) -> bool {
    device.is_cpu()
}

/// Whole blocks of a CPU key pool, `[blocks · block_size, kv_dim]` transposed per block, as
/// rows `[slots][kv_dim]`.
pub fn cpu_keys_as_rows(keys: &Tensor, block_size: usize) -> Result<Tensor> {
    let (slots, kv_dim) = keys.dims2()?;
    if block_size == 0 || !slots.is_multiple_of(block_size) {
        candle_core::bail!("{slots} key slots are not whole blocks of {block_size}");
    }
    keys.reshape((slots / block_size, kv_dim, block_size))?
        .transpose(1, 2)?
        .contiguous()?
        .reshape((slots, kv_dim))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_index_is_a_transpose_inside_each_block() {
        let (kv_dim, bs) = (3, 4);
        // Two blocks written through the index; read back as rows, each element is its own
        // (slot, column).
        let mut pool = vec![0f32; 2 * bs * kv_dim];
        for slot in 0..2 * bs {
            for col in 0..kv_dim {
                pool[cpu_key_index(slot, col, kv_dim, bs)] = (slot * 10 + col) as f32;
            }
        }
        let t = Tensor::from_vec(pool, (2 * bs, kv_dim), &Device::Cpu).expect("pool");
        let rows: Vec<Vec<f32>> = cpu_keys_as_rows(&t, bs)
            .expect("rows")
            .to_vec2()
            .expect("values");
        for (slot, row) in rows.iter().enumerate() {
            let want: Vec<f32> = (0..kv_dim).map(|c| (slot * 10 + c) as f32).collect();
            assert_eq!(row, &want, "slot {slot}");
        }
        assert!(cpu_keys_as_rows(&t.narrow(0, 0, 5).expect("part"), bs).is_err());
    }
}

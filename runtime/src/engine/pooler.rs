//! Embedding requests: their prompt's final hidden states, as the forward hands them over
//! chunk by chunk, pooled into one vector ([`super::request::Pooling`]).

use super::request::{Pooling, PoolingKind};
use crate::model::HiddenRows;

/// One embedding request's pool so far.
#[derive(Debug)]
pub(crate) struct Pool {
    pooling: Pooling,
    /// Mean: the sum of every row so far, in f64, each row added in prompt order (so chunking
    /// and batching never change the result). Last: the latest row.
    acc: Vec<f64>,
    /// Prompt rows taken in so far.
    rows: usize,
}

impl Pool {
    pub(crate) fn new(pooling: Pooling) -> Self {
        Self {
            pooling,
            acc: Vec::new(),
            rows: 0,
        }
    }

    /// The rows of each step's tokens it needs: a mean needs them all, the last only the last.
    pub(crate) fn rows(&self) -> HiddenRows {
        match self.pooling.kind {
            PoolingKind::Mean => HiddenRows::All,
            PoolingKind::Last => HiddenRows::Last,
        }
    }

    /// Takes in the hidden states of prompt tokens `start..`, `width` values per row. Rows it
    /// has already taken (a sequence recomputed after a preemption gets the same bits again)
    /// are skipped.
    pub(crate) fn add(&mut self, start: usize, values: &[f32], width: usize) {
        if width == 0 {
            return;
        }
        if self.acc.len() != width {
            self.acc = vec![0.0; width];
        }
        for (i, row) in values.chunks_exact(width).enumerate() {
            if start + i < self.rows {
                continue;
            }
            match self.pooling.kind {
                PoolingKind::Mean => {
                    for (a, &v) in self.acc.iter_mut().zip(row) {
                        *a += f64::from(v);
                    }
                }
                PoolingKind::Last => {
                    for (a, &v) in self.acc.iter_mut().zip(row) {
                        *a = f64::from(v);
                    }
                }
            }
            self.rows = start + i + 1;
        }
    }

    /// The vector, once every prompt row is in.
    pub(crate) fn finish(&self) -> Vec<f32> {
        let mut v: Vec<f64> = match self.pooling.kind {
            PoolingKind::Mean => self
                .acc
                .iter()
                .map(|a| a / self.rows.max(1) as f64)
                .collect(),
            PoolingKind::Last => self.acc.clone(),
        };
        if self.pooling.normalize {
            let norm = v.iter().map(|x| x * x).sum::<f64>().sqrt();
            // A zero vector stays zero rather than turning into NaNs.
            if norm > 0.0 {
                v.iter_mut().for_each(|x| *x /= norm);
            }
        }
        v.into_iter().map(|x| x as f32).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(kind: PoolingKind, normalize: bool) -> Pool {
        Pool::new(Pooling { kind, normalize })
    }

    const ROWS: [[f32; 3]; 4] = [
        [1.0, 2.0, 3.0],
        [3.0, 0.0, -1.0],
        [0.5, 0.5, 0.5],
        [2.0, 2.0, 1.0],
    ];

    #[test]
    fn mean_is_the_same_whatever_the_chunks() {
        let flat: Vec<f32> = ROWS.concat();
        let mut whole = pool(PoolingKind::Mean, false);
        whole.add(0, &flat, 3);
        let mut chunked = pool(PoolingKind::Mean, false);
        chunked.add(0, &flat[..3], 3);
        chunked.add(1, &flat[3..9], 3);
        chunked.add(3, &flat[9..], 3);
        assert_eq!(whole.finish(), vec![1.625, 1.125, 0.875]);
        assert_eq!(chunked.finish(), whole.finish());
    }

    #[test]
    fn rows_computed_again_after_a_preemption_count_once() {
        let flat: Vec<f32> = ROWS.concat();
        let mut p = pool(PoolingKind::Mean, false);
        p.add(0, &flat[..6], 3);
        // Recomputed from the start, then on to the end.
        p.add(0, &flat, 3);
        assert_eq!(p.finish(), vec![1.625, 1.125, 0.875]);
    }

    #[test]
    fn last_takes_the_final_row_and_normalizes_it() {
        let flat: Vec<f32> = ROWS.concat();
        let mut p = pool(PoolingKind::Last, true);
        p.add(0, &flat[..9], 3);
        p.add(3, &flat[9..], 3);
        assert_eq!(p.finish(), vec![2.0 / 3.0, 2.0 / 3.0, 1.0 / 3.0]);
    }

    #[test]
    fn a_zero_vector_stays_zero() {
        let mut p = pool(PoolingKind::Last, true);
        p.add(0, &[0.0, 0.0], 2);
        assert_eq!(p.finish(), vec![0.0, 0.0]);
    }
}

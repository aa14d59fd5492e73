//! Mixture-of-experts FFNs (Mixtral, Qwen3-MoE, Qwen2-MoE with its gated shared expert): the
//! router picks each token's experts, and every expert runs once per step over all the rows
//! routed to it (one GEMM per expert with work, never one per token), so a batch's tokens share
//! each expert's weight reads.

use candle_core::{Device, Tensor};

use super::ModelError;
use super::activation::swiglu;
use super::config::Moe;
use super::weights::Experts;

/// One token's experts and their weights: the softmax of the router's `logits` over all
/// experts, its `k` largest (ties to the lower index, as a stable sort gives them),
/// renormalised to sum to 1 when `norm` is set (llama.cpp's `build_moe_ffn` with softmax
/// gating).
pub fn route(logits: &[f32], k: usize, norm: bool) -> Vec<(usize, f32)> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let exp: Vec<f32> = logits.iter().map(|&l| (l - max).exp()).collect();
    let sum: f32 = exp.iter().sum();
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| exp[b].total_cmp(&exp[a]));
    let chosen: Vec<(usize, f32)> = order
        .into_iter()
        .take(k)
        .map(|e| (e, exp[e] / sum))
        .collect();
    if !norm {
        return chosen;
    }
    let total: f32 = chosen.iter().map(|&(_, w)| w).sum();
    chosen.into_iter().map(|(e, w)| (e, w / total)).collect()
}

/// Rows routed to one expert, and the weight each row gives its output.
#[derive(Debug, Default, Clone, PartialEq)]
struct Routed {
    rows: Vec<u32>,
    weights: Vec<f32>,
}

/// Groups every row's chosen experts by expert.
fn group(routes: &[Vec<(usize, f32)>], num_experts: usize) -> Vec<Routed> {
    let mut by_expert = vec![Routed::default(); num_experts];
    for (row, chosen) in routes.iter().enumerate() {
        for &(e, w) in chosen {
            by_expert[e].rows.push(row as u32);
            by_expert[e].weights.push(w);
        }
    }
    by_expert
}

/// The FFN output of normed hidden states `h` (`[rows, hidden]` f32): each row's chosen
/// experts' SwiGLU outputs, weighted and summed. The router's logits come back to the host to
/// be ranked, and the weighted outputs are summed there; on a GPU that is a copy each way per
/// layer (correct, not fast), which is also why MoE decode steps are not captured as graphs.
pub fn forward(x: &Experts, moe: &Moe, h: &Tensor) -> Result<Tensor, ModelError> {
    let (rows, hidden) = h.dims2()?;
    let logits = h.matmul(&x.router.t()?)?.to_vec2::<f32>()?;
    let routes: Vec<Vec<(usize, f32)>> = logits
        .iter()
        .map(|l| route(l, moe.experts_per_token, moe.norm_top_k))
        .collect();
    let device = h.device();
    let mut out = vec![0f32; rows * hidden];
    for (e, routed) in group(&routes, moe.num_experts).into_iter().enumerate() {
        let n = routed.rows.len();
        if n == 0 {
            continue;
        }
        let (Some(gate_up), Some(down)) = (x.gate_up.get(e), x.down.get(e)) else {
            return Err(ModelError::InvalidConfig(format!(
                "the router names expert {e} of {}",
                x.gate_up.len()
            )));
        };
        let idx = Tensor::from_vec(routed.rows.clone(), n, device)?;
        let act = swiglu(&gate_up.forward(&h.index_select(&idx, 0)?)?, moe.expert_ffn)?;
        let y = down.forward(&act)?.to_vec2::<f32>()?;
        for ((&row, &w), y) in routed.rows.iter().zip(&routed.weights).zip(&y) {
            let dst = &mut out[row as usize * hidden..(row as usize + 1) * hidden];
            for (d, v) in dst.iter_mut().zip(y) {
                *d += w * v;
            }
        }
    }
    let out = Tensor::from_vec(out, (rows, hidden), &Device::Cpu)?.to_device(device)?;
    match (&x.shared, moe.shared_ffn) {
        (Some(s), Some(width)) => {
            let act = swiglu(&s.gate_up.forward(h)?, width)?;
            let scale = candle_nn::ops::sigmoid(&h.matmul(&s.gate.t()?)?)?;
            Ok((out + s.down.forward(&act)?.broadcast_mul(&scale)?)?)
        }
        _ => Ok(out),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn route_takes_the_top_k_of_the_softmax_and_renormalises() {
        let logits = [0.0, 2.0, 1.0, 2.0];
        let exp: Vec<f32> = logits.iter().map(|&l: &f32| (l - 2.0).exp()).collect();
        let sum: f32 = exp.iter().sum();
        // Ties go to the lower index: experts 1 and 3, then 2.
        let got = route(&logits, 3, false);
        let want = [(1, exp[1] / sum), (3, exp[3] / sum), (2, exp[2] / sum)];
        assert_eq!(got, want);
        let normed = route(&logits, 2, true);
        assert_eq!(normed, vec![(1, 0.5), (3, 0.5)]);
        let total: f32 = route(&logits, 3, true).iter().map(|&(_, w)| w).sum();
        assert!((total - 1.0).abs() < 1e-6, "{total}");
    }

    #[test]
    fn rows_are_grouped_by_expert_in_row_order() {
        let routes = vec![
            vec![(2, 0.7), (0, 0.3)],
            vec![(0, 1.0)],
            vec![(2, 0.6), (1, 0.4)],
        ];
        let g = group(&routes, 4);
        assert_eq!(g[0].rows, vec![0, 1]);
        assert_eq!(g[0].weights, vec![0.3, 1.0]);
        assert_eq!(g[1].rows, vec![2]);
        assert_eq!(g[2].rows, vec![0, 2]);
        assert_eq!(g[2].weights, vec![0.7, 0.6]);
        assert!(g[3].rows.is_empty());
    }
}

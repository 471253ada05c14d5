//! Sharding rules, one file per op family. This module maps canonical op names onto
//! their family; an op with no family is *opaque*: the core can only run it replicated.

/// The op families the core has sharding rules for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Family {
    /// Shape-preserving element-wise ops with one tensor input.
    Unary,
    /// Broadcasting element-wise ops with two tensor inputs.
    Binary,
    /// `linear`, `matmul`, `bmm`, `einsum`.
    Matmul,
    /// `scaled_dot_product_attention`.
    Attention,
    /// `embedding`.
    Embedding,
    /// `layer_norm` and friends.
    Norm,
    /// `softmax`, `log_softmax`.
    Softmax,
    /// Reductions over some dims: `sum`, `mean`.
    Reduction,
    /// `cross_entropy_loss`, `nll_loss`.
    Loss,
    /// `conv2d`, pools.
    Conv,
    /// Views, reshapes, permutes, concatenation, slicing.
    Shape,
    /// MoE gating helpers.
    Moe,
}

/// The family of a canonical op name, or `None` for an opaque op.
pub fn family(op: &str) -> Option<Family> {
    use Family::*;
    Some(match op {
        "aten.relu" | "aten.gelu" | "aten.silu" | "aten.sigmoid" | "aten.tanh" | "aten.dropout"
        | "aten.neg" | "aten.exp" | "aten.rsqrt" | "aten.sqrt" | "aten.pow.Tensor_Scalar"
        | "aten.to.dtype" | "aten._to_copy" | "aten.clone" | "aten.contiguous" => Unary,
        "aten.add.Tensor" | "aten.sub.Tensor" | "aten.mul.Tensor" | "aten.div.Tensor" => Binary,
        "aten.linear" | "aten.matmul" | "aten.bmm" | "aten.einsum" => Matmul,
        "aten.scaled_dot_product_attention" => Attention,
        "aten.embedding" => Embedding,
        "aten.layer_norm" => Norm,
        "aten.softmax.int" | "aten.log_softmax.int" => Softmax,
        "aten.sum.dim_IntList" | "aten.sum" | "aten.mean.dim" | "aten.mean" => Reduction,
        "aten.cross_entropy_loss" | "aten.nll_loss" => Loss,
        "aten.conv2d" | "aten.max_pool2d" | "aten.adaptive_avg_pool2d" => Conv,
        "aten.view" | "aten.reshape" | "aten._unsafe_view" | "aten.flatten.using_ints"
        | "aten.transpose.int" | "aten.permute" | "aten.t" | "aten.unsqueeze" | "aten.squeeze.dim"
        | "aten.expand" | "aten.cat" | "aten.slice.Tensor" | "aten.select.int" | "aten.chunk"
        | "aten.split.Tensor" => Shape,
        _ => return None,
    })
}

//! The names of the rules, in one place. A plan records the name of the rule each step
//! runs, `force` options select rules by name, and the Python runtime keys its adapters
//! on them (the bindings export [`ALL`] as `hapd._core.rule_names()`), so a name is
//! part of the wire format: spell it only through these constants.

macro_rules! rule_names {
    ($($(#[$doc:meta])* $constant:ident = $value:literal;)*) => {
        $($(#[$doc])* pub const $constant: &str = $value;)*

        /// Every rule name as (constant name, value), in declaration order.
        pub const ALL: &[(&str, &str)] = &[$((stringify!($constant), $constant)),*];
    };
}

rule_names! {
    /// Every operand and result a full replica; every rank does all the work. Every op
    /// has this rule, listed first.
    REPLICATED = "replicated";
    /// The same dim split on the operands and the result (element-wise ops, views,
    /// norms, softmax, pools, reductions over other dims, …).
    SHARDED = "sharded";
    /// `expand` of a size-1 dim (or a new leading dim) to length `n`: the operand
    /// replicated, each rank expands it to its own length → the result split on that
    /// dim (a slice of a broadcast, made without communication).
    BROADCAST_SPLIT = "broadcast-split";
    /// Partial-sum operands give a partial-sum result: the op is linear in them.
    PARTIAL = "partial";
    /// `zeros_like`/`ones_like` of a partial sum: the constant, replicated.
    FILL = "fill";
    /// Split the batch (or another free dim) of the data operands, weights replicated.
    DATA_PARALLEL = "data-parallel";
    /// Batch norm in training with the batch split: each rank sums its rows, the
    /// per-channel sums (for the mean, then for the variance) are all-reduced, so every
    /// rank normalizes with the statistics of the whole batch — the single-device result
    /// (synchronized batch norm). Weights and running statistics replicated.
    DATA_PARALLEL_SYNCED = "data-parallel-synced";
    /// Attention split by heads (dim 1 of query, key, value and output).
    HEAD_PARALLEL = "head-parallel";
    /// Attention split along the query sequence, key and value replicated.
    QUERY_SPLIT = "query-split";
    /// Split the output features or channels (weight dim 0 and bias), input
    /// replicated → the result is split on its feature dim.
    COLUMN_PARALLEL = "column-parallel";
    /// Split the input features (the contraction) of input and weight → partial sums;
    /// the bias is added on rank 0 only.
    ROW_PARALLEL = "row-parallel";
    /// Embedding table split by columns, indices replicated → the result is split on
    /// its last dim.
    HIDDEN_SPLIT = "hidden-split";
    /// Embedding table split by rows, indices replicated → partial sums: each rank
    /// looks up only the indices in its row range and writes zeros for the others.
    VOCAB_PARALLEL = "vocab-parallel";
    /// Split a dim that is summed over → partial sums.
    SHARDED_SUM = "sharded-sum";
    /// Split a dim that is averaged over → partial sums once the runtime rescales each
    /// rank's value (a reduction by `local length / global length`; a loss divides its
    /// local sum by the global count).
    SHARDED_MEAN = "sharded-mean";
    /// `matmul`/`bmm`: split the rows of the first operand → the rows of the result.
    ROW_SPLIT = "row-split";
    /// `matmul`/`bmm`: split the columns of the second operand → the columns of the
    /// result.
    COLUMN_SPLIT = "column-split";
    /// `matmul`/`bmm`: split the contracted dim of both operands → partial sums.
    CONTRACTION_SPLIT = "contraction-split";
    /// `einsum`: split one index letter in every operand that has it (partial sums
    /// when the result does not).
    SPLIT = "split";
    /// `einsum`: split the letter that indexes stacked expert weights (the leading dim
    /// of a parameter of rank ≥ 3, as in Mixtral's `gate_up_proj [E, 2I, H]`): each
    /// rank holds and runs its own experts (a `split` under its own name, so plans
    /// can be forced into expert parallelism and say when they chose it).
    EXPERT_PARALLEL = "expert-parallel";
}

#[cfg(test)]
mod tests {
    use super::ALL;

    #[test]
    fn constants_spell_their_values() {
        for (constant, value) in ALL {
            assert_eq!(value.to_uppercase().replace('-', "_"), *constant);
        }
        let mut values: Vec<&str> = ALL.iter().map(|(_, v)| *v).collect();
        values.sort_unstable();
        values.dedup();
        assert_eq!(values.len(), ALL.len(), "a rule name is declared twice");
    }
}

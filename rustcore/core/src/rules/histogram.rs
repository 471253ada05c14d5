//! `histc(self, bins, min, max)`: counts of the input's elements in `bins` equal bins
//! over `[min, max]` (transformers' router auxiliary loss counts the (token, expert)
//! pairs per expert so).
//!
//! - `"sharded-sum"`: the input split on any dim → partial counts: the histogram of a
//!   union of pieces is the sum of their histograms, when the bounds are fixed
//!   (`min < max`). With `min = max` torch takes the bounds from the data (each piece's
//!   own), so such a `histc` runs replicated.

use super::rule_names::SHARDED_SUM;
use super::{elementwise_class, gather, no_shape_checks, Family, OpCtx, Rule};
use crate::cost::Work;
use crate::layout::Layout;

pub const FAMILY: Family =
    Family { ops: &["aten.histc"], rules, flops, class: elementwise_class, check_shapes: no_shape_checks };

fn rules(ctx: &OpCtx) -> Vec<Rule> {
    // torch's schema defaults: min = max = 0, the data's bounds
    let (min, max) = (ctx.float_arg("min").unwrap_or(0.0), ctx.float_arg("max").unwrap_or(0.0));
    if ctx.n_inputs() != 1 || ctx.n_outputs() != 1 || !(min < max) {
        return Vec::new();
    }
    (0..ctx.in_shape(0).len())
        .filter_map(gather)
        .map(|g| ctx.uniform(SHARDED_SUM, g, Layout::Reduce, Work::Sharded))
        .collect()
}

/// A compare and an add per input element.
fn flops(ctx: &OpCtx) -> f64 {
    2.0 * ctx.in_shape(0).iter().product::<usize>() as f64
}

#[cfg(test)]
mod tests {
    use crate::rules::testkit::{assert_rules, float, int, rules, A};

    #[test]
    fn fixed_bounds_split_into_partial_counts() {
        let args = |min: f64, max: f64| vec![("self", A::T(&[64])), ("bins", int(4)), ("min", float(min)), ("max", float(max))];
        let got = rules("aten.histc", args(0.0, 4.0), &[&[4]]);
        assert_rules(&got, &["sharded-sum G0 -> R sharded"]);
        assert_eq!(got.flops, 128.0);
        // bounds from the data: each piece would count over its own range
        assert_rules(&rules("aten.histc", args(0.0, 0.0), &[&[4]]), &[]);
    }
}

//! Communication: how a tensor held in one layout becomes another, and what it costs
//! forward and backward (the backward of a collective is its dual).

use crate::cost::Row;
use crate::layout::Layout;
use crate::profile::{CollectiveCost, Profile};

/// A collective (or free local re-layout) the runtime inserts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Collective {
    /// `Gather(d) → Identity`, shards padded to the largest.
    AllGather,
    /// `Gather(d) → Identity` by one broadcast per rank (no padding).
    AllGatherGrouped,
    /// `Reduce → Gather(d)`, shards padded to the largest.
    ReduceScatter,
    /// `Reduce → Gather(d)` by one reduce per rank (no padding).
    ReduceScatterGrouped,
    /// `Reduce → Identity`.
    AllReduce,
    /// `Gather(i) → Gather(j)`, uneven, no padding.
    AllToAll,
    /// `Identity → Gather(d)`: each rank keeps its slice; free.
    DynamicSlice,
    /// `Identity → Reduce`: rank 0 keeps the value, the others hold zeros; free.
    MaskToRankZero,
}

impl Collective {
    pub fn name(self) -> &'static str {
        match self {
            Collective::AllGather => "all_gather",
            Collective::AllGatherGrouped => "all_gather_grouped",
            Collective::ReduceScatter => "reduce_scatter",
            Collective::ReduceScatterGrouped => "reduce_scatter_grouped",
            Collective::AllReduce => "all_reduce",
            Collective::AllToAll => "all_to_all",
            Collective::DynamicSlice => "dynamic_slice",
            Collective::MaskToRankZero => "mask_to_rank_zero",
        }
    }

    /// The collective autograd runs in the backward pass, if any.
    pub fn backward(self) -> Option<Collective> {
        match self {
            Collective::AllGather => Some(Collective::ReduceScatter),
            Collective::AllGatherGrouped => Some(Collective::ReduceScatterGrouped),
            Collective::ReduceScatter => Some(Collective::AllGather),
            Collective::ReduceScatterGrouped => Some(Collective::AllGatherGrouped),
            Collective::AllReduce => Some(Collective::AllReduce),
            Collective::AllToAll => Some(Collective::AllToAll),
            Collective::DynamicSlice | Collective::MaskToRankZero => None,
        }
    }
}

/// The collectives that turn `from` into `to`, cheapest variants first considered by
/// the caller; empty when no single communication does it.
pub fn conversions(from: Layout, to: Layout) -> &'static [Collective] {
    use Collective::*;
    use Layout::*;
    match (from, to) {
        (Gather(_), Identity) => &[AllGather, AllGatherGrouped],
        (Reduce, Gather(_)) => &[ReduceScatter, ReduceScatterGrouped],
        (Reduce, Identity) => &[AllReduce],
        (Gather(i), Gather(j)) if i != j => &[AllToAll],
        (Identity, Gather(_)) => &[DynamicSlice],
        (Identity, Reduce) => &[MaskToRankZero],
        _ => &[],
    }
}

fn cost_of(profile: &Profile, collective: Collective) -> Option<&CollectiveCost> {
    let c = &profile.collectives;
    Some(match collective {
        Collective::AllGather => &c.all_gather,
        Collective::AllGatherGrouped => &c.all_gather_grouped,
        Collective::ReduceScatter => &c.reduce_scatter,
        Collective::ReduceScatterGrouped => &c.reduce_scatter_grouped,
        Collective::AllReduce => &c.all_reduce,
        Collective::AllToAll => &c.all_to_all,
        Collective::DynamicSlice | Collective::MaskToRankZero => return None,
    })
}

/// Seconds per device of one collective on a tensor of `bytes` (full size), one way.
///
/// Bandwidths count bytes of the full tensor per second. Padded and all-to-all variants
/// move every shard at the size of the sending device's shard scaled to the world
/// (`N · r[d] · bytes`), so the largest shard sets the step's time; grouped variants
/// move exactly `bytes`.
pub fn one_way_row(profile: &Profile, collective: Collective, bytes: f64) -> Row {
    let n = profile.world();
    let mut row = Row::zeros(n);
    let Some(cost) = cost_of(profile, collective) else { return row };
    if n == 1 {
        return row;
    }
    let link = profile.link(cost);
    for d in 0..n {
        row.constant[d] = link.alpha;
        match collective {
            Collective::AllGather | Collective::ReduceScatter | Collective::AllToAll => {
                row.coef[d] = n as f64 * bytes / link.beta;
            }
            _ => row.constant[d] += bytes / link.beta,
        }
    }
    row
}

/// Bytes of gradient the runtime packs into one all-reduce (`hapd.spmd.gradsync.GradSync`):
/// replicated parameters' gradients travel together, one latency per bucket rather than
/// per parameter. Smaller than DDP's 25 MiB so that the first buckets' sums overlap
/// the rest of backward even for models of a few million parameters.
pub const GRAD_BUCKET_BYTES: f64 = 4.0 * 1024.0 * 1024.0;

/// Seconds per device of all-reducing the gradient of one replicated parameter of
/// `bytes` bytes. The gradient shares a bucket with others, so it is charged its bytes
/// over the bandwidth plus its share (`bytes / GRAD_BUCKET_BYTES`) of the bucket's
/// latency; a program whose replicated gradients fill less than a bucket is thus
/// underestimated by at most one α.
pub fn grad_sync_row(profile: &Profile, bytes: f64) -> Row {
    let n = profile.world();
    let mut row = Row::zeros(n);
    if n == 1 {
        return row;
    }
    let c = &profile.collectives;
    let link = profile.link(c.grad_sync.as_ref().unwrap_or(&c.all_reduce));
    let seconds = link.alpha * (bytes / GRAD_BUCKET_BYTES) + bytes / link.beta;
    row.constant.iter_mut().for_each(|c| *c = seconds);
    row
}

/// Forward plus (when the tensor carries a gradient) backward cost of a collective.
pub fn collective_row(profile: &Profile, collective: Collective, bytes: f64, with_grad: bool) -> Row {
    let mut row = one_way_row(profile, collective, bytes);
    if with_grad {
        if let Some(back) = collective.backward() {
            row.add(&one_way_row(profile, back, bytes));
        }
    }
    row
}

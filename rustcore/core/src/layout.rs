//! Layouts: how a rank's tensor relates to the single-device tensor.

use std::fmt;

/// `Gather(dim)`: a slice along `dim` (slices may be uneven; concatenated in rank order
/// they give the full tensor). `Reduce`: a partial value; the sum over ranks is the full
/// tensor. `Identity`: every rank holds the full tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Layout {
    Identity,
    Reduce,
    Gather(u8),
}

/// Most dims a Gather layout can name (the layout set is a 16-bit mask).
pub const MAX_GATHER_DIMS: usize = 14;

impl Layout {
    fn bit(self) -> u16 {
        match self {
            Layout::Identity => 1,
            Layout::Reduce => 2,
            Layout::Gather(d) => 4 << d,
        }
    }

    /// The sharded dim, for `Gather`.
    pub fn gather_dim(self) -> Option<usize> {
        match self {
            Layout::Gather(d) => Some(d as usize),
            _ => None,
        }
    }
}

impl fmt::Display for Layout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Layout::Identity => write!(f, "Identity"),
            Layout::Reduce => write!(f, "Reduce"),
            Layout::Gather(d) => write!(f, "Gather({d})"),
        }
    }
}

/// A set of layouts a tensor is held in at some point of the program.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, PartialOrd, Ord)]
pub struct LayoutSet(pub u16);

impl LayoutSet {
    pub fn single(layout: Layout) -> Self {
        LayoutSet(layout.bit())
    }
    pub fn contains(self, layout: Layout) -> bool {
        self.0 & layout.bit() != 0
    }
    /// Add a layout, in canonical form: a replica makes every split and the masked
    /// partial sum free (dynamic slice, mask to rank 0), so holding `Identity` holds
    /// all of them.
    pub fn with(self, layout: Layout) -> Self {
        LayoutSet(self.0 | layout.bit()).canonical()
    }

    /// Add a layout without canonicalizing (to record everything a program created).
    pub fn with_raw(self, layout: Layout) -> Self {
        LayoutSet(self.0 | layout.bit())
    }

    /// `{Identity}` if the set holds `Identity`; the set itself otherwise.
    pub fn canonical(self) -> Self {
        if self.contains(Layout::Identity) {
            LayoutSet::single(Layout::Identity)
        } else {
            self
        }
    }
    pub fn is_empty(self) -> bool {
        self.0 == 0
    }
    /// The layouts in a fixed order: Identity, Reduce, Gather(0), Gather(1), …
    pub fn iter(self) -> impl Iterator<Item = Layout> {
        let all = [Layout::Identity, Layout::Reduce];
        all.into_iter()
            .chain((0..MAX_GATHER_DIMS as u8).map(Layout::Gather))
            .filter(move |l| self.contains(*l))
    }
}
